"""Notebook 07's puzzles and exercises: the dK/dV kernel with causal skipping, the dQ kernel, and the checkers
of exercises 1-3 (D both ways, dV of one key block, the busiest dK/dV program).

The kernels are the notebook's two-kernel backward: grid ``(batch, heads, outer block, inner block)``; ``lse``
and ``D`` arrive as ``[block_q, 1]`` column blocks; ``causal`` is bottom-right aligned (query ``i`` sees key
``j <= i + offset``, ``offset = kv_len - q_len``); lengths are multiples of the blocks. The checkers run the
learner's kernels under ``pltpu.InterpretParams()`` (scratch starts as NaN, out-of-bounds blocks raise) and
hand every step the causal mask hides a block of NaN, so a body that runs where it should skip shows.

Longer than 400 lines because the two kernel puzzles and the three exercises share one harness (the notebook's
grid, the NaN blocks, the float64 gradients the messages compare against) and each Puzzle stands beside its
checker; the solutions already live in ``backward_solutions``.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib import geometry, reference, viz
from flashlib.checks import CheckFailed, check, check_attention_grads
from flashlib.exercises.backward_solutions import (
    busiest_solution,
    d_both_ways_solution,
    dkv_kernel,
    dq_kernel,
    dv_of_key_block_solution,
    first_q_block,
    last_kv_block,
    probabilities,
)
from flashlib.exercises.puzzle import Puzzle
from flashlib.kernels.tpu_backward import NO_KEY_LSE

__all__ = ["BUSIEST", "DKV_KERNEL", "DQ_KERNEL", "DV_OF_KEY_BLOCK", "D_BOTH_WAYS", "check_busiest",
           "check_d_both_ways", "check_dkv_kernel", "check_dq_kernel", "check_dv_of_key_block"]


# -- the checkers' harness: the two pallas_calls, every hidden step handed a block of NaN ----------------------


_Case = collections.namedtuple("_Case", "name q_len kv_len block_q block_k causal dtype", defaults=(jnp.float32,))

_CASES = (
    _Case("non-causal, q_len 64, kv_len 128", 64, 128, 32, 64, False),
    _Case("causal, q_len = kv_len = 128, block_q 32, block_k 64", 128, 128, 32, 64, True),
    _Case("causal, q_len 64 < kv_len 192 (a KV cache: every query sees the first 128 keys)", 64, 192, 32, 64, True),
    _Case("causal, q_len 192 > kv_len 64, block_q 64 > block_k 32 (the first 128 queries see no key)",
          192, 64, 64, 32, True),
    _Case("bfloat16, causal, q_len = kv_len = 128, block_q 64, block_k 32", 128, 128, 64, 32, True, jnp.bfloat16),
)


def _problem(case: _Case, seed: int):
    """q, k, v, dO [1, 1, n, 32] f32; lse [1, 1, q_len, 1] (rows that see no key: NO_KEY_LSE), D; oracle grads."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q, do = (jax.random.normal(key, (1, 1, case.q_len, 32)).astype(case.dtype) for key in keys[:2])
    k, v = (jax.random.normal(key, (1, 1, case.kv_len, 32)).astype(case.dtype) for key in keys[2:])
    out = reference.attention_oracle(q, k, v, causal=case.causal)
    lse = reference.logsumexp_oracle(q, k, causal=case.causal)[..., None]
    lse = jnp.asarray(np.where(np.isfinite(lse), lse, NO_KEY_LSE), jnp.float32)
    d = jnp.asarray(np.sum(np.asarray(do, np.float64) * out, axis=-1, keepdims=True), jnp.float32)
    return (q, k, v, do, lse, d), reference.attention_vjp_oracle(q, k, v, do, causal=case.causal)


def _with_nan_block(x, block):  # x [1, 1, n, c] with one more block of NaN at the end (index n // block)
    return jnp.concatenate([x, jnp.full((1, 1, block, x.shape[-1]), jnp.nan, x.dtype)], axis=2)


def _spec(rows, cols, index_map):
    return pl.BlockSpec((pl.squeezed, pl.squeezed, rows, cols), index_map)


