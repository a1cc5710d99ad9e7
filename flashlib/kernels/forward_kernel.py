"""The Pallas TPU flash-attention forward kernel's body (stage 5 of the series): one grid step of
:func:`flashlib.kernels.tpu_forward.forward`, which builds the grid, the BlockSpecs and the tables around it.

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

Grouped-query attention: the heads axis of the grid walks groups of query heads (the whole group when it fits
VMEM: :func:`~flashlib.kernels.tpu_forward.heads_per_step`), and a step runs the body once per head of its
group against the one k/v copy it made — so k and v cross HBM once per group rather than once per query head,
and the grid has ``1/group`` of the steps. Each head keeps its own q, out, lse and running state
(:class:`HeadRefs`); the element mask is built once per sub-block and shared.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flashlib import geometry
from flashlib.geometry import MASK_VALUE
from flashlib.kernels.scores import LOG2_E, base2_scores, lanes_to, sublanes_to
from flashlib.kernels.variants import KernelVariants, soft_cap

__all__ = ["HeadRefs", "HeadSlot", "forward_kernel"]


def forward_kernel(
    *refs,  # (compacted: the schedule q_block, kv_step, first, last [num_live] int32 in SMEM, scalar-prefetched);
            # (segment ids: the block tables live, fetch [b * nq * n_steps] int32 in SMEM, scalar-prefetched);
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
    compact: bool = False,
    estimate_as: str | None = None,
    starts: tuple[int, ...] = (),
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
        return [HeadSlot(ref, j) for j in range(heads)]

    schedule = take(4) if compact else None  # geometry.live_schedule's tables
    live_ref, _ = take(2) if variants.uses_tables else (None, None)
    q_refs = each_head()
    k_ref, v_ref = take(2)
    q_seg_ref, kv_seg_ref = take(2) if variants.segments else (None, None)
    sink_refs, o_refs, lse_refs = each_head(variants.sinks), each_head(), each_head(return_lse)
    m_refs, l_refs, acc_refs = take(heads), take(heads), take(heads)
    # GQA: `heads` query heads of one group share this step's k/v block; each has its own q, out, lse and state.
    per_head = [HeadRefs(*refs_of_head) for refs_of_head in
                zip(q_refs, o_refs, lse_refs, m_refs, l_refs, acc_refs, sink_refs, strict=True)]
    block_q = m_refs[0].shape[0]
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

    def update(head: HeadRefs, rows: slice, keys: slice, k, kv_block, masked: bool, row_chunk: int,
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

    @pl.when(is_last)
    def finalize():
        for head in per_head:
            l = head.l[...]  # noqa: E741  [block_q, 128]
            l_safe = jnp.where(l == 0.0, 1.0, l)  # [block_q, 128]   a row that saw no key: acc = 0 -> out = 0
            head.o[...] = (head.acc[...] * lanes_to(1.0 / l_safe, v_head_dim)).astype(head.o.dtype)  # [block_q, dv]
            if head.lse is not None:  # in base 2, as the backward recomputes its scores: lse2 = m + log2(l)
                head.lse[...] = head.m[...] + jnp.log(l) * LOG2_E  # [block_q, 128]   log(0) = -inf: a blind row


class HeadSlot:
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


class HeadRefs(NamedTuple):
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
