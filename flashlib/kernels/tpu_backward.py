"""The Pallas TPU flash-attention backward kernels (stage 6 of the series): dK/dV and dQ by recomputation.

The forward keeps only ``out`` and the row log-sum-exp of its base-2 scores ``lse2``. From them and the
cotangent ``dO``:

    P  = exp2(q k^T * scale * log2(e) - lse2)    recomputed block by block, never stored whole
    dV = P^T dO,   dP = dO v^T
    dS = P * (dP - D),   D = rowsum(dO * out)   (D_i = sum_j P_ij dP_ij: the softmax Jacobian's own term)
    dQ = dS k * scale,   dK = dS^T q * scale

Both kernels make their base-2 scores ``q k^T * scale * log2(e)`` with the forward's own function
(:func:`~flashlib.kernels.tpu_forward.base2_scores`): the backward's scores are the forward's up to the f32
summation order, and so are the probabilities — each recomputed row sums to 1 as the forward normalised it.

Two kernels, so that every output block has one owner that accumulates it in f32 VMEM (no atomics):

* **dK/dV**, grid ``(batch, heads, kv blocks, q blocks)``: a key block stays in VMEM while the query blocks
  stream past on the last, sequential ("arbitrary") axis. It works on the *transposed* score tile
  ``s^T = k q^T [block_k, block_q]``: then ``dV += P^T dO`` and ``dK += dS^T q`` are plain matmuls (no
  score tile is ever transposed), and the queries' lse and D broadcast down sublanes from compact
  ``[8, block_q]`` rows.
* **dQ**, grid ``(batch, heads, q blocks, kv blocks)`` like the forward: a query block stays while key
  blocks stream past. Its ``init`` turns the lse and D rows into lane-replicated ``[block_q, 128]`` columns
  once per query block (one transpose), so the body broadcasts them as the forward broadcasts ``m``, ``l``.

The price of one owner per output: both kernels recompute ``s`` and ``dP``, 7 matmuls per score where the
algorithm needs 5 (:mod:`flashlib.cost`). So while it fits, the dK/dV kernel does dQ too (**fused**, the
default up to :data:`FUSED_DQ_MAX_BYTES`): it keeps a whole head's ``dQ^T [head_dim, q_len]`` f32 in VMEM
(1 MiB at 2048 tokens, head_dim 128) across the key blocks and adds ``dQ^T[:, q block] += k^T dS^T``: a
plain matmul of ``k^T`` (transposed once, in HBM) and the ``dS^T`` tile already in hand. It writes each query
block of dQ^T on the last key block. 5 matmuls per score; the key axis turns sequential ("arbitrary").
On libtpu's static cycle estimate the fused kernel takes 0.50-0.72x the cycles of JAX's own dq + dkv
kernels at flashlib's default blocks (v5e, v6e; 2048 and 4096 tokens; ``data/optimisation/backward_README.md``).

Both run the forward's three kinds of block: causal blocks above the diagonal are skipped (a ``pl.when``
on the program ids, and an index map clamped so the skipped steps fetch nothing new), blocks straddling
the diagonal or holding padded keys build an element mask, the rest are plain. Padded queries need no
mask: their dO and D are zero and their lse is ``NO_KEY_LSE``, so ``P = exp2(s - lse2)`` is exactly 0 there —
the same value a query that sees no key at all gets (the forward returned ``lse = -inf`` for it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib import cost
from flashlib.blockwise import pad_to_multiple
from flashlib.kernels.block_sizes import (
    MASK_VALUE,
    MIB,
    NUM_LANES,
    NUM_SUBLANES,
    BlockSizes,
    round_up,
    vmem_limit_bytes,
)
from flashlib.kernels.tpu_forward import LOG2_E, NT_DIMS, _lanes_to, base2_scores, resolve_call
from flashlib.reference import causal_visible

__all__ = ["FUSED_DQ_MAX_BYTES", "NO_KEY_LSE", "flash_attention_backward"]

# The lse given to padded query rows and to rows that see no key: exp2(s - NO_KEY_LSE) is 0 for every score
# s, masked (MASK_VALUE) or not, so such a row adds nothing to dK, dV and gets dQ = 0. Finite, like MASK_VALUE.
NO_KEY_LSE = -MASK_VALUE
PARALLEL, ARBITRARY = "parallel", "arbitrary"
# The largest dQ^T accumulator ([head_dim, q_len] f32) the fused kernel keeps in VMEM: 4 MiB is 8192 queries
# at head_dim 128; longer sequences run the separate dQ kernel. The fused kernel asks the compiler for this
# VMEM (and its k^T and dQ^T blocks) on top of the dK/dV kernel's checked budget; v5e and v6e have 128 MiB.
FUSED_DQ_MAX_BYTES = 4 * MIB


def _sublanes_to(rows: jax.Array, height: int) -> jax.Array:
    """A sublane-replicated ``[8, n]`` row block as ``[height, n]`` (height a multiple of 8): whole-vreg copies."""
    return jnp.tile(rows, (height // NUM_SUBLANES, 1))


def _rows_to_columns(rows: jax.Array) -> jax.Array:
    """A sublane-replicated ``[8, n]`` row block as a lane-replicated ``[n, 128]`` column block: fill a
    ``[128, n]`` square with whole-vreg copies, then transpose it once."""
    return _sublanes_to(rows, NUM_LANES).T


def _visit_block(body: Callable[[bool], None], q_block, kv_block, *, may_mask: bool, geometry: dict) -> None:
    """Run ``body(masked)`` on the three kinds of block: skipped (causal, above the diagonal), masked
    (straddles the diagonal or holds padded keys), plain. ``may_mask`` False: every block is plain."""
    if not may_mask:
        body(False)
        return
    block_visible = cost.block_is_visible(q_block, kv_block, **geometry)
    needs_mask = cost.block_needs_mask(q_block, kv_block, **geometry)

    @pl.when(block_visible & needs_mask)
    def masked_body():
        body(True)

    @pl.when(block_visible & ~needs_mask)
    def plain_body():
        body(False)


def _mask_scores(scores: jax.Array, q_start, kv_start, *, keys_on_rows: bool, q_len: int, kv_len: int,
                 causal: bool) -> jax.Array:
    """``scores`` with every invisible element set to ``MASK_VALUE``: a padded key or (causal) a key in the
    query's future. ``keys_on_rows``: the tile is transposed, ``[block_k, block_q]`` (else ``[block_q,
    block_k]``); ``q_start``, ``kv_start``: the positions of its first query and its first key.

    The forward kernel builds the same mask relative to the tile's corner (an iota difference against one
    scalar), which its estimate preferred; here that form estimated more cycles (libtpu 0.0.50, fused kernel,
    causal, flashlib's default blocks: v5e T=2048 266,905 vs 263,417, v6e T=2048 152,879 vs 142,959, T=4096
    478,791 vs 458,951), so the backward kernels keep absolute positions."""
    q_axis, kv_axis = (1, 0) if keys_on_rows else (0, 1)
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, scores.shape, q_axis)  # like scores
    kv_pos = kv_start + lax.broadcasted_iota(jnp.int32, scores.shape, kv_axis)  # like scores
    visible = kv_pos < kv_len  # like scores
    if causal:
        visible &= causal_visible(q_pos, kv_pos, q_len=q_len, kv_len=kv_len)
    return jnp.where(visible, scores, MASK_VALUE)


# ---------------------------------------------------------------------------------------------------
# dK and dV (and, fused, dQ): one key block per (batch, head, kv block), query blocks streaming past
# ---------------------------------------------------------------------------------------------------


def _dkv_kernel(
    q_ref,  # [block_q, head_dim]
    k_ref,  # [block_k, head_dim]
    v_ref,  # [block_k, head_dim]
    do_ref,  # [block_q, head_dim]
    lse_ref,  # [8, block_q] f32, sublane-replicated, base 2
    d_ref,  # [8, block_q] f32, sublane-replicated
    *refs,  # with_dq: k_t_ref, dk_ref, dv_ref, dq_t_ref, dk_acc_ref, dv_acc_ref, dq_t_acc_ref; else no k_t, dq_t*
    causal: bool,
    scale: float,
    q_len: int,
    kv_len: int,
    has_padding: bool,
    with_dq: bool,
):
    # k_t_ref [head_dim, block_k] (k^T); dk_ref, dv_ref: out [block_k, head_dim]; dq_t_ref: out [head_dim,
    # block_q]; dk_acc_ref, dv_acc_ref: scratch [block_k, head_dim] f32; dq_t_acc_ref: scratch [head_dim, Tq] f32
    if with_dq:
        k_t_ref, dk_ref, dv_ref, dq_t_ref, dk_acc_ref, dv_acc_ref, dq_t_acc_ref = refs
    else:
        (dk_ref, dv_ref, dk_acc_ref, dv_acc_ref), k_t_ref = refs, None
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    kv_block, q_block = pl.program_id(2), pl.program_id(3)
    geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal)
    q_columns = pl.ds(pl.multiple_of(q_block * block_q, block_q), block_q)  # this query block in dQ^T

    @pl.when(q_block == 0)
    def init():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)  # [block_k, head_dim]
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)  # [block_k, head_dim]

    if with_dq:

        @pl.when(kv_block == 0)
        def init_dq():
            dq_t_acc_ref[:, q_columns] = jnp.zeros((k_t_ref.shape[0], block_q), jnp.float32)  # [head_dim, block_q]

    def body(masked: bool):
        q, k, do = q_ref[...], k_ref[...], do_ref[...]  # [block_q, d], [block_k, d], [block_q, d]
        s_t = base2_scores(k, q, scale)  # [block_k, block_q]   base 2, the forward's scores transposed
        if masked:
            s_t = _mask_scores(s_t, q_block * block_q, kv_block * block_k, keys_on_rows=True, q_len=q_len,
                               kv_len=kv_len, causal=causal)  # [block_k, block_q]
        p_t = jnp.exp2(s_t - _sublanes_to(lse_ref[...], block_k))  # [block_k, block_q]   0 where masked
        dv_acc_ref[...] += jnp.dot(p_t.astype(do.dtype), do, preferred_element_type=jnp.float32)  # [block_k, d]
        dp_t = lax.dot_general(v_ref[...], do, NT_DIMS, preferred_element_type=jnp.float32)  # [block_k, block_q]
        ds_t = (p_t * (dp_t - _sublanes_to(d_ref[...], block_k))).astype(q.dtype)  # [block_k, block_q]
        dk_acc_ref[...] += jnp.dot(ds_t, q, preferred_element_type=jnp.float32)  # [block_k, d]
        if with_dq:  # dQ^T += k^T dS^T: no transpose in the kernel
            dq_t = jnp.dot(k_t_ref[...], ds_t, preferred_element_type=jnp.float32)  # [d, block_q]
            dq_t_acc_ref[:, q_columns] += dq_t

    _visit_block(body, q_block, kv_block, may_mask=causal or has_padding, geometry=geometry)

    @pl.when(q_block == pl.num_programs(3) - 1)
    def finalize():
        dk_ref[...] = (dk_acc_ref[...] * scale).astype(dk_ref.dtype)  # [block_k, head_dim]   scale once, here
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)  # [block_k, head_dim]

    if with_dq:

        @pl.when(kv_block == pl.num_programs(2) - 1)
        def finalize_dq():
            dq_t_ref[...] = (dq_t_acc_ref[:, q_columns] * scale).astype(dq_t_ref.dtype)  # [head_dim, block_q]


def _dkv(q, k, v, do, lse_rows, d_rows, *, causal: bool, scale: float, q_len: int, kv_len: int,
         sizes: BlockSizes, interpret, with_dq: bool = False) -> tuple[jax.Array, ...]:
    """dK, dV ``[b, h, num_kv_blocks * block_k, d]`` from padded inputs (rows past ``kv_len``: padding), and
    with ``with_dq`` also dQ^T ``[b, h, d, num_q_blocks * block_q]`` (q padded to exactly that length)."""
    batch, heads, _, head_dim = q.shape
    block_q, block_k = sizes.blocks("dkv")
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_k)

    def visited_q_block(j, i):
        """Query block ``i``, or — before the first query block that sees key block ``j`` — that block:
        the skipped steps keep the same index, so the pipeline copies nothing for them."""
        if not causal:
            return i
        first_query = jnp.maximum(cost.first_query_seeing(j, block_k=block_k, q_len=q_len, kv_len=kv_len), 0)
        return jnp.maximum(i, lax.div(first_query, block_q))  # lax.div: floor of a value >= 0, no sign()

    def kv_index_map(b, h, j, i):
        return b, h, j, 0

    def q_index_map(b, h, j, i):
        return b, h, visited_q_block(j, i), 0

    def row_stat_index_map(b, h, j, i):
        return b, h, 0, visited_q_block(j, i)

    squeezed = pl.squeezed
    q_spec = pl.BlockSpec((squeezed, squeezed, block_q, head_dim), q_index_map)
    kv_spec = pl.BlockSpec((squeezed, squeezed, block_k, head_dim), kv_index_map)
    row_spec = pl.BlockSpec((squeezed, squeezed, NUM_SUBLANES, block_q), row_stat_index_map)
    dkv_shape = (batch, heads, num_kv_blocks * block_k, head_dim)
    dims = (batch, heads, q_len, kv_len, head_dim, causal)
    inputs: list[Any] = [q, k, v, do, lse_rows, d_rows]
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    out_specs = [kv_spec, kv_spec]
    out_shape = [jax.ShapeDtypeStruct(dkv_shape, k.dtype), jax.ShapeDtypeStruct(dkv_shape, v.dtype)]
    scratch_shapes = [
        pltpu.VMEM((block_k, head_dim), jnp.float32),  # dK accumulator
        pltpu.VMEM((block_k, head_dim), jnp.float32),  # dV accumulator
    ]
    semantics, extra_params = (PARALLEL, PARALLEL, PARALLEL, ARBITRARY), {}
    if with_dq:
        def k_t_index_map(b, h, j, i):
            return b, h, 0, j

        def dq_t_index_map(b, h, j, i):
            """Query block ``i`` on the last key block, where it is written; block 0 before (no copy out)."""
            return b, h, 0, jnp.where(j == num_kv_blocks - 1, i, 0)

        q_padded_len = num_q_blocks * block_q
        inputs.append(jnp.swapaxes(k, 2, 3))  # [b, h, d, Tk]
        in_specs.append(pl.BlockSpec((squeezed, squeezed, head_dim, block_k), k_t_index_map))
        out_specs.append(pl.BlockSpec((squeezed, squeezed, head_dim, block_q), dq_t_index_map))
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, head_dim, q_padded_len), q.dtype))
        scratch_shapes.append(pltpu.VMEM((head_dim, q_padded_len), jnp.float32))  # dQ^T accumulator, one head
        semantics = (PARALLEL, PARALLEL, ARBITRARY, ARBITRARY)  # dQ^T sums over the key blocks
        extra_params["vmem_limit_bytes"] = vmem_limit_bytes(sizes.generation) + _fused_vmem_bytes(
            q_padded_len, head_dim, block_q, block_k, q.dtype)
    counted_as = "fused" if with_dq else "dkv"  # its pl.CostEstimate, from flashlib.cost
    kernel = functools.partial(
        _dkv_kernel, causal=causal, scale=scale, q_len=q_len, kv_len=kv_len,
        has_padding=num_kv_blocks * block_k != kv_len, with_dq=with_dq,
    )
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, num_kv_blocks, num_q_blocks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch_shapes,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, **extra_params),
        cost_estimate=pl.CostEstimate(
            flops=cost.attention_backward_flops(*dims, block_sizes=sizes, kernel=counted_as),
            transcendentals=cost.attention_backward_transcendentals(*dims, block_sizes=sizes, kernel=counted_as),
            bytes_accessed=cost.attention_backward_bytes(*dims, q.dtype, block_sizes=sizes, kernel=counted_as),
        ),
        interpret=interpret,
        name="flash_attention_dkv" + ("_dq" if with_dq else "") + ("_causal" if causal else ""),
    )(*inputs)


def _fused_vmem_bytes(q_padded_len: int, head_dim: int, block_q: int, block_k: int, dtype) -> int:
    """VMEM the fused kernel needs beyond the dK/dV kernel's: the dQ^T accumulator, the double-buffered k^T
    and dQ^T blocks, and one ``[head_dim, block_q]`` f32 matmul result."""
    rows, itemsize = round_up(head_dim, NUM_SUBLANES), jnp.dtype(dtype).itemsize
    return rows * (q_padded_len * 4 + 2 * (block_k + block_q) * itemsize + block_q * 4)


def _fuses_dq(sizes: BlockSizes, q_len: int, kv_len: int, head_dim: int, fuse_dq: bool | None) -> bool:
    """Whether the dK/dV kernel does dQ too: asked for, or (None) when its dQ^T accumulator is at most
    :data:`FUSED_DQ_MAX_BYTES`. k^T puts keys on lanes, so block_k_dkv must be whole lanes or all the keys."""
    block_q, block_k = sizes.blocks("dkv")
    fits_lanes = block_k % NUM_LANES == 0 or block_k >= kv_len
    if fuse_dq is None:
        return fits_lanes and round_up(head_dim, NUM_SUBLANES) * round_up(q_len, block_q) * 4 <= FUSED_DQ_MAX_BYTES
    if fuse_dq and not fits_lanes:
        raise ValueError(
            f"fuse_dq=True needs block_k_dkv to be a multiple of {NUM_LANES} (k^T puts keys on lanes) or to cover "
            f"all {kv_len} keys, got block_k_dkv={block_k}; try block_k_dkv={round_up(block_k, NUM_LANES)} "
            "or fuse_dq=None"
        )
    return bool(fuse_dq)


# ---------------------------------------------------------------------------------------------------
# dQ: one query block per (batch, head, q block), key blocks streaming past
# ---------------------------------------------------------------------------------------------------


def _dq_kernel(
    q_ref,  # [block_q, head_dim]
    k_ref,  # [block_k, head_dim]
    v_ref,  # [block_k, head_dim]
    do_ref,  # [block_q, head_dim]
    lse_ref,  # [8, block_q] f32, sublane-replicated, base 2
    d_ref,  # [8, block_q] f32, sublane-replicated
    dq_ref,  # out [block_q, head_dim]
    dq_acc_ref,  # scratch [block_q, head_dim] f32
    lse_col_ref,  # scratch [block_q, 128] f32, lane-replicated
    d_col_ref,  # scratch [block_q, 128] f32, lane-replicated
    *,
    causal: bool,
    scale: float,
    q_len: int,
    kv_len: int,
    has_padding: bool,
):
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    q_block, kv_block = pl.program_id(2), pl.program_id(3)
    geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal)

    @pl.when(kv_block == 0)
    def init():
        dq_acc_ref[...] = jnp.zeros(dq_acc_ref.shape, jnp.float32)  # [block_q, head_dim]
        lse_col_ref[...] = _rows_to_columns(lse_ref[...])  # [block_q, 128]
        d_col_ref[...] = _rows_to_columns(d_ref[...])  # [block_q, 128]

    def body(masked: bool):
        q, k = q_ref[...], k_ref[...]  # [block_q, d], [block_k, d]
        s = base2_scores(q, k, scale)  # [block_q, block_k]   base 2
        if masked:
            s = _mask_scores(s, q_block * block_q, kv_block * block_k, keys_on_rows=False, q_len=q_len,
                             kv_len=kv_len, causal=causal)  # [block_q, block_k]
        p = jnp.exp2(s - _lanes_to(lse_col_ref[...], block_k))  # [block_q, block_k]   0 where masked
        dp = lax.dot_general(do_ref[...], v_ref[...], NT_DIMS, preferred_element_type=jnp.float32)  # [block_q, block_k]
        ds = p * (dp - _lanes_to(d_col_ref[...], block_k))  # [block_q, block_k]
        dq_acc_ref[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)  # [block_q, d]

    _visit_block(body, q_block, kv_block, may_mask=causal or has_padding, geometry=geometry)

    @pl.when(kv_block == pl.num_programs(3) - 1)
    def finalize():
        dq_ref[...] = (dq_acc_ref[...] * scale).astype(dq_ref.dtype)  # [block_q, head_dim]   scale once, here


def _dq(q, k, v, do, lse_rows, d_rows, *, causal: bool, scale: float, q_len: int, kv_len: int,
        sizes: BlockSizes, interpret) -> jax.Array:
    """dQ ``[b, h, num_q_blocks * block_q, d]`` from padded inputs (rows past ``q_len``: padding)."""
    batch, heads, _, head_dim = q.shape
    block_q, block_k = sizes.blocks("dq")
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_k)

    def visited_kv_block(i, j):
        """Key block ``j``, or — past the last key block query block ``i`` sees — that block (no copy)."""
        if not causal:
            return j
        last_key = jnp.maximum(cost.last_key_seen(i, block_q=block_q, q_len=q_len, kv_len=kv_len), 0)
        return jnp.minimum(j, lax.div(last_key, block_k))  # lax.div: floor of a value >= 0, no sign()

    def q_index_map(b, h, i, j):
        return b, h, i, 0

    def kv_index_map(b, h, i, j):
        return b, h, visited_kv_block(i, j), 0

    def row_stat_index_map(b, h, i, j):
        return b, h, 0, i

    squeezed = pl.squeezed
    q_spec = pl.BlockSpec((squeezed, squeezed, block_q, head_dim), q_index_map)
    kv_spec = pl.BlockSpec((squeezed, squeezed, block_k, head_dim), kv_index_map)
    row_spec = pl.BlockSpec((squeezed, squeezed, NUM_SUBLANES, block_q), row_stat_index_map)
    dims = (batch, heads, q_len, kv_len, head_dim, causal)
    kernel = functools.partial(
        _dq_kernel, causal=causal, scale=scale, q_len=q_len, kv_len=kv_len,
        has_padding=num_kv_blocks * block_k != kv_len,
    )
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, num_q_blocks, num_kv_blocks),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct((batch, heads, num_q_blocks * block_q, head_dim), q.dtype),
        scratch_shapes=[
            pltpu.VMEM((block_q, head_dim), jnp.float32),  # dQ accumulator
            pltpu.VMEM((block_q, NUM_LANES), jnp.float32),  # lse, lane-replicated
            pltpu.VMEM((block_q, NUM_LANES), jnp.float32),  # D, lane-replicated
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=(PARALLEL, PARALLEL, PARALLEL, ARBITRARY)),
        cost_estimate=pl.CostEstimate(
            flops=cost.attention_backward_flops(*dims, block_sizes=sizes, kernel="dq"),
            transcendentals=cost.attention_backward_transcendentals(*dims, block_sizes=sizes, kernel="dq"),
            bytes_accessed=cost.attention_backward_bytes(*dims, q.dtype, block_sizes=sizes, kernel="dq"),
        ),
        interpret=interpret,
        name="flash_attention_dq" + ("_causal" if causal else ""),
    )(q, k, v, do, lse_rows, d_rows)


# ---------------------------------------------------------------------------------------------------
# The backward pass: D, padding, the row statistics, both kernels
# ---------------------------------------------------------------------------------------------------


def _as_rows(x: jax.Array, length: int, fill: float) -> jax.Array:
    """A row statistic ``[b, h, n]`` padded with ``fill`` to ``length`` and replicated over the 8 sublanes:
    ``[b, h, 8, length]`` f32 (8x the data; a lane-replicated ``[length, 128]`` copy would be 128x)."""
    batch, heads, n = x.shape
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 0), (0, length - n)), constant_values=fill)  # [b, h, length]
    return jnp.broadcast_to(x[:, :, None, :], (batch, heads, NUM_SUBLANES, length))


def flash_attention_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    do: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | pltpu.InterpretParams | None = None,
    dlse: jax.Array | None = None,
    fuse_dq: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention VJP by the Pallas kernels: ``(dq, dk, dv)`` like ``(q, k, v)``.

    Args:
      q, k, v: the forward's inputs; out, lse: its output and row log-sum-exp ``[b, h, q_len]`` f32, natural
        log (``flash_attention_forward(..., return_lse=True)``; ``-inf`` for a row that sees no key).
      do: the cotangent of ``out``, like ``out``.
      causal, scale: as in the forward.
      block_sizes: None picks the defaults; the backward fields left None are derived
        (:meth:`BlockSizes.for_backward`). The fused kernel runs on the dK/dV blocks.
      interpret: as in the forward.
      dlse: the cotangent of ``lse``, if the caller differentiates it too (``dS`` gains ``P * dlse``, so it
        is folded into ``D``).
      fuse_dq: True: the dK/dV kernel does dQ too (5 matmuls per score, not 7); False: the separate dQ
        kernel; None: fused while a head's dQ^T fits :data:`FUSED_DQ_MAX_BYTES`.
    """
    shape, sizes, scale, interpret = resolve_call(q, k, v, causal=causal, scale=scale, block_sizes=block_sizes,
                                                  interpret=interpret, backward=True)
    _fuses_dq(sizes, shape.q_len, shape.kv_len, shape.head_dim, fuse_dq)  # a ValueError now, not when traced
    lse2 = lse * LOG2_E  # [b, h, q_len]   the kernels' base 2 (the custom VJP passes the forward's lse2 itself)
    return backward(q, k, v, out, lse2, do, dlse, causal=bool(causal), scale=scale, sizes=sizes,
                    interpret=interpret, fuse_dq=fuse_dq)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "sizes", "interpret", "fuse_dq"))
