"""Causal grid compaction in the Pallas forward: the schedule's tables (geometry.live_schedule) against a brute-force
enumeration, the compacted kernel against the full grid and the float64 oracle, TPU semantics, gradients, the
decision rule, and AOT compiles."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_no_races, make_qkv
from jax.experimental.pallas import tpu as pltpu

import flashlib
from flashlib import geometry
from flashlib.checks import check_attention, check_attention_grads
from flashlib.kernels import BlockSizes, tpu_forward
from flashlib.kernels.variants import KernelVariants
from flashlib.tpu_compile import compile_for_tpu

F32, BF16 = jnp.float32, jnp.bfloat16


# ---------------------------------------------------------------------------------------------------
# The schedule's tables
# ---------------------------------------------------------------------------------------------------

def _brute_force(q_len, kv_len, block_q, kv_step):
    """The live pairs by elements: (i, j) where some row of query block i (padding rows included, as the
    kernel computes them) sees some key of key step j, plus key step 0 for a query block that sees none."""
    num_q, num_kv = -(-q_len // block_q), -(-kv_len // kv_step)
    pairs = []
    for i in range(num_q):
        rows = range(i * block_q, (i + 1) * block_q)
        seen = [j for j in range(num_kv) if any(
            geometry.causal_visible(r, c, q_len=q_len, kv_len=kv_len)
            for r in rows for c in range(j * kv_step, (j + 1) * kv_step))]
        pairs += [(i, j) for j in (seen or [0])]
    return pairs, num_q, num_kv


@pytest.mark.parametrize("q_len, kv_len, block_q, kv_step",
                         [(64, 64, 16, 16), (64, 64, 32, 16), (64, 64, 16, 32), (50, 70, 16, 32), (70, 50, 16, 16),
                          (100, 20, 16, 8), (17, 200, 8, 64), (1, 1, 8, 8), (96, 96, 96, 32), (33, 33, 8, 40)])
def test_live_schedule_matches_brute_force(q_len, kv_len, block_q, kv_step):
    pairs, num_q, num_kv = _brute_force(q_len, kv_len, block_q, kv_step)
    q_block, kv, first, last = geometry.live_schedule(num_q, num_kv, block_q=block_q, kv_step=kv_step, q_len=q_len,
                                                      kv_len=kv_len, causal=True)
    assert all(t.dtype == np.int32 and t.shape == (len(pairs),) for t in (q_block, kv, first, last))
    assert list(zip(q_block.tolist(), kv.tolist(), strict=True)) == pairs  # q block major, steps ascending
    for i, run in itertools.groupby(range(len(pairs)), key=lambda t: pairs[t][0]):
        run = list(run)  # one query block's live steps: consecutive, init at the first, finalize at the last
        assert first[run].tolist() == [1] + [0] * (len(run) - 1), i
        assert last[run].tolist() == [0] * (len(run) - 1) + [1], i
    assert sorted(set(q_block.tolist())) == list(range(num_q))  # every query block writes its output
    # the same tables from the live step's index and the query blocks' first steps (the estimate-only kernel's)
    starts = tuple(np.flatnonzero(first).tolist())
    computed = geometry.scheduled_pair(np.arange(len(pairs)), starts, len(pairs))
    for table, values in zip((q_block, kv, first, last), computed, strict=True):
        np.testing.assert_array_equal(table, values)


def test_decision_rule():
    assert geometry.compacts_by_table(True)
    assert geometry.compacts_by_table(True, (None, 0)) and geometry.compacts_by_table(False, (None, 3))
    assert not geometry.compacts_by_table(False)  # nothing to drop
    assert not geometry.compacts_by_table(True, (64, 0))  # a left window compacts statically (geometry.compacts)
    assert not geometry.compacts_by_table(True, segments=True)  # segments keep their own tables on the full grid


def _grid(q, k, v, segment_ids=None, **kwargs):
    """The grid of the forward's pallas_call (from its jaxpr)."""
    jaxpr = jax.make_jaxpr(lambda q, k, v: tpu_forward.forward(q, k, v, segment_ids, interpret=True, **kwargs))(q, k, v)
    calls = [e for e in jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "pallas_call"]
    return calls[0].params["grid_mapping"].grid


def test_when_the_forward_compacts():
    q, k, v = make_qkv(heads=1, q_len=256, head_dim=32)
    common = dict(scale=0.1, return_lse=False)
    sizes = BlockSizes(64, 128).fit(256, 256, F32)
    assert _grid(q, k, v, causal=True, sizes=sizes, **common) == (1, 1, 6)  # 4 x 2 steps, 6 live
    assert _grid(q, k, v, causal=True, sizes=sizes, compact=False, **common) == (1, 1, 4, 2)
    assert _grid(q, k, v, causal=False, sizes=sizes, **common) == (1, 1, 4, 2)
    one_step = BlockSizes(64, 256).fit(256, 256, F32)  # one key step per query block: nothing to drop
    assert _grid(q, k, v, causal=True, sizes=one_step, **common) == (1, 1, 4, 1)
    assert _grid(q, k, v, causal=True, sizes=one_step, compact=True, **common) == (1, 1, 4)
    ids = (jnp.zeros((1, 256), jnp.int32),) * 2
    segments = KernelVariants(segments=True)
    assert _grid(q, k, v, ids, causal=True, sizes=sizes, variants=segments, **common) == (1, 1, 4, 2)
    with pytest.raises(ValueError, match="compact=True"):
        _grid(q, k, v, causal=False, sizes=sizes, compact=True, **common)
    with pytest.raises(ValueError, match="estimate_as"):
        _grid(q, k, v, causal=True, sizes=sizes, compact=False, estimate_as="plain", **common)


