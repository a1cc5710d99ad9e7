"""The Pallas TPU flash-attention forward kernel (stage 5 of the series), the forward of ``impl="pallas"``.

The algorithm is :mod:`flashlib.blockwise`'s, with the ``scan`` replaced by a Pallas grid
``(batch, heads, num_q_blocks, num_kv_steps)``. Pallas copies one ``[block_q, head_dim]`` query tile and
one ``[block_k_major, head_dim]`` key and value slab into VMEM per step (``BlockSizes.kv_step``; double-buffered:
the next step's copy overlaps this step's compute), and the body walks that slab in ``block_k`` sub-blocks.
The running softmax state lives in f32 VMEM scratch that persists across the innermost, sequential
("arbitrary") key axis:

* ``init``     (first key step): ``m = MASK_VALUE``, ``l = 0``, ``acc = 0``;
* ``body``     (every visible sub-block): base-2 scores on the MXU (:func:`~flashlib.kernels.scores.base2_scores`),
  online-softmax update of ``m``, ``l``, ``acc`` with ``exp2``;
* ``finalize`` (last key step): ``out = acc / l`` — one division per row, deferred as in FlashAttention-2.

``m`` and ``l`` are stored lane-replicated, ``[block_q, 128]`` rather than ``[block_q]``: a row statistic
then already has the layout of a score tile's row, and broadcasting it against ``[block_q, block_k]`` is a
cheap copy of whole vregs, never a cross-lane shuffle.

Causal attention does not visit the key steps above the diagonal: its grid is compacted to ``(batch, heads,
num_live)``, the last ("arbitrary") axis walking only the live (query block, key step) pairs, query block major
(:func:`flashlib.geometry.live_schedule`). Four int32 tables, per live step, arrive by scalar prefetch (SMEM): the
query block (q/out/lse index maps), key step (k/v index maps), first (``init``) and last (``finalize``), so each
output block stays resident across its consecutive steps. ``forward(compact=False)`` (and a call where nothing
would be dropped, :func:`flashlib.geometry.compacted_schedule`) keeps the full grid, where a step above the
diagonal costs a grid step but neither compute (a ``pl.when`` on the program ids) nor a copy (clamped k/v index
maps). Only sub-blocks that straddle the diagonal or hold padded keys build an element mask, and when ``block_q >
block_k`` a masked sub-block is split into row chunks of ``block_k`` rows, each again skipped, masked or plain
(:mod:`flashlib.geometry` decides all of it, from the tables' query block and key step when compacted).

The variants (:mod:`flashlib.kernels.variants`): a sliding window is a band like the causal one, with the same
three kinds of block; bounded on the left, the key axis of the grid walks only the steps a query block's
window reaches (``geometry.visited_block``, ``geometry.fetched_block``), so the grid stays the window's size
as the sequences grow. Soft-capping applies ``C tanh(s / C)`` to the base-2 scores; segment ids come in as
lane- and sublane-replicated id tiles and mask every visited block; a sink starts each row's running state
(``m = sink``, ``l = 1``); ``v`` may have its own head_dim, which the accumulator and output take.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib import cost, geometry
from flashlib.geometry import MASK_VALUE
from flashlib.kernels.block_sizes import BlockSizes
from flashlib.kernels.options import resolve_call
from flashlib.kernels.scores import LN_2, LOG2_E, base2_scores, lanes_to, sublanes_to
from flashlib.kernels.variants import (
    PLAIN,
    KernelVariants,
    segment_blocks,
    segment_layouts,
    sinks_tiles,
    soft_cap,
    with_tables,
)
from flashlib.tiling import NUM_LANES, NUM_SUBLANES, pad_to_multiple

__all__ = ["flash_attention_forward", "forward", "natural_lse"]

def _forward_kernel(
    *refs,  # (compacted: the schedule q_block, kv_step, first, last [num_live] int32 in SMEM, scalar-prefetched);
            # (segment ids: the block tables live, fetch [b * nq * n_steps] int32 in SMEM, scalar-prefetched);
            # q [block_q, head_dim], k [block_k_major, head_dim], v [block_k_major, v_head_dim]; (segment ids
            # q [block_q, 128], kv [8, block_k_major] int32); (sink [8, 128] f32); outputs o [block_q, v_head_dim]
            # (, lse [block_q, 128] f32); scratch m, l [block_q, 128], acc [block_q, v_head_dim]
    causal: bool,
    scale: float,
    block_k: int,
    q_len: int,
    kv_len: int,
    has_padding: bool,
    return_lse: bool,
    variants: KernelVariants,
    num_kv_steps: int,
    compact: bool = False,
    estimate_as: str | None = None,
    starts: tuple[int, ...] = (),
):
    refs = list(refs)
    schedule = [refs.pop(0) for _ in range(4)] if compact else None  # geometry.live_schedule's tables
    live_ref, _ = (refs.pop(0), refs.pop(0)) if variants.uses_tables else (None, None)
    q_ref, k_ref, v_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    q_seg_ref, kv_seg_ref = (refs.pop(0), refs.pop(0)) if variants.segments else (None, None)
    sink_ref = refs.pop(0) if variants.sinks else None
    if return_lse:
        o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
    else:
        (o_ref, m_ref, l_ref, acc_ref), lse_ref = refs, None
    block_q, head_dim = q_ref.shape
    v_head_dim = v_ref.shape[1]
    kv_step_len = k_ref.shape[0]
    num_sub_blocks = kv_step_len // block_k
    window = variants.window
    if compact:  # causal: grid step t is live pair t of the schedule (geometry.live_schedule), read from SMEM
        t = pl.program_id(2)
        q_block, kv_step, step_is_live = schedule[0][t], schedule[1][t], True
        is_first, is_last = schedule[2][t] != 0, schedule[3][t] != 0
        if estimate_as == "program_ids":  # estimate-only (see forward): the same pair, from t and constants
            q_block, kv_step, is_first, is_last = geometry.scheduled_pair(t, starts, pl.num_programs(2))
        elif estimate_as is not None:  # estimate-only: as often as the tables say, but on program ids
            is_first, is_last = t < len(starts), t >= pl.num_programs(2) - len(starts)
    else:
        q_block = pl.program_id(2)
        # With a window bounded on the left the key axis walks only the steps this query block needs, from its
        # first live step (geometry.compacts); past its last, the index map repeats the last (no copy) and nothing
        # computes.
        kv_step, step_is_live = geometry.visited_block(q_block, pl.program_id(3), outer_block=block_q,
                                                       inner_block=kv_step_len, num_inner=num_kv_steps, q_len=q_len,
                                                       kv_len=kv_len, causal=causal, window=window)
        is_first, is_last = pl.program_id(3) == 0, pl.program_id(3) == pl.num_programs(3) - 1
    if live_ref is not None:  # and the step's keys can meet this query block's segments (SegmentBlocks)
        row = (pl.program_id(0) * pl.num_programs(2) + q_block) * num_kv_steps
        step_is_live = step_is_live & (live_ref[row + jnp.minimum(kv_step, num_kv_steps - 1)] != 0)
    block_geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal,
                          window=window)
    # Rows that see no key at all (KernelVariants.has_blind_rows): their m stays MASK_VALUE and exp2(s - m)
    # would be 1 on masked keys, so their probabilities are masked a second time.
    has_blind_rows = variants.has_blind_rows(causal, q_len, kv_len)
    left, right = geometry.band(causal, window)

    @pl.when(is_first)
    def init():
        if sink_ref is None:
            m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)  # [block_q, 128]
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)  # [block_q, 128]
        else:  # the sink is a key of value 0 seen first: m = sink, l = exp2(sink - m) = 1
            m_ref[...] = sublanes_to(sink_ref[...], block_q)  # [block_q, 128]
            l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)  # [block_q, 128]
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)  # [block_q, v_head_dim]

    def body(sub_block: int, kv_block, masked: bool, row_chunk: int = 0, chunk_rows: int = block_q):
        """One online-softmax update: rows ``[row_chunk * chunk_rows, +chunk_rows)`` of the query block
        against key sub-block ``sub_block`` of this step (``kv_block`` in the whole sequence)."""
        rows = slice(row_chunk * chunk_rows, (row_chunk + 1) * chunk_rows)
        keys = slice(sub_block * block_k, (sub_block + 1) * block_k)
        q = q_ref[rows, :]  # [chunk_rows, head_dim]
        k = k_ref[keys, :]  # [block_k, head_dim]
        s = base2_scores(q, k, scale)  # [chunk_rows, block_k]   base 2
        if variants.softcap is not None:
            s, _ = soft_cap(s, variants.softcap)  # [chunk_rows, block_k]
        if masked:
            shape = (chunk_rows, block_k)
            row = lax.broadcasted_iota(jnp.int32, shape, 0)  # [chunk_rows, block_k]
            col = lax.broadcasted_iota(jnp.int32, shape, 1)  # [chunk_rows, block_k]
            key_offset = kv_block * block_k  # position of this sub-block's first key
            visible = col < kv_len - key_offset  # [chunk_rows, block_k]   padded keys are never seen
            # (backward_kernels._mask_scores is the same rule in absolute positions, which the backward prefers)
            # key j visible to query i within the band: relative to the tile's corner, col - row against a scalar
            query_offset = q_block * block_q + row_chunk * chunk_rows
            diagonal = query_offset - key_offset + (kv_len - q_len)  # col - row of the diagonal key
            if right is not None:
                visible &= col - row <= diagonal + right
            if left is not None:
                visible &= col - row >= diagonal - left
            if q_seg_ref is not None:  # packed sequences: the query's segment id against the key's
                q_ids = lanes_to(q_seg_ref[rows, :], block_k)  # [chunk_rows, block_k]
                kv_ids = sublanes_to(kv_seg_ref[:, keys], chunk_rows)  # [chunk_rows, block_k]
                visible &= q_ids == kv_ids
            s = jnp.where(visible, s, MASK_VALUE)  # [chunk_rows, block_k]

        m_prev, l_prev = m_ref[rows, :], l_ref[rows, :]  # [chunk_rows, 128]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [chunk_rows, 128]
        alpha = jnp.exp2(m_prev - m_next)  # [chunk_rows, 128]   rescales what was accumulated so far
        p = jnp.exp2(s - lanes_to(m_next, block_k))  # [chunk_rows, block_k]
        if masked and has_blind_rows:
            p = p * visible.astype(p.dtype)  # [chunk_rows, block_k]   (a select here crashes libtpu's profiler)
        m_ref[rows, :] = m_next
        l_ref[rows, :] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)  # [chunk_rows, 128]
        v = v_ref[keys, :]  # [block_k, v_head_dim]
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [chunk_rows, v_head_dim]
        acc_ref[rows, :] = acc_ref[rows, :] * lanes_to(alpha, v_head_dim) + pv  # [chunk_rows, v_head_dim]

    # A causal diagonal sub-block is split into square [block_k, block_k] row chunks when the query block is
    # taller: the chunks above the diagonal are skipped, those below it need no mask.
    split_rows = geometry.splits_rows(block_q, block_k, causal) and not variants.segments
    num_chunks = block_q // block_k if split_rows else 1
    for sub_block in range(num_sub_blocks):  # unrolled: each sub-block is skipped, masked or plain on its own
        kv_block = kv_step * num_sub_blocks + sub_block  # index of the [block_k] key block in the sequence
        if estimate_as in ("plain", "masked"):  # estimate-only: every sub-block of every live step, unguarded
            body(sub_block, kv_block, masked=estimate_as == "masked")
            continue
        if not variants.may_mask(causal, has_padding):  # no band, no padding: every step is live and plain
            body(sub_block, kv_block, masked=False)
            continue
        # three kinds of block: skipped, masked (band edge, padding or segments), plain
        block_visible = step_is_live & geometry.block_is_visible(q_block, kv_block, **block_geometry)
        if num_sub_blocks > 1 and has_padding:  # a sub-block of padding alone (the step was padded to whole copies)
            block_visible &= kv_block * block_k < kv_len
        needs_mask = True if variants.segments else geometry.block_needs_mask(q_block, kv_block, **block_geometry)
        update = functools.partial(body, sub_block, kv_block)
        if variants.segments:  # ids are data: every visited block builds the mask
            pl.when(block_visible)(functools.partial(update, True))
            continue
        pl.when(block_visible & ~needs_mask)(functools.partial(update, False))
        if not split_rows:
            pl.when(block_visible & needs_mask)(functools.partial(update, True))
            continue
        chunk_geometry = dict(block_geometry, block_q=block_k)
        for chunk in range(num_chunks):  # the same three kinds again, for each row chunk of a masked block
            chunk_block = q_block * num_chunks + chunk  # index of the [block_k] query chunk in the sequence
            chunk_visible = block_visible & needs_mask & geometry.block_is_visible(
                chunk_block, kv_block, **chunk_geometry)
            chunk_needs_mask = geometry.block_needs_mask(chunk_block, kv_block, **chunk_geometry)
            pl.when(chunk_visible & chunk_needs_mask)(functools.partial(update, True, chunk, block_k))
            pl.when(chunk_visible & ~chunk_needs_mask)(functools.partial(update, False, chunk, block_k))

    @pl.when(is_last)
    def finalize():
        l = l_ref[...]  # noqa: E741  [block_q, 128]
        l_safe = jnp.where(l == 0.0, 1.0, l)  # [block_q, 128]   a row that saw no key: acc = 0 -> out = 0
        o_ref[...] = (acc_ref[...] * lanes_to(1.0 / l_safe, v_head_dim)).astype(o_ref.dtype)  # [block_q, dv]
        if lse_ref is not None:  # in base 2, as the backward recomputes its scores: lse2 = m + log2(l)
            lse_ref[...] = m_ref[...] + jnp.log(l) * LOG2_E  # [block_q, 128]   log(0) = -inf: a row that saw no key


def flash_attention_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | pltpu.InterpretParams | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Flash attention forward as one Pallas TPU kernel; any ``q_len``/``kv_len``, head_dim, f32 or bf16.

    Args:
      q: ``[batch, heads, q_len, head_dim]``; k, v: ``[batch, heads, kv_len, head_dim]``, same dtype.
      causal: bottom-right aligned causal mask (query ``i`` sees keys ``j <= i + kv_len - q_len``).
      scale: softmax temperature, default ``1/sqrt(head_dim)``.
      block_sizes: tile sizes; None picks :meth:`BlockSizes.default` for the chip. Blocks longer than the
        (tile-rounded) sequences are clamped to them.
      interpret: None: compiled on a TPU, interpreted elsewhere (:func:`flashlib.env.interpret_default`);
        False forces the compiled path (to lower or compile for a TPU from any machine); True, or a
        ``pltpu.InterpretParams`` for TPU-semantics emulation (e.g. race detection), interprets.
      return_lse: also return the row log-sum-exp ``[batch, heads, q_len]`` f32 (``-inf`` for a row that
        sees no key), the residual the backward pass needs.

    Returns:
      ``out`` like ``q`` (and ``lse`` when asked).

    This is the forward kernel alone; :func:`flashlib.kernels.flash_attention` (``impl="pallas"``) joins it
    with the backward kernels so that ``jax.grad`` works.
    """
    _, sizes, scale, interpret = resolve_call(q, k, v, causal=causal, scale=scale, block_sizes=block_sizes,
                                              interpret=interpret)
    result = forward(q, k, v, causal=bool(causal), scale=scale, sizes=sizes, interpret=interpret,
                      return_lse=return_lse)
    return natural_lse(result) if return_lse else result


