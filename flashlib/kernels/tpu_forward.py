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

Causal attention skips the blocks above the diagonal twice over: ``body`` does not run (a ``pl.when`` on
the program ids, per sub-block) and the k/v index maps clamp to the last needed step, so the pipeline issues
no copy; the skipped grid steps themselves remain. Only sub-blocks that straddle the diagonal or hold padded
keys build an element mask, and when ``block_q > block_k`` a masked sub-block is split into row chunks of
``block_k`` rows, each again skipped, masked or plain (:mod:`flashlib.geometry` decides all of it).

The variants (:mod:`flashlib.kernels.variants`): a sliding window is a band like the causal one, with the same
three kinds of block; bounded on the left, the key axis of the grid walks only the steps a query block's
window reaches (``geometry.visited_block``, ``geometry.fetched_block``), so the grid stays the window's size
as the sequences grow. Soft-capping applies ``C tanh(s / C)`` to the base-2 scores; segment ids come in as
lane- and sublane-replicated id tiles and mask every visited block; a sink starts each row's running state
(``m = sink``, ``l = 1``); ``v`` may have its own head_dim, which the accumulator and output take.

Grouped-query attention: the heads axis of the grid walks groups of query heads (:func:`heads_per_step`: the
whole group when it fits VMEM), and a step runs the body once per head of its group against the one k/v copy
it made — so k and v cross HBM once per group rather than once per query head, and the grid has ``1/group``
of the steps. Each head keeps its own q, out, lse and running state (:class:`_HeadRefs`); the element mask is
built once per sub-block and shared.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib import cost, geometry
from flashlib.geometry import MASK_VALUE
from flashlib.kernels.block_sizes import BlockSizes, vmem_limit_bytes
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

__all__ = ["flash_attention_forward", "forward", "heads_per_step", "natural_lse"]