def backward(q, k, v, out, lse2, do, dlse, *, causal: bool, scale: float, sizes: BlockSizes, interpret,
             fuse_dq: bool | None = None):
    """:func:`flash_attention_backward` on resolved, static settings (what the custom VJP calls), with the
    forward's base-2 log-sum-exp ``lse2`` (``tpu_forward._forward(..., return_lse=True)``); ``dlse`` is the
    cotangent of the natural-log lse."""
    q_len, kv_len = q.shape[2], k.shape[2]
    fused = _fuses_dq(sizes, q_len, kv_len, q.shape[3], fuse_dq)
    (block_q_dkv, block_k_dkv), (block_q_dq, block_k_dq) = sizes.blocks("dkv"), sizes.blocks("dq")
    d = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [b, h, q_len]
    if dlse is not None:
        d = d - dlse  # [b, h, q_len]   dS = P * (dP - D) + P * dlse
    lse2 = jnp.where(jnp.isfinite(lse2), lse2, NO_KEY_LSE)  # [b, h, q_len]   rows that see no key -> P = 0

    # Pad once to a length every kernel that runs tiles; each grid covers only the blocks its own sizes need.
    q_multiple = block_q_dkv if fused else math.lcm(block_q_dkv, block_q_dq)
    k_multiple = block_k_dkv if fused else math.lcm(block_k_dkv, block_k_dq)
    q_padded = pad_to_multiple(q, 2, q_multiple)  # [b, h, Tq, d]
    do_padded = pad_to_multiple(do, 2, q_multiple)  # [b, h, Tq, d]
    k_padded = pad_to_multiple(k, 2, k_multiple)  # [b, h, Tk, d]
    v_padded = pad_to_multiple(v, 2, k_multiple)  # [b, h, Tk, d]
    lse_rows = _as_rows(lse2, q_padded.shape[2], NO_KEY_LSE)  # [b, h, 8, Tq]
    d_rows = _as_rows(d, q_padded.shape[2], 0.0)  # [b, h, 8, Tq]

    inputs = (q_padded, k_padded, v_padded, do_padded, lse_rows, d_rows)
    settings = dict(causal=causal, scale=scale, q_len=q_len, kv_len=kv_len, sizes=sizes, interpret=interpret)
    if fused:
        dk, dv, dq_t = _dkv(*inputs, **settings, with_dq=True)  # [b, h, Tk, d] x 2, [b, h, d, Tq]
        dq = jnp.swapaxes(dq_t, 2, 3)  # [b, h, Tq, d]
    else:
        dk, dv = _dkv(*inputs, **settings)  # [b, h, nk * block_k_dkv, d] each
        dq = _dq(*inputs, **settings)  # [b, h, nq * block_q_dq, d]
    return dq[:, :, :q_len], dk[:, :, :kv_len], dv[:, :, :kv_len]