def _run(kernel, case: _Case, inputs, *, dkv: bool):
    """The learner's dK/dV (``dkv``) or dQ kernel on ``inputs``, under InterpretParams; a step the causal mask
    hides gets the NaN block (the library's geometry decides which), so a body that runs there makes NaN."""
    (q, k, v, do, lse, d), bq, bk = inputs, case.block_q, case.block_k
    hd, num_q, num_kv = q.shape[-1], case.q_len // bq, case.kv_len // bk
    geo, offset, scale = dict(q_len=case.q_len, kv_len=case.kv_len), case.kv_len - case.q_len, hd**-0.5

    def visits(i, j):  # query block i sees some key of key block j
        return j * bk <= geometry.last_key_seen(i, block_q=bq, **geo) if case.causal else True

    def last(i):  # the last key block query block i visits (0 when it sees none: a real block to name)
        return jnp.maximum(geometry.last_key_seen(i, block_q=bq, **geo), 0) // bk

    if dkv:  # grid (b, h, key block j, query block i); the stream is the query side
        q, do, lse, d = (_with_nan_block(x, bq) for x in (q, do, lse, d))
        stream = lambda b, h, j, i: (b, h, jnp.where(visits(i, j), i, num_q), 0)  # noqa: E731
        stay = lambda b, h, j, i: (b, h, j, 0)  # noqa: E731
        grid, q_map, kv_map = (1, 1, num_kv, num_q), stream, stay
        # dK, dV, and per key block the count of steps before the last query block that stored into them
        out_specs = [_spec(bk, hd, stay)] * 2 + [pl.BlockSpec((8, 128), lambda b, h, j, i: (j, 0))]
        out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2 + [jax.ShapeDtypeStruct((8 * num_kv, 128),
                                                                                         jnp.int32)]
        scratch = [pltpu.VMEM((bk, hd), jnp.float32)] * 2
        kernel = _counting_early_stores(kernel)
    else:  # grid (b, h, query block i, key block j); the stream is the key side
        k, v = (_with_nan_block(x, bk) for x in (k, v))
        stream = lambda b, h, i, j: (b, h, jnp.where(visits(i, j) | (j <= last(i)), j, num_kv), 0)  # noqa: E731
        stay = lambda b, h, i, j: (b, h, i, 0)  # noqa: E731
        grid, q_map, kv_map = (1, 1, num_q, num_kv), stay, stream
        out_specs, out_shape = _spec(bq, hd, stay), jax.ShapeDtypeStruct((1, 1, case.q_len, hd), q.dtype)
        scratch = [pltpu.VMEM((bq, hd), jnp.float32)]
        kernel = _poisoning_dq_acc(kernel)
    q_spec, row_spec, kv_spec = _spec(bq, hd, q_map), _spec(bq, 1, q_map), _spec(bk, hd, kv_map)
    return pl.pallas_call(
        functools.partial(kernel, scale=scale, causal=case.causal, offset=offset), grid=grid,
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec], out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=scratch, interpret=pltpu.InterpretParams(),
    )(q, k, v, do, lse, d)


def _bits(ref):
    """A ref's contents as integers of the same width (NaN compares equal to itself, bit for bit)."""
    x = ref[...]
    return jax.lax.bitcast_convert_type(x, {4: jnp.int32, 2: jnp.int16}[jnp.dtype(x.dtype).itemsize])


def _counting_early_stores(kernel):
    """``kernel`` with a third output: how many query steps before the last stored into dk_ref or dv_ref (a
    store that a later step overwrites is wasted: they are written once, at the last query block)."""
    def spy(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dk_ref, dv_ref, early_ref, dk_acc, dv_acc, **params):
        q_block = pl.program_id(3)

        @pl.when(q_block == 0)
        def _():
            early_ref[...] = jnp.zeros(early_ref.shape, jnp.int32)
            # each key block's accumulators start as NaN, as the first one's do: one never zeroed for this key
            # block (init under the key axis) shows as NaN instead of the last key block's sums carried over
            dk_acc[...] = jnp.full(dk_acc.shape, jnp.nan, dk_acc.dtype)
            dv_acc[...] = jnp.full(dv_acc.shape, jnp.nan, dv_acc.dtype)

        before = (_bits(dk_ref), _bits(dv_ref))
        kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dk_ref, dv_ref, dk_acc, dv_acc, **params)
        stored = jnp.any(_bits(dk_ref) != before[0]) | jnp.any(_bits(dv_ref) != before[1])
        early_ref[...] += jnp.where(stored & (q_block < pl.num_programs(3) - 1), 1, 0)
    return spy


