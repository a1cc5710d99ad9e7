"""The Pallas TPU flash-attention backward kernels (stage 6 of the series): dK/dV and dQ by recomputation.

The forward keeps only ``out`` and the row log-sum-exp of its base-2 scores ``lse2``. From them and the
cotangent ``dO``:

    P  = exp2(q k^T * scale * log2(e) - lse2)    recomputed block by block, never stored whole
    dV = P^T dO,   dP = dO v^T
    dS = P * (dP - D),   D = rowsum(dO * out)   (D_i = sum_j P_ij dP_ij: the softmax Jacobian's own term)
    dQ = dS k * scale,   dK = dS^T q * scale

The kernels make their base-2 scores ``q k^T * scale * log2(e)`` with the forward's own function
(:func:`~flashlib.kernels.scores.base2_scores`): the backward's scores are the forward's up to the f32
summation order, and so are the probabilities — each recomputed row sums to 1 as the forward normalised it.
They run on the padded inputs and row statistics :func:`flashlib.kernels.tpu_backward.backward` makes.

Two kernels, so that every output block has one owner that accumulates it in f32 VMEM (no atomics):

* **dK/dV** (:func:`_dkv_kernel`), grid ``(batch, heads, kv blocks, q blocks)``: a key block stays in VMEM
  while the query blocks stream past on the last, sequential ("arbitrary") axis. It works on the
  *transposed* score tile ``s^T = k q^T [block_k, block_q]``: then ``dV += P^T dO`` and ``dK += dS^T q`` are
  plain matmuls (no score tile is ever transposed), and the queries' lse and D broadcast down sublanes from
  compact ``[8, block_q]`` rows.
* **dQ** (:func:`_dq_kernel`), grid ``(batch, heads, q blocks, kv blocks)`` like the forward: a query block
  stays while key blocks stream past. Its ``init`` turns the lse and D rows into lane-replicated ``[block_q,
  128]`` columns once per query block (one transpose): the body broadcasts them as the forward does ``m``, ``l``.

The price of one owner per output: both kernels recompute ``s`` and ``dP``, 7 matmuls per score where the
algorithm needs 5 (:mod:`flashlib.cost`). So while it fits, the dK/dV kernel does dQ too: the **fused**
kernel (:func:`_fused_kernel`, the default up to ``tpu_backward.FUSED_DQ_MAX_BYTES``) keeps a whole head's
``dQ^T [head_dim, q_len]`` f32 in VMEM (1 MiB at 2048 tokens, head_dim 128) across the key blocks and adds
``dQ^T[:, q block] += k^T dS^T``: a plain matmul of ``k^T`` (transposed once, in HBM) and the ``dS^T`` tile
already in hand. It writes each query block of dQ^T on the last key block. 5 matmuls per score; the key
axis turns sequential ("arbitrary"). (Cycle estimates: ``data/optimisation/backward_README.md``.)

Grouped-query attention: a group's query heads read one kv head (``h // group`` in the k/v index maps; K
and V are never repeated in HBM). The dK/dV and fused kernels walk the group's query heads one after another:
their grid gains a sequential axis of ``heads_inner`` query heads before the query axis, ``(batch, kv heads,
kv blocks, head of the group, q steps)``, so a key block is copied once per group and its dK and dV accumulate
the whole group's sum in VMEM: written once, in k's dtype. Only where the fused kernel's ``dQ^T`` for the whole group
would not fit (``FUSED_DQ_MAX_BYTES``) does it take fewer heads, and
:func:`flashlib.kernels.tpu_backward.backward` sums the rest from f32 partial sums — FlashAttention 2's way.
The dQ kernel reads k and v once per query head.

The variants (:mod:`flashlib.kernels.variants`) follow the forward's: the window's band decides the three
kinds of block, and with a left edge the dK/dV kernel's query axis and the dQ kernel's key axis walk only the
live blocks (the fused kernel's cannot — its dQ^T spans the whole query axis — so such windows run the
separate kernels); the soft-cap multiplies ``dS`` by ``1 - tanh^2``; segment ids mask every visited block;
a sink needs nothing here (the lse includes it; ``dsinks`` is summed in :mod:`~flashlib.kernels.tpu_backward`);
``v`` and ``dO`` may have their own head_dim.

Longer than 400 lines because the three kernels share one block visitor, one mask, one set of BlockSpecs, one
accumulation step and the variants' masks; apart, each piece would be read without the kernels it serves.

All three run the forward's three kinds of block: causal blocks above the diagonal are skipped (a
``pl.when`` on the program ids, and an index map clamped so the skipped steps fetch nothing new), blocks
straddling the diagonal or holding padded keys build an element mask, the rest are plain. Padded queries
need no mask: their dO and D are zero and their lse is ``tpu_backward.NO_KEY_LSE``, so ``P = exp2(s - lse2)``
is exactly 0 there — as for a query that sees no key at all (the forward returned ``lse = -inf`` for it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib import cost, geometry
from flashlib.hardware import MIB
from flashlib.kernels.block_sizes import BlockSizes, vmem_limit_bytes
from flashlib.kernels.scores import NT_DIMS, base2_scores, lanes_to, sublanes_to
from flashlib.kernels.variants import PLAIN, KernelVariants, mask_scores, segment_blocks, soft_cap, with_tables
from flashlib.tiling import F32_BYTES, NUM_LANES, NUM_SUBLANES, round_up

PARALLEL, ARBITRARY = "parallel", "arbitrary"
# The largest dQ^T accumulator ([head_dim, q_len] f32, per step's query heads) the fused kernel keeps in VMEM:
# 4 MiB is 8192 queries at head_dim 128; longer sequences run the separate dQ kernel. The fused kernel asks the
# compiler for this VMEM (and its k^T and dQ^T blocks) on top of the dK/dV kernel's checked budget; v5e and
# v6e have 128 MiB.
FUSED_DQ_MAX_BYTES = 4 * MIB


def _rows_to_columns(rows: jax.Array) -> jax.Array:
    """A sublane-replicated ``[8, n]`` row block as a lane-replicated ``[n, 128]`` column block: fill a
    ``[128, n]`` square with whole-vreg copies, then transpose it once."""
    return sublanes_to(rows, NUM_LANES).T


def _visit_block(body: Callable[[bool], None], q_block, kv_block, *, may_mask: bool, segments: bool = False,
                 live=True, block_geometry: dict) -> None:
    """Run ``body(masked)`` on the three kinds of block: skipped (outside the band, or ``live`` False: a step
    past the outer block's live range), masked (on the band's edge or holding padded keys; every visited
    block with ``segments``), plain. ``may_mask`` False: every block is plain (and live)."""
    if not may_mask:
        body(False)
        return
    block_visible = live & geometry.block_is_visible(q_block, kv_block, **block_geometry)
    if segments:  # segment ids are data: every visited block builds the mask
        pl.when(block_visible)(lambda: body(True))
        return
    needs_mask = geometry.block_needs_mask(q_block, kv_block, **block_geometry)

    @pl.when(block_visible & needs_mask)
    def masked_body():
        body(True)

    @pl.when(block_visible & ~needs_mask)
    def plain_body():
        body(False)


class _Refs(NamedTuple):
    """The inputs every backward kernel reads, each ``[block, ...]``: q, k, v, dO; the lse and D rows ``[8,
    block_q]``; and with segment ids, the queries' and keys' ids in the layout the kernel's tile needs."""

    q: Any
    k: Any
    v: Any
    do: Any
    lse: Any
    d: Any
    q_ids: Any = None
    kv_ids: Any = None


