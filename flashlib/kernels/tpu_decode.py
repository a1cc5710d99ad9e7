"""The Pallas TPU decode kernels (issue 17): a few new queries against a long KV cache, contiguous or paged,
split along the keys (flash-decoding). The contract — shapes, positions, what a blind row returns — is
:mod:`flashlib.decode`'s; :func:`flashlib.kernels.decode_attention` is the entry point that picks the kernel.

One kernel body serves both cache layouts. The grid is ``(batch, kv_heads, num_splits, steps_per_split)``:

* the query tile is one kv head's whole GQA group: its ``group`` query heads times ``q_len`` new tokens
  packed as rows (row ``r = g * q_len + i``; not padded, see :func:`_pack`), so the MXU sees a ``[rows, block_k]``
  score tile rather than one row per head — K and V are read once per kv head, never per query head;
* step ``j`` of split ``s`` takes ``slots`` key blocks from block ``(s * steps_per_split + j) * slots`` on; a
  contiguous cache copies one ``[block_k, head_dim]`` slab of ``[batch, kv_heads, max_len, head_dim]`` per step
  (``slots = 1``), a paged one ``pages_per_step`` pages ``block_table[b, p]`` of the pool ``[num_pages, kv_heads,
  page_size, head_dim]`` (``block_k = page_size``), each page its own operand — the same pool passed
  ``pages_per_step`` times, each with its own index map — so that Pallas pipelines all of them and a step's
  fixed cost is shared (pages are not contiguous, so one BlockSpec cannot gather them);
* ``lengths`` (and the flattened block table) reach the index maps and the body by scalar prefetch (SMEM):
  an index map clamps a block past the sequence's length to the last live block (each slot to its own,
  :func:`_slot_block`) — the same block index as the step before, so the pipeline issues no copy — and the
  body skips it (``pl.when``);
* only a block that reaches the new tokens' diagonal is masked: query ``i`` sees key ``j`` when ``j <=
  length - q_len + i`` (bottom-right causal); in that block values past the length are zeroed, so stale
  cache contents (even NaN) never reach a row through ``0 * v``;
* the variants decoding models use: a soft-cap on the base-2 scores (:func:`flashlib.kernels.variants.soft_cap`)
  and a sliding window's left edge — blocks wholly before the first new token's window are neither copied
  (each slot's index map raises them to its first live block) nor computed, and the block the window starts
  in is masked, its values before the window zeroed like those past the length;
* each split ends with its partial state ``(m, l, acc)`` — ``m`` in base 2, ``m`` and ``l`` lane-replicated
  ``[rows, 128]`` as in :mod:`flashlib.kernels.tpu_forward` — and :func:`merge_splits` merges them with
  notebook 03's identity (:func:`flashlib.reference.merge_states`) in plain JAX; with one split the kernel
  normalises in place and writes the output itself.

``static_length`` (for libtpu's static estimate only): libtpu credits code under a ``pl.when`` that reads
SMEM as never run, so a kernel whose guards read ``lengths`` looks free. With ``static_length=n`` every
length is taken to be the Python int ``n``: the guards and clamps read program ids only and are credited
step by step; the result is right only when every ``lengths[b] == n``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib.geometry import MASK_VALUE
from flashlib.kernels.scores import LN_2, base2_scores, lanes_to
from flashlib.kernels.variants import soft_cap
from flashlib.reference import SoftmaxState, merge_states, state_output
from flashlib.tiling import NUM_LANES

__all__ = ["decode_contiguous", "decode_paged", "merge_splits", "query_rows"]


def query_rows(q_len: int, group: int, rows: int) -> jax.Array:
    """``[rows, 1]`` int32: the new-token index ``i`` of each packed row ``r = g * q_len + i``. Built from
    compares, not a vector division, which Mosaic may not lower."""
    r = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    i = r
    for g in range(1, group):
        i = i - q_len * (r >= g * q_len).astype(jnp.int32)
    return i


def _decode_kernel(
    *refs,  # prefetch: lengths [batch] (, block table [batch * pages_per_seq]); q [rows, d]; slots x k [block_k, d];
    # slots x v [block_k, dv]; outputs o [rows, dv] (normalize) or m, l [rows, 128], acc [rows, dv]; scratch m, l, acc
    num_prefetch: int,
    slots: int,
    block_k: int,
    steps_per_split: int,
    q_len: int,
    group: int,
    scale: float,
    static_length: int | None,
    normalize: bool,
    softcap: float | None = None,
    left: int | None = None,
):
    lengths_ref = refs[0]
    q_ref, *rest = refs[num_prefetch:]
    k_refs, v_refs = rest[:slots], rest[slots:2 * slots]
    m_ref, l_ref, acc_ref = rest[-3:]
    outputs = rest[2 * slots:-3]
    rows, value_dim = acc_ref.shape
    b, split, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    length = static_length if static_length is not None else lengths_ref[b]
    first_block = (split * steps_per_split + step) * slots  # this step's first key block in the sequence

    @pl.when(step == 0)
    def init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)  # [rows, 128]
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)  # [rows, 128]
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)  # [rows, dv]

    def update(first: int, count: int, masked: bool):
        """One online-softmax update with key blocks ``first .. first + count - 1`` of this step, as one block of
        ``count * block_k`` keys: scores per block (one matmul each) side by side, one softmax update, then
        ``p @ v`` per block summed."""
        start = (first_block + first) * block_k  # position of the first key
        width = count * block_k
        q = q_ref[...]  # [rows, d]
        scores = [base2_scores(q, k_refs[first + i][...], scale) for i in range(count)]  # count x [rows, block_k]
        s = jnp.concatenate(scores, axis=1) if count > 1 else scores[0]  # [rows, width]   base 2
        if softcap is not None:
            s, _ = soft_cap(s, softcap)  # [rows, width]
        values = [v_refs[first + i][...] for i in range(count)]  # count x [block_k, dv]
        if masked:
            col = lax.broadcasted_iota(jnp.int32, (rows, width), 1)  # [rows, width]
            position = length - q_len + (query_rows(q_len, group, rows) if q_len > 1 else 0)  # [rows, 1] or scalar
            visible = (col <= position - start) & (col < length - start)  # [rows, width]
            if left is not None:  # a sliding window: only the last left + 1 keys up to the query's own
                visible &= col >= position - left - start
            s = jnp.where(visible, s, MASK_VALUE)  # [rows, width]
            key = lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)  # [block_k, 1]
            # stale cache rows (past the length, or a dead block's repeated copy) never reach acc through 0 * v,
            # nor (a window) the rows before the first new token's window
            lowest = 0 if left is None else length - q_len - left  # the first key any row may see
            values = [jnp.where((key < length - start - i * block_k) & (key >= lowest - start - i * block_k), v,
                                jnp.zeros_like(v)) for i, v in enumerate(values)]
        m_prev, l_prev = m_ref[...], l_ref[...]  # [rows, 128]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [rows, 128]
        alpha = jnp.exp2(m_prev - m_next)  # [rows, 128]
        p = jnp.exp2(s - lanes_to(m_next, width))  # [rows, width]
        if masked:  # a row that sees no key keeps m = MASK_VALUE, where exp2(s - m) = 1 on masked keys
            p = p * visible.astype(p.dtype)  # [rows, width]   (multiplied, not selected, as in the forward)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)  # [rows, 128]
        pv = sum(jnp.dot(p[:, i * block_k:(i + 1) * block_k].astype(v.dtype), v, preferred_element_type=jnp.float32)
                 for i, v in enumerate(values))  # [rows, dv]
        acc_ref[...] = acc_ref[...] * lanes_to(alpha, value_dim) + pv  # [rows, dv]

    # Blocks of a multiple of 128 keys are updated together (their scores join along lanes); narrower ones (a
    # page of 16 keys) one at a time, each skipped, masked or plain on its own.
    groups = [(0, slots)] if block_k % NUM_LANES == 0 else [(i, 1) for i in range(slots)]
    for first, count in groups:
        start = (first_block + first) * block_k  # position of the first key
        live = start < length  # blocks past the sequence are neither copied (index map) nor computed
        plain = start + count * block_k <= length - q_len + 1  # every key visible to every row
        if left is not None:  # and blocks before the window of the first new token (the index maps clamp too)
            live &= start + count * block_k - 1 >= length - q_len - left
            plain &= start >= length - 1 - left
        pl.when(live & plain)(functools.partial(update, first, count, False))
        pl.when(live & jnp.logical_not(plain))(functools.partial(update, first, count, True))

    @pl.when(step == pl.num_programs(3) - 1)
    def finalize():
        if normalize:  # one split: the output itself
            (o_ref,) = outputs
            l = l_ref[...]  # noqa: E741  [rows, 128]
            l_safe = jnp.where(l == 0.0, 1.0, l)  # a row that saw no key: acc = 0 -> out = 0
            o_ref[...] = (acc_ref[...] * lanes_to(1.0 / l_safe, value_dim)).astype(o_ref.dtype)  # [rows, dv]
        else:  # this split's partial state, merged by merge_splits
            m_out, l_out, acc_out = outputs
            m_out[...] = m_ref[...]
            l_out[...] = l_ref[...]
            acc_out[...] = acc_ref[...]


def merge_splits(m: jax.Array, l: jax.Array, acc: jax.Array) -> jax.Array:  # noqa: E741
    """The output from the splits' partial states ``m`` (base 2), ``l`` ``[..., splits, rows, 128]`` and ``acc
    [..., splits, rows, dv]``: merged pairwise as a balanced tree by :func:`flashlib.reference.merge_states`
    (its ``m`` is natural-log: base 2 times ln 2), then normalised (a row no split saw gives zeros)."""
    level = [SoftmaxState(m[..., s, :, 0] * LN_2, l[..., s, :, 0], acc[..., s, :, :]) for s in range(m.shape[-3])]
    while len(level) > 1:
        merged = [merge_states(a, b) for a, b in zip(level[::2], level[1::2], strict=False)]
        level = merged + ([level[-1]] if len(level) % 2 else [])
    return state_output(level[0])


def _pack(q: jax.Array, kv_heads: int) -> jax.Array:
    """``[b, heads, q_len, d]`` -> ``[b, kv_heads, group * q_len, d]``: a group's heads and new tokens as rows.

    The rows are not padded to whole sublanes: a block that spans the whole rows axis is legal at any size
    (Mosaic pads the tile in VMEM), and a ``jnp.pad`` here — an HBM copy of q for nothing — made libtpu
    0.0.50's static profiler crash on the bf16 kernel ("Cannot schedule FIFO pop instruction when the FIFO
    is empty") while 16 unpadded rows profile fine."""
    batch, heads, q_len, d = q.shape
    return q.reshape(batch, kv_heads, heads // kv_heads * q_len, d)


def _unpack(out: jax.Array, heads: int, q_len: int) -> jax.Array:
    batch, kv_heads, _, dv = out.shape
    return out.reshape(batch, heads, q_len, dv)


def _last_live_block(length, block_k: int, num_blocks: int):
    """The index of the block holding key ``length - 1`` (0 for an empty sequence), at most ``num_blocks - 1``."""
    if isinstance(length, int):
        return min(max(-(-length // block_k) - 1, 0), num_blocks - 1)
    return jnp.minimum(jnp.maximum(lax.div(length + block_k - 1, block_k) - 1, 0), num_blocks - 1)


def _first_live_block(length, q_len: int, left: int | None, block_k: int):
    """The first block a window lets any new token see (0 without a window): the first token, at position
    ``length - q_len``, sees keys from ``length - q_len - left`` on."""
    if left is None:
        return 0
    if isinstance(length, int):
        return max(length - q_len - left, 0) // block_k
    return lax.div(jnp.maximum(length - q_len - left, 0), block_k)


def _slot_block(block, last, slot: int, slots: int, first=0):
    """The key block slot ``slot`` copies when the step asks for ``block``: ``block`` while it is live, then the
    slot's own last live block (``last - (last - slot) % slots``), so a dead step repeats each slot's previous
    index and the pipeline copies nothing; ``last`` itself when the sequence ends before the slot's first block.
    With a window, a block before ``first`` (the first live one) is raised to the slot's first block from
    ``first`` on, so the dead steps before the window repeat one index too."""
    if isinstance(first, int):
        own_first = first + (slot - first) % slots
    else:  # lax.rem keeps the dividend's sign: shift it to [0, slots)
        own_first = first + lax.rem(lax.rem(slot - first, slots) + slots, slots)
    if isinstance(last, int):
        own_last = last - (last - slot) % slots if last >= slot else last
    else:
        own_last = jnp.where(last >= slot, last - lax.rem(jnp.maximum(last - slot, 0), slots), last)
    return jnp.minimum(jnp.maximum(block, own_first), own_last)


def _call(prefetch, q, k, v, kv_index_map, *, block_k: int, num_blocks: int, slots: int, num_splits: int,
          q_len: int, heads: int, scale: float, interpret, static_length: int | None, name: str,
          softcap: float | None = None, left: int | None = None):
    """The pallas_call both layouts share: ``q [b, kv_heads, rows, d]`` packed; ``k``/``v`` the cache arrays, each
    passed ``slots`` times (one operand per key block of a grid step: Pallas pipelines every one of them), read
    through ``kv_index_map(b, h, block, *prefetch_refs)`` (``block`` already clamped to the live blocks)."""
    batch, kv_heads, rows, d = q.shape
    value_dim = v.shape[-1]
    num_steps = -(-num_blocks // slots)
    steps_per_split = -(-num_steps // num_splits)
    normalize = num_splits == 1

    def length_of(b, prefetch_refs):
        return static_length if static_length is not None else prefetch_refs[0][b]

    def slot_map(slot):
        def kv_map(b, h, s, j, *prefetch_refs):
            length = length_of(b, prefetch_refs)
            last = _last_live_block(length, block_k, num_blocks)
            first = _first_live_block(length, q_len, left, block_k)
            block = _slot_block((s * steps_per_split + j) * slots + slot, last, slot, slots, first)
            return kv_index_map(b, h, block, *prefetch_refs)
        return kv_map

    def q_map(b, h, s, j, *_):
        return b, h, 0, 0

    def split_map(b, h, s, j, *_):
        return b, h, s, 0, 0

    sq = pl.squeezed
    k_specs = [pl.BlockSpec((sq, sq, block_k, d), slot_map(i)) for i in range(slots)]
    v_specs = [pl.BlockSpec((sq, sq, block_k, value_dim), slot_map(i)) for i in range(slots)]
    if normalize:
        out_shape = [jax.ShapeDtypeStruct((batch, kv_heads, rows, value_dim), q.dtype)]
        out_specs = [pl.BlockSpec((sq, sq, rows, value_dim), q_map)]
    else:
        out_shape = [jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, width), jnp.float32)
                     for width in (NUM_LANES, NUM_LANES, value_dim)]
        out_specs = [pl.BlockSpec((sq, sq, sq, rows, width), split_map) for width in (NUM_LANES, NUM_LANES, value_dim)]
    kernel = functools.partial(
        _decode_kernel, num_prefetch=len(prefetch), slots=slots, block_k=block_k, steps_per_split=steps_per_split,
        q_len=q_len, group=heads // kv_heads, scale=scale, static_length=static_length, normalize=normalize,
        softcap=softcap, left=left)
    live_keys = batch * kv_heads * num_blocks * block_k  # an upper bound: every block of every sequence
    itemsize = jnp.dtype(k.dtype).itemsize
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(batch, kv_heads, num_splits, steps_per_split),
        in_specs=[pl.BlockSpec((sq, sq, rows, d), q_map), *k_specs, *v_specs],
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((rows, NUM_LANES), jnp.float32),  # m: running max (base 2), lane-replicated
            pltpu.VMEM((rows, NUM_LANES), jnp.float32),  # l: running sum, lane-replicated
            pltpu.VMEM((rows, value_dim), jnp.float32),  # acc: unnormalised output
        ],
    )
    outputs = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=2 * rows * live_keys * (d + value_dim),
            transcendentals=rows * live_keys,
            bytes_accessed=live_keys * (d + value_dim) * itemsize + 2 * q.size * q.dtype.itemsize,
        ),
        interpret=interpret,
        name=name,
    )(*prefetch, q, *[k] * slots, *[v] * slots)
    out = outputs[0] if normalize else merge_splits(*outputs).astype(q.dtype)  # [b, kv_heads, rows, dv]
    return _unpack(out, heads, q_len)


