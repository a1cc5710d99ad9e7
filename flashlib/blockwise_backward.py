"""The backward pass of :mod:`flashlib.blockwise` in pure JAX: the probabilities recomputed block by block.

Autodiff through the forward's ``scan`` would save every block's probabilities for the backward: the whole
``[q_len, kv_len]`` matrix again, only in pieces. The custom VJP saves ``(q, k, v, out, lse)`` instead, and
this module walks the key blocks once more::

    D = rowsum(dO * out)                           [q]      (= rowsum(P * dP), one number per query)
    for each key block j:
        P_j  = exp(q k_j^T * scale - lse)          [q, block_k]   recomputed from the saved lse
        dV_j = P_j^T dO,   dP_j = dO v_j^T
        dS_j = P_j * (dP_j - D)
        dK_j = dS_j^T q * scale                    finished: this key block's rows
        dQ  += dS_j k_j * scale                    the scan's carry

With the variants of :mod:`flashlib.masks`: the mask of each block adds the window and segment ids; a
soft-cap multiplies ``dS`` by its derivative ``1 - tanh^2(s / c)``; a group's query heads add their ``dK``
and ``dV`` into the kv head they share (the einsums sum over the group); a sink is a key with no value, so
``dsink = -sum over rows of exp(sink - lse) * D``.

Peak memory is one ``[q_len, block_k]`` slab, as in the forward. The Pallas kernels
(:mod:`flashlib.kernels.tpu_backward`) compute the same thing, tiled along queries too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashlib.masks import Window, element_visible
from flashlib.tiling import blocks_first, pad_to_multiple

__all__ = ["attention_backward", "block_visible"]


def block_visible(q_pos, kv_pos, *, q_len: int, kv_len: int, causal: bool, window: Window | None = None,
                  q_seg=None, kv_seg=None) -> jax.Array:
    """The element mask of one key block: real (not padded) keys the query may see by position, and of its
    segment when ``q_seg``/``kv_seg`` (broadcastable to the positions' shape) are given."""
    visible = kv_pos < kv_len  # padded keys are never visible
    visible = visible & element_visible(q_pos, kv_pos, q_len=q_len, kv_len=kv_len, causal=causal, window=window)
    if q_seg is not None:
        visible = visible & (q_seg == kv_seg)
    return visible


def attention_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    do: jax.Array,
    dlse: jax.Array | None = None,
    *,
    causal: bool,
    scale: float,
    block_k: int,
    window: Window | None = None,
    softcap: float | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """``(dq, dk, dv, dsinks)`` of attention from the forward's residuals and the cotangent ``do`` of ``out``.

    Args:
      q, k, v: the forward's inputs; out: its output; lse: its row log-sum-exp ``[b, h, q_len]`` f32
        (``-inf`` for a row that sees no key).
      do: the cotangent of ``out``; dlse: the cotangent of ``lse`` if it was differentiated too (the
        lse's own gradient is ``P``, so it adds ``P * dlse`` to ``dS``: folded into ``D``).
      causal, scale: as in the forward; block_k: keys per scan step; window, softcap, segment_ids, sinks: the
        variants, as in the forward.

    Returns:
      ``dq, dk, dv`` in the dtypes of ``q, k, v``, and ``dsinks`` like ``sinks`` (``None`` without sinks);
      everything in between is float32.
    """
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len, v_dim = k.shape[1], k.shape[2], v.shape[3]
    group = heads // kv_heads
    f32 = jnp.float32
    q32 = q.astype(f32).reshape(batch, kv_heads, group, q_len, head_dim)  # [b, hk, g, q, d]
    do32 = do.astype(f32).reshape(batch, kv_heads, group, q_len, v_dim)  # [b, hk, g, q, dv]
    d = jnp.sum(do32 * out.astype(f32).reshape(do32.shape), axis=-1)  # [b, hk, g, q]
    if dlse is not None:
        d = d - dlse.reshape(d.shape)  # [b, hk, g, q]
    lse = lse.reshape(d.shape)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # [b, hk, g, q]   a row that sees no key is masked everywhere

    kb = blocks_first(pad_to_multiple(k, 2, block_k), block_k)  # [nk, b, hk, bk, d]
    vb = blocks_first(pad_to_multiple(v, 2, block_k), block_k)  # [nk, b, hk, bk, dv]
    q_pos = jnp.arange(q_len)[:, None]  # [q, 1]
    q_seg = kv_seg = None
    if segment_ids is not None:
        q_seg = segment_ids[0][:, :, None]  # [b, q, 1]
        kv_seg = pad_to_multiple(segment_ids[1], 1, block_k).reshape(batch, -1, block_k)  # [b, nk, bk]
        kv_seg = jnp.moveaxis(kv_seg, 1, 0)  # [nk, b, bk]

    def visit_kv_block(dq_acc: jax.Array, inputs) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        j, k_blk, v_blk, kv_seg_blk = inputs  # k_blk [b, hk, bk, d], v_blk [b, hk, bk, dv], kv_seg_blk [b, bk]
        kv_pos = j * block_k + jnp.arange(block_k)  # [bk]
        visible = block_visible(q_pos, kv_pos, q_len=q_len, kv_len=kv_len, causal=causal, window=window,
                                q_seg=q_seg, kv_seg=None if kv_seg_blk is None else kv_seg_blk[:, None, :])
        visible = visible if visible.ndim < 3 else visible[:, None, None]  # segments: [b, q, bk] -> [b, 1, 1, q, bk]
        k32 = k_blk.astype(f32)  # [b, hk, bk, d]   bf16 is exact in f32: the same products, f32 accumulation
        s = jnp.einsum("bngqd,bnkd->bngqk", q32, k32) * scale  # [b, hk, g, q, bk]
        if softcap is not None:
            capped = jnp.tanh(s / softcap)
            s = softcap * capped
        p = jnp.exp(jnp.where(visible, s, -jnp.inf) - lse[..., None])  # [b, hk, g, q, bk]   exp(-inf) = 0
        dv_blk = jnp.einsum("bngqk,bngqd->bnkd", p, do32)  # [b, hk, bk, dv]   the group's heads add up
        dp = jnp.einsum("bngqd,bnkd->bngqk", do32, v_blk.astype(f32))  # [b, hk, g, q, bk]
        ds = p * (dp - d[..., None])  # [b, hk, g, q, bk]
        if softcap is not None:
            ds = ds * (1.0 - capped * capped)  # d(c tanh(s / c)) / ds
        dk_blk = jnp.einsum("bngqk,bngqd->bnkd", ds, q32)  # [b, hk, bk, d]   (x scale at the end)
        dq_acc = dq_acc + jnp.einsum("bngqk,bnkd->bngqd", ds, k32)  # [b, hk, g, q, d]
        return dq_acc, (dk_blk, dv_blk)

    dq0 = jnp.zeros(q32.shape, f32)  # [b, hk, g, q, d]
    dq, (dk, dv) = jax.lax.scan(visit_kv_block, dq0, (jnp.arange(kb.shape[0]), kb, vb, kv_seg))  # [nk, b, hk, bk, .]

    def rows_of(blocks: jax.Array) -> jax.Array:
        """``[nk, b, hk, bk, x]`` -> ``[b, hk, kv_len, x]``: undo :func:`blocks_first`, drop the padding."""
        return jnp.moveaxis(blocks, 0, 2).reshape(batch, kv_heads, -1, blocks.shape[-1])[:, :, :kv_len]

    dsinks = None
    if sinks is not None:  # a key with no value: dS = p_sink (0 - D)
        p_sink = jnp.exp(sinks.astype(f32).reshape(1, kv_heads, group, 1) - lse)  # [b, hk, g, q]
        dsinks = (-(p_sink * d).sum(axis=(0, 3))).reshape(heads).astype(sinks.dtype)  # [h]
    dq = (dq * scale).reshape(q.shape).astype(q.dtype)  # [b, h, q, d]
    return dq, (rows_of(dk) * scale).astype(k.dtype), rows_of(dv).astype(v.dtype), dsinks
