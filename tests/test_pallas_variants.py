"""The variants in the Pallas kernels (issue 16): sliding windows, soft-capping, segment ids, sinks and a value
head_dim of its own, alone and combined, forward and backward (``dsinks`` too), against the float64 oracle.

* the block geometry of the band (:func:`flashlib.geometry.band`) against the element rule, searched: a block
  is skipped only when no element of it is visible, computed plain only when every element is, and the live
  range a kernel walks holds every visible block;
* the kernels in interpret mode, searched over every combination (hypothesis, fresh examples each run; a
  failure prints the seed to replay with ``pytest --hypothesis-seed=N``), with lengths over several blocks so
  that the window's grid compaction, padding and rows that see no key all happen;
* bfloat16 by FlashAttention's rule and TPU-semantics interpret mode with race detection, on chosen cases;
* the forward and gradient compiled for v5e and v6e by libtpu.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

import flashlib
from flashlib import checks, geometry, masks, reference
from flashlib.kernels import BlockSizes, variants
from flashlib.kernels.tpu_backward import _fuses_dq
from flashlib.tpu_compile import compile_for_tpu

BF16 = jnp.bfloat16


# ---------------------------------------------------------------------------------------------------
# The band's block geometry against the element rule
# ---------------------------------------------------------------------------------------------------

side = st.one_of(st.none(), st.integers(0, 40))


@settings(max_examples=300, derandomize=False, deadline=None)
@given(q_len=st.integers(1, 70), kv_len=st.integers(1, 70), block_q=st.sampled_from([1, 3, 8, 16]),
       block_k=st.sampled_from([1, 4, 8, 32]), causal=st.booleans(), window=st.one_of(st.none(), st.tuples(side, side)))
def test_block_geometry_follows_the_element_rule(q_len, kv_len, block_q, block_k, causal, window):
    num_q, num_k = -(-q_len // block_q), -(-kv_len // block_k)
    q_pos = np.arange(num_q * block_q)[:, None]  # padding rows included, as the kernels count them
    kv_pos = np.arange(num_k * block_k)[None, :]
    seen = (kv_pos < kv_len) & np.broadcast_to(masks.window_visible(q_pos, kv_pos, q_len=q_len, kv_len=kv_len,
                                                                    window=geometry.band(causal, window)),
                                               (q_pos.size, kv_pos.size))
    geo = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal, window=window)
    first, last = geometry.live_range(np.arange(num_q), outer_block=block_q, inner_block=block_k, num_inner=num_k,
                                      q_len=q_len, kv_len=kv_len, causal=causal, window=window)
    first_t, last_t = geometry.live_range(np.arange(num_k), outer_block=block_k, inner_block=block_q,
                                          num_inner=num_q, q_len=q_len, kv_len=kv_len, causal=causal, window=window,
                                          keys_inner=False)
    for i in range(num_q):
        for j in range(num_k):
            tile = seen[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k]
            visible = bool(geometry.block_is_visible(i, j, **geo))
            assert visible or not tile.any(), ("a block with visible elements is skipped", i, j)
            if visible and not geometry.block_needs_mask(i, j, **geo):
                assert tile.all(), ("a block computed without a mask hides an element", i, j)
            if tile.any():
                assert first[i] <= j <= last[i], ("a visible key block outside the query block's live range", i, j)
                assert first_t[j] <= i <= last_t[j], ("a visible query block outside the key block's live range", i, j)
    compacted = geometry.compacts(causal, window)
    for outer, inner, num_outer, num_inner, (lo, hi), keys_inner in (
            (block_q, block_k, num_q, num_k, (first, last), True),
            (block_k, block_q, num_k, num_q, (first_t, last_t), False)):
        steps = geometry.live_steps(num_outer, outer_block=outer, inner_block=inner, num_inner=num_inner, q_len=q_len,
                                    kv_len=kv_len, causal=causal, window=window, keys_inner=keys_inner)
        # compacted, a grid walks each live range from its first block; else every inner block from block 0
        assert steps == (int(np.max(hi - lo + 1)) if compacted else num_inner) <= num_inner


def test_a_two_sided_window_walks_a_constant_number_of_key_steps():
    """Grid compaction: with a window bounded on the left the key axis is as long as the window needs, so the
    grid (and the kernel's cost) grows linearly with the sequence; causal alone still walks every key step."""
    def steps(length, window):
        blocks = length // 512
        return geometry.live_steps(blocks, outer_block=512, inner_block=512, num_inner=blocks, q_len=length,
                                   kv_len=length, causal=True, window=window)

    assert [steps(n, (1023, 0)) for n in (2048, 8192, 32768)] == [3, 3, 3]
    assert [steps(n, None) for n in (2048, 8192, 32768)] == [4, 16, 64]


# ---------------------------------------------------------------------------------------------------
# The kernels against the oracle, searched
# ---------------------------------------------------------------------------------------------------

SIZES = BlockSizes(block_q=16, block_k=128, block_q_dkv=128, block_k_dkv=128, block_q_dq=128, block_k_dq=128)


@st.composite
def cases(draw):
    kv_heads, group = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    q_len, kv_len = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    head_dim, v_head_dim = draw(st.sampled_from([8, 16])), draw(st.sampled_from([8, 16, 24]))
    magnitude = draw(st.sampled_from([0.5, 2.0, 6.0]))  # 6: logits in the hundreds
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    heads = kv_heads * group
    q = rng.normal(size=(1, heads, q_len, head_dim)) * magnitude
    k = rng.normal(size=(1, kv_heads, kv_len, head_dim)) * magnitude
    v = rng.normal(size=(1, kv_heads, kv_len, v_head_dim))
    wide = st.one_of(st.none(), st.integers(0, 300))
    variants = {"window": draw(st.one_of(st.none(), st.tuples(wide, wide))),
                "softcap": draw(st.one_of(st.none(), st.sampled_from([2.0, 20.0])))}
    if draw(st.booleans()):  # packed: non-decreasing ids, so some rows see nothing
        segments = draw(st.integers(1, 4))
        variants["segment_ids"] = (np.sort(rng.integers(0, segments, (1, q_len)), -1),
                                   np.sort(rng.integers(0, segments, (1, kv_len)), -1))
    if draw(st.booleans()):
        variants["sinks"] = rng.normal(size=heads) * magnitude
    return q, k, v, draw(st.booleans()), {name: x for name, x in variants.items() if x is not None}


def _jax_variants(variants, dtype):
    out = dict(variants)
    if "segment_ids" in out:
        out["segment_ids"] = tuple(jnp.asarray(ids, jnp.int32) for ids in out["segment_ids"])
    if "sinks" in out:
        out["sinks"] = jnp.asarray(out["sinks"], dtype)
    return out


def _vjp(q, k, v, causal, variants, *, interpret=True, sizes=SIZES):
    """``(out, grads)`` of impl="pallas", sinks differentiated when given."""
    sinks = variants.get("sinks")
    fixed = {name: x for name, x in variants.items() if name != "sinks"}

    def fn(q, k, v, *maybe_sinks):
        extra = {"sinks": maybe_sinks[0]} if maybe_sinks else {}
        return flashlib.attention(q, k, v, causal=causal, impl="pallas", block_sizes=sizes, interpret=interpret,
                                  **fixed, **extra)

    out, vjp = jax.vjp(fn, *((q, k, v) if sinks is None else (q, k, v, sinks)))
    return out, vjp


@settings(max_examples=12, derandomize=False, deadline=None)
@given(cases())
def test_pallas_variants_match_the_oracle(case):
    q, k, v, causal, variants = case
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    jv = _jax_variants(variants, jnp.float32)
    out, vjp = _vjp(*f32, causal, jv)
    do = np.random.default_rng(1).normal(size=out.shape)
    grads = vjp(jnp.asarray(do, jnp.float32))
    exact = [np.asarray(x, np.float64) for x in f32]
    oracle_variants = {**variants, **({"sinks": np.asarray(jv["sinks"], np.float64)} if "sinks" in jv else {})}
    want = reference.attention_oracle(*exact, causal=causal, **oracle_variants)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5 * max(1.0, np.abs(v).max()), rtol=1e-4)
    want_grads = reference.attention_vjp_oracle(*exact, do, causal=causal, **oracle_variants)
    magnitude = max(1.0, *(float(np.abs(w).max(initial=0.0)) for w in want_grads))
    assert len(grads) == len(want_grads)
    for name, got, expected in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads, strict=False):
        np.testing.assert_allclose(np.asarray(got, np.float64), expected, atol=5e-4 * magnitude, rtol=1e-3,
                                   err_msg=name)


