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
and V are never repeated in HBM); dK and dV come out per query head, in f32, and
:func:`flashlib.kernels.tpu_backward.backward` sums each group — FlashAttention 2's way for MQA/GQA.

Longer than 400 lines because the three kernels share one block visitor, one mask, one set of BlockSpecs and
one accumulation step; apart, each piece would be read without the kernels it serves.

All three run the forward's three kinds of block: causal blocks above the diagonal are skipped (a
``pl.when`` on the program ids, and an index map clamped so the skipped steps fetch nothing new), blocks
straddling the diagonal or holding padded keys build an element mask, the rest are plain. Padded queries
need no mask: their dO and D are zero and their lse is ``tpu_backward.NO_KEY_LSE``, so ``P = exp2(s - lse2)``
is exactly 0 there — as for a query that sees no key at all (the forward returned ``lse = -inf`` for it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib import cost, geometry
from flashlib.geometry import MASK_VALUE, causal_visible
from flashlib.kernels.block_sizes import BlockSizes, vmem_limit_bytes
from flashlib.kernels.scores import NT_DIMS, base2_scores, lanes_to
from flashlib.tiling import NUM_LANES, NUM_SUBLANES, round_up

PARALLEL, ARBITRARY = "parallel", "arbitrary"


def _sublanes_to(rows: jax.Array, height: int) -> jax.Array:
    """A sublane-replicated ``[8, n]`` row block as ``[height, n]`` (height a multiple of 8): whole-vreg copies."""
    return jnp.tile(rows, (height // NUM_SUBLANES, 1))


def _rows_to_columns(rows: jax.Array) -> jax.Array:
    """A sublane-replicated ``[8, n]`` row block as a lane-replicated ``[n, 128]`` column block: fill a
    ``[128, n]`` square with whole-vreg copies, then transpose it once."""
    return _sublanes_to(rows, NUM_LANES).T


def _visit_block(body: Callable[[bool], None], q_block, kv_block, *, may_mask: bool, block_geometry: dict) -> None:
    """Run ``body(masked)`` on the three kinds of block: skipped (causal, above the diagonal), masked
    (straddles the diagonal or holds padded keys), plain. ``may_mask`` False: every block is plain."""
    if not may_mask:
        body(False)
        return
    block_visible = geometry.block_is_visible(q_block, kv_block, **block_geometry)
    needs_mask = geometry.block_needs_mask(q_block, kv_block, **block_geometry)

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
    scalar); here that form estimated more cycles (``data/optimisation/backward_README.md``), so the backward
    kernels keep absolute positions."""
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


def _accumulate_dkv(in_refs, dk_acc_ref, dv_acc_ref, q_block, kv_block, *, masked: bool, causal: bool,
                    scale: float, q_len: int, kv_len: int) -> jax.Array:
    """One grid step of the dK/dV and fused kernels: ``dV += P^T dO`` and ``dK += dS^T q`` (unscaled) into
    the ``[block_k, head_dim]`` f32 accumulators; returns ``dS^T [block_k, block_q]`` in q's dtype."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref = in_refs
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
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
    return ds_t


def _dkv_kernel(
    q_ref, k_ref, v_ref, do_ref,  # [block_q, head_dim], [block_k, head_dim] x 2, [block_q, head_dim]
    lse_ref, d_ref,  # [8, block_q] f32, sublane-replicated; lse in base 2
    dk_ref, dv_ref,  # out [block_k, head_dim]
    dk_acc_ref, dv_acc_ref,  # scratch [block_k, head_dim] f32
    *, causal: bool, scale: float, q_len: int, kv_len: int, has_padding: bool,
):
    in_refs = (q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref)
    block_geometry = dict(block_q=q_ref.shape[0], block_k=k_ref.shape[0], q_len=q_len, kv_len=kv_len, causal=causal)
    kv_block, q_block = pl.program_id(2), pl.program_id(3)

    @pl.when(q_block == 0)
    def init():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)  # [block_k, head_dim]
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)  # [block_k, head_dim]

    def body(masked: bool):
        _accumulate_dkv(in_refs, dk_acc_ref, dv_acc_ref, q_block, kv_block, masked=masked, causal=causal,
                        scale=scale, q_len=q_len, kv_len=kv_len)

    _visit_block(body, q_block, kv_block, may_mask=causal or has_padding, block_geometry=block_geometry)

    @pl.when(q_block == pl.num_programs(3) - 1)
    def finalize():
        dk_ref[...] = (dk_acc_ref[...] * scale).astype(dk_ref.dtype)  # [block_k, head_dim]   scale once, here
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)  # [block_k, head_dim]


