"""The variants in the Pallas kernels (issue 16): sliding windows, soft-capping, segment ids, sinks and a value
head_dim of its own, alone and combined, forward and backward (``dsinks`` too), against the float64 oracle.

* the block geometry of the band (:func:`flashlib.geometry.band`) against the element rule, searched: a block
  is skipped only when no element of it is visible, computed plain only when every element is, and the live
  range a kernel walks holds every visible block;
* the kernels in interpret mode, searched over every combination (hypothesis, fresh examples each run; a
  failure prints the seed to replay with ``pytest --hypothesis-seed=N``), with lengths over several blocks so
  that the window's grid compaction, padding and rows that see no key all happen;
* bfloat16 by FlashAttention's rule and TPU-semantics interpret mode with race detection, on chosen cases;
* :mod:`flashlib.cost`'s counts of the band (the kernels' ``pl.CostEstimate``) against the kernels' grids walked
  step by step and against the element mask, and as XLA reports them for compiled windowed kernels;
* the forward and gradient compiled for v5e and v6e by libtpu.

Search or smoke (``tests/conftest.py``): the block-geometry search (NumPy only) and the kernel search run in full
in the main environment and as a random quarter under ``make test-colab``; every fixed case runs in both.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import search_examples
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

import flashlib
from flashlib import checks, cost, geometry, masks, reference
from flashlib.kernels import BlockSizes, backward_kernels, variants
from flashlib.kernels.tpu_backward import _fuses_dq
from flashlib.tpu_compile import compile_for_tpu

BF16 = jnp.bfloat16


# ---------------------------------------------------------------------------------------------------
# The band's block geometry against the element rule
# ---------------------------------------------------------------------------------------------------

side = st.one_of(st.none(), st.integers(0, 40))


@settings(max_examples=search_examples(300), derandomize=False, deadline=None)
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
# The band's cost (flashlib.cost, the kernels' pl.CostEstimate) against the kernels' grids walked step by step
# ---------------------------------------------------------------------------------------------------


class _Blocks:
    """Block sizes as flashlib.cost reads them (cost.KernelBlocks), free of the TPU tiling rules: small blocks
    give many blocks on short sequences, so every kind of grid step happens in a few microseconds."""

    def __init__(self, block_q: int, block_k: int, kv_step: int, backward: dict):
        self.block_q, self.block_k, self.kv_step, self._backward = block_q, block_k, kv_step, backward

    def blocks(self, kernel: str = "forward") -> tuple[int, int]:
        return self._backward.get(kernel, (self.block_q, self.block_k))


COST_LENGTHS = [(37, 100), (100, 37), (64, 64), (1, 50)]  # q_len, kv_len
COST_BLOCKS = [  # block_q, block_k, kv_step (block_k_major); the backward's (block_q, block_k) per kernel
    _Blocks(8, 16, 16, {"dkv": (16, 8), "fused": (16, 8), "dq": (8, 16)}),
    _Blocks(16, 8, 32, {"dkv": (8, 8), "fused": (8, 8), "dq": (16, 8)}),  # row chunks; 4 sub-blocks a copy
    _Blocks(32, 8, 8, {"dkv": (8, 32), "fused": (8, 32), "dq": (32, 8)}),
]
COST_WINDOWS = [None, (0, 0), (5, None), (None, 3), (20, 4), (200, 200), (None, None)]


def _copies(indices: list) -> int:
    """Copies of one input over a grid walked in order: one at the start and one whenever the index changes."""
    return 1 + sum(a != b for a, b in itertools.pairwise(indices))


def _walk_forward(q_len, kv_len, blocks: _Blocks, causal, window) -> tuple[int, int, int]:
    """``(whole sub-blocks, row chunks, k copies)`` of one head of tpu_forward's grid, step by step."""
    block_q, block_k, kv_step = blocks.block_q, blocks.block_k, blocks.kv_step
    num_q, num_steps, subs = -(-q_len // block_q), -(-kv_len // kv_step), kv_step // block_k
    live = dict(outer_block=block_q, inner_block=kv_step, num_inner=num_steps, q_len=q_len, kv_len=kv_len,
                causal=causal, window=window)
    geo = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal, window=window)
    split, chunks_per_block = geometry.splits_rows(block_q, block_k, causal), block_q // block_k
    whole = chunks = 0
    fetched = []
    for i in range(num_q):
        for j in range(geometry.live_steps(num_q, **live)):
            fetched.append(int(geometry.fetched_block(i, j, **live)))
            step, step_live = geometry.visited_block(i, j, **live)
            for kv_block in range(step * subs, (step + 1) * subs):
                if not (step_live and kv_block * block_k < kv_len and geometry.block_is_visible(i, kv_block, **geo)):
                    continue
                if split and geometry.block_needs_mask(i, kv_block, **geo):
                    chunks += sum(bool(geometry.block_is_visible(i * chunks_per_block + c, kv_block,
                                                                 **dict(geo, block_q=block_k)))
                                  for c in range(chunks_per_block))
                else:
                    whole += 1
    return whole, chunks, _copies(fetched)


