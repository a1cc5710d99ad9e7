"""The Pallas TPU flash-attention backward (stage 6 of the series): the attention VJP by recomputation.

:func:`flash_attention_backward` (and :func:`backward`, what the custom VJP calls) turn the forward's
``out``, its row log-sum-exp and the cotangent ``dO`` into ``(dq, dk, dv)`` with the kernels of
:mod:`flashlib.kernels.backward_kernels` (the equations, and why each output has one owner, are there):

* ``D = rowsum(dO * out)``, one XLA reduction (minus ``dlse`` when the caller differentiates the lse too);
* padding: q, dO to a whole number of query blocks, k, v of key blocks, once for every kernel that runs;
* the row statistics lse and D as sublane-replicated ``[b, h, 8, Tq]`` rows, padded with :data:`NO_KEY_LSE`
  and 0 so that a padded query contributes nothing;
* the kernels: the fused dK/dV/dQ kernel (5 matmuls per score) while a head's ``dQ^T`` fits
  :data:`FUSED_DQ_MAX_BYTES`, else the dK/dV kernel and the dQ kernel (7).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from flashlib.geometry import MASK_VALUE
from flashlib.kernels.backward_kernels import FUSED_DQ_MAX_BYTES, _dkv, _dq, _fused
from flashlib.kernels.block_sizes import BlockSizes
from flashlib.kernels.options import resolve_call
from flashlib.kernels.scores import LOG2_E
from flashlib.kernels.variants import PLAIN, KernelVariants, segment_layouts
from flashlib.tiling import NUM_LANES, NUM_SUBLANES, pad_to_multiple, round_up

__all__ = ["FUSED_DQ_MAX_BYTES", "NO_KEY_LSE", "flash_attention_backward"]

# The lse given to padded query rows and to rows that see no key: exp2(s - NO_KEY_LSE) is 0 for every score
# s, masked (MASK_VALUE) or not, so such a row adds nothing to dK, dV and gets dQ = 0. Finite, like MASK_VALUE.
NO_KEY_LSE = -MASK_VALUE


def _fuses_dq(sizes: BlockSizes, q_len: int, kv_len: int, head_dim: int, fuse_dq: bool | None,
              window=None) -> bool:
    """Whether the dK/dV kernel does dQ too: asked for, or (None) when its dQ^T accumulator is at most
    :data:`FUSED_DQ_MAX_BYTES`. k^T puts keys on lanes, so block_k_dkv must be whole lanes or all the keys. A
    window bounded on the left never fuses: the separate kernels visit only each block's live range (their
    cost grows linearly with length), the fused kernel's query axis is the whole sequence."""
    block_q, block_k = sizes.blocks("fused")
    fits_lanes = block_k % NUM_LANES == 0 or block_k >= kv_len
    left_bounded = window is not None and window[0] is not None
    if fuse_dq and left_bounded:
        raise ValueError(f"fuse_dq=True cannot run a window bounded on the left (window={window}): the fused "
                         "kernel walks every query block; use fuse_dq=None or False")
    if fuse_dq is None:
        return (fits_lanes and not left_bounded
                and round_up(head_dim, NUM_SUBLANES) * round_up(q_len, block_q) * 4 <= FUSED_DQ_MAX_BYTES)
    if fuse_dq and not fits_lanes:
        raise ValueError(
            f"fuse_dq=True needs block_k_dkv to be a multiple of {NUM_LANES} (k^T puts keys on lanes) or to cover "
            f"all {kv_len} keys, got block_k_dkv={block_k}; try block_k_dkv={round_up(block_k, NUM_LANES)} "
            "or fuse_dq=None"
        )
    return bool(fuse_dq)


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