def _forward_kernel(
    *refs,  # (segment ids: the block tables live, fetch [b * nq * n_steps] int32 in SMEM, scalar-prefetched);
            # q [block_q, head_dim], k [block_k_major, head_dim], v [block_k_major, v_head_dim]; (segment ids
            # q [block_q, 128], kv [8, block_k_major] int32); (sink [8, 128] f32); outputs o [block_q, v_head_dim]
            # (, lse [block_q, 128] f32); scratch m, l [block_q, 128], acc [block_q, v_head_dim] for each head.
            # With `heads` > 1 (GQA): q, sink, o, lse are [heads, ...] blocks, or `heads` operands each
            # (`separate_heads`); m, l, acc are `heads` scratch buffers each.
    causal: bool,
    scale: float,
    block_k: int,
    q_len: int,
    kv_len: int,
    has_padding: bool,
    return_lse: bool,
    variants: KernelVariants,
    num_kv_steps: int,
    heads: int,
    separate_heads: bool,
):
    refs = list(refs)

    def take(count: int) -> list:
        taken = refs[:count]
        del refs[:count]
        return taken

    def each_head(present: bool = True) -> list:  # a ref per head: its own operand, or its slot of a [heads, ...] block
        if not present:
            return [None] * heads
        if separate_heads or heads == 1:
            return take(heads)
        (ref,) = take(1)
        return [_HeadSlot(ref, j) for j in range(heads)]

    live_ref, _ = take(2) if variants.uses_tables else (None, None)
    q_refs = each_head()
    k_ref, v_ref = take(2)
    q_seg_ref, kv_seg_ref = take(2) if variants.segments else (None, None)
    sink_refs, o_refs, lse_refs = each_head(variants.sinks), each_head(), each_head(return_lse)
    m_refs, l_refs, acc_refs = take(heads), take(heads), take(heads)
    # GQA: `heads` query heads of one group share this step's k/v block; each has its own q, out, lse and state.
    per_head = [_HeadRefs(*refs_of_head) for refs_of_head in
                zip(q_refs, o_refs, lse_refs, m_refs, l_refs, acc_refs, sink_refs, strict=True)]
    block_q = m_refs[0].shape[0]
    v_head_dim = v_ref.shape[1]
    kv_step_len = k_ref.shape[0]
    num_sub_blocks = kv_step_len // block_k
    window = variants.window
    q_block = pl.program_id(2)
    # With a window bounded on the left the key axis walks only the steps this query block needs, from its first
    # live step (geometry.compacts); past its last, the index map repeats the last (no copy) and nothing computes.
    kv_step, step_is_live = geometry.visited_block(q_block, pl.program_id(3), outer_block=block_q,
                                                   inner_block=kv_step_len, num_inner=num_kv_steps, q_len=q_len,
                                                   kv_len=kv_len, causal=causal, window=window)
    if live_ref is not None:  # and the step's keys can meet this query block's segments (SegmentBlocks)
        row = (pl.program_id(0) * pl.num_programs(2) + q_block) * num_kv_steps
        step_is_live = step_is_live & (live_ref[row + jnp.minimum(kv_step, num_kv_steps - 1)] != 0)
    block_geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal,
                          window=window)
    # Rows that see no key at all (KernelVariants.has_blind_rows): their m stays MASK_VALUE and exp2(s - m)
    # would be 1 on masked keys, so their probabilities are masked a second time.
    has_blind_rows = variants.has_blind_rows(causal, q_len, kv_len)
    left, right = geometry.band(causal, window)

    @pl.when(pl.program_id(3) == 0)
    def init():
        for head in per_head:
            if head.sink is None:
                head.m[...] = jnp.full(head.m.shape, MASK_VALUE, jnp.float32)  # [block_q, 128]
                head.l[...] = jnp.zeros(head.l.shape, jnp.float32)  # [block_q, 128]
            else:  # the sink is a key of value 0 seen first: m = sink, l = exp2(sink - m) = 1
                head.m[...] = sublanes_to(head.sink[...], block_q)  # [block_q, 128]
                head.l[...] = jnp.ones(head.l.shape, jnp.float32)  # [block_q, 128]
            head.acc[...] = jnp.zeros(head.acc.shape, jnp.float32)  # [block_q, v_head_dim]

    def body(sub_block: int, kv_block, masked: bool, row_chunk: int = 0, chunk_rows: int = block_q):
        """One online-softmax update: rows ``[row_chunk * chunk_rows, +chunk_rows)`` of the query block
        against key sub-block ``sub_block`` of this step (``kv_block`` in the whole sequence), for each head."""
        rows = slice(row_chunk * chunk_rows, (row_chunk + 1) * chunk_rows)
        keys = slice(sub_block * block_k, (sub_block + 1) * block_k)
        k = k_ref[keys, :]  # [block_k, head_dim]
        visible = None  # the element mask: built for the first head, the same for the others
        for head in per_head:
            visible = update(head, rows, keys, k, kv_block, masked, row_chunk, chunk_rows, visible)

    def update(head: _HeadRefs, rows: slice, keys: slice, k, kv_block, masked: bool, row_chunk: int,
               chunk_rows: int, visible):
        q = head.q[rows, :]  # [chunk_rows, head_dim]
        s = base2_scores(q, k, scale)  # [chunk_rows, block_k]   base 2
        if variants.softcap is not None:
            s, _ = soft_cap(s, variants.softcap)  # [chunk_rows, block_k]
        if masked and visible is None:
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
        if masked:
            s = jnp.where(visible, s, MASK_VALUE)  # [chunk_rows, block_k]

        m_prev, l_prev = head.m[rows, :], head.l[rows, :]  # [chunk_rows, 128]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [chunk_rows, 128]
        alpha = jnp.exp2(m_prev - m_next)  # [chunk_rows, 128]   rescales what was accumulated so far
        p = jnp.exp2(s - lanes_to(m_next, block_k))  # [chunk_rows, block_k]
        if masked and has_blind_rows:
            p = p * visible.astype(p.dtype)  # [chunk_rows, block_k]   (a select here crashes libtpu's profiler)
        head.m[rows, :] = m_next
        head.l[rows, :] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)  # [chunk_rows, 128]
        v = v_ref[keys, :]  # [block_k, v_head_dim]
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [chunk_rows, v_head_dim]
        head.acc[rows, :] = head.acc[rows, :] * lanes_to(alpha, v_head_dim) + pv  # [chunk_rows, v_head_dim]
        return visible

    # A causal diagonal sub-block is split into square [block_k, block_k] row chunks when the query block is
    # taller: the chunks above the diagonal are skipped, those below it need no mask.
    split_rows = geometry.splits_rows(block_q, block_k, causal) and not variants.segments
    num_chunks = block_q // block_k if split_rows else 1
    for sub_block in range(num_sub_blocks):  # unrolled: each sub-block is skipped, masked or plain on its own
        kv_block = kv_step * num_sub_blocks + sub_block  # index of the [block_k] key block in the sequence
        if not variants.may_mask(causal, has_padding):  # no band, no padding: every step is live and plain
            body(sub_block, kv_block, masked=False)
            continue
        # three kinds of block: skipped, masked (band edge, padding or segments), plain
        block_visible = step_is_live & geometry.block_is_visible(q_block, kv_block, **block_geometry)
        if num_sub_blocks > 1 and has_padding:  # a sub-block of padding alone (the step was padded to whole copies)
            block_visible &= kv_block * block_k < kv_len
        needs_mask = True if variants.segments else geometry.block_needs_mask(q_block, kv_block, **block_geometry)
        run = functools.partial(body, sub_block, kv_block)
        if variants.segments:  # ids are data: every visited block builds the mask
            pl.when(block_visible)(functools.partial(run, True))
            continue
        pl.when(block_visible & ~needs_mask)(functools.partial(run, False))
        if not split_rows:
            pl.when(block_visible & needs_mask)(functools.partial(run, True))
            continue
        chunk_geometry = dict(block_geometry, block_q=block_k)
        for chunk in range(num_chunks):  # the same three kinds again, for each row chunk of a masked block
            chunk_block = q_block * num_chunks + chunk  # index of the [block_k] query chunk in the sequence
            chunk_visible = block_visible & needs_mask & geometry.block_is_visible(
                chunk_block, kv_block, **chunk_geometry)
            chunk_needs_mask = geometry.block_needs_mask(chunk_block, kv_block, **chunk_geometry)
            pl.when(chunk_visible & chunk_needs_mask)(functools.partial(run, True, chunk, block_k))
            pl.when(chunk_visible & ~chunk_needs_mask)(functools.partial(run, False, chunk, block_k))

    @pl.when(pl.program_id(3) == pl.num_programs(3) - 1)
    def finalize():
        for head in per_head:
            l = head.l[...]  # noqa: E741  [block_q, 128]
            l_safe = jnp.where(l == 0.0, 1.0, l)  # [block_q, 128]   a row that saw no key: acc = 0 -> out = 0
            head.o[...] = (head.acc[...] * lanes_to(1.0 / l_safe, v_head_dim)).astype(head.o.dtype)  # [block_q, dv]
            if head.lse is not None:  # in base 2, as the backward recomputes its scores: lse2 = m + log2(l)
                head.lse[...] = head.m[...] + jnp.log(l) * LOG2_E  # [block_q, 128]   log(0) = -inf: a blind row