# ---------------------------------------------------------------------------------------------------
# bfloat16 by FlashAttention's rule, in TPU-semantics interpret mode (NaN scratch, races detected)
# ---------------------------------------------------------------------------------------------------

IDS = (np.repeat(np.arange(4), [50, 90, 1, 59])[None], np.repeat(np.arange(5), [30, 100, 40, 10, 20])[None])


@pytest.mark.parametrize("q_len, kv_len, causal, variants", [
    (200, 200, True, {"window": (63, 0)}),  # local causal: compacted grids, the separate dQ kernel
    (136, 260, False, {"window": (None, 5), "softcap": 5.0}),  # bounded on the right only: the fused kernel
    (200, 200, True, {"segment_ids": IDS, "sinks": np.array([0.5, -2.0, 3.0, 0.0])}),  # a segment of 1 query
    (260, 136, True, {"window": (40, 3), "softcap": 2.0, "sinks": np.array([1.0, 0.0, -1.0, 4.0])}),  # blind rows
])
def test_bfloat16_by_flashattentions_rule_in_tpu_interpret_mode(q_len, kv_len, causal, variants):
    pltpu.reset_tpu_interpret_mode_state()
    rng = np.random.default_rng(3)
    if "segment_ids" in variants:
        q_ids, kv_ids = variants["segment_ids"]
        variants = dict(variants, segment_ids=(q_ids[:, :q_len], kv_ids[:, :kv_len]))
    q = jnp.asarray(rng.normal(size=(1, 4, q_len, 64)) * 2, BF16)
    k = jnp.asarray(rng.normal(size=(1, 2, kv_len, 64)) * 2, BF16)
    v = jnp.asarray(rng.normal(size=(1, 2, kv_len, 32)), BF16)
    do = jnp.asarray(rng.normal(size=(1, 4, q_len, 32)), BF16)
    jv = _jax_variants(variants, BF16)
    sizes = BlockSizes(block_q=64, block_k_major=128, block_k=128)
    out, vjp = _vjp(q, k, v, causal, jv, interpret=pltpu.InterpretParams(detect_races=True), sizes=sizes)
    checks.check_attention(out, q, k, v, causal=causal, quiet=True, **jv)
    checks.check_attention_grads(vjp(do), q, k, v, do, causal=causal, quiet=True, **jv)


