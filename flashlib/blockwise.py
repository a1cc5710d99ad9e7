"""Flash attention in pure JAX: tiles of queries meet a stream of key/value blocks (stage 4 of the series).

The algorithm is the one the Pallas kernel runs, written with ``jax.lax.scan`` instead of a grid:

1. pad ``q`` to whole query blocks and ``k, v`` to whole key blocks (padding is masked, so any length works);
2. keep a :class:`~flashlib.reference.SoftmaxState` per query row: running max ``m``, running sum ``l`` and
   an unnormalised accumulator ``acc``;
3. for each key block: scores ``s = q k^T * scale``, new max, rescale the old ``l`` and ``acc`` by
   ``exp(m_old - m_new)``, add the block's ``exp(s - m_new)`` contributions (:func:`online_update`);
4. normalise once at the end: ``out = acc / l`` (FlashAttention-2 defers the division).

Peak memory is one ``[q_len, block_k]`` slab of scores instead of the ``[q_len, kv_len]`` matrix.

Gradients come from a ``jax.custom_vjp``: autodiff through the ``scan`` would save every block's
probabilities — the whole matrix again, in pieces — so the forward saves only ``(q, k, v, out, lse)`` and
:mod:`flashlib.blockwise_backward` recomputes the probabilities block by block, in O(N) memory too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flashlib.api import check_positive_ints, register
from flashlib.blockwise_backward import attention_backward
from flashlib.geometry import causal_visible
from flashlib.reference import SoftmaxState, default_scale, state_output
from flashlib.tiling import blocks_first, pad_to_multiple

__all__ = [
    "DEFAULT_BLOCK_K",
    "DEFAULT_BLOCK_Q",
    "blocks_first",
    "blockwise_attention",
    "online_update",
    "pad_to_multiple",
]

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128


def online_update(state: SoftmaxState, s: jax.Array, v: jax.Array, mask: jax.Array) -> SoftmaxState:
    """Fold one block of scores ``s [..., q, k]`` and values ``v [..., k, d]`` into the running state.

    This is :func:`~flashlib.reference.merge_states` with the block's own state inlined: the block is
    exponentiated directly against the new maximum, so only the old state needs rescaling.
    """
    s = jnp.where(mask, s, -jnp.inf)  # [..., q, k]
    m_new = jnp.maximum(state.m, jnp.max(s, axis=-1))  # [..., q]
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with no visible key yet stay empty
    alpha = jnp.exp(state.m - m_safe)  # [..., q]    rescales what was accumulated so far
    p = jnp.exp(s - m_safe[..., None])  # [..., q, k]
    return SoftmaxState(
        m=m_new,
        l=state.l * alpha + jnp.sum(p, axis=-1),
        acc=state.acc * alpha[..., None] + jnp.einsum("...qk,...kd->...qd", p, v),
    )


@register(
    "blockwise",
    description="flash attention in pure JAX: scan over KV blocks with online softmax, O(N) memory",
    options=("block_q", "block_k"),
    resolve_options=check_positive_ints,
)
def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Flash attention forward in pure JAX, O(N) memory, any ``q_len``/``kv_len``.

    Args:
      q: ``[batch, heads, q_len, head_dim]``; k, v: ``[batch, heads, kv_len, head_dim]``.
      causal: bottom-right aligned causal mask (query ``i`` sees keys ``j <= i + kv_len - q_len``).
      scale: softmax temperature, default ``1/sqrt(head_dim)``.
      block_q, block_k: tile sizes along the query and key axes (any positive int; no divisibility rule).
      return_lse: also return the row log-sum-exp ``[batch, heads, q_len]`` in f32 (``-inf`` for empty rows).

    Returns:
      ``out`` like ``q`` (and ``lse`` when asked). Both are differentiable (a custom VJP that recomputes
      the probabilities block by block, :mod:`flashlib.blockwise_backward`).
    """
    q_len, kv_len, head_dim = q.shape[2], k.shape[2], q.shape[3]
    scale = default_scale(head_dim) if scale is None else float(scale)
    block_q = min(block_q, q_len)  # a short sequence is one block, not one padded block
    block_k = min(block_k, kv_len)
    return _attention(q, k, v, bool(causal), scale, block_q, block_k, bool(return_lse))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _attention(q, k, v, causal, scale, block_q, block_k, return_lse):
    """Not differentiated: just the forward."""
    out, lse = _forward(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


def _attention_fwd(q, k, v, causal, scale, block_q, block_k, return_lse):
    """Differentiated: the forward, saving O(N) residuals (no probabilities). The output is kept in f32:
    the backward's ``D = rowsum(dO * out)`` must be the probabilities' own ``rowsum(P * dP)``, and from a
    bfloat16-rounded ``out`` it is not — with one visible key, where dQ must be exactly 0, it gave dQ errors
    of 10-25x the naive error (FlashAttention computes D from the rounded output too)."""
    out32, lse = _forward(q, k, v, causal=causal, scale=scale, block_q=block_q, block_k=block_k)
    out = out32.astype(q.dtype)
    return ((out, lse) if return_lse else out), (q, k, v, out32, lse)


def _attention_bwd(causal, scale, block_q, block_k, return_lse, residuals, cotangent):

    del block_q  # the backward walks key blocks only
    do, dlse = cotangent if return_lse else (cotangent, None)
    return attention_backward(*residuals, do, dlse, causal=causal, scale=scale, block_k=block_k)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _forward(q, k, v, *, causal: bool, scale: float, block_q: int, block_k: int) -> tuple[jax.Array, jax.Array]:
    """The scan over key blocks: ``out`` in f32 (the caller rounds it to q's dtype) and the row
    log-sum-exp ``[b, h, q_len]`` f32."""
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]

    qp = pad_to_multiple(q, 2, block_q)  # [b, h, Tq, d]
    num_q_blocks = qp.shape[2] // block_q
    qb = qp.reshape(batch, heads, num_q_blocks, block_q, head_dim)  # [b, h, nq, bq, d]
    kb = blocks_first(pad_to_multiple(k, 2, block_k), block_k)  # [nk, b, h, bk, d]
    vb = blocks_first(pad_to_multiple(v, 2, block_k), block_k).astype(jnp.float32)  # [nk, b, h, bk, d]
    q_pos = jnp.arange(num_q_blocks * block_q).reshape(num_q_blocks, block_q, 1)  # [nq, bq, 1]

    def visit_kv_block(state: SoftmaxState, inputs) -> tuple[SoftmaxState, None]:
        j, k_blk, v_blk = inputs  # k_blk, v_blk: [b, h, bk, d]
        # bf16 values are exact in f32, so upcasting first is the same product with f32 accumulation; the mixed
        # bf16 x bf16 -> f32 form of this 5-d contraction has no CPU kernel in jax 0.7.2 (Colab's).
        s = jnp.einsum("bhnqd,bhkd->bhnqk", qb.astype(jnp.float32), k_blk.astype(jnp.float32)) * scale  # [b,h,nq,bq,bk]
        kv_pos = j * block_k + jnp.arange(block_k)  # [bk]
        mask = kv_pos < kv_len  # [bk]               padded keys are never visible
        if causal:
            mask = mask & causal_visible(q_pos, kv_pos, q_len=q_len, kv_len=kv_len)  # [nq, bq, bk]
        return online_update(state, s, v_blk[:, :, None], mask), None

    init = SoftmaxState(
        m=jnp.full((batch, heads, num_q_blocks, block_q), -jnp.inf, jnp.float32),  # [b, h, nq, bq]
        l=jnp.zeros((batch, heads, num_q_blocks, block_q), jnp.float32),  # [b, h, nq, bq]
        acc=jnp.zeros((batch, heads, num_q_blocks, block_q, head_dim), jnp.float32),  # [b, h, nq, bq, d]
    )
    state, _ = jax.lax.scan(visit_kv_block, init, (jnp.arange(kb.shape[0]), kb, vb))

    out = state_output(state).reshape(batch, heads, -1, head_dim)[:, :, :q_len]  # [b, h, q, d] f32
    m_safe = jnp.where(jnp.isfinite(state.m), state.m, 0.0)
    lse = (m_safe + jnp.log(state.l)).reshape(batch, heads, -1)[:, :, :q_len]  # [b, h, q]; log(0) = -inf
    return out, lse