def _fused_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref,  # as in _dkv_kernel
    k_t_ref,  # [head_dim, block_k]   k^T
    dk_ref, dv_ref, dq_t_ref,  # out: as in _dkv_kernel; [head_dim, block_q]
    dk_acc_ref, dv_acc_ref, dq_t_acc_ref,  # scratch: as in _dkv_kernel; [head_dim, Tq] f32, the whole head's dQ^T
    *, causal: bool, scale: float, q_len: int, kv_len: int, has_padding: bool,
):
    """:func:`_dkv_kernel`, and with the ``dS^T`` tile it already has, ``dQ^T[:, q block] += k^T dS^T``."""
    in_refs = (q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref)
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    kv_block, q_block = pl.program_id(2), pl.program_id(3)
    block_geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal)
    q_columns = pl.ds(pl.multiple_of(q_block * block_q, block_q), block_q)  # this query block in dQ^T

    @pl.when(q_block == 0)
    def init():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)  # [block_k, head_dim]
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)  # [block_k, head_dim]

    @pl.when(kv_block == 0)
    def init_dq():
        dq_t_acc_ref[:, q_columns] = jnp.zeros((k_t_ref.shape[0], block_q), jnp.float32)  # [head_dim, block_q]

    def body(masked: bool):
        ds_t = _accumulate_dkv(in_refs, dk_acc_ref, dv_acc_ref, q_block, kv_block, masked=masked, causal=causal,
                               scale=scale, q_len=q_len, kv_len=kv_len)  # [block_k, block_q]
        dq_t = jnp.dot(k_t_ref[...], ds_t, preferred_element_type=jnp.float32)  # [d, block_q]   no transpose
        dq_t_acc_ref[:, q_columns] += dq_t

    _visit_block(body, q_block, kv_block, may_mask=causal or has_padding, block_geometry=block_geometry)

    @pl.when(q_block == pl.num_programs(3) - 1)
    def finalize():
        dk_ref[...] = (dk_acc_ref[...] * scale).astype(dk_ref.dtype)  # [block_k, head_dim]   scale once, here
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)  # [block_k, head_dim]

    @pl.when(kv_block == pl.num_programs(2) - 1)
    def finalize_dq():
        dq_t_ref[...] = (dq_t_acc_ref[:, q_columns] * scale).astype(dq_t_ref.dtype)  # [head_dim, block_q]


def _kv_head(h, group: int):
    """The kv head query head ``h`` reads (GQA): ``h // group`` (``lax.div``: Mosaic lowers it without sign())."""
    return h if group == 1 else lax.div(h, group)


def _dkv_specs(head_dim: int, block_q: int, block_k: int, *, causal: bool, q_len: int, kv_len: int, group: int = 1):
    """The BlockSpecs of the dK/dV and fused grids ``(b, h, kv block j, q block i)``: ``(q_spec, kv_spec,
    row_spec, dkv_spec)`` for q and dO, for k and v (the group's kv head), for the lse and D rows, and for
    dK and dV (per query head: with GQA the group's heads are summed afterwards, FlashAttention 2's way)."""

    def visited_q_block(j, i):
        """Query block ``i``, or — before the first query block that sees key block ``j`` — that block:
        the skipped steps keep the same index, so the pipeline copies nothing for them."""
        if not causal:
            return i
        first_query = jnp.maximum(geometry.first_query_seeing(j, block_k=block_k, q_len=q_len, kv_len=kv_len), 0)
        return jnp.maximum(i, lax.div(first_query, block_q))  # lax.div: floor of a value >= 0, no sign()

    def kv_index_map(b, h, j, i):
        return b, _kv_head(h, group), j, 0

    def dkv_index_map(b, h, j, i):
        return b, h, j, 0

    def q_index_map(b, h, j, i):
        return b, h, visited_q_block(j, i), 0

    def row_stat_index_map(b, h, j, i):
        return b, h, 0, visited_q_block(j, i)

    squeezed = pl.squeezed
    return (pl.BlockSpec((squeezed, squeezed, block_q, head_dim), q_index_map),
            pl.BlockSpec((squeezed, squeezed, block_k, head_dim), kv_index_map),
            pl.BlockSpec((squeezed, squeezed, NUM_SUBLANES, block_q), row_stat_index_map),
            pl.BlockSpec((squeezed, squeezed, block_k, head_dim), dkv_index_map))


def _cost_estimate(kernel: str, dims: tuple, dtype, sizes: BlockSizes) -> pl.CostEstimate:
    """``kernel``'s (``"dkv"``, ``"fused"``, ``"dq"``) pl.CostEstimate, from :mod:`flashlib.cost`."""
    return pl.CostEstimate(
        flops=cost.attention_backward_flops(*dims, block_sizes=sizes, kernel=kernel),
        transcendentals=cost.attention_backward_transcendentals(*dims, block_sizes=sizes, kernel=kernel),
        bytes_accessed=cost.attention_backward_bytes(*dims, dtype, block_sizes=sizes, kernel=kernel),
    )


