"""Notebook 04's puzzle and exercises: flash attention in pure JAX, judged against the float64 oracle.

The puzzle is the notebook's final one-head version (padding, bottom-right causal masks, rows that see no key,
one query block at a time; its solution is in :mod:`~flashlib.exercises.flash_jax_solutions`); the exercises are
a from-scratch loop over key blocks, the log-sum-exp the backward pass needs, and a prediction of how each
method's scratch memory scales, checked against XLA's measurement.

Every attention output is judged by :func:`flashlib.checks.check_attention` (2x the naive float32 error); when
it fails, the output is compared with what each usual mistake computes (top-left causal mask, padded keys left
visible, no final division, a dropped last block, a wrong scale...) and a wrong causal output names its first wrong
row, so the message names the mistake, not just the error.

Longer than 400 lines because the puzzle and the three exercises share one judge: the float64 oracle, the inputs
(random, and with every score far below zero), and what each usual mistake computes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import flashlib
from flashlib import reference
from flashlib.blockwise import blockwise_attention
from flashlib.checks import CheckFailed, check_attention
from flashlib.exercises.flash_jax_solutions import (
    flash_attention_head_solution,
    flash_attention_one_head_solution,
    flash_attention_with_lse_solution,
    fold_kv_block,
    scratch_exponents_solution,
)
from flashlib.exercises.puzzle import Puzzle

__all__ = ["FLASH_ATTENTION_HEAD", "LSE", "ONE_HEAD", "SCRATCH_EXPONENTS", "check_flash_attention_head", "check_lse",
           "check_one_head", "check_scratch_exponents", "flash_attention_head_solution",
           "flash_attention_one_head_solution", "flash_attention_with_lse_solution", "fold_kv_block",
           "scratch_exponents_solution"]


# -- judging an attention output: the oracle, then what each usual mistake would have computed ------------------


def _attend64(q, k, v, visible: np.ndarray, *, divide: bool = True, scale: float | None = None) -> np.ndarray:
    """Float64 attention of one head under a ``[q_len, kv_len]`` visibility mask (rows that see nothing: 0)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.where(visible, q @ k.T * (reference.default_scale(q.shape[1]) if scale is None else scale), -np.inf)
    m = s.max(axis=1, initial=-np.inf, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(axis=1, keepdims=True)  # noqa: E741
    return p @ v / np.where(l == 0.0, 1.0, l) if divide else p @ v


def _visible(q_len: int, kv_len: int, causal: bool, *, top_left: bool = False, offset: int | None = None,
             strict: bool = False) -> np.ndarray:
    """Which keys each query sees: all, or causal with ``offset`` (default bottom-right, ``kv_len - q_len``)."""
    rows, cols = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    if not causal:
        return np.ones((q_len, kv_len), bool)
    offset = (0 if top_left else kv_len - q_len) if offset is None else offset
    return cols < rows + offset if strict else cols <= rows + offset


def _scale_suspects(q, k, v, visible: np.ndarray) -> list[tuple[np.ndarray, str]]:
    d = q.shape[1]
    return [(_attend64(q, k, v, visible, scale=1.0), "the scores are not scaled: multiply q @ k.T by "
             f"reference.default_scale(d) = 1/sqrt(d) (d = {d})"),
            *([(_attend64(q, k, v, visible, scale=0.125), "the scale is 1/sqrt(64), section 1's global `scale` for "
                "D = 64: compute it from q's head size, reference.default_scale(q.shape[1])")] if d != 64 else []),
            (_attend64(q, k, v, visible, scale=1.0 / d), f"the scale is 1/d; it is 1/sqrt(d) (d = {d}), "
             "reference.default_scale(d)")]


def _causal_hint(got: np.ndarray, *, q, k, v) -> str:
    """For a wrong causal output: the first wrong query row and the keys it should see."""
    q_len, kv_len = q.shape[0], k.shape[0]
    want = _attend64(q, k, v, _visible(q_len, kv_len, True))
    bad = np.flatnonzero(~np.isclose(got, want, rtol=1e-3, atol=1e-4).all(axis=1))
    if not len(bad):
        return _RESCALE
    row, last = int(bad[0]), int(bad[0]) + kv_len - q_len
    if bad[-1] + kv_len - q_len < 0:
        return (f"the first {q_len - kv_len} queries see no key and must give 0, but row {row} does not: mask with "
                "-jnp.inf (a large finite number such as -1e30 gives such a row the mean of v) and divide by 1 "
                "where l == 0")
    return (f"query row {row} is wrong: it should see {f'keys 0..{last}' if last >= 0 else 'no key'} (j <= i + "
            f"kv_len - q_len = i + {kv_len - q_len}); build the mask from absolute positions, q_pos = i * block_q + "
            "row and kv_pos = j * block_k + col, with the real q_len and kv_len, not the padded ones")


def _judge(out, q, k, v, *, causal: bool, where: str, suspects: Sequence[tuple[np.ndarray, str]],
           nan_hint: str, otherwise: str | Callable[[np.ndarray], str]) -> None:
    """Raise :class:`CheckFailed` naming the mistake when ``out`` (one head) is not attention of ``q, k, v``
    (``otherwise``: the hint when no suspect matches, or a function of the float64 output that finds one)."""
    got = np.asarray(out)
    if got.shape != q.shape:
        rows = " (the padded length: drop the padded query rows, out[:q_len])" if got.shape[:1] != q.shape[:1] else ""
        raise CheckFailed(f"failed: {where} — output shape {got.shape}, expected q's shape {q.shape}{rows}")
    if got.dtype != q.dtype:
        raise CheckFailed(f"failed: {where} — output dtype {got.dtype}, expected q's dtype {q.dtype}: the contract "
                          "is q's dtype, so accumulate in it (np.zeros and np.full default to float64, and a NumPy "
                          "scalar such as np.sqrt(d) turns float32 into float64; pass dtype=q.dtype, or use jnp)")
    if not np.isfinite(got.astype(np.float64)).all():
        raise CheckFailed(f"failed: {where} — NaN or inf in the output: {nan_hint}")
    try:
        check_attention(got[None, None], q[None, None], k[None, None], v[None, None], causal=causal, name=where,
                        quiet=True)
    except CheckFailed as failure:
        for candidate, mistake in suspects:
            if np.allclose(got, candidate, rtol=1e-3, atol=1e-4):
                raise CheckFailed(f"failed: {where} — {mistake}") from None
        raise CheckFailed(f"{failure}: {otherwise(got.astype(np.float64)) if callable(otherwise) else otherwise}") \
            from None


def _qkv(seed: int, q_len: int, kv_len: int, d: int = 32, spread: float = 2.0):
    """Random one-head inputs; ``spread`` widens the scores so each block raises the running maximum often."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (spread * jax.random.normal(kq, (q_len, d)), jax.random.normal(kk, (kv_len, d)),
            jax.random.normal(kv, (kv_len, d)))


def _far_below_zero_qkv(seed: int, q_len: int, kv_len: int, d: int = 32):
    """One-head inputs whose every score is far below zero (q near -3, k near 9: scores about -150, still spread),
    where a running maximum started at 0 instead of -inf loses every key: ``exp(s - 0)`` underflows to 0."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (-3.0 + 0.2 * jax.random.normal(kq, (q_len, d)), 9.0 + 0.2 * jax.random.normal(kk, (kv_len, d)),
            jax.random.normal(kv, (kv_len, d)))