def _take_refs(refs: tuple, variants: KernelVariants) -> tuple[Any, _Refs, list]:
    """Split a kernel's positional refs into the block table of live pairs (segment ids: scalar-prefetched,
    first; else None), its :class:`_Refs` and the rest (outputs, scratch)."""
    live_ref, refs = (refs[0], refs[2:]) if variants.uses_tables else (None, refs)
    count = 8 if variants.segments else 6
    return live_ref, _Refs(*refs[:count]), list(refs[count:])


def _pair_is_live(live_ref, outer, inner, num_inner: int):
    """Whether the block table (:class:`~flashlib.kernels.variants.SegmentBlocks`) lets this (outer, inner)
    pair meet; True without segment ids."""
    if live_ref is None:
        return True
    row = (pl.program_id(0) * pl.num_programs(2) + outer) * num_inner
    return live_ref[row + jnp.minimum(inner, num_inner - 1)] != 0


def _tables(q_ids, kv_ids, *, keys_outer: bool, q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool,
            window) -> list:
    """The scalar-prefetched block tables (live, fetch) of a grid with key blocks outer (dK/dV, fused) or
    query blocks outer (dQ), from the padded ids ``[b, Tq]``, ``[b, Tk]``."""
    num_q, num_k = -(-q_len // block_q), -(-kv_len // block_k)  # the grids' blocks (the ids may be padded further)
    q_ids, kv_ids = q_ids[:, :num_q * block_q], kv_ids[:, :num_k * block_k]
    band = np.broadcast_to(geometry.block_is_visible(
        np.arange(num_q)[:, None], np.arange(num_k)[None, :], block_q=block_q, block_k=block_k, q_len=q_len,
        kv_len=kv_len, causal=causal, window=window), (num_q, num_k))  # [nq, nk]
    if keys_outer:
        blocks = segment_blocks(kv_ids, q_ids, outer_len=kv_len, inner_len=q_len, outer_block=block_k,
                                inner_block=block_q, band_visible=band.T)
    else:
        blocks = segment_blocks(q_ids, kv_ids, outer_len=q_len, inner_len=kv_len, outer_block=block_q,
                                inner_block=block_k, band_visible=band)
    return [blocks.live, blocks.fetch]


def _scores(a, b, *, scale: float, variants: KernelVariants):
    """Base-2 scores ``a b^T`` (soft-capped if asked) and the cap's ``tanh`` (None without a cap)."""
    s = base2_scores(a, b, scale)
    if variants.softcap is None:
        return s, None
    return soft_cap(s, variants.softcap)


# ---------------------------------------------------------------------------------------------------
# dK and dV (and, fused, dQ): one key block per (batch, head, kv block), query blocks streaming past
# ---------------------------------------------------------------------------------------------------


def _accumulate_dkv(refs: _Refs, dk_acc_ref, dv_acc_ref, q_block, kv_block, *, masked: bool, causal: bool,
                    scale: float, q_len: int, kv_len: int, variants: KernelVariants) -> jax.Array:
    """One grid step of the dK/dV and fused kernels: ``dV += P^T dO`` and ``dK += dS^T q`` (unscaled) into
    the ``[block_k, head_dim]`` f32 accumulators; returns ``dS^T [block_k, block_q]`` in q's dtype."""
    block_q, block_k = refs.q.shape[0], refs.k.shape[0]
    q, k, do = refs.q[...], refs.k[...], refs.do[...]  # [block_q, d], [block_k, d], [block_q, dv]
    s_t, tanh_t = _scores(k, q, scale=scale, variants=variants)  # [block_k, block_q]   the forward's, transposed
    if masked:
        ids = {}
        if refs.q_ids is not None:  # keys' ids down the rows, queries' along the lanes
            ids = dict(q_ids=sublanes_to(refs.q_ids[...], block_k), kv_ids=lanes_to(refs.kv_ids[...], block_q))
        s_t = mask_scores(s_t, q_block * block_q, kv_block * block_k, keys_on_rows=True, q_len=q_len,
                          kv_len=kv_len, causal=causal, window=variants.window, **ids)  # [block_k, block_q]
    p_t = jnp.exp2(s_t - sublanes_to(refs.lse[...], block_k))  # [block_k, block_q]   0 where masked
    dv_acc_ref[...] += jnp.dot(p_t.astype(do.dtype), do, preferred_element_type=jnp.float32)  # [block_k, dv]
    dp_t = lax.dot_general(refs.v[...], do, NT_DIMS, preferred_element_type=jnp.float32)  # [block_k, block_q]
    ds_t = p_t * (dp_t - sublanes_to(refs.d[...], block_k))  # [block_k, block_q]
    if tanh_t is not None:
        ds_t = ds_t * (1.0 - tanh_t * tanh_t)  # through the soft-cap: d(C tanh(s / C)) / ds
    ds_t = ds_t.astype(q.dtype)
    dk_acc_ref[...] += jnp.dot(ds_t, q, preferred_element_type=jnp.float32)  # [block_k, d]
    return ds_t


def _inner_steps(heads_inner: int):
    """``(head, step, first, last)`` of a dK/dV or fused grid step: the query head of the step's group (0
    without GQA's extra axis), the query step, and whether this is the first / last step that accumulates into
    the key block's dK and dV (the group's first head's first step, its last head's last)."""
    step_axis = 3 if heads_inner == 1 else 4
    step = pl.program_id(step_axis)
    first, last = step == 0, step == pl.num_programs(step_axis) - 1
    if heads_inner == 1:
        return 0, step, first, last
    head = pl.program_id(3)
    return head, step, first & (head == 0), last & (head == heads_inner - 1)


def _dkv_kernel(
    *refs,  # q [block_q, d], k [block_k, d], v [block_k, dv], dO [block_q, dv], lse and D [8, block_q] f32 (lse
            # base 2), (segment ids: q [8, block_q], kv [block_k, 128]); out dK [block_k, d], dV [block_k, dv];
            # scratch: their f32 accumulators
    causal: bool, scale: float, q_len: int, kv_len: int, has_padding: bool, variants: KernelVariants,
    num_q_blocks: int, heads_inner: int,
):
    live_ref, in_refs, (dk_ref, dv_ref, dk_acc_ref, dv_acc_ref) = _take_refs(refs, variants)
    block_q, block_k = in_refs.q.shape[0], in_refs.k.shape[0]
    block_geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal,
                          window=variants.window)
    kv_block = pl.program_id(2)
    # with a window bounded on the left, the query axis walks only this key block's live query blocks
    _, step, first, last = _inner_steps(heads_inner)  # (GQA: of this query head, the group's heads in turn)
    q_block, live = geometry.visited_block(kv_block, step, outer_block=block_k, inner_block=block_q,
                                           num_inner=num_q_blocks, q_len=q_len, kv_len=kv_len, causal=causal,
                                           window=variants.window, keys_inner=False)
    live = live & _pair_is_live(live_ref, kv_block, q_block, num_q_blocks)

    @pl.when(first)  # with GQA the first head's first step: the accumulators sum the whole group
    def init():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)  # [block_k, head_dim]
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)  # [block_k, v_head_dim]

    def body(masked: bool):
        _accumulate_dkv(in_refs, dk_acc_ref, dv_acc_ref, q_block, kv_block, masked=masked, causal=causal,
                        scale=scale, q_len=q_len, kv_len=kv_len, variants=variants)

    _visit_block(body, q_block, kv_block, may_mask=variants.may_mask(causal, has_padding), segments=variants.segments,
                 live=live, block_geometry=block_geometry)

    @pl.when(last)
    def finalize():
        dk_ref[...] = (dk_acc_ref[...] * scale).astype(dk_ref.dtype)  # [block_k, head_dim]   scale once, here
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)  # [block_k, v_head_dim]