def _poisoning_dq_acc(kernel):
    """``kernel`` with dq_acc set to NaN at each query block's first key step (before the kernel runs), as the
    first query block's scratch is under InterpretParams: an init that skips it shows as NaN, not as sums."""
    def spy(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dq_ref, dq_acc, **params):
        @pl.when(pl.program_id(3) == 0)
        def _():
            dq_acc[...] = jnp.full(dq_acc.shape, jnp.nan, dq_acc.dtype)

        kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dq_ref, dq_acc, **params)
    return spy


def _close(got, want) -> bool:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return bool(np.all(np.abs(got - want) <= 1e-3 * (1.0 + np.abs(want).max())))


# -- the puzzles' checkers -------------------------------------------------------------------------------------


def _check_probabilities(probabilities) -> None:
    """P of single tiles, against float64: normalised by lse, masked on the diagonal (and with an offset)."""
    rng = np.random.default_rng(3)
    for name, (q_block, kv_block, bq, bk, causal, offset) in {
        "a non-causal tile": (1, 0, 32, 64, False, 0),
        "the diagonal tile (query block 1, key block 0 of 32 x 64 blocks, q_len = kv_len)": (1, 0, 32, 64, True, 0),
        "a tile with offset 64 (query block 0, key block 1, q_len 64 < kv_len 128)": (0, 1, 32, 64, True, 64),
    }.items():
        q, k = rng.normal(size=(bq, 16)), rng.normal(size=(bk, 16))  # head_dim 16: no block is [16, 16]
        s = q @ k.T / np.sqrt(16)
        lse = np.log(np.exp(s).sum(axis=1, keepdims=True)) + 1.0  # as if the row had more keys elsewhere
        visible = (kv_block * bk + np.arange(bk)[None]) <= (q_block * bq + np.arange(bq)[:, None] + offset)
        want = np.where(visible | (not causal), np.exp(s - lse), 0.0)
        got = np.asarray(probabilities(*(jnp.asarray(x, jnp.float32) for x in (q, k, lse)), jnp.int32(q_block),
                                       jnp.int32(kv_block), scale=16**-0.5, causal=causal, offset=offset), np.float64)
        where = f"failed: probabilities, {name} —"
        if got.shape != want.shape or not np.isfinite(got).all():
            raise CheckFailed(f"{where} shape {got.shape} (expected {want.shape}) or NaN/inf: [block_q, block_k], "
                              "masked with the finite MASK_VALUE before the exp")
        if _close(got, want):
            continue
        if _close(got, np.exp(s)) or _close(got, np.where(visible | (not causal), np.exp(s), 0.0)):
            raise CheckFailed(f"{where} P is exp(s), not exp(s - lse): subtract the saved log-sum-exp (lse_ref, "
                              "[block_q, 1]) so that each row's probabilities are the forward's, normalised")
        if not causal and _close(got, np.where(visible, np.exp(s - lse), 0.0)):
            raise CheckFailed(f"{where} the tile is masked although causal is False: mask only `if causal:`")
        if causal:
            why = "no causal mask" if _close(got, np.exp(s - lse)) else "the mask is in the wrong place"
            raise CheckFailed(f"{where} {why}: on a tile that straddles the diagonal, P = 0 where kv_pos > q_pos + "
                              "offset (q_pos = q_block * block_q + row, kv_pos = kv_block * block_k + column)")
        raise CheckFailed(f"{where} P must be exp(scale * q k^T - lse): scores q k^T (contract the last dims), "
                          "times scale, minus lse_ref broadcast across the columns")


