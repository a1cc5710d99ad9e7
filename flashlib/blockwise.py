"""Flash attention in pure JAX: tiles of queries meet a stream of key/value blocks (stage 4 of the series).

The algorithm is the one the Pallas kernel runs, written with ``jax.lax.scan`` instead of a grid:

1. pad ``q`` to whole query blocks and ``k, v`` to whole key blocks (padding is masked, so any length works);
2. keep a :class:`~flashlib.reference.SoftmaxState` per query row: running max ``m``, running sum ``l`` and
   an unnormalised accumulator ``acc``;
3. for each key block: scores ``s = q k^T * scale``, new max, rescale the old ``l`` and ``acc`` by
   ``exp(m_old - m_new)``, add the block's ``exp(s - m_new)`` contributions (:func:`online_update`);
4. normalise once at the end: ``out = acc / l`` (FlashAttention-2 defers the division).

Peak memory is one ``[q_len, block_k]`` slab of scores instead of the ``[q_len, kv_len]`` matrix.

Every variant of :mod:`flashlib.masks` runs here: a group's query heads share their kv head's blocks (a
reshape, no copy), the window and segment ids add to each block's mask, the soft-cap bends the scores before
it, and a sink joins the state once at the end, as one more state to merge (``m = sink, l = 1, acc = 0``).

Gradients come from a ``jax.custom_vjp``: autodiff through the ``scan`` would save every block's
probabilities — the whole matrix again, in pieces — so the forward saves only ``(q, k, v, out, lse)`` and
:mod:`flashlib.blockwise_backward` recomputes the probabilities block by block, in O(N) memory too.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flashlib.api import check_positive_ints, register
from flashlib.blockwise_backward import attention_backward, block_visible
from flashlib.masks import FEATURES
from flashlib.reference import SoftmaxState, default_scale, merge_states, state_output
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
    features=tuple(FEATURES),
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
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Flash attention forward in pure JAX, O(N) memory, any ``q_len``/``kv_len``.

    Args:
      q: ``[batch, heads, q_len, head_dim]``; k: ``[batch, kv_heads, kv_len, head_dim]``; v: ``[batch,
        kv_heads, kv_len, v_head_dim]`` (``kv_heads`` divides ``heads``).
      causal: bottom-right aligned causal mask (query ``i`` sees keys ``j <= i + kv_len - q_len``).
      scale: softmax temperature, default ``1/sqrt(head_dim)``.
      block_q, block_k: tile sizes along the query and key axes (any positive int; no divisibility rule).
      return_lse: also return the row log-sum-exp ``[batch, heads, q_len]`` in f32 (``-inf`` for empty rows;
        the sink is part of the sum).
      window, softcap, segment_ids, sinks: the variants, as :mod:`flashlib.masks` defines them.

    Returns:
      ``out [batch, heads, q_len, v_head_dim]`` in q's dtype (and ``lse`` when asked). Both are
      differentiable (a custom VJP that recomputes the probabilities block by block,
      :mod:`flashlib.blockwise_backward`), for ``sinks`` too.
    """
    q_len, kv_len, head_dim = q.shape[2], k.shape[2], q.shape[3]
    scale = default_scale(head_dim) if scale is None else float(scale)
    block_q = min(block_q, q_len)  # a short sequence is one block, not one padded block
    block_k = min(block_k, kv_len)
    static = _Static(bool(causal), scale, block_q, block_k, bool(return_lse),
                     None if window is None else tuple(window), None if softcap is None else float(softcap))
    return _attention(q, k, v, segment_ids, sinks, static)


class _Static(NamedTuple):
    """The call's static configuration (hashable: the custom VJP's non-differentiable argument)."""

    causal: bool
    scale: float
    block_q: int
    block_k: int
    return_lse: bool
    window: tuple[int | None, int | None] | None
    softcap: float | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, segment_ids, sinks, static: _Static):
    """Not differentiated: just the forward."""
    out, lse = _forward(q, k, v, segment_ids, sinks, static)
    out = out.astype(q.dtype)
    return (out, lse) if static.return_lse else out


def _attention_fwd(q, k, v, segment_ids, sinks, static: _Static):
    """Differentiated: the forward, saving O(N) residuals (no probabilities). The output is kept in f32:
    the backward's ``D = rowsum(dO * out)`` must be the probabilities' own ``rowsum(P * dP)``, and from a
    bfloat16-rounded ``out`` it is not — with one visible key, where dQ must be exactly 0, it gave dQ errors
    of 10-25x the naive error (FlashAttention computes D from the rounded output too)."""
    out32, lse = _forward(q, k, v, segment_ids, sinks, static)
    out = out32.astype(q.dtype)
    return ((out, lse) if static.return_lse else out), (q, k, v, segment_ids, sinks, out32, lse)