class _HeadSlot:
    """Head ``j`` of a ``[heads, ...]`` ref, indexed like a ref of its own: ``slot[rows, :]`` is ``ref[j, rows, :]``."""

    def __init__(self, ref, j: int):
        self.ref, self.j = ref, j
        self.shape, self.dtype = ref.shape[1:], ref.dtype

    def _index(self, index):
        return (self.j, *(index if isinstance(index, tuple) else (index,)))

    def __getitem__(self, index):
        return self.ref[self._index(index)]

    def __setitem__(self, index, value):
        self.ref[self._index(index)] = value


class _HeadRefs(NamedTuple):
    """One query head's refs in a grid step (GQA packs several): q ``[block_q, head_dim]``, out ``[block_q,
    v_head_dim]``, lse ``[block_q, 128]`` (or None), the scratch m, l ``[block_q, 128]`` and acc ``[block_q,
    v_head_dim]``, and its sink tile ``[8, 128]`` (or None)."""

    q: Any
    o: Any
    lse: Any
    m: Any
    l: Any  # noqa: E741
    acc: Any
    sink: Any


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

def heads_per_step(group: int, sizes: BlockSizes, head_dim: int, dtype) -> int:
    """How many query heads of a GQA group one grid step of the forward computes against its k/v block: the
    largest divisor of ``group`` (query heads per kv head; 1 for MHA) whose q, out, lse and scratch fit the
    VMEM budget beside the step's k/v (:meth:`BlockSizes.vmem_bytes`). All ``group`` heads, when they fit: k
    and v then cross HBM once per group instead of once per query head (``1/group`` of MHA's reads)."""
    limit = vmem_limit_bytes(sizes.generation)
    fitting = [p for p in range(group, 0, -1) if group % p == 0
               and sizes.vmem_bytes(head_dim, dtype, heads_per_step=p) <= limit]
    return fitting[0] if fitting else 1