def _walk_backward(q_len, kv_len, block_q, block_k, causal, window, keys_outer: bool, compact: bool = True):
    """``(computed blocks, inner-axis copies)`` of one head of a backward grid: dK/dV (and fused, which never
    compacts) walk query blocks per key block, dQ key blocks per query block."""
    num_q, num_k = -(-q_len // block_q), -(-kv_len // block_k)
    outer_block, inner_block, num_outer, num_inner = ((block_k, block_q, num_k, num_q) if keys_outer
                                                      else (block_q, block_k, num_q, num_k))
    live = dict(outer_block=outer_block, inner_block=inner_block, num_inner=num_inner, q_len=q_len, kv_len=kv_len,
                causal=causal, window=window, keys_inner=not keys_outer)
    geo = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal, window=window)
    steps = geometry.live_steps(num_outer, **live) if compact else num_inner
    computed, fetched = 0, []
    for outer in range(num_outer):
        for step in range(steps):
            fetched.append(int(geometry.fetched_block(outer, step, **live)))
            inner, is_live = geometry.visited_block(outer, step, **live) if compact else (step, True)
            q_block, kv_block = (inner, outer) if keys_outer else (outer, inner)
            computed += bool(is_live and geometry.block_is_visible(q_block, kv_block, **geo))
    return computed, _copies(fetched)