def _attention_bwd(static: _Static, residuals, cotangent):
    q, k, v, segment_ids, sinks, out, lse = residuals
    do, dlse = cotangent if static.return_lse else (cotangent, None)
    dq, dk, dv, dsinks = attention_backward(
        q, k, v, out, lse, do, dlse, causal=static.causal, scale=static.scale, block_k=static.block_k,
        window=static.window, softcap=static.softcap, segment_ids=segment_ids, sinks=sinks)
    return dq, dk, dv, None, dsinks  # segment ids are integers: no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


def _forward(q, k, v, segment_ids, sinks, static: _Static) -> tuple[jax.Array, jax.Array]:
    """The scan over key blocks: ``out`` in f32 (the caller rounds it to q's dtype) and the row
    log-sum-exp ``[b, h, q_len]`` f32."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len, v_dim = k.shape[1], k.shape[2], v.shape[3]
    group, block_q, block_k = heads // kv_heads, static.block_q, static.block_k

    qp = pad_to_multiple(q, 2, block_q)  # [b, h, Tq, d]
    num_q_blocks = qp.shape[2] // block_q
    qb = qp.reshape(batch, kv_heads, group, num_q_blocks, block_q, head_dim)  # [b, hk, g, nq, bq, d]
    kb = blocks_first(pad_to_multiple(k, 2, block_k), block_k)  # [nk, b, hk, bk, d]
    vb = blocks_first(pad_to_multiple(v, 2, block_k), block_k).astype(jnp.float32)  # [nk, b, hk, bk, dv]
    q_pos = jnp.arange(num_q_blocks * block_q).reshape(num_q_blocks, block_q, 1)  # [nq, bq, 1]
    q_seg = kv_seg = None
    if segment_ids is not None:
        q_seg = pad_to_multiple(segment_ids[0], 1, block_q).reshape(batch, num_q_blocks, block_q, 1)  # [b,nq,bq,1]
        kv_seg = pad_to_multiple(segment_ids[1], 1, block_k).reshape(batch, -1, block_k)  # [b, nk, bk]
        kv_seg = jnp.moveaxis(kv_seg, 1, 0)  # [nk, b, bk]

    def visit_kv_block(state: SoftmaxState, inputs) -> tuple[SoftmaxState, None]:
        j, k_blk, v_blk, kv_seg_blk = inputs  # k_blk [b, hk, bk, d], v_blk [b, hk, bk, dv], kv_seg_blk [b, bk]
        # bf16 values are exact in f32, so upcasting first is the same product with f32 accumulation; the mixed
        # bf16 x bf16 -> f32 form of this 6-d contraction has no CPU kernel in jax 0.7.2 (Colab's).
        s = jnp.einsum("bngNqd,bnkd->bngNqk", qb.astype(jnp.float32), k_blk.astype(jnp.float32)) * static.scale
        if static.softcap is not None:  # s: [b, hk, g, nq, bq, bk]
            s = static.softcap * jnp.tanh(s / static.softcap)
        kv_pos = j * block_k + jnp.arange(block_k)  # [bk]
        mask = block_visible(q_pos, kv_pos, q_len=q_len, kv_len=kv_len, causal=static.causal, window=static.window,
                             q_seg=q_seg, kv_seg=None if kv_seg_blk is None else kv_seg_blk[:, None, None, :])
        mask = mask if mask.ndim < 4 else mask[:, None, None]  # segments: [b, nq, bq, bk] -> [b, 1, 1, nq, bq, bk]
        return online_update(state, s, v_blk[:, :, None, None], mask), None

    rows = (batch, kv_heads, group, num_q_blocks, block_q)
    init = SoftmaxState(m=jnp.full(rows, -jnp.inf, jnp.float32), l=jnp.zeros(rows, jnp.float32),
                        acc=jnp.zeros((*rows, v_dim), jnp.float32))
    state, _ = jax.lax.scan(visit_kv_block, init, (jnp.arange(kb.shape[0]), kb, vb, kv_seg))
    if sinks is not None:  # one more state per row: the sink's logit, no value
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, group, 1, 1), rows)
        state = merge_states(state, SoftmaxState(m=sink, l=jnp.ones(rows, jnp.float32),
                                                 acc=jnp.zeros((*rows, v_dim), jnp.float32)))

    out = state_output(state).reshape(batch, heads, -1, v_dim)[:, :, :q_len]  # [b, h, q, dv] f32
    m_safe = jnp.where(jnp.isfinite(state.m), state.m, 0.0)
    lse = (m_safe + jnp.log(state.l)).reshape(batch, heads, -1)[:, :, :q_len]  # [b, h, q]; log(0) = -inf
    return out, lse