@functools.partial(jax.jit, static_argnames=("block_k", "num_splits", "scale", "interpret", "static_length",
                                             "softcap", "left"))
def decode_contiguous(q, k, v, lengths, *, block_k: int, num_splits: int, scale: float, interpret,
                      static_length: int | None = None, softcap: float | None = None, left: int | None = None):
    """Decode over a contiguous cache ``k [b, kv_heads, max_len, d]`` (``max_len`` a multiple of ``block_k``),
    ``v [..., dv]``, ``lengths [b]``; settings already checked (:func:`flashlib.kernels.decode_attention`)."""
    batch, heads, q_len, _ = q.shape
    kv_heads, max_len = k.shape[1], k.shape[2]

    def kv_index_map(b, h, block, *_):
        return b, h, block, 0

    return _call((lengths.astype(jnp.int32),), _pack(q, kv_heads), k, v, kv_index_map, block_k=block_k,
                 num_blocks=max_len // block_k, slots=1, num_splits=num_splits, q_len=q_len, heads=heads, scale=scale,
                 interpret=interpret, static_length=static_length, name="flash_decode", softcap=softcap, left=left)


@functools.partial(jax.jit, static_argnames=("num_splits", "pages_per_step", "scale", "interpret", "static_length",
                                             "softcap", "left"))
