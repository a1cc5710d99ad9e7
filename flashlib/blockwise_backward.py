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

Peak memory is one ``[q_len, block_k]`` slab, as in the forward. The Pallas kernels
(:mod:`flashlib.kernels.tpu_backward`) compute the same thing, tiled along queries too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashlib.geometry import causal_visible
from flashlib.tiling import blocks_first, pad_to_multiple

__all__ = ["attention_backward"]


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
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` of attention from the forward's residuals and the cotangent ``do`` of ``out``.

    Args:
      q, k, v: the forward's inputs; out: its output; lse: its row log-sum-exp ``[b, h, q_len]`` f32
        (``-inf`` for a row that sees no key).
      do: the cotangent of ``out``; dlse: the cotangent of ``lse`` if it was differentiated too (the
        lse's own gradient is ``P``, so it adds ``P * dlse`` to ``dS``: folded into ``D``).
      causal, scale: as in the forward; block_k: keys per scan step.

    Returns:
      ``dq, dk, dv`` in the dtypes of ``q, k, v``; everything in between is float32.
    """
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    f32 = jnp.float32
    q32, do32 = q.astype(f32), do.astype(f32)  # [b, h, q, d]
    d = jnp.sum(do32 * out.astype(f32), axis=-1)  # [b, h, q]
    if dlse is not None:
        d = d - dlse  # [b, h, q]
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # [b, h, q]   a row that sees no key is masked everywhere

    kb = blocks_first(pad_to_multiple(k, 2, block_k), block_k)  # [nk, b, h, bk, d]
    vb = blocks_first(pad_to_multiple(v, 2, block_k), block_k)  # [nk, b, h, bk, d]
    q_pos = jnp.arange(q_len)[:, None]  # [q, 1]

    def visit_kv_block(dq_acc: jax.Array, inputs) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        j, k_blk, v_blk = inputs  # k_blk, v_blk: [b, h, bk, d]
        kv_pos = j * block_k + jnp.arange(block_k)  # [bk]
        visible = kv_pos < kv_len  # [bk]                padded keys are never visible
        if causal:
            visible = visible & causal_visible(q_pos, kv_pos, q_len=q_len, kv_len=kv_len)  # [q, bk]
        k32 = k_blk.astype(f32)  # [b, h, bk, d]   bf16 is exact in f32: the same products, f32 accumulation
        s = jnp.einsum("bhqd,bhkd->bhqk", q32, k32) * scale  # [b, h, q, bk]
        p = jnp.exp(jnp.where(visible, s, -jnp.inf) - lse[..., None])  # [b, h, q, bk]   exp(-inf) = 0
        dv_blk = jnp.einsum("bhqk,bhqd->bhkd", p, do32)  # [b, h, bk, d]
        dp = jnp.einsum("bhqd,bhkd->bhqk", do32, v_blk.astype(f32))  # [b, h, q, bk]
        ds = p * (dp - d[..., None])  # [b, h, q, bk]
        dk_blk = jnp.einsum("bhqk,bhqd->bhkd", ds, q32)  # [b, h, bk, d]   (x scale at the end)
        dq_acc = dq_acc + jnp.einsum("bhqk,bhkd->bhqd", ds, k32)  # [b, h, q, d]
        return dq_acc, (dk_blk, dv_blk)

    dq0 = jnp.zeros((batch, heads, q_len, head_dim), f32)  # [b, h, q, d]
    dq, (dk, dv) = jax.lax.scan(visit_kv_block, dq0, (jnp.arange(kb.shape[0]), kb, vb))  # dk, dv: [nk, b, h, bk, d]

    def rows_of(blocks: jax.Array) -> jax.Array:
        """``[nk, b, h, bk, d]`` -> ``[b, h, kv_len, d]``: undo :func:`blocks_first`, drop the padding."""
        return jnp.moveaxis(blocks, 0, 2).reshape(batch, heads, -1, head_dim)[:, :, :kv_len]

    dq = (dq * scale).astype(q.dtype)  # [b, h, q, d]
    return dq, (rows_of(dk) * scale).astype(k.dtype), rows_of(dv).astype(v.dtype)