# ---------------------------------------------------------------------------------------------------
# Numerics (interpret mode on this CPU)
# ---------------------------------------------------------------------------------------------------

CASES = [  # q_len, kv_len, head_dim, dtype, block sizes
    (300, 300, 64, BF16, BlockSizes(64, 128)),  # skipped, straddling and padded blocks
    (37, 300, 32, F32, BlockSizes(16, 128)),  # q_len < kv_len: the diagonal shifted right
    (300, 37, 32, BF16, BlockSizes(32, 128)),  # q_len > kv_len: blind query blocks (one placeholder step each)
    (300, 300, 64, BF16, BlockSizes(64, 128, block_k_major=256)),  # sub-blocks; the last one all padding
    (400, 300, 32, F32, BlockSizes(256, 128, block_k_major=256)),  # row chunks, sub-blocks, rows that see nothing
    (300, 300, 64, BF16, BlockSizes(256, 128)),  # row chunks, bf16
]


@pytest.mark.parametrize("q_len, kv_len, head_dim, dtype, sizes", CASES)
def test_compacted_matches_full_grid_and_oracle(q_len, kv_len, head_dim, dtype, sizes):
    q, k, v = make_qkv(q_len=q_len, kv_len=kv_len, head_dim=head_dim, dtype=dtype)
    fitted = sizes.fit(q_len, kv_len, dtype)
    common = dict(causal=True, scale=head_dim ** -0.5, sizes=fitted, interpret=True, return_lse=True)
    out, lse = tpu_forward.forward(q, k, v, compact=True, **common)
    full_out, full_lse = tpu_forward.forward(q, k, v, compact=False, **common)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(full_out, np.float32))  # the same sums
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(full_lse))  # -inf where a row sees nothing
    check_attention(out, q, k, v, causal=True, quiet=True)


def test_the_schedule_from_program_ids_computes_the_same():
    """forward(estimate_as="program_ids"), the kernel the static estimate can see into, is the same kernel."""
    q, k, v = make_qkv(q_len=300, kv_len=260, head_dim=32, dtype=BF16)
    sizes = BlockSizes(256, 128).fit(300, 260, BF16)
    common = dict(causal=True, scale=32 ** -0.5, sizes=sizes, interpret=True, return_lse=True, compact=True)
    out, lse = tpu_forward.forward(q, k, v, **common)
    ids_out, ids_lse = tpu_forward.forward(q, k, v, estimate_as="program_ids", **common)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ids_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ids_lse))


def test_tpu_interpret_mode_detects_no_races():
    """TPU-semantics emulation of the compacted grid: SMEM tables, DMAs driven by them, row chunks."""
    pltpu.reset_tpu_interpret_mode_state()
    q, k, v = make_qkv(q_len=300, kv_len=260, head_dim=32)
    params = pltpu.InterpretParams(detect_races=True)
    sizes = BlockSizes(256, 128, block_k_major=256).fit(300, 260, F32)
    out = tpu_forward.forward(q, k, v, causal=True, scale=32 ** -0.5, sizes=sizes, interpret=params,
                              return_lse=False, compact=True)
    check_attention(out, q, k, v, causal=True, quiet=True)
    assert_no_races()


def test_gradients_through_the_compacted_forward():
    """flashlib.attention(impl='pallas') compacts its causal forward by default; the backward's residuals
    (out in f32, lse) from it still give the oracle's gradients."""
    q, k, v = make_qkv(q_len=200, kv_len=150, head_dim=32)
    do = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)
    sizes = BlockSizes(32, 128, block_q_dkv=128, block_k_dkv=128, block_q_dq=128, block_k_dq=128)
    grid = _grid(q, k, v, causal=True, sizes=sizes.fit(200, 150, F32), scale=0.1, return_lse=True)
    assert grid == (1, 2, 9)  # of 7 x 2 steps
    _, vjp = jax.vjp(lambda q, k, v: flashlib.attention(q, k, v, impl="pallas", causal=True, block_sizes=sizes),
                     q, k, v)
    check_attention_grads(vjp(do), q, k, v, do, causal=True, quiet=True)


# ---------------------------------------------------------------------------------------------------
# Ahead-of-time compiles (libtpu)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.tpu
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
def test_compacted_kernel_compiles_for_tpu(topology):
    q = jax.ShapeDtypeStruct((1, 2, 1024, 128), BF16)
    sizes = BlockSizes(512, 256)  # row chunks; 2 x 4 steps, 6 live

    def fn(q, k, v):
        return tpu_forward.forward(q, k, v, causal=True, scale=128 ** -0.5, sizes=sizes, interpret=False,
                                   return_lse=True, compact=True)

    check = compile_for_tpu(fn, q, q, q, topology=topology)
    assert check.ok, check.compiler_message