@functools.partial(jax.jit, static_argnames=("causal", "scale", "sizes", "interpret", "return_lse", "out_dtype",
                                             "variants", "separate_heads"))
def forward(q, k, v, segment_ids=None, sinks=None, *, causal: bool, scale: float, sizes: BlockSizes, interpret,
            return_lse: bool, out_dtype=None, variants: KernelVariants = PLAIN, separate_heads: bool = False):
    """The forward kernel on resolved, static settings: ``out``, and with ``return_lse`` the row
    log-sum-exp of the base-2 scores, ``lse2 = lse * log2(e)`` ``[b, h, q_len]`` f32 — the residual the
    backward kernels take as it is (:func:`natural_lse` converts it for a caller). ``out_dtype`` (None: q's)
    f32 keeps the unrounded output for the backward's ``D = rowsum(dO * out)``. ``variants`` says which of
    ``segment_ids`` (a pair of int arrays) and ``sinks`` (``[heads]``) are given, and the window and soft-cap.

    GQA: a grid step computes :func:`heads_per_step` query heads of a group against one k/v copy. Their q, out
    and lse travel as one ``[heads, block_q, ...]`` block; ``separate_heads`` passes them as one 2-D block per
    head instead (the same copies and compute, plus a stack of the outputs afterwards): libtpu's static
    profiler reports 0 cycles for any kernel whose blocks have a third non-squeezed dimension, so estimates
    measure this layout (:func:`flashlib.estimate.flashlib_forward`)."""
    out_dtype = q.dtype if out_dtype is None else out_dtype
    batch, heads, q_len, head_dim = q.shape
    v_head_dim = v.shape[3]
    kv_len, group = k.shape[2], heads // k.shape[1]  # query heads per kv head (GQA; 1 for MHA)
    block_q, block_k, kv_step = sizes.block_q, sizes.block_k, sizes.kv_step
    pack = heads_per_step(group, sizes, max(head_dim, v_head_dim), q.dtype)  # q heads sharing a k/v copy
    q_padded = pad_to_multiple(q, 2, block_q)  # [b, h, Tq, d]
    k_padded = pad_to_multiple(k, 2, kv_step)  # [b, h, Tk, d]
    v_padded = pad_to_multiple(v, 2, kv_step)  # [b, h, Tk, dv]
    num_q_blocks, num_kv_steps = q_padded.shape[2] // block_q, k_padded.shape[2] // kv_step
    live = dict(outer_block=block_q, inner_block=kv_step, num_inner=num_kv_steps, q_len=q_len, kv_len=kv_len,
                causal=causal, window=variants.window)
    # the key axis: the most steps any query block needs (all of them, unless a window bounds both sides)
    grid_kv_steps = geometry.live_steps(num_q_blocks, **live)

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

    def q_index_map(b, h, i, j, *tables):
        return b, h, i, 0

    def kv_step_of(b, i, j, tables):
        """The key step grid step ``j`` of query block ``i`` reads (geometry.fetched_block, then with segment
        ids the block table's): past the last one it needs, the same index again, so no new HBM -> VMEM copy."""
        step = geometry.fetched_block(i, j, **live)
        if tables:
            step = tables[1][(b * num_q_blocks + i) * num_kv_steps + step]
        return step

    def kv_index_map(b, h, i, j, *tables):  # h: the step's first query head is h * pack; GQA: its group's kv head
        return b, (h if group == pack else lax.div(h, group // pack)), kv_step_of(b, i, j, tables), 0

    def row_stat_index_map(b, h, i, j, *tables):
        return b, h, i, 0

    squeezed = pl.squeezed
    # The step's query heads: one [pack, ...] block per operand, or (separate_heads) `pack` operands of one head each.
    heads_block = pack if pack > 1 and not separate_heads else squeezed
    operands = pack if separate_heads else 1

    def of_head(index_map, nth: int):  # separate_heads: operand `nth` holds query head h * pack + nth
        if not separate_heads:
            return index_map
        return lambda b, h, *rest: (lambda index: (index[0], h * pack + nth, *index[2:]))(index_map(b, h, *rest))

    k_spec = pl.BlockSpec((squeezed, squeezed, kv_step, head_dim), kv_index_map)
    v_spec = pl.BlockSpec((squeezed, squeezed, kv_step, v_head_dim), kv_index_map)
    in_specs = [pl.BlockSpec((squeezed, heads_block, block_q, head_dim), of_head(q_index_map, n))
                for n in range(operands)] + [k_spec, v_spec]
    inputs = [q_padded] * operands + [k_padded, v_padded]
    if variants.segments:
        in_specs += [pl.BlockSpec((squeezed, block_q, NUM_LANES), lambda b, h, i, j, *t: (b, i, 0)),
                     pl.BlockSpec((squeezed, NUM_SUBLANES, kv_step),
                                  lambda b, h, i, j, *t: (b, 0, kv_step_of(b, i, j, t)))]
        inputs += [ids["q_columns"], ids["kv_rows"]]
    if variants.sinks:
        in_specs += [pl.BlockSpec((heads_block, NUM_SUBLANES, NUM_LANES),
                                  (lambda b, h, i, j, *t, n=n: (h * pack + n, 0, 0)) if separate_heads
                                  else (lambda b, h, i, j, *t: (h, 0, 0))) for n in range(operands)]
        inputs += [sinks_tiles(sinks)] * operands
    out_heads = heads // operands  # separate_heads: each output holds one head of every step
    out_shape = [jax.ShapeDtypeStruct((batch, out_heads, q_padded.shape[2], v_head_dim), out_dtype)] * operands
    out_specs = [pl.BlockSpec((squeezed, heads_block, block_q, v_head_dim), q_index_map)] * operands
    if return_lse:  # lane-replicated like m and l: a lane-dense [block_q, 128] store
        out_shape += [jax.ShapeDtypeStruct((batch, out_heads, q_padded.shape[2], NUM_LANES), jnp.float32)] * operands
        out_specs += [pl.BlockSpec((squeezed, heads_block, block_q, NUM_LANES), row_stat_index_map)] * operands

    dims = (batch, heads, q_len, kv_len, head_dim, causal)
    kernel = functools.partial(
        _forward_kernel, causal=causal, scale=scale, block_k=block_k, q_len=q_len, kv_len=kv_len,
        has_padding=k_padded.shape[2] != kv_len, return_lse=return_lse, variants=variants,
        num_kv_steps=num_kv_steps, heads=pack, separate_heads=separate_heads,
    )
    grid = dict(
        grid=(batch, heads // pack, num_q_blocks, grid_kv_steps),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=(  # one of each per query head of the step
            [pltpu.VMEM((block_q, NUM_LANES), jnp.float32)] * pack  # m: running max (base 2), lane-replicated
            + [pltpu.VMEM((block_q, NUM_LANES), jnp.float32)] * pack  # l: running sum, lane-replicated
            + [pltpu.VMEM((block_q, v_head_dim), jnp.float32)] * pack  # acc: unnormalised output
        ),
    )
    outputs = pl.pallas_call(
        kernel,
        **with_tables(grid, len(prefetch)),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(  # the band's blocks and copies (cost.py); with segment ids, the band's (a bound)
            flops=cost.attention_flops(*dims, block_sizes=sizes, window=variants.window, segments=variants.segments),
            transcendentals=cost.attention_transcendentals(*dims, block_sizes=sizes, with_lse=return_lse,
                                                           window=variants.window, segments=variants.segments),
            bytes_accessed=cost.attention_bytes(*dims, q.dtype, block_sizes=sizes, with_lse=return_lse,
                                                window=variants.window, heads_per_step=pack),
        ),
        interpret=interpret,
        name="flash_attention_forward" + ("_causal" if causal else ""),
    )(*prefetch, *inputs)
    if separate_heads:  # [b, h / pack, T, x] per head of a step -> [b, h, T, x]: head h * pack + n is output n's
        outputs = [jnp.stack(outputs[n:n + operands], axis=2).reshape(batch, heads, *outputs[n].shape[2:])
                   for n in range(0, len(outputs), operands)]
    out = outputs[0][:, :, :q_len]  # [b, h, q_len, dv]
    if not return_lse:
        return out
    return out, outputs[1][:, :, :q_len, 0]  # [b, h, q_len]