def test_blocks_whose_segments_cannot_meet_are_neither_computed_nor_read():
    """Two packed documents; the keys of block 1 belong to a third segment no query has. Poisoned with NaN, they
    would reach the output if the kernels computed (or masked) that block: ``0 * NaN`` is NaN. The block tables
    (scalar prefetch) skip it in the forward, the dK/dV and the dQ kernels, so everything stays finite and
    equals the oracle's — which never looks at those keys."""
    rng = np.random.default_rng(5)
    q_len = kv_len = 384  # three 128-key blocks
    q_ids = np.repeat([0, 1], [192, 192])[None]
    kv_ids = np.repeat([0, 2, 1], [128, 128, 128])[None]  # block 1: segment 2, seen by no query
    q = rng.normal(size=(1, 2, q_len, 32))
    k, v = rng.normal(size=(2, 1, 2, kv_len, 32))
    do = rng.normal(size=q.shape)
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[:, :, 128:256] = np.nan
    v_nan[:, :, 128:256] = np.nan
    ids = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    sizes = BlockSizes(block_q=128, block_k=128)
    out, vjp = jax.vjp(lambda q, k, v: flashlib.attention(q, k, v, segment_ids=ids, impl="pallas", block_sizes=sizes,
                                                          interpret=True), *(jnp.asarray(x, jnp.float32)
                                                                             for x in (q, k_nan, v_nan)))
    dq, dk, dv = vjp(jnp.asarray(do, jnp.float32))
    want = reference.attention_oracle(q, k, v, segment_ids=(q_ids, kv_ids))
    want_dq, want_dk, want_dv = reference.attention_vjp_oracle(q, k, v, do, segment_ids=(q_ids, kv_ids))
    np.testing.assert_allclose(out, want, atol=1e-5)
    np.testing.assert_allclose(dq, want_dq, atol=1e-4)
    np.testing.assert_allclose(np.delete(np.asarray(dk), np.s_[128:256], axis=2),
                               np.delete(want_dk, np.s_[128:256], axis=2), atol=1e-4)
    np.testing.assert_allclose(np.asarray(dv)[:, :, 128:256], 0.0)  # never computed: the accumulators' zeros
    np.testing.assert_allclose(np.delete(np.asarray(dv), np.s_[128:256], axis=2),
                               np.delete(want_dv, np.s_[128:256], axis=2), atol=1e-4)