def decode_paged(q, k_pages, v_pages, block_table, lengths, *, num_splits: int, scale: float, interpret,
                 pages_per_step: int = 1, static_length: int | None = None, softcap: float | None = None,
                 left: int | None = None):
    """Decode over a paged cache: pool ``k_pages [num_pages, kv_heads, page_size, d]``, ``v_pages``, ``block_table
    [b, pages_per_seq]``, ``lengths [b]``; ``pages_per_step`` pages per grid step, each its own pipelined operand
    found through the table (scalar prefetch), so a step's fixed cost is paid once for all of them."""
    batch, heads, q_len, _ = q.shape
    num_pages, kv_heads, page_size, _ = k_pages.shape
    pages_per_seq = block_table.shape[1]

    def page_index_map(b, h, block, lengths_ref, table_ref):
        page = table_ref[b * pages_per_seq + block]  # the table, flattened: SMEM pads a 2-D array's rows
        return jnp.minimum(jnp.maximum(page, 0), num_pages - 1), h, 0, 0  # a bad entry is never a wild copy

    prefetch = (lengths.astype(jnp.int32), block_table.astype(jnp.int32).reshape(-1))
    return _call(prefetch, _pack(q, kv_heads), k_pages, v_pages, page_index_map, block_k=page_size,
                 num_blocks=pages_per_seq, slots=pages_per_step, num_splits=num_splits, q_len=q_len, heads=heads,
                 scale=scale, interpret=interpret, static_length=static_length, name="flash_decode_paged",
                 softcap=softcap, left=left)
