"""Notebook 06's puzzles and exercises: the forward kernel (init / online-softmax body / finalize under
``pl.when``), causal skipping with a clamped key/value index map, and the checkers of exercises 1-3
(softcapping, counting skipped steps and copies, block sizes under a VMEM budget).

Grid ``(batch, heads, q_block, kv_block)``, ``m``/``l`` ``[block_q, 1]`` and ``acc`` f32 VMEM scratch, lengths
multiples of the blocks; causal is bottom-right (query ``i`` sees key ``j <= i + offset``, ``offset = kv_len -
q_len >= 0``). The checkers run the kernels under ``pltpu.InterpretParams()`` (NaN scratch, out-of-bounds blocks
raise) and hand every step the causal mask skips a block of NaN, so a body that runs there shows.

Longer than 400 lines because every checker here runs the learner's kernel through one harness (the notebook's
grid, NaN blocks where causal skips, the jaxpr probes for pl.when and matmul dtypes) and judges it against one set
of float64 suspects; split apart, each half would import the other's helpers."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib import cost
from flashlib.checks import CheckFailed, check_attention
from flashlib.exercises.flash_kernel_solutions import (
    causal_kv_index_map_solution,
    flash_kernel_causal_solution,
    flash_kernel_softcap_solution,
    flash_kernel_solution,
    pick_blocks_solution,
    skip_counts_solution,
)
from flashlib.exercises.puzzle import Puzzle
from flashlib.exercises.start_here import traced_eqns
from flashlib.kernels import BlockSizes
from flashlib.kernels.block_sizes import MIB, vmem_limit_bytes

__all__ = ["BUDGET", "CAUSAL_SKIPPING", "COUNTS", "FORWARD_KERNEL", "SOFTCAP", "check_budget", "check_causal",
           "check_counts", "check_forward_kernel", "check_softcap"]


# -- running a kernel the way the notebook's flash_call does, under TPU interpret semantics --------------------
def _qkv(seed: int, q_len: int, kv_len: int, dtype=jnp.float32, head_dim: int = 32):
    keys, lengths = jax.random.split(jax.random.key(seed), 3), (q_len, kv_len, kv_len)
    return tuple(jax.random.normal(key, (1, 1, n, head_dim)).astype(dtype)
                 for key, n in zip(keys, lengths, strict=True))


def _call(kernel, q, k, v, *, block_q: int, block_k: int, kv_map=None, num_kv: int | None = None):
    """The notebook's ``flash_call``; ``num_kv`` key blocks, one fewer than k holds when it ends in a NaN block."""
    q_len, head_dim = q.shape[2], q.shape[3]
    num_kv = k.shape[2] // block_k if num_kv is None else num_kv
    kv_map = kv_map or (lambda b, h, i, j, **_: (b, h, j, 0))
    blocks = dict(block_q=block_q, block_k=block_k, offset=num_kv * block_k - q_len)
    q_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, block_q, head_dim), lambda b, h, i, j: (b, h, i, 0))
    kv_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, block_k, head_dim), functools.partial(kv_map, **blocks))
    return pl.pallas_call(
        functools.partial(kernel, scale=head_dim**-0.5),
        grid=(q.shape[0], q.shape[1], q_len // block_q, num_kv),
        in_specs=[q_spec, kv_spec, kv_spec], out_specs=q_spec, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32)] * 2 + [pltpu.VMEM((block_q, head_dim), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams(),
    )(q, k, v)


def _primitives(jaxpr) -> set[str]:
    """Every primitive's name in a jaxpr and the jaxprs inside it (pl.when branches, pallas_call bodies)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner)
    return names


def _kernel_conds(kernel, q, k, v, **blocks) -> int:
    """How many ``pl.when`` / ``lax.cond`` the kernel's body traces to (at its top level)."""
    jaxpr = jax.make_jaxpr(lambda q, k, v: _call(kernel, q, k, v, **blocks))(q, k, v).jaxpr
    (call,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "pallas_call"]
    inner = call.params["jaxpr"]
    return sum(eqn.primitive.name == "cond" for eqn in getattr(inner, "jaxpr", inner).eqns)


def _scores64(q, k, cap: float | None = None, before_scale: bool = False, times_cap: bool = True) -> np.ndarray:
    s, scale = np.asarray(q, np.float64)[0, 0] @ np.asarray(k, np.float64)[0, 0].T, q.shape[-1] ** -0.5
    if cap is None or before_scale:
        return s * scale if cap is None else cap * np.tanh(s / cap) * scale
    return (cap if times_cap else 1.0) * np.tanh(s * scale / cap)


def _softmax_out(s: np.ndarray, v, visible=None) -> np.ndarray:
    s = s if visible is None else np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ np.asarray(v, np.float64)[0, 0]


def _blockwise(s: np.ndarray, v, block_k: int, *, rescale: bool = True, divide: bool = True) -> np.ndarray:
    v64 = np.asarray(v, np.float64)[0, 0]
    m, l, acc = np.full((len(s), 1), -np.inf), np.zeros((len(s), 1)), np.zeros((len(s), v64.shape[1]))  # noqa: E741
    for lo in range(0, s.shape[1], block_k):
        m_next = np.maximum(m, s[:, lo:lo + block_k].max(axis=1, keepdims=True))
        alpha, p = (np.exp(m - m_next) if rescale else 1.0), np.exp(s[:, lo:lo + block_k] - m_next)
        m, l, acc = m_next, alpha * l + p.sum(axis=1, keepdims=True), alpha * acc + p @ v64[lo:lo + block_k]
    return acc / l if divide else acc


def _near(got, want, dtype) -> bool:
    got = np.asarray(got, np.float64)[0, 0]
    return bool(np.all(np.abs(got - want) <= (1e-4 if np.dtype(dtype) == np.float32 else 3e-2)))


def _diagnose(name: str, case: str, out, dtype, nan_hint: str, suspects, otherwise: str) -> None:
    """Raise naming the mistake: NaN, the first suspect (a float64 answer with a mistake) matched, or otherwise."""
    if not np.isfinite(np.asarray(out, np.float64)).all():
        raise CheckFailed(f"failed: {name}, case '{case}' — {nan_hint}")
    for want, hint in suspects:
        if _near(out, want, dtype):
            raise CheckFailed(f"failed: {name}, case '{case}' — {hint}")
    raise CheckFailed(f"failed: {name}, case '{case}' — {otherwise}")


def _fits(out, q, k, v, causal: bool = False) -> bool:
    try:
        return bool(check_attention(out, q, k, v, causal=causal, quiet=True))
    except CheckFailed:
        return False


# -- puzzle 1: the forward kernel ---------------------------------------------------------------------------
_NAN_STATE = ("NaN in the output: scratch starts as garbage (NaN under InterpretParams), so set m = -inf, l = 0, "
              "acc = 0 under pl.when(kv_block == 0) before the first fold, and write o_ref on the last key block; "
              "and rescale by alpha = exp(m_prev - m_next) (at most 1, and 0 from the empty state), not "
              "exp(m_next - m_prev), which is inf on the first block")


def _float32_matmuls(kernel, q, k, v, **blocks) -> list[tuple[str, ...]]:
    """The kernel's matmuls whose operands are not all in the inputs' dtype (bfloat16 inputs: float32 operands)."""
    jaxpr = jax.make_jaxpr(lambda q, k, v: _call(kernel, q, k, v, **blocks))(q, k, v).jaxpr
    (call,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "pallas_call"]
    inner, dtype = call.params["jaxpr"], jnp.dtype(q.dtype).name
    matmuls = [tuple(jnp.dtype(var.aval.dtype).name for var in eqn.invars)
               for eqn in traced_eqns(getattr(inner, "jaxpr", inner)) if eqn.primitive.name == "dot_general"]
    return [dtypes for dtypes in matmuls if set(dtypes) != {dtype}]


_FORWARD_CASES = [  # (words, q_len, kv_len, block_q, block_k, dtype)
    ("128 queries, 384 keys: three key blocks", 128, 384, 64, 128, jnp.float32),
    ("192 queries, 128 keys: one key block, init and finalize on the same step", 192, 128, 64, 128, jnp.float32),
    ("128 queries, 256 keys in bfloat16, 128 x 128 blocks", 128, 256, 128, 128, jnp.bfloat16),
    (_EXTREME := "scores near +180 in even rows' key blocks 0 and 2, near -180 everywhere else, 32 x 128 blocks",
     128, 384, 32, 128, jnp.float32),
]


def _extreme_qkv(seed: int):
    """Even rows score about +181 on key blocks 0 and 2 and -181 on block 1 (exp overflows unless shifted by the
    running max); odd rows score about -181 everywhere (exp(s - 0) underflows to 0: m must start at -inf)."""
    q, k, v = _qkv(seed, 128, 384)
    u, w = (jnp.arange(32) < 16).astype(jnp.float32), (jnp.arange(32) >= 16).astype(jnp.float32)
    rows, sign = jnp.arange(128)[:, None], jnp.where((jnp.arange(384) // 128)[:, None] == 1, -1.0, 1.0)
    return q + 8 * jnp.where(rows % 2 == 0, u, w), k + 8 * (sign * u - w), v


def check_forward_kernel(kernel: Callable) -> None:
    """``kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, scale)`` on the notebook's grid, non-causal."""
    for seed, (case, q_len, kv_len, bq, bk, dtype) in enumerate(_FORWARD_CASES):
        q, k, v = _extreme_qkv(seed) if case == _EXTREME else _qkv(seed, q_len, kv_len, dtype)
        out = _call(kernel, q, k, v, block_q=bq, block_k=bk)
        nan_rows = np.flatnonzero(~np.isfinite(np.asarray(out, np.float64)[0, 0]).all(axis=1))
        if case == _EXTREME and nan_rows.size and (nan_rows % 2 == 0).any():
            raise CheckFailed(f"failed: forward kernel, case '{case}' — NaN in rows whose scores reach +180: exp "
                              "overflows unless every exponent is shifted by the RUNNING maximum, m_next = "
                              "max(m_prev, this block's row max) (this block's max alone makes alpha = "
                              "exp(m_prev - m_next) overflow when a later block scores lower)")
        if case == _EXTREME and nan_rows.size:
            raise CheckFailed(f"failed: forward kernel, case '{case}' — NaN in the rows whose scores are all near "
                              "-180: with m starting at 0, exp(s - m) underflows to 0 and l stays 0; start m at "
                              "-inf, so the first block's own maximum becomes m")
        if _fits(out, q, k, v):
            if seed == 0 and _kernel_conds(kernel, q, k, v, block_q=bq, block_k=bk) < 2:
                raise CheckFailed(
                    "failed: forward kernel — right numbers, but fewer than two pl.when in the kernel: a jnp.where "
                    "reset and a write of acc / l on every step pay on every step for work done once; put init "
                    "under pl.when(kv_block == 0) and finalize under pl.when(kv_block == last)")
            if dtype == jnp.bfloat16 and (wide := _float32_matmuls(kernel, q, k, v, block_q=bq, block_k=bk)):
                raise CheckFailed(
                    f"failed: forward kernel, case '{case}' — right numbers, but a matmul multiplies "
                    f"{' x '.join(wide[0])} operands though the inputs are bfloat16: cast p to v's dtype before "
                    "p @ v, jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32) (the "
                    "MXU multiplies bfloat16 at full rate and float32 in several passes; the f32 accumulation "
                    "keeps the sum exact enough)")
            continue
        s = _scores64(q, k)
        _diagnose("forward kernel", case, out, dtype, _NAN_STATE, [
            (_softmax_out(s[:, -bk:], v[:, :, -bk:]), "the output is attention over the LAST key block alone: the "
             "state is reset on every step; initialise only when pl.program_id(3) == 0"),
            (_softmax_out(s[:, :bk], v[:, :, :bk]), "the output is attention over the FIRST key block alone: "
             "finalize runs on the first step; run it when kv_block == pl.num_programs(3) - 1"),
            (_blockwise(s, v, bk, rescale=False), "l and acc are not rescaled when the maximum grows: multiply "
             "them by alpha = exp(m_prev - m_next) before adding this block's sums"),
            (_blockwise(s, v, bk, divide=False), "the output is acc, not acc / l: divide by l in finalize"),
            (_softmax_out(s * q.shape[-1] ** 0.5, v), "the scores are not scaled: multiply q k^T by scale"),
        ], "the output is not softmax attention: check the online update (m, then l and acc rescaled by "
            "alpha, then p @ v) and that o_ref is written on the last key block")
    print(f"passed: forward kernel matches attention in all {len(_FORWARD_CASES)} cases (one key block, three, "
          "bfloat16, scores near +-180), with init and finalize under pl.when")


FORWARD_KERNEL = Puzzle(
    "puzzle 1: the forward kernel",
    check_forward_kernel,
    flash_kernel_solution,
    (
        "Three phases, by `kv_block = pl.program_id(3)`: `@pl.when(kv_block == 0)` sets the scratch to an empty "
        "state (`m = -inf`, `l = 0`, `acc = 0`, with `jnp.full` / `jnp.zeros` of the ref's shape); every step "
        "folds its block in; `@pl.when(kv_block == pl.num_programs(3) - 1)` writes `acc / l` to `o_ref`.",
        "The body, with refs: `s = lax.dot_general(q_ref[...], k_ref[...], NT_DIMS, preferred_element_type="
        "jnp.float32) * scale`; `m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))`; `alpha = "
        "jnp.exp(m_prev - m_next)`; `p = jnp.exp(s - m_next)`; then store `m_next`, `alpha * l + p.sum(axis=1, "
        "keepdims=True)` and `alpha * acc + jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type="
        "jnp.float32)`. Read `m_prev` before you overwrite `m_ref`.",
    ),
)


# -- puzzle 2: causal skipping, in the compute and in the copies ---------------------------------------------
_CAUSAL_CASES = [  # (words, q_len, kv_len, block_q, block_k)
    ("128 queries over 256 keys (offset 128: they are the last 128 positions), 64 x 64 blocks", 128, 256, 64, 64),
    ("256 queries over 256 keys, 64 x 128 blocks: two query blocks per diagonal key block", 256, 256, 64, 128),
    ("256 queries over 320 keys (offset 64), 128 x 64 blocks: several key blocks per diagonal", 256, 320, 128, 64),
]


def _last(i, bq: int, bk: int, offset: int) -> int:
    return ((i + 1) * bq - 1 + offset) // bk


def _check_index_map(index_map: Callable) -> list[list[int]]:
    """The block the map names at each step of each case, against ``min(j, last(i))``; it passes b, h through."""
    named, wrong, unclamped = [], [], True  # wrong: (case, i, j, last, named block); unclamped: skips name j
    for case, q_len, kv_len, bq, bk in _CAUSAL_CASES:
        named.append([])
        for i, j in ((i, j) for i in range(q_len // bq) for j in range(kv_len // bk)):
            got = tuple(int(x) for x in index_map(1, 2, i, j, block_q=bq, block_k=bk, offset=kv_len - q_len))
            if len(got) != 4 or got[:2] != (1, 2) or got[3] != 0:
                raise CheckFailed(f"failed: causal index map, case '{case}' — step (b=1, h=2, i={i}, j={j}) gives "
                                  f"{got}: return (b, h, key block, 0)")
            named[-1].append(got[2])
            last = _last(i, bq, bk, kv_len - q_len)
            unclamped &= j <= last or got[2] == j
            if got[2] != min(j, last):
                wrong.append((case, i, j, last, got[2]))
    if not wrong:
        return named
    case, i, j, last, block = wrong[0]
    name = f"failed: causal index map, case '{case}' — step (i={i}, j={j})"
    if j <= last:
        raise CheckFailed(f"{name} computes (query block {i} sees key blocks 0 to {last}), so it must read block "
                          f"{j}, not {block}: is the clamp too low? (last = ((i + 1) * block_q - 1 + offset) // "
                          "block_k, offset included)")
    if unclamped:
        raise CheckFailed(f"{name} is skipped (query block {i} sees key blocks 0 to {last}) but names block {j}: "
                          "the index map is not clamped, so Pallas copies a block nobody uses; name "
                          "jnp.minimum(j, last) so a skipped step repeats the block before")
    raise CheckFailed(f"{name} is skipped and should repeat block {last}, the last one query block {i} sees "
                      f"(((i + 1) * block_q - 1 + offset) // block_k), not name {block}: off by one?")


def _poisoned_map(b, h, i, j, *, block_q, block_k, offset, num_kv):  # a skipped step gets the NaN block
    return b, h, jnp.where(j <= lax.div((i + 1) * block_q - 1 + offset, block_k), j, num_kv), 0


def check_causal(answer) -> None:
    """``answer = (causal_kv_index_map, flash_kernel_causal)``: the map names ``min(j, last)`` on every step,
    the kernel matches bottom-right causal attention, and no skipped step computes (it is handed NaN)."""
    if not (isinstance(answer, tuple) and len(answer) == 2 and all(map(callable, answer))):
        raise CheckFailed("failed: causal skipping — give the pair (causal_kv_index_map, flash_kernel_causal)")
    index_map, kernel = answer
    named = _check_index_map(index_map)
    case, q_len, kv_len, bq, bk = _CAUSAL_CASES[0]
    q, k, v = _qkv(0, q_len, kv_len)
    blocks = dict(block_q=bq, block_k=bk, offset=kv_len - q_len)
    for part, jaxpr in (("index map", jax.make_jaxpr(lambda i, j: index_map(0, 0, i, j, **blocks))(0, 0).jaxpr),
                        ("kernel", jax.make_jaxpr(lambda q, k, v: _call(functools.partial(
                            kernel, offset=kv_len - q_len), q, k, v, block_q=bq, block_k=bk))(q, k, v).jaxpr)):
        if "sign" in _primitives(jaxpr):
            raise CheckFailed(f"failed: causal skipping — the {part} divides a traced int with "
                              "//, which lowers through sign(): Mosaic could not lower that when section 7 "
                              "compiles your kernel for a TPU v5e; divide with lax.div (both operands >= 0 here)")
    for seed, (case, q_len, kv_len, bq, bk) in enumerate(_CAUSAL_CASES):
        q, k, v = _qkv(seed, q_len, kv_len)
        offset, num_kv = kv_len - q_len, kv_len // bk
        learners = functools.partial(kernel, offset=offset)
        out = _call(learners, q, k, v, block_q=bq, block_k=bk, kv_map=index_map)
        if not _fits(out, q, k, v, causal=True):
            s, rows, cols = _scores64(q, k), np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
            _diagnose("causal kernel", case, out, jnp.float32,
                      "NaN in the output: init must run on kv_block == 0 and finalize on the last grid step even "
                      "when that step is skipped; keep both outside the pl.when that skips", [
                          (_softmax_out(s, v, cols <= rows), "the mask is aligned top-left: query i sees key j "
                           "<= i + offset (offset = kv_len - q_len), both in the mask and in the last block"),
                          (_softmax_out(s, v, cols // bk <= _last(rows // bq, bq, bk, offset)), "the diagonal "
                           "block is not masked element by element: keep scores where kv_pos <= q_pos + offset, "
                           "MASK_VALUE elsewhere (absolute positions from program_id and iota)"),
                      ], "the output is not causal attention: the body must run exactly when kv_block <= "
                      "((q_block + 1) * block_q - 1 + offset) // block_k, masking kv_pos <= q_pos + offset")
        k, v = (jnp.concatenate([x, jnp.full((1, 1, bk, x.shape[3]), jnp.nan)], axis=2) for x in (k, v))
        out = _call(learners, q, k, v, block_q=bq, block_k=bk, num_kv=num_kv,
                    kv_map=functools.partial(_poisoned_map, num_kv=num_kv))
        if not np.isfinite(np.asarray(out)).all():
            raise CheckFailed(f"failed: causal kernel, case '{case}' — right numbers, but the body runs on skipped "
                              "steps (handed a block of NaN, it made NaN): put it under pl.when(kv_block <= last)")
    case, q_len, kv_len, bq, bk = _CAUSAL_CASES[0]  # every score far below zero (q near -3, k near 9: about -150)
    q, k, v = _qkv(len(_CAUSAL_CASES), q_len, kv_len)
    q, k = -3.0 + 0.2 * q, 9.0 + 0.2 * k
    out = _call(functools.partial(kernel, offset=kv_len - q_len), q, k, v, block_q=bq, block_k=bk, kv_map=index_map)
    if not _fits(out, q, k, v, causal=True):
        raise CheckFailed(f"failed: causal kernel, case '{case}, every score far below zero (about -150)' — the "
                          "running max m starts at 0, not -inf? exp(s - 0) underflows to 0 for every key, so l stays "
                          "0 and the row comes out 0 or NaN: start m at -inf, so the first block's maximum replaces it")
    copies = ", ".join(str(1 + int(np.count_nonzero(np.diff(blocks)))) for blocks in named)
    print(f"passed: causal kernel matches causal attention in all {len(_CAUSAL_CASES) + 1} cases, skipped steps do no "
          f"work, and the clamped index map copies {copies} k blocks where an unclamped one copies "
          f"{', '.join(str(len(blocks)) for blocks in named)}")


CAUSAL_SKIPPING = Puzzle(
    "puzzle 2: causal skipping",
    check_causal,
    (causal_kv_index_map_solution, flash_kernel_causal_solution),
    (
        "Query block `i` sees keys up to its last row's limit, `(i + 1) * block_q - 1 + offset`, so its last key "
        "block is that divided by `block_k` (`lax.div`: Mosaic cannot lower `//` on traced ints). The index map "
        "returns `(b, h, jnp.minimum(j, last), 0)`; the kernel runs its body under `pl.when(kv_block <= last)`.",
        "Inside the body, mask by absolute positions: `q_pos = q_block * block_q + lax.broadcasted_iota(jnp.int32, "
        "s.shape, 0)`, `kv_pos = kv_block * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)`, then `s = "
        "jnp.where(kv_pos <= q_pos + offset, s, MASK_VALUE)` before the online update. Init stays on `kv_block == "
        "0` and finalize on the last grid step, both outside the skip: the last step may be a skipped one.",
    ),
)


# -- exercise 1: softcapping -----------------------------------------------------------------------------------
_SOFTCAP_CASES = [("128 queries, 256 keys, cap 2", 128, 256, 2.0), ("64 queries, 384 keys, cap 1", 64, 384, 1.0)]


def check_softcap(kernel: Callable) -> None:
    """``kernel(..., *, scale, cap)``: the forward kernel with scores capped, ``s -> cap * tanh(s / cap)``."""
    for seed, (case, q_len, kv_len, cap) in enumerate(_SOFTCAP_CASES):
        q, k, v = _qkv(10 + seed, q_len, kv_len)
        out = _call(functools.partial(kernel, cap=cap), q, k, v, block_q=64, block_k=128)
        if _near(out, _softmax_out(_scores64(q, k, cap), v), jnp.float32):
            continue
        _diagnose("softcapped kernel", case, out, jnp.float32, _NAN_STATE, [
            (_softmax_out(_scores64(q, k), v), "the scores are not capped: apply s -> cap * tanh(s / cap) to the "
             "scaled scores, before the online update"),
            (_softmax_out(_scores64(q, k, cap, before_scale=True), v), "the cap is applied before the scale: "
             "scale q k^T first, then cap"),
            (_softmax_out(_scores64(q, k, cap, times_cap=False), v), "tanh(s / cap) lies in (-1, 1): multiply it "
             "by cap"),
            *[(_softmax_out(_scores64(q, k, other), v), f"this is the cap {other:g} of the case before: use the "
               "kernel's cap argument, not a number") for other in {c for *_, c in _SOFTCAP_CASES} - {cap}],
            (_softmax_out(np.clip(_scores64(q, k), -cap, cap), v), "the scores are clipped to [-cap, cap]: the "
             "softcap is smooth, cap * tanh(s / cap)"),
        ], "the output is not softcapped attention (compared with a float64 reference)")
    # A large cap keeps large scores: every scaled score near -150 (q near -3, k near 9), about -129 once capped
    # at 200. exp(s - m) underflows to 0 for every key unless m is the row's maximum (m starting at -inf).
    q, k, v = _qkv(10 + len(_SOFTCAP_CASES), 64, 128)
    q, k, case = -3.0 + 0.2 * q, 9.0 + 0.2 * k, "64 queries, 128 keys, cap 200, every score far below zero"
    out = _call(functools.partial(kernel, cap=200.0), q, k, v, block_q=64, block_k=128)
    if not _near(out, _softmax_out(_scores64(q, k, 200.0), v), jnp.float32):
        _diagnose("softcapped kernel", case, out, jnp.float32, "NaN in the output: the running max m starts at 0, "
                  "not -inf? A large cap keeps scores near -130, exp(s - 0) underflows to 0 for every key and l "
                  "stays 0: start m at -inf, so the first block's maximum replaces it", [],
                  "the output is not softcapped attention (compared with a float64 reference)")
    print(f"passed: softcapped kernel matches the float64 reference (caps 2, 1 and 200) in all "
          f"{len(_SOFTCAP_CASES) + 1} cases")


SOFTCAP = Puzzle(
    "exercise 1: softcapping",
    check_softcap,
    flash_kernel_softcap_solution,
    (
        "Start from your `flash_kernel`: init, the online update and finalize stay as they are. The cap changes "
        "only the scores, once they are scaled and before anything reads them: `m_next`, `p` and the sums then "
        "see capped scores.",
        "Right after `s = lax.dot_general(...) * scale`, add `s = cap * jnp.tanh(s / cap)`, with the kernel's "
        "`cap` argument (the checker passes 2, 1 and 200). Capped scores lie in `(-cap, cap)`: `tanh` alone would "
        "squash them into `(-1, 1)`, and `jnp.clip` is a hard cap, not the smooth one.",
    ),
)


# -- exercise 2: count the skipped steps and the copies --------------------------------------------------------
def check_counts(answer, tokens: int = 1024, block_q: int = 128, block_k: int = 256) -> None:
    """``answer = (skipped steps, k block copies)`` per batch and head, causal, ``tokens`` queries and keys."""
    (skipped, copies), blocks = (int(x) for x in answer), (tokens, tokens, block_q, block_k)
    total, visited = (tokens // block_q) * (tokens // block_k), cost.visited_blocks(*blocks, causal=True)
    name = "failed: skipped steps and k block copies"
    if (skipped, copies) == (cost.kv_block_fetches(*blocks, causal=True), total - visited):
        raise CheckFailed(f"{name} — ({skipped}, {copies}) is the right pair in the wrong order: (skipped steps, "
                          "k block copies)")
    if skipped != total - visited:
        hint = (f"{skipped} is the number of steps that run; skipped = the {total} steps minus those"
                if skipped == visited else "whole key blocks skip; the visible key blocks of query block i are 0 .. "
                f"((i + 1) * {block_q} - 1) // {block_k}, and blocks on the diagonal run")
        raise CheckFailed(f"{name} — {skipped} skipped steps is wrong: {hint}")
    if copies != cost.kv_block_fetches(*blocks, causal=True):
        hint = {total: "one copy per grid step, as without the clamp: a skipped step repeats the block before it",
                visited: "one copy per step that computes is nearly it, but when a query block ends on block 0 and "
                         "the next one starts on block 0, Pallas copies nothing"
                }.get(copies, "Pallas copies when the block index differs from the step before's")
        raise CheckFailed(f"{name} — {copies} copies is wrong: {hint}")
    print(f"passed: {skipped} of {total} steps skipped, {copies} k block copies instead of {total}")


COUNTS = Puzzle(
    "exercise 2: count the skipped blocks",
    check_counts,
    skip_counts_solution,
    (
        "Walk the grid in order, query block `i` outer, key block `j` inner. Query block `i` sees key blocks `0` "
        "to `last = ((i + 1) * block_q - 1) // block_k` (the block of its last query); steps with `j > last` skip "
        "the body.",
        "The clamped index map names block `min(j, last)`, and Pallas copies a block only when that index differs "
        "from the step before's (the very first step always copies). Count the steps with `j > last`, and the "
        "steps whose `min(j, last)` differs from the previous step's; answer `(skipped, copies)`.",
    ),
    answer_is_value=True,
)


# -- exercise 3: the biggest blocks that fit a VMEM budget -----------------------------------------------------
_SIZES = (128, 256, 512, 1024, 2048)
_BUDGET_CASES = [(256, jnp.float32, "v5e"), (128, jnp.float32, "v6e"), (128, jnp.bfloat16, "v6e"),
                 (128, jnp.bfloat16, "v5e")]


def _best_blocks(head_dim: int, dtype, generation: str, spare: int = 0) -> tuple[int, int]:
    fit = [(bq, bk) for bq in _SIZES for bk in _SIZES
           if BlockSizes(bq, bk).vmem_bytes(head_dim, dtype) <= vmem_limit_bytes(generation) - spare]
    return max(fit, key=lambda b: (b[0] * b[1], b[0]))


def check_budget(pick_blocks: Callable) -> None:
    """``pick_blocks(head_dim, dtype, generation) -> (block_q, block_k)``: the largest product that fits, the
    larger ``block_q`` between equal products; tried where three pairs tie and where the best fits exactly."""
    for head_dim, dtype, generation in _BUDGET_CASES:
        case = f"head_dim {head_dim}, {jnp.dtype(dtype).name}, {generation}"
        want = _best_blocks(head_dim, dtype, generation)
        got = tuple(int(x) for x in pick_blocks(head_dim, dtype, generation))
        limit, need = vmem_limit_bytes(generation), BlockSizes(*got).vmem_bytes(head_dim, dtype)
        if got == want:
            continue
        if need > limit:
            hint = f"{got} needs {need / MIB:.1f} MiB, more than the {limit / MIB:.0f} MiB limit"
        elif got == _best_blocks(head_dim, dtype, generation, spare=1):
            hint = f"{want} needs exactly the {limit / MIB:.0f} MiB limit, and that fits (<=, not <)"
        elif got[0] * got[1] == want[0] * want[1]:
            hint = f"{got} ties with {want} on block_q x block_k; between equal products take the larger block_q"
        else:
            hint = f"{want} fits too and has the larger block_q x block_k"
        raise CheckFailed(f"failed: the biggest blocks that fit, case '{case}' — got {got}, expected {want}: {hint}")
    print(f"passed: the biggest blocks that fit, in all {len(_BUDGET_CASES)} cases (ties and exact fits included)")


BUDGET = Puzzle(
    "exercise 3: fit a budget",
    check_budget,
    pick_blocks_solution,
    (
        "Try all 25 pairs: keep those whose `BlockSizes(block_q, block_k).vmem_bytes(head_dim, dtype)` is at most "
        "`vmem_limit_bytes(generation)` (a pair that needs exactly the limit fits), then take the best of them.",
        "`max(fits, key=lambda b: (b[0] * b[1], b[0]))`: a tuple key compares the product first, and between "
        "equal products the larger `block_q`.",
    ),
)