def _dkv(q, k, v, do, lse_rows, d_rows, *, causal: bool, scale: float, q_len: int, kv_len: int,
         sizes: BlockSizes, interpret) -> tuple[jax.Array, jax.Array]:
    """dK, dV ``[b, h, num_kv_blocks * block_k, d]`` from padded inputs (rows past ``kv_len``: padding), per
    query head ``h`` (with GQA in f32, for the caller to sum over each group)."""
    batch, heads, _, head_dim = q.shape
    group = heads // k.shape[1]
    block_q, block_k = sizes.blocks("dkv")
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_k)
    q_spec, kv_spec, row_spec, dkv_spec = _dkv_specs(head_dim, block_q, block_k, causal=causal, q_len=q_len,
                                                     kv_len=kv_len, group=group)
    dkv_shape = (batch, heads, num_kv_blocks * block_k, head_dim)
    dk_dtype, dv_dtype = (k.dtype, v.dtype) if group == 1 else (jnp.float32, jnp.float32)
    kernel = functools.partial(_dkv_kernel, causal=causal, scale=scale, q_len=q_len, kv_len=kv_len,
                               has_padding=num_kv_blocks * block_k != kv_len)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, num_kv_blocks, num_q_blocks),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=[dkv_spec, dkv_spec],
        out_shape=[jax.ShapeDtypeStruct(dkv_shape, dk_dtype), jax.ShapeDtypeStruct(dkv_shape, dv_dtype)],
        scratch_shapes=[
            pltpu.VMEM((block_k, head_dim), jnp.float32),  # dK accumulator
            pltpu.VMEM((block_k, head_dim), jnp.float32),  # dV accumulator
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=(PARALLEL, PARALLEL, PARALLEL, ARBITRARY)),
        cost_estimate=_cost_estimate("dkv", (batch, heads, q_len, kv_len, head_dim, causal), q.dtype, sizes),
        interpret=interpret,
        name="flash_attention_dkv" + ("_causal" if causal else ""),
    )(q, k, v, do, lse_rows, d_rows)