def test_segment_block_tables():
    """Live where the id ranges overlap and the band allows; a dead pair fetches the last live block before
    it (the first live one when none is), so the pipeline copies nothing new for it."""
    q_ids = jnp.asarray(np.repeat([0, 1, 2], [4, 4, 8])[None])  # blocks of 4: ids {0}, {1}, {2}, {2}
    kv_ids = jnp.asarray(np.repeat([1, 0, 2], [4, 4, 8])[None])  # {1}, {0}, {2}, {2}
    blocks = variants.segment_blocks(q_ids, kv_ids, outer_len=16, inner_len=15, outer_block=4, inner_block=4,
                                     band_visible=np.ones((4, 4), bool))
    np.testing.assert_array_equal(np.asarray(blocks.live).reshape(4, 4),
                                  [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]])
    np.testing.assert_array_equal(np.asarray(blocks.fetch).reshape(4, 4),
                                  [[1, 1, 1, 1], [0, 0, 0, 0], [2, 2, 2, 3], [2, 2, 2, 3]])


def test_a_fused_backward_cannot_run_a_left_window():
    sizes = BlockSizes(block_q=128, block_k=128).for_backward(512, 512, 64, "float32")
    assert not _fuses_dq(sizes, 512, 512, 64, None, window=(100, 0))
    with pytest.raises(ValueError, match="fuse_dq=True cannot run a window bounded on the left"):
        _fuses_dq(sizes, 512, 512, 64, True, window=(100, 0))


# ---------------------------------------------------------------------------------------------------
# Compiled for TPU
# ---------------------------------------------------------------------------------------------------


@pytest.mark.tpu
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
def test_every_variant_together_compiles_for_tpu(topology):
    """Window, soft-cap, segment ids, sinks, GQA and a value head_dim of its own, forward and gradient."""
    q = jax.ShapeDtypeStruct((1, 8, 1024, 128), BF16)
    k = jax.ShapeDtypeStruct((1, 2, 1024, 128), BF16)
    v = jax.ShapeDtypeStruct((1, 2, 1024, 64), BF16)
    ids = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
    sinks = jax.ShapeDtypeStruct((8,), jnp.float32)

    def loss(q, k, v, sinks, q_ids, kv_ids):
        out = flashlib.attention(q, k, v, causal=True, window=(300, 0), softcap=30.0, segment_ids=(q_ids, kv_ids),
                                 sinks=sinks, impl="pallas", interpret=False)
        return out.astype(jnp.float32).sum()

    check = compile_for_tpu(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, sinks, ids, ids, topology=topology)
    assert check.ok, check.compiler_message