def natural_lse(result: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(out, lse2)`` from :func:`forward` as ``(out, lse)``: the base-2 log-sum-exp back in natural log."""
    out, lse2 = result
    return out, lse2 * LN_2

@functools.partial(jax.jit, static_argnames=("causal", "scale", "sizes", "interpret", "return_lse", "out_dtype",
                                             "variants", "compact", "estimate_as"))
def forward(q, k, v, segment_ids=None, sinks=None, *, causal: bool, scale: float, sizes: BlockSizes, interpret,
            return_lse: bool, out_dtype=None, variants: KernelVariants = PLAIN, compact: bool | None = None,
            estimate_as: str | None = None):
    """The forward kernel on resolved, static settings: ``out``, and with ``return_lse`` the row
    log-sum-exp of the base-2 scores, ``lse2 = lse * log2(e)`` ``[b, h, q_len]`` f32 — the residual the
    backward kernels take as it is (:func:`natural_lse` converts it for a caller). ``out_dtype`` (None: q's)
    f32 keeps the unrounded output for the backward's ``D = rowsum(dO * out)``. ``variants`` says which of
    ``segment_ids`` (a pair of int arrays) and ``sinks`` (``[heads]``) are given, and the window and soft-cap.

    ``compact``: walk only the live (query block, key step) pairs of a causal grid, from scalar-prefetched
    tables (None: where that drops a step; :func:`flashlib.geometry.compacted_schedule`). ``estimate_as``:
    estimate-only variants of the compacted kernel (:func:`flashlib.estimate.flashlib_forward` says which)."""
    out_dtype = q.dtype if out_dtype is None else out_dtype
    batch, heads, q_len, head_dim = q.shape
    v_head_dim = v.shape[3]
    kv_len, group = k.shape[2], heads // k.shape[1]  # query heads per kv head (GQA; 1 for MHA)
    block_q, block_k, kv_step = sizes.block_q, sizes.block_k, sizes.kv_step
    q_padded = pad_to_multiple(q, 2, block_q)  # [b, h, Tq, d]
    k_padded = pad_to_multiple(k, 2, kv_step)  # [b, h, Tk, d]
    v_padded = pad_to_multiple(v, 2, kv_step)  # [b, h, Tk, dv]
    num_q_blocks, num_kv_steps = q_padded.shape[2] // block_q, k_padded.shape[2] // kv_step
    live = dict(outer_block=block_q, inner_block=kv_step, num_inner=num_kv_steps, q_len=q_len, kv_len=kv_len,
                causal=causal, window=variants.window)
    # the key axis: the most steps any query block needs (all of them, unless a window bounds both sides)
    grid_kv_steps = geometry.live_steps(num_q_blocks, **live)

    # Causal compaction: the grid walks the live (q block, key step) pairs alone, tables scalar-prefetched;
    # None or geometry.live_schedule's (q_block, kv_step, first, last), each [num_live] int32
    schedule = geometry.compacted_schedule(compact, num_q_blocks, num_kv_steps, block_q=block_q, kv_step=kv_step,
                                           q_len=q_len, kv_len=kv_len, causal=causal, window=variants.window,
                                           segments=variants.segments)
    if estimate_as not in (None, "plain", "masked", "program_ids") or (estimate_as and schedule is None):
        raise ValueError(f"estimate_as must be None, 'program_ids', 'plain' or 'masked', and only compacted; got "
                         f"{estimate_as!r}")
    starts = () if schedule is None else tuple(np.flatnonzero(schedule[2]).tolist())  # each q block's first step

    prefetch = []  # segment ids: the block tables, scalar-prefetched into SMEM; every index map receives them
    if variants.segments:
        ids = segment_layouts(segment_ids, q_padded.shape[2], k_padded.shape[2])
    if variants.uses_tables:
        band = np.broadcast_to(geometry.block_is_visible(
            np.arange(num_q_blocks)[:, None], np.arange(num_kv_steps)[None, :], block_q=block_q, block_k=kv_step,
            q_len=q_len, kv_len=kv_len, causal=causal, window=variants.window), (num_q_blocks, num_kv_steps))
        blocks = segment_blocks(ids["q_columns"][:, :, 0], ids["kv_rows"][:, 0, :], outer_len=q_len, inner_len=kv_len,
                                outer_block=block_q, inner_block=kv_step, band_visible=band)
        prefetch = [blocks.live, blocks.fetch]
    if schedule is not None:  # 16 bytes of SMEM per live step
        prefetch = [jnp.asarray(table) for table in schedule]

    # An index map receives (b, h, *ids): ids is the grid position (i, j) then the tables, or compacted (t, *schedule)
    def q_block_of(ids):
        """The query block of grid position ``ids``: ``i``, or compacted the schedule's at live step ``t``."""
        if estimate_as == "program_ids":
            return geometry.scheduled_pair(ids[0], starts, schedule[0].size)[0]
        return ids[1][ids[0]] if schedule is not None else ids[0]

    def q_index_map(b, h, *ids):
        return b, h, q_block_of(ids), 0

    def kv_step_of(b, ids):
        """The key step grid step ``j`` of query block ``i`` reads (geometry.fetched_block, then with segment
        ids the block table's): past the last one it needs, the same index again, so no new HBM -> VMEM copy.
        Compacted, the schedule's key step at live step ``t``."""
        if estimate_as == "program_ids":
            return geometry.scheduled_pair(ids[0], starts, schedule[0].size)[1]
        if schedule is not None:
            return ids[2][ids[0]]
        i, j, *tables = ids
        step = geometry.fetched_block(i, j, **live)
        if tables:
            step = tables[1][(b * num_q_blocks + i) * num_kv_steps + step]
        return step

    def kv_index_map(b, h, *ids):
        return b, (h if group == 1 else lax.div(h, group)), kv_step_of(b, ids), 0  # GQA: the group's head

    def row_stat_index_map(b, h, *ids):
        return b, h, q_block_of(ids), 0

    squeezed = pl.squeezed
    q_spec = pl.BlockSpec((squeezed, squeezed, block_q, head_dim), q_index_map)
    k_spec = pl.BlockSpec((squeezed, squeezed, kv_step, head_dim), kv_index_map)
    v_spec = pl.BlockSpec((squeezed, squeezed, kv_step, v_head_dim), kv_index_map)
    in_specs, inputs = [q_spec, k_spec, v_spec], [q_padded, k_padded, v_padded]
    if variants.segments:
        in_specs += [pl.BlockSpec((squeezed, block_q, NUM_LANES), lambda b, h, *ids: (b, q_block_of(ids), 0)),
                     pl.BlockSpec((squeezed, NUM_SUBLANES, kv_step), lambda b, h, *ids: (b, 0, kv_step_of(b, ids)))]
        inputs += [ids["q_columns"], ids["kv_rows"]]
    if variants.sinks:
        in_specs.append(pl.BlockSpec((squeezed, NUM_SUBLANES, NUM_LANES), lambda b, h, *ids: (h, 0, 0)))
        inputs.append(sinks_tiles(sinks))
    out_shape = [jax.ShapeDtypeStruct((*q_padded.shape[:3], v_head_dim), out_dtype)]
    out_specs = [pl.BlockSpec((squeezed, squeezed, block_q, v_head_dim), q_index_map)]
    if return_lse:  # lane-replicated like m and l: a lane-dense [block_q, 128] store
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, q_padded.shape[2], NUM_LANES), jnp.float32))
        out_specs.append(pl.BlockSpec((squeezed, squeezed, block_q, NUM_LANES), row_stat_index_map))

    dims = (batch, heads, q_len, kv_len, head_dim, causal)
    kernel = functools.partial(
        _forward_kernel, causal=causal, scale=scale, block_k=block_k, q_len=q_len, kv_len=kv_len,
        has_padding=k_padded.shape[2] != kv_len, return_lse=return_lse, variants=variants,
        num_kv_steps=num_kv_steps, compact=schedule is not None, estimate_as=estimate_as, starts=starts,
    )
    grid = dict(
        # compacted: (b, h, num_live), the live pairs in the schedule's order; else (b, h, nq, key steps)
        grid=(batch, heads, schedule[0].size) if schedule is not None else (batch, heads, num_q_blocks, grid_kv_steps),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((block_q, NUM_LANES), jnp.float32),  # m: running max (base 2), lane-replicated
            pltpu.VMEM((block_q, NUM_LANES), jnp.float32),  # l: running sum, lane-replicated
            pltpu.VMEM((block_q, v_head_dim), jnp.float32),  # acc: unnormalised output
        ],
    )
    outputs = pl.pallas_call(
        kernel,
        **with_tables(grid, len(prefetch)),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=(
            ("parallel", "parallel", "arbitrary") if schedule is not None else
            ("parallel", "parallel", "parallel", "arbitrary"))),
        cost_estimate=pl.CostEstimate(  # the causal mask's count (cost.py); a window's skipped blocks are not counted
            flops=cost.attention_flops(*dims, block_sizes=sizes),
            transcendentals=cost.attention_transcendentals(*dims, block_sizes=sizes, with_lse=return_lse),
            bytes_accessed=cost.attention_bytes(*dims, q.dtype, block_sizes=sizes, with_lse=return_lse),
        ),
        interpret=interpret,
        name="flash_attention_forward" + ("_causal" if causal else ""),
    )(*prefetch, *inputs)
    out = outputs[0][:, :, :q_len]  # [b, h, q_len, dv]
    if not return_lse:
        return out
    return out, outputs[1][:, :, :q_len, 0]  # [b, h, q_len]