_FAR_BELOW_ZERO = "every score far below zero (q near -3, k near 9: scores about -150)"
_M_STARTS_AT_ZERO = ("the running max m starts at 0, not -inf: when every score of a row is far below zero (here about "
                     "-150), exp(s - m) underflows to 0 for every key, so l stays 0 and the row comes out 0 (or NaN); "
                     "start m at -inf (jnp.full(..., -jnp.inf)), so the first block's maximum replaces it")


def _zeros_suspect(q) -> tuple[np.ndarray, str]:
    """What a running max started at 0 computes when every score is far below zero: all zeros."""
    return np.zeros(q.shape), _M_STARTS_AT_ZERO


_RESCALE = ("check the online update: at every key block, multiply l and acc by alpha = exp(m_old - m_new) "
            "before adding the block's p, and divide acc by l once after the last block")
_ONE_HEAD = "check that the blocks cover every key exactly once (k[lo:lo + block_k] for lo in range(0, kv_len, " \
            "block_k)) and the online update: multiply l and acc by alpha = exp(m_old - m_new) before adding " \
            "the block's p, and divide acc by l once after the last block"


# -- the puzzle --------------------------------------------------------------------------------------------


_HEAD_CASES = [  # (case in words, q_len, kv_len, causal, block_q, block_k)
    ("lengths that divide the blocks, no mask", 128, 128, False, 64, 32),
    ("causal, q_len = kv_len", 128, 128, True, 64, 32),
    ("kv_len = 75 does not divide block_k = 32 (padded keys), no mask", 50, 75, False, 32, 32),
    ("causal with more keys than queries (q_len 50, kv_len 75: query i sees keys j <= i + 25)", 50, 75, True, 32, 32),
    ("causal with more queries than keys (q_len 75, kv_len 40: the first 35 queries see no key)", 75, 40, True, 32, 16),
    ("sequences shorter than one block (q_len 20, kv_len 30, blocks of 128)", 20, 30, False, 128, 128),
]