def _check_block_function(fn, name: str, expected: Callable[..., int], meaning: str) -> None:
    """``fn(block, block_q, block_k, offset)`` on Python ints over several geometries, against ``expected``."""
    # the last: offset 1, so a query block's last visible key is the first key of a block (a tight diagonal)
    for bq, bk, q_len, kv_len in ((32, 64, 128, 128), (64, 32, 128, 128), (32, 64, 64, 192), (64, 32, 192, 64),
                                  (32, 64, 96, 97)):
        count = (kv_len // bk) if name == "first_q_block" else (q_len // bq)
        for block in range(count):
            want = expected(block, bq, bk, q_len, kv_len)
            got = int(fn(block, bq, bk, kv_len - q_len))
            if got != want:
                case = f"{name}({block}, block_q={bq}, block_k={bk}, offset={kv_len - q_len})"
                clamp = " (an index map must name a real block: clamp at 0)" if got < 0 else ""
                raise CheckFailed(f"failed: {case} is {got}, expected {want}{clamp} — {meaning}")


def _diagnose(label: str, got, want, case: _Case, scale: float, what: str) -> str:
    """Why gradient ``label`` of the learner's ``what`` kernel differs from the oracle, in words."""
    got = np.asarray(got, np.float64)
    if not np.isfinite(got).all():
        if case.causal:
            return (f"{label} has NaN: the body ran on a step the causal mask hides (the checker hands those steps "
                    "a block of NaN); skip them with pl.when, as the index map's clamp assumes")
        return (f"{label} has NaN: zero the accumulator at the first step of the inner axis (scratch starts as "
                "NaN under InterpretParams) and add into it at every step")
    if _close(got * scale, want):
        return f"{label} is 1/scale too large: dS = P * (dP - D) is the gradient of scale * q k^T; multiply by scale"
    if _close(got / scale, want):
        return (f"{label} has the scale twice: multiply the accumulated sum by scale once, at the end" if label != "dv"
                else "dv is scale times too small: dV = P^T dO has no scale (only dQ and dK do, from S = scale QK^T)")
    if case.causal:
        return (f"{label} is right without the mask but not here: the body must run at every step that sees a key "
                f"of the block (pl.when with {what}'s block function) and P must be masked on the diagonal")
    if label == "dv":
        return "dv is wrong: dV_j += P^T dO_i at every step (P from probabilities), written at the last"
    return (f"{label} is wrong: dS = P * (dP - D) with dP = dO V^T and D = d_ref (subtract D: the softmax's "
            f"correction), then {'dK_j += dS^T Q_i' if label == 'dk' else 'dQ_i += dS K_j'}")


def _check_kernel(kernel, dkv: bool) -> None:
    what = "dkv_kernel" if dkv else "dq_kernel"
    for seed, case in enumerate(_CASES):
        inputs, (dq, dk, dv) = _problem(case, seed)
        got = _run(kernel, case, inputs, dkv=dkv)
        early = int(np.asarray(got[2]).max()) if dkv else 0
        got = got[:2] if dkv else got
        pairs = (("dk", got[0], dk), ("dv", got[1], dv)) if dkv else (("dq", got, dq),)
        for label, mine, want in pairs if case.dtype == jnp.float32 else ():  # bfloat16: the rule alone
            if np.shape(mine) != want.shape or not _close(mine, want):
                why = _diagnose(label, mine, want, case, inputs[0].shape[-1] ** -0.5, what)
                raise CheckFailed(f"failed: {what}, case '{case.name}' — {why}")
        grads = (dq, got[0], got[1]) if dkv else (got, dk, dv)
        grads = [jnp.asarray(g, case.dtype) for g in grads]  # the oracle's other gradient(s), rounded
        try:
            check_attention_grads(grads, *inputs[:4], causal=case.causal, quiet=True)
        except CheckFailed as failure:
            raise CheckFailed(f"failed: {what}, case '{case.name}' — {failure}; cast P and dS to the inputs' dtype "
                              "before their matmuls, accumulate in float32, write in the outputs' dtype") from None
        if early:
            raise CheckFailed(f"failed: {what}, case '{case.name}' — dk_ref or dv_ref is stored into on {early} query "
                              "step(s) before the last: the right numbers, but wasted stores (each is overwritten by "
                              "the next); accumulate in dk_acc and dv_acc and write dk_ref, dv_ref once, under "
                              "pl.when(q_block == pl.num_programs(3) - 1)")


def check_dkv_kernel(answer) -> None:
    """``answer = (probabilities, first_q_block, dkv_kernel)``: P of single tiles, the clamp's values, then the
    kernel under InterpretParams against the float64 oracle (FlashAttention's rule), case by case."""
    probabilities, first_q_block, dkv_kernel = answer
    _check_probabilities(probabilities)
    _check_block_function(first_q_block, "first_q_block", lambda j, bq, bk, q_len, kv_len: max(
        geometry.first_query_seeing(j, block_k=bk, q_len=q_len, kv_len=kv_len), 0) // bq,
                          "the first query block that sees key block j holds query j * block_k - offset "
                          "(integer division; 0 when that is negative: every query sees the block)")
    _check_kernel(dkv_kernel, dkv=True)
    print(f"passed: the dK/dV kernel, with causal skipping, in all {len(_CASES)} cases (FlashAttention's rule)")


def check_dq_kernel(answer) -> None:
    """``answer = (last_kv_block, dq_kernel)``: the clamp's values, then the kernel as :func:`check_dkv_kernel`."""
    last_kv_block, dq_kernel = answer
    _check_block_function(last_kv_block, "last_kv_block", lambda i, bq, bk, q_len, kv_len: max(
        geometry.last_key_seen(i, block_q=bq, q_len=q_len, kv_len=kv_len), 0) // bk,
                          "query block i's last query, (i + 1) * block_q - 1, sees keys up to that + offset "
                          "(integer division by block_k; 0 when negative: the block sees no key)")
    _check_kernel(dq_kernel, dkv=False)
    print(f"passed: the dQ kernel, with causal skipping, in all {len(_CASES)} cases (FlashAttention's rule)")


DKV_KERNEL = Puzzle(
    "puzzle 1: the dK/dV kernel", check_dkv_kernel, (probabilities, first_q_block, dkv_kernel),
    ("Every line of the body is a line of section 1 on one tile: recompute P (line 1), dV += P^T dO (line 2), "
     "dP and dS (lines 3, 4), dK += dS^T Q (line 5). Around it, notebook 06's kernel shape: zero the scratch at "
     "the first inner step, the body under `pl.when`, write the outputs at the last inner step.",
     "`probabilities` is line 1 of the derivation on one tile: the forward's scores (`lax.dot_general` with "
     "`NT_DIMS`, float32, times `scale`); when `causal`, positions `q_block * block_q + broadcasted_iota(..., 0)` "
     "and `kv_block * block_k + broadcasted_iota(..., 1)`, and `MASK_VALUE` where `kv_pos > q_pos + offset`; "
     "then `exp(s - lse_ref[...])`: no max, no sum, the saved lse normalises. `first_q_block`: key block `j` "
     "starts at key `j * block_k`, which query `j * block_k - offset` is the first to see.",
     "`dkv_kernel` has notebook 06's three parts under `pl.when`: zero `dk_acc`, `dv_acc` at `q_block == 0`; "
     "the body when `q_block >= first_q_block(kv_block, block_q, block_k, offset)` (always, if not causal): "
     "`p = probabilities(...)`, `dv_acc += p^T do` and `dk_acc += ds^T q` with `lax.dot_general(..., TN_DIMS, "
     "preferred_element_type=jnp.float32)` (p, ds cast to q's dtype), between them `dp = do v^T` (`NT_DIMS`) and "
     "`ds = p * (dp - d_ref[...])`; at the last query block write `dk_acc * scale` and `dv_acc`, cast to the "
     "outputs' dtype. `first_q_block`: `lax.div(jnp.maximum(j * block_k - offset, 0), block_q)`."),
)

DQ_KERNEL = Puzzle(
    "puzzle 2: the dQ kernel", check_dq_kernel, (last_kv_block, dq_kernel),
    ("Puzzle 1 with the roles swapped: the accumulator is dQ_i, line 5's dS K (times scale at the end), and "
     "dS is built exactly as there; there is no dV to accumulate.",
     "The dQ kernel is the forward's grid: query block `i` stays, key blocks stream past, and the blocks right "
     "of the diagonal are skipped as in notebook 06. `last_kv_block`: query block `i`'s last query is "
     "`(i + 1) * block_q - 1` and sees keys up to that plus `offset`; a block that sees no key still needs a "
     "real block to name (0).",
     "Zero `dq_acc` at `kv_block == 0`; when `kv_block <= last_kv_block(q_block, block_q, block_k, offset)` "
     "(always, if not causal): `p = probabilities(...)` (yours, from puzzle 1), `dp = do v^T` (`NT_DIMS`), "
     "`ds = p * (dp - d_ref[...])`, `dq_acc += jnp.dot(ds.astype(k.dtype), k, preferred_element_type="
     "jnp.float32)`; at the last key block write `dq_acc * scale`. `last_kv_block`: "
     "`lax.div(jnp.maximum((i + 1) * block_q - 1 + offset, 0), block_k)`."),
)


def check_d_both_ways(d_both_ways) -> None:  # the exercises' checkers, from here on
    """``d_both_ways(p, dp, out, do) -> (rowsum(P * dP), rowsum(dO * O))`` on one non-causal head [64, 32]; each
    must need only its own inputs (the checker withholds the others as NaN)."""
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.normal(size=(64, 32)) for _ in range(4))
    p = np.exp(q @ k.T / np.sqrt(32) - reference.logsumexp_oracle(q[None, None], k[None, None])[0, 0, :, None])
    out, dp = p @ v, do @ v.T
    want_p, want_o = np.sum(p * dp, axis=1), np.sum(do * out, axis=1)
    f32, nan = functools.partial(jnp.asarray, dtype=jnp.float32), np.full_like(p, np.nan)
    from_p, from_o = (np.asarray(x, np.float64) for x in d_both_ways(f32(p), f32(dp), f32(out), f32(do)))
    for name, got, want in (("rowsum(P * dP)", from_p, want_p), ("rowsum(dO * O)", from_o, want_o)):
        if got.shape != want.shape:
            raise CheckFailed(f"failed: {name} has shape {got.shape}, expected {want.shape}: one number per query "
                              "row (sum over axis 1, no keepdims)")
        if not np.allclose(got, want, atol=1e-4):
            raise CheckFailed(f"failed: {name} is off: sum each query's row, axis=1 (axis 0 sums over queries)")
    if not np.allclose(d_both_ways(f32(nan), f32(nan), f32(out), f32(do))[1], want_o, atol=1e-4):
        raise CheckFailed("failed: the second, rowsum(dO * O), changed when P and dP were withheld (NaN): it must "
                          "need only O and dO — that is why a kernel can have it before its first block")
    if not np.allclose(d_both_ways(f32(p), f32(dp), f32(nan[:, :32]), f32(do))[0], want_p, atol=1e-4):
        raise CheckFailed("failed: the first, rowsum(P * dP), changed when O was withheld (NaN): compute it from P "
                          "and dP (the definition), not from O")
    check(np.allclose(from_p, from_o, atol=1e-4), "D both ways: rowsum(P * dP) == rowsum(dO * O)")