def _fused_kernel(
    *refs,  # as in _dkv_kernel, then k^T [head_dim, block_k]; out: dK, dV, dQ^T [head_dim, block_q]; scratch:
            # the dK, dV accumulators and dQ^T [head_dim, Tq] f32, the whole head's
    causal: bool, scale: float, q_len: int, kv_len: int, has_padding: bool, variants: KernelVariants,
    q_steps: int, heads_inner: int,
):
    """:func:`_dkv_kernel`, and with the ``dS^T`` tile it already has, ``dQ^T[:, q block] += k^T dS^T``. Its
    query axis is the whole sequence (a window bounded on the left runs the separate kernels, which compact);
    with GQA, the whole sequence of each of the ``heads_inner`` query heads in turn, their dQ^T side by side
    (``q_steps`` blocks each)."""
    live_ref, in_refs, (k_t_ref, dk_ref, dv_ref, dq_t_ref, dk_acc_ref, dv_acc_ref, dq_t_acc_ref) = _take_refs(
        refs, variants)
    block_q, block_k = in_refs.q.shape[0], in_refs.k.shape[0]
    kv_block = pl.program_id(2)
    head, q_block, first, last = _inner_steps(heads_inner)  # head: of the step's group (GQA)
    block_geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal,
                          window=variants.window)
    column = (head * q_steps + q_block) * block_q  # this head's query block in dQ^T
    q_columns = pl.ds(pl.multiple_of(column, block_q), block_q)

    @pl.when(first)
    def init():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)  # [block_k, head_dim]
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)  # [block_k, v_head_dim]

    @pl.when(kv_block == 0)
    def init_dq():
        dq_t_acc_ref[:, q_columns] = jnp.zeros((k_t_ref.shape[0], block_q), jnp.float32)  # [head_dim, block_q]

    def body(masked: bool):
        ds_t = _accumulate_dkv(in_refs, dk_acc_ref, dv_acc_ref, q_block, kv_block, masked=masked, causal=causal,
                               scale=scale, q_len=q_len, kv_len=kv_len, variants=variants)  # [block_k, block_q]
        dq_t = jnp.dot(k_t_ref[...], ds_t, preferred_element_type=jnp.float32)  # [d, block_q]   no transpose
        dq_t_acc_ref[:, q_columns] += dq_t

    _visit_block(body, q_block, kv_block, may_mask=variants.may_mask(causal, has_padding), segments=variants.segments,
                 live=_pair_is_live(live_ref, kv_block, q_block, q_steps), block_geometry=block_geometry)

    @pl.when(last)
    def finalize():
        dk_ref[...] = (dk_acc_ref[...] * scale).astype(dk_ref.dtype)  # [block_k, head_dim]   scale once, here
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)  # [block_k, v_head_dim]

    @pl.when(kv_block == pl.num_programs(2) - 1)
    def finalize_dq():
        dq_t_ref[...] = (dq_t_acc_ref[:, q_columns] * scale).astype(dq_t_ref.dtype)  # [head_dim, block_q]