def _fused(q, k, v, do, lse_rows, d_rows, *, causal: bool, scale: float, q_len: int, kv_len: int,
           sizes: BlockSizes, interpret) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dK, dV as :func:`_dkv` and dQ^T ``[b, h, d, num_q_blocks * block_q]`` (q padded to exactly that length)."""
    batch, heads, _, head_dim = q.shape
    group = heads // k.shape[1]
    block_q, block_k = sizes.blocks("fused")
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_k)
    q_spec, kv_spec, row_spec, dkv_spec = _dkv_specs(head_dim, block_q, block_k, causal=causal, q_len=q_len,
                                                     kv_len=kv_len, group=group)
    dk_dtype, dv_dtype = (k.dtype, v.dtype) if group == 1 else (jnp.float32, jnp.float32)

    def k_t_index_map(b, h, j, i):
        return b, _kv_head(h, group), 0, j

    def dq_t_index_map(b, h, j, i):
        """Query block ``i`` on the last key block, where it is written; block 0 before (no copy out)."""
        return b, h, 0, jnp.where(j == num_kv_blocks - 1, i, 0)

    squeezed, q_padded_len = pl.squeezed, num_q_blocks * block_q
    dkv_shape = (batch, heads, num_kv_blocks * block_k, head_dim)
    k_t = jnp.swapaxes(k, 2, 3)  # [b, h, d, Tk]
    extra_vmem = _fused_vmem_bytes(q_padded_len, head_dim, block_q, block_k, q.dtype)  # beyond the dK/dV budget
    kernel = functools.partial(_fused_kernel, causal=causal, scale=scale, q_len=q_len, kv_len=kv_len,
                               has_padding=num_kv_blocks * block_k != kv_len)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, num_kv_blocks, num_q_blocks),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
                  pl.BlockSpec((squeezed, squeezed, head_dim, block_k), k_t_index_map)],
        out_specs=[dkv_spec, dkv_spec, pl.BlockSpec((squeezed, squeezed, head_dim, block_q), dq_t_index_map)],
        out_shape=[jax.ShapeDtypeStruct(dkv_shape, dk_dtype), jax.ShapeDtypeStruct(dkv_shape, dv_dtype),
                   jax.ShapeDtypeStruct((batch, heads, head_dim, q_padded_len), q.dtype)],
        scratch_shapes=[
            pltpu.VMEM((block_k, head_dim), jnp.float32),  # dK accumulator
            pltpu.VMEM((block_k, head_dim), jnp.float32),  # dV accumulator
            pltpu.VMEM((head_dim, q_padded_len), jnp.float32),  # dQ^T accumulator, one head
        ],
        compiler_params=pltpu.CompilerParams(  # dQ^T sums over the key blocks: that axis turns sequential too
            dimension_semantics=(PARALLEL, PARALLEL, ARBITRARY, ARBITRARY),
            vmem_limit_bytes=vmem_limit_bytes(sizes.generation) + extra_vmem),
        cost_estimate=_cost_estimate("fused", (batch, heads, q_len, kv_len, head_dim, causal), q.dtype, sizes),
        interpret=interpret,
        name="flash_attention_dkv_dq" + ("_causal" if causal else ""),
    )(q, k, v, do, lse_rows, d_rows, k_t)


def _fused_vmem_bytes(q_padded_len: int, head_dim: int, block_q: int, block_k: int, dtype) -> int:
    """VMEM the fused kernel needs beyond the dK/dV kernel's: the dQ^T accumulator, the double-buffered k^T
    and dQ^T blocks, and one ``[head_dim, block_q]`` f32 matmul result."""
    rows, itemsize = round_up(head_dim, NUM_SUBLANES), jnp.dtype(dtype).itemsize
    return rows * (q_padded_len * 4 + 2 * (block_k + block_q) * itemsize + block_q * 4)


# ---------------------------------------------------------------------------------------------------
# dQ: one query block per (batch, head, q block), key blocks streaming past
# ---------------------------------------------------------------------------------------------------


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref,  # as in _dkv_kernel
    dq_ref,  # out [block_q, head_dim]
    dq_acc_ref,  # scratch [block_q, head_dim] f32
    lse_col_ref, d_col_ref,  # scratch [block_q, 128] f32, lane-replicated
    *, causal: bool, scale: float, q_len: int, kv_len: int, has_padding: bool,
):
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    q_block, kv_block = pl.program_id(2), pl.program_id(3)
    block_geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal)

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
        p = jnp.exp2(s - lanes_to(lse_col_ref[...], block_k))  # [block_q, block_k]   0 where masked
        dp = lax.dot_general(do_ref[...], v_ref[...], NT_DIMS, preferred_element_type=jnp.float32)  # [block_q, block_k]
        ds = p * (dp - lanes_to(d_col_ref[...], block_k))  # [block_q, block_k]
        dq_acc_ref[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)  # [block_q, d]

    _visit_block(body, q_block, kv_block, may_mask=causal or has_padding, block_geometry=block_geometry)

    @pl.when(kv_block == pl.num_programs(3) - 1)
    def finalize():
        dq_ref[...] = (dq_acc_ref[...] * scale).astype(dq_ref.dtype)  # [block_q, head_dim]   scale once, here


def _dq(q, k, v, do, lse_rows, d_rows, *, causal: bool, scale: float, q_len: int, kv_len: int,
        sizes: BlockSizes, interpret) -> jax.Array:
    """dQ ``[b, h, num_q_blocks * block_q, d]`` from padded inputs (rows past ``q_len``: padding)."""
    batch, heads, _, head_dim = q.shape
    group = heads // k.shape[1]
    block_q, block_k = sizes.blocks("dq")
    num_q_blocks, num_kv_blocks = -(-q_len // block_q), -(-kv_len // block_k)

    def visited_kv_block(i, j):
        """Key block ``j``, or — past the last key block query block ``i`` sees — that block (no copy)."""
        if not causal:
            return j
        last_key = jnp.maximum(geometry.last_key_seen(i, block_q=block_q, q_len=q_len, kv_len=kv_len), 0)
        return jnp.minimum(j, lax.div(last_key, block_k))  # lax.div: floor of a value >= 0, no sign()

    def q_index_map(b, h, i, j):
        return b, h, i, 0

    def kv_index_map(b, h, i, j):
        return b, _kv_head(h, group), visited_kv_block(i, j), 0

    def row_stat_index_map(b, h, i, j):
        return b, h, 0, i

    squeezed = pl.squeezed
    q_spec = pl.BlockSpec((squeezed, squeezed, block_q, head_dim), q_index_map)
    kv_spec = pl.BlockSpec((squeezed, squeezed, block_k, head_dim), kv_index_map)
    row_spec = pl.BlockSpec((squeezed, squeezed, NUM_SUBLANES, block_q), row_stat_index_map)
    kernel = functools.partial(_dq_kernel, causal=causal, scale=scale, q_len=q_len, kv_len=kv_len,
                               has_padding=num_kv_blocks * block_k != kv_len)
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
        cost_estimate=_cost_estimate("dq", (batch, heads, q_len, kv_len, head_dim, causal), q.dtype, sizes),
        interpret=interpret,
        name="flash_attention_dq" + ("_causal" if causal else ""),
    )(q, k, v, do, lse_rows, d_rows)