def _head_suspects(q, k, v, causal: bool, block_q: int, block_k: int) -> list[tuple[np.ndarray, str]]:
    q_len, kv_len = q.shape[0], k.shape[0]
    bk = min(block_k, kv_len)
    whole = (-(-kv_len // bk) - 1) * bk  # the keys before the last (possibly padded) key block
    suspects = [(_attend64(q, k, v, _visible(q_len, kv_len, causal), divide=False),
                 "the output is not normalised: divide acc by l once, after the last key block"),
                *([(_attend64(q, k, v, _visible(q_len, kv_len, causal) & (np.arange(kv_len)[None, :] < whole)),
                    f"the last key block (keys {whole}..{kv_len - 1}) is missing: scan over all "
                    f"-(-kv_len // block_k) = {-(-kv_len // bk)} key blocks, the last one padded to a whole block")]
                  if whole else []),
                *_scale_suspects(q, k, v, _visible(q_len, kv_len, causal))]
    if causal:
        suspects.append((_attend64(q, k, v, _visible(q_len, kv_len, True, strict=True)), "query i must also see "
                         "key j = i + kv_len - q_len, its own position: j <= i + kv_len - q_len (<=, not <)"))
    if causal and q_len != kv_len:
        padded = -kv_len % min(block_k, kv_len) - -q_len % min(block_q, q_len)  # offset error from padded lengths
        suspects += [(_attend64(q, k, v, _visible(q_len, kv_len, True, top_left=True)),
                      "the causal mask is top-left aligned (query i sees keys j <= i); flashlib's is bottom-right: "
                      "query i sees keys j <= i + kv_len - q_len (reference.causal_visible on absolute positions)"),
                     (_attend64(q, k, v, _visible(q_len, kv_len, True, offset=q_len - kv_len)), "the offset is "
                      "the wrong way round: query i sees keys j <= i + kv_len - q_len (keys' length minus queries')")]
        if padded:
            suspects.append((_attend64(q, k, v, _visible(q_len, kv_len, True, offset=kv_len - q_len + padded)),
                             "the causal offset comes from the padded lengths: pass the real q_len and kv_len "
                             "to reference.causal_visible (pad_to_multiple does not change them)"))
    for bk in sorted({block_k, min(block_k, kv_len)}):
        padded = -kv_len % bk
        if padded and not causal:
            kp, vp = (np.pad(np.asarray(x, np.float64), ((0, padded), (0, 0))) for x in (k, v))
            suspects += [(_attend64(q, kp, vp, _visible(q_len, kv_len + padded, False)),
                          f"the {padded} padded keys are visible: the zeros appended to k score 0 and add "
                          "e^(0 - m) to l; mask the key positions >= kv_len (kv_pos < kv_len)"),
                         (_attend64(q, kp[:kv_len + 1], vp[:kv_len + 1], _visible(q_len, kv_len + 1, False)),
                          "the first padded key (position kv_len) is visible: mask with kv_pos < kv_len, not <=")]
    return suspects


def check_flash_attention_head(head: Callable[..., Any]) -> None:
    """``head(q, k, v, *, causal, block_q, block_k)`` for one head, under ``jax.jit``: the float64 oracle on
    every case of ``_HEAD_CASES``. First (it costs no compile) its traced program must not grow with N; last,
    its scratch memory must not either."""
    _check_program_size(head)
    for seed, (case, q_len, kv_len, causal, block_q, block_k) in enumerate(_HEAD_CASES):
        q, k, v = _qkv(seed, q_len, kv_len)
        out = jax.jit(functools.partial(head, causal=causal, block_q=block_q, block_k=block_k))(q, k, v)
        empty = "the first q_len - kv_len queries see no key: their m stays -inf and l 0, so exponentiate against " \
                "m_safe (0 where m is -inf) and divide by 1 where l == 0 (their output is 0)"
        _judge(out, q, k, v, causal=causal, where=f"flash_attention_head, case '{case}'",
               suspects=_head_suspects(q, k, v, causal, block_q, block_k),
               otherwise=functools.partial(_causal_hint, q=q, k=k, v=v) if causal else _RESCALE,
               nan_hint=empty if causal and q_len > kv_len else "a tile whose keys are all masked has m = -inf "
               "for a row that has seen no key yet: exponentiate against m_safe, not m")
    for causal in (False, True):  # 40 queries, 75 keys in blocks of 16 and 32: padded keys, a causal offset
        q, k, v = _far_below_zero_qkv(len(_HEAD_CASES) + causal, 40, 75)
        out = jax.jit(functools.partial(head, causal=causal, block_q=16, block_k=32))(q, k, v)
        _judge(out, q, k, v, causal=causal, where=f"flash_attention_head, case '{_FAR_BELOW_ZERO}, "
               f"{'causal' if causal else 'no mask'}'", suspects=[_zeros_suspect(q)], otherwise=_RESCALE,
               nan_hint=_M_STARTS_AT_ZERO)
    _check_scratch(head)
    print(f"passed: flash_attention_head matches the float64 oracle in all {len(_HEAD_CASES) + 2} cases (padding, "
          "causal both ways, rows that see no key, scores far below zero), under jax.jit; its program and its "
          "scratch do not grow with N")


def _check_program_size(head: Callable[..., Any]) -> None:
    def trace(n: int):
        x = jnp.zeros((n, 8))  # head_dim 8: no other value has a [32, 16] or [16, 32] shape
        return jax.make_jaxpr(functools.partial(head, block_q=32, block_k=16))(x, x, x).jaxpr

    jaxpr = trace(128)
    small, large = len(jaxpr.eqns), len(trace(512).eqns)
    if not any(shape[-2:] in ((32, 16), (16, 32)) for shape in _shapes(jaxpr)):
        raise CheckFailed("failed: flash_attention_head, block sizes — called with block_q=32, block_k=16 it computes "
                          "no [32, 16] tile of scores: use the block_q and block_k it is given (clamped to the "
                          "lengths), not fixed sizes such as section 1's BLOCK")
    if large > 1.5 * small:
        raise CheckFailed(f"failed: flash_attention_head, traced program — {small} operations at N = 128, {large} at "
                          "N = 512: a Python loop over blocks is unrolled; loop over the key blocks with jax.lax.scan "
                          "and over the query blocks with jax.lax.map (section 3)")


def scratch_bytes(fn: Callable[..., Any], *shape: int) -> int:
    """XLA's planned scratch memory (``temp_size_in_bytes``) of ``fn(q, k, v)`` for float32 inputs of ``shape``."""
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.jit(fn).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes


def _check_scratch(head: Callable[..., Any]) -> None:
    fn = functools.partial(head, block_q=128, block_k=128)
    small, large = scratch_bytes(fn, 1024, 64), scratch_bytes(fn, 4096, 64)
    if large > 2 * small:
        raise CheckFailed(f"failed: flash_attention_head, scratch memory — {small} bytes at N = 1024, {large} at "
                          "N = 4096: hold one [block_q, block_k] tile at a time, so visit the query blocks one after "
                          "another with jax.lax.map and fold the key blocks in one by one with jax.lax.scan (jax.vmap "
                          "over either holds all their tiles at once)")


FLASH_ATTENTION_HEAD = Puzzle(
    label="puzzle 1: flash_attention_head, any lengths, causal or not",
    checker=check_flash_attention_head,
    solution=flash_attention_head_solution,
    hints=(
        "Start from `flash_attention_head_v1` (section 3). Three additions: pad q, k, v to whole blocks "
        "(`pad_to_multiple`) and cut the output back to `q_len` rows; give each block its index (scan and map "
        "over `(jnp.arange(n), blocks)`) so you know absolute positions; and before folding a tile, set the "
        "scores it may not see to `-inf` with `jnp.where`. Clamp the blocks to the lengths first "
        "(`min(block_q, q_len)`), so a short sequence is one block.",
        "Inside `kv_step`: `q_pos = i * block_q + jnp.arange(block_q)[:, None]` and "
        "`kv_pos = j * block_k + jnp.arange(block_k)[None, :]`; `visible = kv_pos < kv_len`, and when causal "
        "also `& reference.causal_visible(q_pos, kv_pos, q_len=q_len, kv_len=kv_len)`; "
        "`s = jnp.where(visible, q_blk @ k_blk.T * scale, -jnp.inf)`. At the end a row may have `l == 0` (it saw "
        "no key): divide by `jnp.where(l == 0.0, 1.0, l)` so it comes out 0.",
    ),
)


# -- exercise 1: one head from scratch ---------------------------------------------------------------------


def _first_keys(q, k, v, n: int) -> np.ndarray:
    """Attention to the first ``n`` keys only."""
    return _attend64(q, k, v, np.broadcast_to(np.arange(k.shape[0])[None, :] < n, (q.shape[0], k.shape[0])))


def _one_head_suspects(q, k, v, block_k: int) -> list[tuple[np.ndarray, str]]:
    """What exercise 1's usual mistakes compute (no mask, ``kv_len = 75``, ``q_len = 50``)."""
    q_len, kv_len, padded = q.shape[0], k.shape[0], -k.shape[0] % block_k
    kp, vp = (np.pad(np.asarray(x, np.float64), ((0, padded), (0, 0))) for x in (k, v))
    return [(_attend64(q, k, v, _visible(q_len, kv_len, False), divide=False),
             "the output is not normalised: divide acc by l once, after the last key block"),
            (_first_keys(q, k, v, kv_len // block_k * block_k), "the keys past the last whole block are missing: "
             "loop over range(0, kv_len, block_k); the last block is shorter (k[lo:lo + block_k] slices it)"),
            (_first_keys(q, k, v, q_len), f"only the first q_len = {q_len} keys are attended: loop over the keys, "
             f"range(0, k.shape[0], block_k) (kv_len = {kv_len})"),
            *([(_attend64(q, kp, vp, _visible(q_len, kv_len + padded, False)), f"the {padded} zero rows padded onto k "
                "score 0, and each adds e^(0 - m) to l: mask them (-inf), or slice the short last block instead")]
              if padded else []),
            *_scale_suspects(q, k, v, _visible(q_len, kv_len, False))]


def _shapes(jaxpr) -> set[tuple[int, ...]]:
    """The shapes of every value a traced program computes, inside loops too."""
    found = set()
    for eqn in jaxpr.eqns:
        found |= {tuple(getattr(var.aval, "shape", ())) for var in eqn.outvars}
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found |= _shapes(inner)
    return found


def _check_blockwise(fn: Callable[..., Any], q, k, v, block_k: int, where: str) -> None:
    """No ``[q_len, kv_len]`` matrix of scores when ``block_k < kv_len`` (skipped for code JAX cannot trace)."""
    try:
        jaxpr = jax.make_jaxpr(lambda q, k, v: fn(q, k, v, block_k))(q, k, v).jaxpr
    except Exception:  # noqa: BLE001 (NumPy code, say: its output is still judged against the oracle)
        return
    whole = (q.shape[0], k.shape[0])
    if whole in _shapes(jaxpr):
        raise CheckFailed(f"failed: {where} — the scores of all {k.shape[0]} keys exist at once (a {list(whole)} "
                          f"matrix): visit the keys block by block, {block_k} at a time, folding each block into "
                          "the running (m, l, acc) with the online softmax")


def check_one_head(fn: Callable[..., Any], blocks_k: Sequence[int] = (25, 32, 100)) -> None:
    """``fn(q, k, v, block_k) -> out`` for one head, no mask, ``out`` in q's dtype: the float64 oracle for a
    ``block_k`` that divides ``kv_len = 75``, one that does not, and one larger than ``kv_len``; and no
    ``[q_len, kv_len]`` score matrix when ``block_k < kv_len``."""
    q, k, v = _qkv(4, 50, 75)
    _check_blockwise(fn, q, k, v, blocks_k[0], f"exercise 1, case 'block_k = {blocks_k[0]}'")
    for block_k in blocks_k:
        how = ("divides" if 75 % block_k == 0 else "is larger than") if block_k >= 75 or 75 % block_k == 0 \
            else "does not divide"
        where = f"exercise 1, case 'block_k = {block_k} {how} kv_len = 75'"
        _judge(fn(q, k, v, block_k), q, k, v, causal=False, where=where, otherwise=_ONE_HEAD,
               suspects=_one_head_suspects(q, k, v, block_k),
               nan_hint="if no key block was visited, l is still 0: with block_k > kv_len (or a partial last "
               "block) the loop must still visit the shorter block, range(0, kv_len, block_k)")
    q, k, v = _far_below_zero_qkv(6, 50, 75)
    _judge(fn(q, k, v, blocks_k[1]), q, k, v, causal=False, nan_hint=_M_STARTS_AT_ZERO, otherwise=_ONE_HEAD,
           where=f"exercise 1, case '{_FAR_BELOW_ZERO}, block_k = {blocks_k[1]}'", suspects=[_zeros_suspect(q)])
    print(f"passed: exercise 1, one head matches the float64 oracle for block_k = {', '.join(map(str, blocks_k))} "
          "(divides kv_len = 75, does not, is larger) and with every score far below zero")


ONE_HEAD = Puzzle("exercise 1: from scratch", check_one_head, flash_attention_one_head_solution, (
    "Keep three running values per query row: the maximum `m` (start at `-inf`), the sum `l` (start at 0) and the "
    "unnormalised output `acc` (zeros, `[q_len, d]`). Visit the keys `block_k` at a time, `for lo in range(0, "
    "kv_len, block_k)`: the slice `k[lo:lo + block_k]` is simply shorter for the last block, and is all of `k` "
    "when `block_k > kv_len`.",
    "Per block: `s = q @ k_blk.T * reference.default_scale(d)`; `m_new = jnp.maximum(m, s.max(axis=1))`; "
    "`alpha = jnp.exp(m - m_new)` rescales what came before and `p = jnp.exp(s - m_new[:, None])` weighs this "
    "block; then `l = alpha * l + p.sum(axis=1)` and `acc = alpha[:, None] * acc + p @ v_blk`. After the loop "
    "divide once, `acc / l[:, None]`. Build the state with `jnp` (or `dtype=q.dtype`) so it stays float32.",
))


# -- exercise 2: the log-sum-exp -----------------------------------------------------------------------------


def check_lse(fn: Callable[..., Any], blocks_k: Sequence[int] = (32, 100)) -> None:
    """``fn(q, k, v, block_k) -> (out, lse)``: ``out`` as in exercise 1, ``lse [q_len]`` within 2e-5 of
    :func:`flashlib.reference.logsumexp_oracle` (and 8 float32 steps more where every score is far below zero,
    ``lse`` near -150)."""
    q, k, v = _qkv(5, 50, 75)
    _check_blockwise(lambda *args: fn(*args)[0], q, k, v, blocks_k[0], f"exercise 2, case 'block_k = {blocks_k[0]}'")
    cases = [((q, k, v), block_k, f"exercise 2, case 'block_k = {block_k}'") for block_k in blocks_k]
    cases.append((_far_below_zero_qkv(7, 50, 75), blocks_k[0], f"exercise 2, case '{_FAR_BELOW_ZERO}, block_k = "
                  f"{blocks_k[0]}'"))
    for (q, k, v), block_k, where in cases:
        want = np.asarray(reference.logsumexp_oracle(q[None, None], k[None, None]))[0, 0]
        s = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T * reference.default_scale(q.shape[1])
        m, log_l = s.max(axis=1), np.log(np.exp(s - s.max(axis=1, keepdims=True)).sum(axis=1))
        answer = fn(q, k, v, block_k)
        if not isinstance(answer, (tuple, list)) or len(answer) != 2:
            raise CheckFailed(f"failed: {where} — return a pair (out, lse), got {type(answer).__name__}")
        out, lse = answer
        if np.shape(out) == want.shape and np.shape(lse) == q.shape:
            raise CheckFailed(f"failed: {where} — the pair is the wrong way round: return (out, lse), out first")
        far = where.endswith(f"{_FAR_BELOW_ZERO}, block_k = {blocks_k[0]}'")
        _judge(out, q, k, v, causal=False, where=where, otherwise=_ONE_HEAD,
               suspects=[_zeros_suspect(q)] if far else _one_head_suspects(q, k, v, block_k),
               nan_hint=_M_STARTS_AT_ZERO if far else _RESCALE)
        lse = np.asarray(lse, np.float64)
        if lse.shape != want.shape:
            raise CheckFailed(f"failed: {where} — lse has shape {lse.shape}, expected ({q.shape[0]},): one number per "
                              "query row")
        atol = 2e-5 + (8 * np.spacing(np.abs(want).astype(np.float32)).astype(np.float64) if far else 0.0)
        if not np.all(np.abs(lse - want) <= atol):
            if far and not np.isfinite(lse).all():
                raise CheckFailed(f"failed: {where} — lse is not finite: {_M_STARTS_AT_ZERO}")
            for wrong, mistake in ((m, "lse equals the row maximum m: add log(l), lse = m + log(l)"),
                                   (log_l, "lse equals log(l) alone: l is the sum relative to m, so lse = m + log(l)")):
                if np.allclose(lse, wrong, atol=1e-4):
                    raise CheckFailed(f"failed: {where} — {mistake}")
            worst = int(np.argmax(np.where(np.isfinite(lse), np.abs(lse - want), np.inf)))
            raise CheckFailed(f"failed: {where} — lse[{worst}] = {lse[worst]:.6g}, expected {want[worst]:.6g}: use the "
                              "final m and l, lse = m + log(l)")
    print(f"passed: exercise 2, out and lse match the float64 oracle for block_k = {', '.join(map(str, blocks_k))} "
          "and with every score far below zero")


LSE = Puzzle("exercise 2: the log-sum-exp", check_lse, flash_attention_with_lse_solution, (
    "Exercise 1's loop already ends with what you need: each row's maximum `m` and its sum `l`, which is measured "
    "against `m`: `l = sum over j of e^(s_j - m)`.",
    "So `sum over j of e^(s_j) = e^m * l`, and its log is `m + log(l)`: return `(acc / l[:, None], m + "
    "jnp.log(l))`, one number per query row (shape `[q_len]`).",
))


# -- exercise 3: predict how scratch memory scales -----------------------------------------------------------


_WHAT_EACH_HOLDS = {  # method: (why its exponent in N, why its exponent in block_k)
    "naive": ("it holds the whole N x N score matrix", "it has no blocks: block_k does not enter it"),
    "library blockwise": ("it holds one [N, block_k] slab of scores (all query blocks at once)",
                          "its slab of scores is [N, block_k]"),
    "ours": ("it holds one [block_q, block_k] tile at a time: N only sets how many steps there are",
             "its tile of scores is [block_q, block_k]"),
}


def _methods() -> dict[str, Callable[[int], Callable[..., Any]]]:
    """Each method as ``block_k -> fn(q, k, v)`` on ``[1, 1, N, 64]`` inputs (naive ignores ``block_k``)."""
    def ours(block_k: int) -> Callable[..., Any]:
        head = functools.partial(flash_attention_head_solution, block_q=128, block_k=block_k)
        return lambda q, k, v: jax.vmap(jax.vmap(head))(q, k, v)

    return {"naive": lambda block_k: functools.partial(flashlib.attention, impl="reference"),
            "library blockwise": lambda block_k: functools.partial(blockwise_attention, block_k=block_k),
            "ours": ours}


@functools.lru_cache(maxsize=4)  # a compile-time measurement: the same for the same JAX, so once per process
def measured_exponents(n: int = 2048, block_k: int = 256) -> dict[str, tuple[float, float]]:
    """``{method: (a, b)}`` with scratch ∝ N^a · block_k^b, measured by doubling N and block_k from ``(n, block_k)``."""
    found = {}
    for method, make in _methods().items():
        base = scratch_bytes(make(block_k), 1, 1, n, 64)
        twice_n, twice_k = scratch_bytes(make(block_k), 1, 1, 2 * n, 64), scratch_bytes(make(2 * block_k), 1, 1, n, 64)
        found[method] = (math.log2(twice_n / base), math.log2(twice_k / base))
    return found


def check_scratch_exponents(predicted: dict[str, Any]) -> None:
    """``{method: (a, b)}``, integers, for naive, library blockwise and ours (block_q = 128): scratch ∝ N^a · block_k^b,
    compared with XLA's measured scratch when N and block_k double (rounded to whole exponents)."""
    methods = ", ".join(map(repr, _WHAT_EACH_HOLDS))
    if not isinstance(predicted, dict) or set(predicted) - set(_WHAT_EACH_HOLDS):
        raise CheckFailed(f"failed: exercise 3 — give a dict with exactly the keys {methods}; got "
                          f"{sorted(predicted) if isinstance(predicted, dict) else type(predicted).__name__}")
    if all(predicted.get(method) is None for method in _WHAT_EACH_HOLDS):
        raise NotImplementedError
    for method in _WHAT_EACH_HOLDS:
        pair = predicted.get(method)
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(x, (int, float)) for x in pair)):
            raise CheckFailed(f"failed: exercise 3, {method} — got {pair!r}: give two numbers (a, b), the exponents "
                              "of N and of block_k")
    measured = measured_exponents()
    for method, (why_n, why_k) in _WHAT_EACH_HOLDS.items():
        a, b = predicted[method]
        for axis, guess, got, why in (("N", a, measured[method][0], why_n), ("block_k", b, measured[method][1], why_k)):
            if guess != round(got):
                raise CheckFailed(f"failed: exercise 3, {method} — you predicted scratch ∝ {axis}^{guess}, XLA "
                                  f"measures {axis}^{got:.2f} (x{2 ** got:.2f} when {axis} doubles): {why}")
    print("passed: exercise 3, your exponents match XLA's measured scratch for naive, library blockwise and ours")


SCRATCH_EXPONENTS = Puzzle("exercise 3: what sets the scratch memory", check_scratch_exponents,
                           scratch_exponents_solution, (
    "For each method, write down the shape of the largest array it holds at once, for one head: naive attention's "
    "score matrix, the library's slab (one key block against every query), ours' tile (one query block against "
    "one key block). Its size is the product of its dimensions; doubling a dimension that appears `a` times "
    "multiplies it by `2^a`.",
    "Naive holds `[N, N]`: `N^2`, and `block_k` does not enter it. The library's slab is `[N, block_k]`: `N^1 "
    "block_k^1`. Ours holds one `[block_q, block_k]` tile with `block_q = 128` fixed: `N` only sets how many steps "
    "there are, so `N^0 block_k^1`.",
), answer_is_value=True)