def _kv_head(h, group: int):
    """The kv head query head ``h`` reads (GQA): ``h // group`` (``lax.div``: Mosaic lowers it without sign())."""
    return h if group == 1 else lax.div(h, group)


def _dkv_specs(head_dim: int, v_head_dim: int, block_q: int, block_k: int, *, causal: bool, q_len: int,
               kv_len: int, group: int = 1, window=None, segments: bool = False, heads_inner: int = 1):
    """The BlockSpecs of the dK/dV and fused grids ``(b, h, kv block j, step i)`` — with GQA's ``heads_inner`` >
    1, ``(b, h, j, head g, step i)`` — in the kernels' input order: q, k, v, dO, the lse and D rows (and the
    segment ids); then the outputs dK and dV, one per grid head ``h``. Query head ``h * heads_inner + g`` (a
    group's heads one after another, summing into one dK/dV) at step ``i`` reads the query block
    :func:`flashlib.geometry.fetched_block` names: with a window bounded on the left, ``first + i`` of key block
    ``j``'s live range clamped to its last; else step ``i`` raised to the first block the key block needs. Either
    way a skipped step keeps its neighbour's index, so the pipeline copies nothing for it. Every index map
    takes ``(b, h, j, *steps, *tables)``: :func:`_grid_steps` splits the rest."""
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_k)
    steps = _grid_steps(heads_inner)

    def head_and_step(h, rest):
        """(query head, query step, tables) of a grid step of grid head ``h``."""
        g, i, tables = steps(rest)
        return h * heads_inner + g, i, tables

    def q_block_of(b, j, i, tables):
        step = geometry.fetched_block(j, i, outer_block=block_k, inner_block=block_q, num_inner=num_q_blocks,
                                      q_len=q_len, kv_len=kv_len, causal=causal, window=window, keys_inner=False)
        if tables:  # segment ids: the block table's fetch (a pair that cannot meet repeats its neighbour's index)
            step = tables[1][(b * num_kv_blocks + j) * num_q_blocks + step]
        return step

    def kv_index_map(b, h, j, *rest):
        return b, _kv_head(h, group // heads_inner), j, 0

    def dkv_index_map(b, h, j, *rest):
        return b, h, j, 0

    def q_index_map(b, h, j, *rest):
        head, step, tables = head_and_step(h, rest)
        return b, head, q_block_of(b, j, step, tables), 0

    def row_stat_index_map(b, h, j, *rest):
        head, step, tables = head_and_step(h, rest)
        return b, head, 0, q_block_of(b, j, step, tables)

    def q_ids_index_map(b, h, j, *rest):
        _, step, tables = head_and_step(h, rest)
        return b, 0, q_block_of(b, j, step, tables)

    squeezed = pl.squeezed
    row_spec = pl.BlockSpec((squeezed, squeezed, NUM_SUBLANES, block_q), row_stat_index_map)
    in_specs = [pl.BlockSpec((squeezed, squeezed, block_q, head_dim), q_index_map),
                pl.BlockSpec((squeezed, squeezed, block_k, head_dim), kv_index_map),
                pl.BlockSpec((squeezed, squeezed, block_k, v_head_dim), kv_index_map),
                pl.BlockSpec((squeezed, squeezed, block_q, v_head_dim), q_index_map),
                row_spec, row_spec]
    if segments:  # q ids as rows [8, block_q], kv ids as columns [block_k, 128]
        in_specs += [pl.BlockSpec((squeezed, NUM_SUBLANES, block_q), q_ids_index_map),
                     pl.BlockSpec((squeezed, block_k, NUM_LANES), lambda b, h, j, *rest: (b, j, 0))]
    out_specs = [pl.BlockSpec((squeezed, squeezed, block_k, head_dim), dkv_index_map),
                 pl.BlockSpec((squeezed, squeezed, block_k, v_head_dim), dkv_index_map)]
    return in_specs, out_specs


def _grid_steps(heads_inner: int):
    """A function splitting a dK/dV or fused index map's arguments after ``(b, h, j)`` into ``(head of the
    group, query step, scalar-prefetched tables)``: the grid has the head axis only when ``heads_inner`` > 1."""
    def split(rest):
        if heads_inner == 1:
            return 0, rest[0], rest[1:]
        return rest[0], rest[1], rest[2:]
    return split


def _cost_estimate(kernel: str, dims: tuple, dtype, sizes: BlockSizes, window=None,
                   heads_per_step: int = 1) -> pl.CostEstimate:
    """``kernel``'s (``"dkv"``, ``"fused"``, ``"dq"``) pl.CostEstimate, from :mod:`flashlib.cost`: the blocks and
    copies of the band (causal, ``window``); with segment ids, the band's (a bound: :mod:`flashlib.cost`)."""
    return pl.CostEstimate(
        flops=cost.attention_backward_flops(*dims, block_sizes=sizes, kernel=kernel, window=window),
        transcendentals=cost.attention_backward_transcendentals(*dims, block_sizes=sizes, kernel=kernel,
                                                                window=window),
        bytes_accessed=cost.attention_backward_bytes(*dims, dtype, block_sizes=sizes, kernel=kernel, window=window,
                                                     heads_per_step=heads_per_step),
    )


def _inputs(q, k, v, do, lse_rows, d_rows, ids, variants: KernelVariants, q_ids: str, kv_ids: str) -> list:
    """The kernels' inputs in order, the segment ids in the layouts named (keys of ``segment_layouts``)."""
    inputs = [q, k, v, do, lse_rows, d_rows]
    if variants.segments:
        inputs += [ids[q_ids], ids[kv_ids]]
    return inputs


def _segment_tables(ids, variants: KernelVariants, **geometry_) -> list:
    """The block tables to prefetch (none without segment ids, or with the tables off)."""
    if not variants.uses_tables:
        return []
    return _tables(ids["q_rows"][:, 0, :], ids["kv_rows"][:, 0, :], window=variants.window, **geometry_)


def _dkv(q, k, v, do, lse_rows, d_rows, ids=None, *, causal: bool, scale: float, q_len: int, kv_len: int,
         sizes: BlockSizes, interpret, variants: KernelVariants = PLAIN) -> tuple[jax.Array, jax.Array]:
    """dK, dV ``[b, kv_heads, num_kv_blocks * block_k, d or dv]`` from padded inputs (rows past ``kv_len``:
    padding): with GQA the group's query heads run one after another on the query axis and sum into one
    dK/dV. ``ids``: the segment ids' layouts (:func:`~flashlib.kernels.variants.segment_layouts`) when
    ``variants.segments``."""
    batch, heads, _, head_dim = q.shape
    v_head_dim, group = v.shape[3], heads // k.shape[1]
    block_q, block_k = sizes.blocks("dkv")
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_k)
    geo = dict(causal=causal, q_len=q_len, kv_len=kv_len, window=variants.window)
    grid_q_steps = geometry.live_steps(num_kv_blocks, outer_block=block_k, inner_block=block_q,
                                       num_inner=num_q_blocks, keys_inner=False, **geo)
    in_specs, out_specs = _dkv_specs(head_dim, v_head_dim, block_q, block_k, group=group,
                                     segments=variants.segments, heads_inner=group, **geo)
    kernel = functools.partial(_dkv_kernel, causal=causal, scale=scale, q_len=q_len, kv_len=kv_len,
                               has_padding=num_kv_blocks * block_k != kv_len, variants=variants,
                               num_q_blocks=num_q_blocks, heads_inner=group)
    tables = _segment_tables(ids, variants, keys_outer=True, q_len=q_len, kv_len=kv_len, block_q=block_q,
                             block_k=block_k, causal=causal)
    grid = dict(
        grid=(batch, heads // group, num_kv_blocks, *_group_axis(group), grid_q_steps),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((block_k, head_dim), jnp.float32),  # dK accumulator
            pltpu.VMEM((block_k, v_head_dim), jnp.float32),  # dV accumulator
        ],
    )
    return pl.pallas_call(
        kernel,
        **with_tables(grid, len(tables)),
        out_shape=[jax.ShapeDtypeStruct((batch, heads // group, num_kv_blocks * block_k, head_dim), k.dtype),
                   jax.ShapeDtypeStruct((batch, heads // group, num_kv_blocks * block_k, v_head_dim), v.dtype)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(PARALLEL, PARALLEL, PARALLEL, *_group_axis(group, ARBITRARY), ARBITRARY)),
        cost_estimate=_cost_estimate("dkv", (batch, heads, q_len, kv_len, head_dim, causal), q.dtype, sizes,
                                     variants.window, heads_per_step=group),
        interpret=interpret,
        name="flash_attention_dkv" + ("_causal" if causal else ""),
    )(*tables, *_inputs(q, k, v, do, lse_rows, d_rows, ids, variants, "q_rows", "kv_columns"))


def _fused(q, k, v, do, lse_rows, d_rows, ids=None, *, causal: bool, scale: float, q_len: int, kv_len: int,
           sizes: BlockSizes, interpret, variants: KernelVariants = PLAIN
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dK, dV as :func:`_dkv` — ``[b, h / p, ...]`` for the ``p`` query heads of a group whose dQ^T fit
    :data:`FUSED_DQ_MAX_BYTES` together (:func:`fused_heads_inner`; f32 partial sums for the caller to add when
    ``p`` is less than the group) — and dQ^T ``[b, h, d, num_q_blocks * block_q]`` (q padded to exactly that
    length)."""
    batch, heads, _, head_dim = q.shape
    v_head_dim, group = v.shape[3], heads // k.shape[1]
    block_q, block_k = sizes.blocks("fused")
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_k)
    squeezed, q_padded_len = pl.squeezed, num_q_blocks * block_q
    inner = fused_heads_inner(group, head_dim, q_padded_len)  # query heads per grid head, one after another
    in_specs, out_specs = _dkv_specs(head_dim, v_head_dim, block_q, block_k, causal=causal, q_len=q_len,
                                     kv_len=kv_len, group=group, window=variants.window,
                                     segments=variants.segments, heads_inner=inner)
    dk_dtype, dv_dtype = (k.dtype, v.dtype) if inner == group else (jnp.float32, jnp.float32)

    steps = _grid_steps(inner)

    def k_t_index_map(b, h, j, *rest):
        return b, _kv_head(h, group // inner), 0, j

    def dq_t_index_map(b, h, j, *rest):
        """Query block ``i`` of the step's head ``g`` (block ``g * num_q_blocks + i``) on the last key block, where
        it is written; block 0 before (no copy out)."""
        g, i, _ = steps(rest)
        return b, h, 0, jnp.where(j == num_kv_blocks - 1, g * num_q_blocks + i, 0)

    k_t = jnp.swapaxes(k, 2, 3)  # [b, kv_heads, d, Tk]
    extra_vmem = _fused_vmem_bytes(inner * q_padded_len, head_dim, block_q, block_k, q.dtype)  # beyond dK/dV's
    kernel = functools.partial(_fused_kernel, causal=causal, scale=scale, q_len=q_len, kv_len=kv_len,
                               has_padding=num_kv_blocks * block_k != kv_len, variants=variants,
                               q_steps=num_q_blocks, heads_inner=inner)
    tables = _segment_tables(ids, variants, keys_outer=True, q_len=q_len, kv_len=kv_len, block_q=block_q,
                             block_k=block_k, causal=causal)
    grid = dict(
        grid=(batch, heads // inner, num_kv_blocks, *_group_axis(inner), num_q_blocks),
        in_specs=[*in_specs, pl.BlockSpec((squeezed, squeezed, head_dim, block_k), k_t_index_map)],
        out_specs=[*out_specs, pl.BlockSpec((squeezed, squeezed, head_dim, block_q), dq_t_index_map)],
        scratch_shapes=[
            pltpu.VMEM((block_k, head_dim), jnp.float32),  # dK accumulator
            pltpu.VMEM((block_k, v_head_dim), jnp.float32),  # dV accumulator
            pltpu.VMEM((head_dim, inner * q_padded_len), jnp.float32),  # dQ^T accumulator, the step's heads
        ],
    )
    dk, dv, dq_t = pl.pallas_call(
        kernel,
        **with_tables(grid, len(tables)),
        out_shape=[jax.ShapeDtypeStruct((batch, heads // inner, num_kv_blocks * block_k, head_dim), dk_dtype),
                   jax.ShapeDtypeStruct((batch, heads // inner, num_kv_blocks * block_k, v_head_dim), dv_dtype),
                   jax.ShapeDtypeStruct((batch, heads // inner, head_dim, inner * q_padded_len), q.dtype)],
        compiler_params=pltpu.CompilerParams(  # dQ^T sums over the key blocks: that axis turns sequential too
            dimension_semantics=(PARALLEL, PARALLEL, ARBITRARY, *_group_axis(inner, ARBITRARY), ARBITRARY),
            vmem_limit_bytes=vmem_limit_bytes(sizes.generation) + extra_vmem),
        cost_estimate=_cost_estimate("fused", (batch, heads, q_len, kv_len, head_dim, causal), q.dtype, sizes,
                                     variants.window, heads_per_step=inner),
        interpret=interpret,
        name="flash_attention_dkv_dq" + ("_causal" if causal else ""),
    )(*tables, *_inputs(q, k, v, do, lse_rows, d_rows, ids, variants, "q_rows", "kv_columns"), k_t)
    # [b, h / inner, d, inner * Tq] -> [b, h, d, Tq]: the step's heads side by side along the queries
    dq_t = dq_t.reshape(batch, heads // inner, head_dim, inner, q_padded_len).swapaxes(2, 3)
    return dk, dv, dq_t.reshape(batch, heads, head_dim, q_padded_len)


def _group_axis(heads_inner: int, entry=None) -> tuple:
    """The dK/dV and fused grids' axis of a group's query heads (GQA): ``(entry,)`` — its size, or its dimension
    semantics — when ``heads_inner`` > 1, else no axis."""
    return () if heads_inner == 1 else ((heads_inner if entry is None else entry),)


def fused_heads_inner(group: int, head_dim: int, q_padded_len: int) -> int:
    """How many query heads of a GQA group the fused kernel walks in turn per grid head: the largest divisor
    of ``group`` whose dQ^T accumulators ``[head_dim, q_len]`` f32 fit :data:`FUSED_DQ_MAX_BYTES` together (at
    least 1: :func:`flashlib.kernels.tpu_backward._fuses_dq` has checked one)."""
    one_head = round_up(head_dim, NUM_SUBLANES) * q_padded_len * F32_BYTES
    return max(p for p in range(1, group + 1) if group % p == 0 and (p == 1 or p * one_head <= FUSED_DQ_MAX_BYTES))


def _fused_vmem_bytes(q_padded_len: int, head_dim: int, block_q: int, block_k: int, dtype) -> int:
    """VMEM the fused kernel needs beyond the dK/dV kernel's: the dQ^T accumulator, the double-buffered k^T
    and dQ^T blocks, and one ``[head_dim, block_q]`` f32 matmul result."""
    rows, itemsize = round_up(head_dim, NUM_SUBLANES), jnp.dtype(dtype).itemsize
    return rows * (q_padded_len * 4 + 2 * (block_k + block_q) * itemsize + block_q * 4)


# ---------------------------------------------------------------------------------------------------
# dQ: one query block per (batch, head, q block), key blocks streaming past
# ---------------------------------------------------------------------------------------------------


def _dq_kernel(
    *refs,  # as in _dkv_kernel (segment ids: q [block_q, 128], kv [8, block_k]); out dQ [block_q, d]; scratch:
            # its f32 accumulator, the lse and D lane-replicated [block_q, 128] f32
    causal: bool, scale: float, q_len: int, kv_len: int, has_padding: bool, variants: KernelVariants,
    num_kv_blocks: int,
):
    live_ref, in_refs, (dq_ref, dq_acc_ref, lse_col_ref, d_col_ref) = _take_refs(refs, variants)
    block_q, block_k = in_refs.q.shape[0], in_refs.k.shape[0]
    q_block = pl.program_id(2)
    kv_block, live = geometry.visited_block(q_block, pl.program_id(3), outer_block=block_q, inner_block=block_k,
                                            num_inner=num_kv_blocks, q_len=q_len, kv_len=kv_len, causal=causal,
                                            window=variants.window)
    live = live & _pair_is_live(live_ref, q_block, kv_block, num_kv_blocks)
    block_geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal,
                          window=variants.window)

    @pl.when(pl.program_id(3) == 0)
    def init():
        dq_acc_ref[...] = jnp.zeros(dq_acc_ref.shape, jnp.float32)  # [block_q, head_dim]
        lse_col_ref[...] = _rows_to_columns(in_refs.lse[...])  # [block_q, 128]
        d_col_ref[...] = _rows_to_columns(in_refs.d[...])  # [block_q, 128]

    def body(masked: bool):
        q, k = in_refs.q[...], in_refs.k[...]  # [block_q, d], [block_k, d]
        s, tanh = _scores(q, k, scale=scale, variants=variants)  # [block_q, block_k]   base 2
        if masked:
            ids = {}
            if in_refs.q_ids is not None:  # queries' ids down the rows, keys' along the lanes
                ids = dict(q_ids=lanes_to(in_refs.q_ids[...], block_k),
                           kv_ids=sublanes_to(in_refs.kv_ids[...], block_q))
            s = mask_scores(s, q_block * block_q, kv_block * block_k, keys_on_rows=False, q_len=q_len,
                            kv_len=kv_len, causal=causal, window=variants.window, **ids)  # [block_q, block_k]
        p = jnp.exp2(s - lanes_to(lse_col_ref[...], block_k))  # [block_q, block_k]   0 where masked
        dp = lax.dot_general(in_refs.do[...], in_refs.v[...], NT_DIMS,
                             preferred_element_type=jnp.float32)  # [block_q, block_k]
        ds = p * (dp - lanes_to(d_col_ref[...], block_k))  # [block_q, block_k]
        if tanh is not None:
            ds = ds * (1.0 - tanh * tanh)  # through the soft-cap
        dq_acc_ref[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)  # [block_q, d]

    _visit_block(body, q_block, kv_block, may_mask=variants.may_mask(causal, has_padding), segments=variants.segments,
                 live=live, block_geometry=block_geometry)

    @pl.when(pl.program_id(3) == pl.num_programs(3) - 1)
    def finalize():
        dq_ref[...] = (dq_acc_ref[...] * scale).astype(dq_ref.dtype)  # [block_q, head_dim]   scale once, here


def _dq(q, k, v, do, lse_rows, d_rows, ids=None, *, causal: bool, scale: float, q_len: int, kv_len: int,
        sizes: BlockSizes, interpret, variants: KernelVariants = PLAIN) -> jax.Array:
    """dQ ``[b, h, num_q_blocks * block_q, d]`` from padded inputs (rows past ``q_len``: padding)."""
    batch, heads, _, head_dim = q.shape
    v_head_dim, group = v.shape[3], heads // k.shape[1]
    block_q, block_k = sizes.blocks("dq")
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_k)
    live = dict(outer_block=block_q, inner_block=block_k, num_inner=num_kv_blocks, q_len=q_len, kv_len=kv_len,
                causal=causal, window=variants.window)
    grid_kv_steps = geometry.live_steps(num_q_blocks, **live)

    def kv_block_of(b, i, j, tables):
        """The key block grid step ``j`` of query block ``i`` reads (geometry.fetched_block, then with segment
        ids the block table's fetch; skipped: no copy)."""
        block = geometry.fetched_block(i, j, **live)
        if tables:
            block = tables[1][(b * num_q_blocks + i) * num_kv_blocks + block]
        return block

    def q_index_map(b, h, i, j, *tables):
        return b, h, i, 0

    def kv_index_map(b, h, i, j, *tables):
        return b, _kv_head(h, group), kv_block_of(b, i, j, tables), 0

    def row_stat_index_map(b, h, i, j, *tables):
        return b, h, 0, i

    squeezed = pl.squeezed
    in_specs = [pl.BlockSpec((squeezed, squeezed, block_q, head_dim), q_index_map),
                pl.BlockSpec((squeezed, squeezed, block_k, head_dim), kv_index_map),
                pl.BlockSpec((squeezed, squeezed, block_k, v_head_dim), kv_index_map),
                pl.BlockSpec((squeezed, squeezed, block_q, v_head_dim), q_index_map),
                pl.BlockSpec((squeezed, squeezed, NUM_SUBLANES, block_q), row_stat_index_map),
                pl.BlockSpec((squeezed, squeezed, NUM_SUBLANES, block_q), row_stat_index_map)]
    if variants.segments:  # q ids as columns [block_q, 128], kv ids as rows [8, block_k]
        in_specs += [pl.BlockSpec((squeezed, block_q, NUM_LANES), lambda b, h, i, j, *t: (b, i, 0)),
                     pl.BlockSpec((squeezed, NUM_SUBLANES, block_k),
                                  lambda b, h, i, j, *t: (b, 0, kv_block_of(b, i, j, t)))]
    kernel = functools.partial(_dq_kernel, causal=causal, scale=scale, q_len=q_len, kv_len=kv_len,
                               has_padding=num_kv_blocks * block_k != kv_len, variants=variants,
                               num_kv_blocks=num_kv_blocks)
    tables = _segment_tables(ids, variants, keys_outer=False, q_len=q_len, kv_len=kv_len, block_q=block_q,
                             block_k=block_k, causal=causal)
    grid = dict(
        grid=(batch, heads, num_q_blocks, grid_kv_steps),
        in_specs=in_specs,
        out_specs=in_specs[0],
        scratch_shapes=[
            pltpu.VMEM((block_q, head_dim), jnp.float32),  # dQ accumulator
            pltpu.VMEM((block_q, NUM_LANES), jnp.float32),  # lse, lane-replicated
            pltpu.VMEM((block_q, NUM_LANES), jnp.float32),  # D, lane-replicated
        ],
    )
    return pl.pallas_call(
        kernel,
        **with_tables(grid, len(tables)),
        out_shape=jax.ShapeDtypeStruct((batch, heads, num_q_blocks * block_q, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=(PARALLEL, PARALLEL, PARALLEL, ARBITRARY)),
        cost_estimate=_cost_estimate("dq", (batch, heads, q_len, kv_len, head_dim, causal), q.dtype, sizes,
                                     variants.window),
        interpret=interpret,
        name="flash_attention_dq" + ("_causal" if causal else ""),
    )(*tables, *_inputs(q, k, v, do, lse_rows, d_rows, ids, variants, "q_columns", "kv_rows"))