@functools.partial(jax.jit, static_argnames=("causal", "scale", "sizes", "interpret", "fuse_dq", "variants"))
def backward(q, k, v, out, lse2, do, dlse, segment_ids=None, sinks=None, *, causal: bool, scale: float,
             sizes: BlockSizes, interpret, fuse_dq: bool | None = None, variants: KernelVariants = PLAIN):
    """:func:`flash_attention_backward` on resolved, static settings (what the custom VJP calls), with the
    forward's base-2 log-sum-exp ``lse2`` (``tpu_forward.forward(..., return_lse=True)``); ``dlse`` is the
    cotangent of the natural-log lse. Returns ``(dq, dk, dv)``, and ``dsinks`` ``[heads]`` with sinks."""
    q_len, kv_len = q.shape[2], k.shape[2]
    fused = _fuses_dq(sizes, q_len, kv_len, q.shape[3], fuse_dq, variants.window)
    (block_q_dkv, block_k_dkv), (block_q_dq, block_k_dq) = sizes.blocks("dkv"), sizes.blocks("dq")
    d = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [b, h, q_len]
    if dlse is not None:
        d = d - dlse  # [b, h, q_len]   dS = P * (dP - D) + P * dlse
    lse2 = jnp.where(jnp.isfinite(lse2), lse2, NO_KEY_LSE)  # [b, h, q_len]   rows that see no key -> P = 0

    # Pad once to a length every kernel that runs tiles; each grid covers only the blocks its own sizes need.
    q_multiple = block_q_dkv if fused else math.lcm(block_q_dkv, block_q_dq)
    k_multiple = block_k_dkv if fused else math.lcm(block_k_dkv, block_k_dq)
    q_padded = pad_to_multiple(q, 2, q_multiple)  # [b, h, Tq, d]
    do_padded = pad_to_multiple(do, 2, q_multiple)  # [b, h, Tq, dv]
    k_padded = pad_to_multiple(k, 2, k_multiple)  # [b, h, Tk, d]
    v_padded = pad_to_multiple(v, 2, k_multiple)  # [b, h, Tk, dv]
    lse_rows = _as_rows(lse2, q_padded.shape[2], NO_KEY_LSE)  # [b, h, 8, Tq]
    d_rows = _as_rows(d, q_padded.shape[2], 0.0)  # [b, h, 8, Tq]
    ids = segment_layouts(segment_ids, q_padded.shape[2], k_padded.shape[2]) if variants.segments else None

    inputs = (q_padded, k_padded, v_padded, do_padded, lse_rows, d_rows, ids)
    settings = dict(causal=causal, scale=scale, q_len=q_len, kv_len=kv_len, sizes=sizes, interpret=interpret,
                    variants=variants)
    if fused:
        dk, dv, dq_t = _fused(*inputs, **settings)  # [b, h, Tk, d], [b, h, Tk, dv], [b, h, d, Tq]
        dq = jnp.swapaxes(dq_t, 2, 3)  # [b, h, Tq, d]
    else:
        dk, dv = _dkv(*inputs, **settings)  # [b, h, nk * block_k_dkv, d or dv]
        dq = _dq(*inputs, **settings)  # [b, h, nq * block_q_dq, d]
    dk, dv = dk[:, :, :kv_len], dv[:, :, :kv_len]  # [b, kv_heads, kv_len, d or dv] (or partial sums, below)
    kv_heads = k.shape[1]
    if dk.shape[1] != kv_heads:  # GQA, fused with fewer heads per step than the group: add the f32 partial sums
        dk, dv = (x.reshape(x.shape[0], kv_heads, -1, *x.shape[2:]).sum(axis=2) for x in (dk, dv))
        dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
    grads = (dq[:, :, :q_len], dk, dv)
    if not variants.sinks:
        return grads
    # The sink is a key of value 0: dS_sink = P_sink * (0 - D), P_sink = exp2(sink2 - lse2), summed over rows.
    p_sink = jnp.exp2(sinks.astype(jnp.float32)[None, :, None] * LOG2_E - lse2)  # [b, h, q_len]
    dsinks = -jnp.sum(p_sink * d, axis=(0, 2))  # [h]
    return (*grads, dsinks.astype(sinks.dtype))