@pytest.mark.parametrize("window", COST_WINDOWS, ids=str)
def test_window_cost_counts_the_blocks_and_copies_the_kernels_walk(window):
    """Forward, dK/dV, dQ and fused: flops, exps and bytes of cost's kernel view equal the grids walked step by
    step with the kernels' own geometry (visited_block, fetched_block, block_is_visible), q_len != kv_len,
    windows wider than the sequences, (0, 0), one-sided."""
    head_dim, itemsize = 8, 2
    for (q_len, kv_len), blocks, causal in itertools.product(COST_LENGTHS, COST_BLOCKS, (False, True)):
        case = (q_len, kv_len, blocks.blocks(), blocks.kv_step, causal, window)
        dims, band = (1, 1, q_len, kv_len, head_dim, causal), dict(window=window)
        bq, bk, kv_step = blocks.block_q, blocks.block_k, blocks.kv_step
        whole, chunks, kv_copies = _walk_forward(q_len, kv_len, blocks, causal, window)
        scores = whole * bq * bk + chunks * bk * bk
        assert cost.attention_flops(*dims, blocks, **band) == scores * 4 * head_dim, case
        assert cost.attention_transcendentals(*dims, blocks, **band) == scores + (whole * bq + chunks * bk) * 128, case
        assert cost.kv_block_fetches(q_len, kv_len, bq, kv_step, causal, window) == kv_copies, case
        q_rows = -(-q_len // bq) * bq
        assert cost.attention_bytes(*dims, "bfloat16", blocks, **band) == (
            (2 * q_rows + 2 * kv_copies * kv_step) * head_dim * itemsize), case
        for kernel, keys_outer in (("dkv", True), ("dq", False), ("fused", True)):
            kq, kk = blocks.blocks(kernel)
            compact = kernel != "fused"  # the fused kernel's query axis is whole (a left window runs dkv + dq)
            computed, copies = _walk_backward(q_len, kv_len, kq, kk, causal, window, keys_outer, compact)
            matmuls = {"dkv": 4, "dq": 3, "fused": 5}[kernel]
            got = cost.attention_backward_flops(*dims, blocks, kernel, **band)
            assert got == computed * kq * kk * matmuls * 2 * head_dim, (kernel, case)
            assert cost.attention_backward_transcendentals(*dims, blocks, kernel, **band) == computed * kq * kk
            if keys_outer:
                assert cost.q_block_fetches(q_len, kv_len, kq, kk, causal, window) == copies, (kernel, case)
                q_rows, kv_rows = copies * kq, -(-kv_len // kk) * kk
                moved = (2 * q_rows + 4 * kv_rows) * head_dim * itemsize
                if kernel == "fused":
                    moved += (kv_rows + -(-q_len // kq) * kq) * head_dim * itemsize
            else:
                assert cost.kv_block_fetches(q_len, kv_len, kq, kk, causal, window) == copies, (kernel, case)
                q_rows = -(-q_len // kq) * kq
                moved = (3 * q_rows + 2 * copies * kk) * head_dim * itemsize
            moved += 2 * q_rows * 8 * 4  # the lse and D rows, [8, block_q] f32, with q
            assert cost.attention_backward_bytes(*dims, "bfloat16", blocks, kernel, **band) == moved, (kernel, case)


def test_window_cost_of_the_algorithm_counts_the_element_mask():
    """block_sizes=None: the pairs masks.element_visible lets through; k and v cross HBM once per kv head."""
    for q_len, kv_len, causal, window in itertools.product((1, 37, 64, 100), (1, 50, 64), (False, True),
                                                           COST_WINDOWS + [(3, 0), (0, 7)]):
        rows, cols = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
        mask = masks.element_visible(rows, cols, q_len=q_len, kv_len=kv_len, causal=causal, window=window)
        pairs = int(np.broadcast_to(mask, (q_len, kv_len)).sum())
        assert cost.visible_pairs(q_len, kv_len, causal, window) == pairs, (q_len, kv_len, causal, window)
        dims = (2, 3, q_len, kv_len, 16, causal)
        assert cost.attention_flops(*dims, window=window) == 2 * 3 * pairs * 4 * 16
        assert cost.attention_transcendentals(*dims, window=window) == 2 * 3 * pairs
        assert cost.attention_backward_flops(*dims, window=window) == 2 * 3 * pairs * 10 * 16
    b, h, n, d = 2, 8, 64, 32
    assert cost.attention_bytes(b, h, n, n, d, False, "bfloat16", kv_heads=2) == b * (h * 2 + 2 * 2) * n * d * 2
    assert cost.attention_bytes(b, h, n, n, d, False, "bfloat16", kv_heads=h) == cost.attention_bytes(
        b, h, n, n, d, False, "bfloat16")
    with pytest.raises(ValueError, match="kv_heads must divide heads"):
        cost.attention_bytes(b, h, n, n, d, False, "bfloat16", kv_heads=3)


def test_segment_cost_is_the_bands_whole_blocks():
    """Segment ids are data: the count is the band's blocks, each whole (the kernel builds a masked block's
    mask whole with segment ids, never in row chunks): an upper bound of what the block tables let run."""
    blocks = COST_BLOCKS[1]  # 16-row query blocks over 8-key blocks: causal splits diagonal blocks into chunks
    dims = (1, 1, 100, 37, 8, True)
    visited = geometry.visited_blocks(100, 37, 16, 8, True, (20, 4))
    assert cost.attention_flops(*dims, blocks, window=(20, 4), segments=True) == visited * 16 * 8 * 4 * 8
    assert cost.attention_flops(*dims, blocks, segments=True) > cost.attention_flops(*dims, blocks)


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


@settings(max_examples=search_examples(12), derandomize=False, deadline=None)
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
    checks.check_attention_and_grads(out, vjp(do), q, k, v, do, causal=causal, quiet=True, **jv)


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


@pytest.mark.tpu
def test_a_windows_cost_estimate_reaches_the_compiler():
    """XLA reports the windowed forward's pl.CostEstimate: the band's blocks and copies, not the causal count
    (aligned shapes: the program is the kernel alone). Row chunks and grid compaction both happen here."""
    batch, heads, n, head_dim, sizes, window = 1, 4, 2048, 128, BlockSizes(512, 256), (511, 0)
    q = jax.ShapeDtypeStruct((batch, heads, n, head_dim), BF16)
    fn = jax.jit(lambda q, k, v: flashlib.attention(q, k, v, causal=True, window=window, block_sizes=sizes,
                                                    impl="pallas", interpret=False))
    check = compile_for_tpu(fn, q, q, q)
    assert check.ok, check.compiler_message
    dims = (batch, heads, n, n, head_dim, True)
    assert check.flops == cost.attention_flops(*dims, block_sizes=sizes, window=window)
    assert check.bytes_accessed == cost.attention_bytes(*dims, BF16, block_sizes=sizes, window=window)
    assert check.flops < cost.attention_flops(*dims, block_sizes=sizes) * 3 // 5  # causal alone: over twice the work


@pytest.mark.tpu
@pytest.mark.parametrize("kernel", ["dkv", "dq"])
def test_a_windows_backward_cost_estimate_reaches_the_compiler(kernel):
    """The compacted dK/dV and dQ grids' pl.CostEstimate, as XLA reports it, is flashlib.cost's band count."""
    batch, heads, n, head_dim, window = 1, 4, 2048, 128, (300, 0)
    sizes = BlockSizes(256, 512, block_q_dkv=512, block_k_dkv=256, block_q_dq=256, block_k_dq=512)
    q = jax.ShapeDtypeStruct((batch, heads, n, head_dim), BF16)
    rows = jax.ShapeDtypeStruct((batch, heads, 8, n), jnp.float32)
    call = {"dkv": backward_kernels._dkv, "dq": backward_kernels._dq}[kernel]

    def run(q, k, v, do, lse_rows, d_rows):
        return call(q, k, v, do, lse_rows, d_rows, causal=True, scale=0.1, q_len=n, kv_len=n, sizes=sizes,
                    interpret=False, variants=variants.KernelVariants(window=window))

    check = compile_for_tpu(run, q, q, q, q, rows, rows)
    assert check.ok, check.compiler_message
    dims = (batch, heads, n, n, head_dim, True)
    assert check.flops == cost.attention_backward_flops(*dims, block_sizes=sizes, kernel=kernel, window=window)
    assert check.bytes_accessed == cost.attention_backward_bytes(*dims, BF16, block_sizes=sizes, kernel=kernel,
                                                                 window=window)