D_BOTH_WAYS = Puzzle(
    "exercise 1: D, both ways",
    check_d_both_ways,
    d_both_ways_solution,
    (
        "Both are one number per query row: multiply element by element, then sum each row (`axis=1`, no "
        "`keepdims`). The first needs only `p` and `dp`, the second only `out` and `do`.",
        "`jnp.sum(p * dp, axis=1)` and `jnp.sum(do * out, axis=1)`. Only the second can be computed before the "
        "kernel visits a block: `O` and `dO` are whole rows it has from the start.",
    ),
)


def check_dv_of_key_block(dv_of_key_block, *, n: int = 256) -> None:
    """``dv_of_key_block(q, k, do, lse, j, *, block_q, block_k, scale)`` for causal attention on one head [n, 32],
    for the first, a middle and the last key block, with block_q < block_k and block_q > block_k, against
    float64. The query blocks that cannot see key block ``j`` are handed to it as NaN: the loop must start at the
    first query block that sees ``j``."""
    rng = np.random.default_rng(6)
    q, k, v, do = (rng.normal(size=(n, 32)) for _ in range(4))
    scale = 32**-0.5
    s = np.where(np.tril(np.ones((n, n), bool)), q @ k.T * scale, -np.inf)
    lse = np.log(np.exp(s).sum(axis=1))
    for (block_q, block_k), j in ((blocks, j) for blocks in ((32, 64), (64, 32)) for j in (0, 1, n // blocks[1] - 1)):
        keys, first = slice(j * block_k, (j + 1) * block_k), j * block_k // block_q * block_q
        hidden = np.arange(n)[:, None] < first  # rows of the query blocks that see none of key block j
        args = [jnp.asarray(np.where(hidden, np.nan, x), jnp.float32) for x in (q, k, do, lse[:, None])]
        got = np.asarray(dv_of_key_block(args[0], args[1], args[2], args[3][:, 0], j, block_q=block_q,
                                         block_k=block_k, scale=scale), np.float64)
        p = np.exp(s - lse[:, None])[:, keys]
        want = p.T @ do
        name = f"failed: dv_of_key_block, key block {j} of {block_q} x {block_k} blocks —"
        if got.shape != want.shape:
            raise CheckFailed(f"{name} shape {got.shape}, expected {want.shape} ([block_k, d])")
        if not np.isfinite(got).all():
            raise CheckFailed(f"{name} NaN: it used a query block that cannot see key block {j} (the checker hands "
                              "those as NaN); start the loop at the first query block that sees it, j * block_k // "
                              "block_q")
        if np.allclose(got, want, atol=1e-4):
            continue
        unmasked = np.exp(q @ k.T * scale - lse[:, None])[first:, keys].T @ do[first:]
        if np.allclose(got, unmasked, rtol=1e-3, atol=1e-3):
            raise CheckFailed(f"{name} the diagonal block is not masked: query i sees key j only when j <= i")
        if np.allclose(got, p[first + block_q:].T @ do[first + block_q:], atol=1e-4):
            raise CheckFailed(f"{name} query block {first // block_q} is left out, but it sees key block {j} (it "
                              f"holds query {j * block_k}): the first query block is j * block_k // block_q, "
                              "rounded down")
        raise CheckFailed(f"{name} off from the float64 oracle: dV_j = sum over query blocks i of P_ij^T dO_i, with "
                          "P_ij = exp(scale * q_i k_j^T - lse_i) (the saved lse: no max, no sum)")
    print("passed: dv_of_key_block matches the float64 oracle on key blocks 0, 1 and the last (block_q < block_k "
          "and block_q > block_k), using only the query blocks that see them")


DV_OF_KEY_BLOCK = Puzzle(
    "exercise 2: the dV accumulation of one key block",
    check_dv_of_key_block,
    dv_of_key_block_solution,
    (
        "Key block `j` holds keys `j * block_k` to `(j + 1) * block_k - 1`. Causal, a query sees the keys at or "
        "before its own position, so the first query that sees block `j` is query `j * block_k`, in query block "
        "`j * block_k // block_q`. Loop from there to the last query block.",
        "For each query block `i`: `s = q_i @ k_j.T * scale`, masked to `-inf` where `kv_pos > q_pos` (absolute "
        "positions, `jnp.arange`); `P_ij = jnp.exp(s - lse_i[:, None])` (the saved `lse`: no max, no sum); "
        "`dv += P_ij.T @ do_i`, starting from `jnp.zeros((block_k, d))`.",
    ),
)


def check_busiest(answer, *, n: int = 4096, block: int = 512) -> None:
    """``answer = (most_block, most_steps, fewest_block, fewest_steps)`` for the causal dK/dV kernel's programs
    (one per key block) over ``n`` tokens in ``block x block`` tiles; ``None`` is not attempted."""
    if answer is None:
        raise NotImplementedError
    runs = np.zeros(n // block, dtype=int)
    for step in viz.tiling_steps(n, n, block, block, causal=True):
        runs[step.kv_block] += step.kind != "skipped"
    expected = (int(runs.argmax()), int(runs.max()), int(runs.argmin()), int(runs.min()))
    rule = f"key block j is seen by query blocks j .. {n // block - 1} (query block i sees key blocks 0 .. i)"
    for index, what in enumerate(("the busiest key block", "its body steps", "the idlest key block", "its body steps")):
        if int(answer[index]) != expected[index]:
            raise CheckFailed(f"failed: the busiest and the idlest dK/dV program — {what} is not {answer[index]}: "
                              f"{rule}; skipped steps do not count")
    print("passed: the busiest and the idlest dK/dV program")


BUSIEST = Puzzle(
    "exercise 3: the block that dominates",
    check_busiest,
    busiest_solution,
    (
        "The dK/dV kernel has one program per key block `j`; query blocks `i` stream past it, and a step runs its "
        "body only when query block `i` sees some key of block `j`. With `block_q = block_k`, causal, that is "
        "`i >= j`.",
        "For each of the `4096 // 512 = 8` key blocks `j`, count the query blocks `i` with `i >= j` (skipped "
        "steps do not count); then take the largest and the smallest count and their key blocks: `(most_block, "
        "most_steps, fewest_block, fewest_steps)`.",
    ),
    answer_is_value=True,
)
