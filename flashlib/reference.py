"""Attention and softmax as the textbook writes them: the ground truth every later stage is checked against.

Everything here is deliberately simple:

* :func:`attention_naive` materialises the full ``[q_len, kv_len]`` score matrix (stage 1 of the series);
* :func:`attention_oracle` does the same in float64 NumPy, the yardstick for errors, and
  :func:`attention_vjp_oracle` its gradients (the backward pass written out by hand);
* :func:`softmax_naive`, :func:`softmax_stable` and :func:`softmax_online` are softmax three ways;
* :class:`SoftmaxState` and :func:`merge_states` are the identity flash attention rests on: two partial
  softmax-weighted sums over disjoint key sets combine exactly into the sum over their union.

Shapes follow the library contract: ``q [batch, heads, q_len, head_dim]``, ``k, v [batch, heads, kv_len,
head_dim]``. With ``causal=True`` the mask is bottom-right aligned (query ``i`` sees keys ``j <= i + kv_len -
q_len``), the KV-cache convention of FlashAttention >= 2.1. A query row that sees no key returns zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flashlib.api import register
from flashlib.geometry import causal_visible  # the rule itself; re-exported for the notebooks
from flashlib.masks import FEATURES, Window, element_visible, segments_visible

__all__ = [
    "SoftmaxState",
    "attention_naive",
    "attention_oracle",
    "attention_vjp_oracle",
    "causal_mask",
    "causal_visible",
    "default_scale",
    "logsumexp_oracle",
    "merge_states",
    "softmax_naive",
    "softmax_online",
    "softmax_stable",
    "state_from_scores",
    "state_output",
    "variant_mask",
]


def default_scale(head_dim: int) -> float:
    """The usual ``1 / sqrt(head_dim)`` softmax temperature."""
    return 1.0 / float(np.sqrt(head_dim))


def causal_mask(q_len: int, kv_len: int) -> jax.Array:
    """Boolean ``[q_len, kv_len]`` mask, True where query ``i`` may attend key ``j``."""
    rows = jnp.arange(q_len)[:, None]  # [q_len, 1]
    cols = jnp.arange(kv_len)[None, :]  # [1, kv_len]
    return causal_visible(rows, cols, q_len=q_len, kv_len=kv_len)  # [q_len, kv_len]


# ---------------------------------------------------------------------------------------------------
# Softmax three ways (last axis)
# ---------------------------------------------------------------------------------------------------


def softmax_naive(x: jax.Array) -> jax.Array:
    """``exp(x) / sum(exp(x))`` straight from the definition: overflows to inf/NaN once x > ~88 (f32)."""
    e = jnp.exp(x)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def softmax_stable(x: jax.Array) -> jax.Array:
    """Subtract the row maximum first: mathematically identical, and every exponent is <= 0."""
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - m)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def softmax_online(x: jax.Array) -> jax.Array:
    """One pass over the row keeping a running max ``m`` and running sum ``l`` (Milakov & Gimelshein, 2018).

    When a larger value arrives the old sum is rescaled by ``exp(m_old - m_new)``. The final
    normalisation needs a second, elementwise pass, but the reduction is a single streaming sweep — the
    trick that lets flash attention see keys one block at a time.
    """
    x = jnp.moveaxis(x, -1, 0)  # [n, ...rows]

    def step(carry, xi):
        m, l = carry
        m_new = jnp.maximum(m, xi)
        l_new = l * jnp.exp(m - m_new) + jnp.exp(xi - m_new)
        return (m_new, l_new), None

    init = (jnp.full(x.shape[1:], -jnp.inf, x.dtype), jnp.zeros(x.shape[1:], x.dtype))
    (m, l), _ = jax.lax.scan(step, init, x)
    return jnp.moveaxis(jnp.exp(x - m) / l, 0, -1)


# ---------------------------------------------------------------------------------------------------
# Partial softmax states and their merge
# ---------------------------------------------------------------------------------------------------


class SoftmaxState(NamedTuple):
    """What flash attention carries per query row after seeing some of the keys.

    ``m [..., q]``: the largest score seen; ``l [..., q]``: ``sum exp(s - m)``; ``acc [..., q, d]``:
    ``sum exp(s - m) * v``. The attention output over the keys seen so far is ``acc / l``.
    """

    m: jax.Array
    l: jax.Array  # noqa: E741 - the name of the running sum in every flash attention paper
    acc: jax.Array


def state_from_scores(s: jax.Array, v: jax.Array, mask: jax.Array | None = None) -> SoftmaxState:
    """The state of one block of scores ``s [..., q, k]`` (masked where ``mask`` is False), values ``v [..., k, d]``."""
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)  # [..., q]
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)  # a row with no visible key keeps m = -inf, l = 0
    p = jnp.exp(s - m_safe[..., None])  # [..., q, k]
    return SoftmaxState(m=m, l=jnp.sum(p, axis=-1), acc=jnp.einsum("...qk,...kd->...qd", p, v))


def merge_states(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """Combine the states of two disjoint key sets into the state of their union — exactly.

    ``m = max(m_a, m_b)``, and each side is rescaled by ``exp(m_side - m)`` before adding:
    ``l = l_a e^(m_a - m) + l_b e^(m_b - m)``, ``acc = acc_a e^(m_a - m) + acc_b e^(m_b - m)``.
    Rows that have seen no key on either side (``m = -inf``) stay empty instead of turning NaN.
    """
    m = jnp.maximum(a.m, b.m)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    alpha = jnp.exp(a.m - m_safe)  # [..., q]   (0 where a has seen nothing)
    beta = jnp.exp(b.m - m_safe)  # [..., q]
    return SoftmaxState(
        m=m,
        l=a.l * alpha + b.l * beta,
        acc=a.acc * alpha[..., None] + b.acc * beta[..., None],
    )


def state_output(state: SoftmaxState) -> jax.Array:
    """Normalise a state into the attention output; empty rows give 0, not NaN."""
    l = jnp.where(state.l == 0.0, 1.0, state.l)  # noqa: E741
    return state.acc / l[..., None]


# ---------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------


def variant_mask(q_len: int, kv_len: int, *, causal: bool = False, window: Window | None = None,
                 segment_ids: tuple[jax.Array, jax.Array] | None = None) -> jax.Array | None:
    """Boolean mask, True where a query may attend a key: ``[q_len, kv_len]``, or ``[batch, 1, q_len, kv_len]``
    with segment ids (it broadcasts against scores ``[batch, heads, q_len, kv_len]``); ``None`` when nothing
    is masked."""
    rows, cols = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]  # [q_len, 1], [1, kv_len]
    by_position = element_visible(rows, cols, q_len=q_len, kv_len=kv_len, causal=causal, window=window)
    mask = None if by_position is True else jnp.broadcast_to(by_position, (q_len, kv_len))
    if segment_ids is not None:
        same = segments_visible(jnp.asarray(segment_ids[0]), jnp.asarray(segment_ids[1]))[:, None]
        mask = same if mask is None else mask & same  # [b, 1, q, k]
    return mask


@register("reference", description="naive softmax attention: materialises the full [q_len, kv_len] score matrix",
          features=tuple(FEATURES))
def attention_naive(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: Window | None = None,
    softcap: float | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Stage 1: build the full score matrix, softmax it, multiply by V. Memory is O(q_len * kv_len).

    Inputs in bf16 are multiplied on the MXU with f32 accumulation; the softmax runs in f32. With GQA the kv
    heads are repeated to the query heads (plain, and the naive residuals keep their ``[b, h, q, k]`` shape);
    a sink joins each row as one more state to merge: ``m = sink, l = 1, acc = 0`` (a logit with no value).
    """
    b, heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    if group > 1:  # the reference reads each kv head once per query head (the kernels never copy them)
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # [b, h, k, d], [b, h, k, dv]
    scale = default_scale(d) if scale is None else scale
    # bf16 values are exact in f32, so upcasting first is the same product with f32 accumulation; the mixed
    # bf16 x bf16 -> f32 dot has no kernel in some XLA:CPU paths of jax 0.7.2 (Colab's): seen failing at run time.
    s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale  # [b, h, q, k]
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    mask = variant_mask(q_len, kv_len, causal=causal, window=window, segment_ids=segment_ids)
    state = state_from_scores(s, v.astype(jnp.float32), mask)  # acc [b, h, q, dv]
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], state.m.shape)  # [b, h, q]
        state = merge_states(state, SoftmaxState(m=sink, l=jnp.ones_like(sink), acc=jnp.zeros_like(state.acc)))
    return state_output(state).astype(q.dtype)  # [b, h, q, dv]


# ---------------------------------------------------------------------------------------------------
# The float64 oracle (NumPy, independent of JAX)
# ---------------------------------------------------------------------------------------------------


class _OracleScores(NamedTuple):
    s: np.ndarray  # [b, h, q, k] the scores the softmax sees: scaled, capped, -inf where masked
    capped: np.ndarray | None  # tanh(raw / softcap) where softcap is set (its derivative needs it)
    k: np.ndarray  # [b, h, k, d] keys, repeated to q's heads
    v: np.ndarray  # [b, h, k, dv] values, repeated to q's heads
    sinks: np.ndarray | None  # [1, h, 1] the sink logits


def _oracle_scores(q, k, v, causal: bool, scale: float | None, window=None, softcap=None, segment_ids=None,
                   sinks=None) -> _OracleScores:
    q = np.asarray(q, dtype=np.float64)
    group = q.shape[1] // np.shape(k)[1]
    k = np.repeat(np.asarray(k, dtype=np.float64), group, axis=1)  # [b, h, k, d]
    v = np.repeat(np.asarray(v, dtype=np.float64), group, axis=1)  # [b, h, k, dv]
    scale = default_scale(q.shape[-1]) if scale is None else scale
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    capped = None
    if softcap is not None:
        capped = np.tanh(s / softcap)
        s = softcap * capped
    q_len, kv_len = q.shape[2], k.shape[2]
    rows, cols = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    visible = np.broadcast_to(element_visible(rows, cols, q_len=q_len, kv_len=kv_len, causal=causal, window=window),
                              (q_len, kv_len))
    if segment_ids is not None:
        visible = visible & segments_visible(np.asarray(segment_ids[0]), np.asarray(segment_ids[1]))[:, None]
    s = np.where(visible, s, -np.inf)
    sink = None if sinks is None else np.asarray(sinks, dtype=np.float64)[None, :, None]
    return _OracleScores(s, capped, k, v, sink)


def _oracle_softmax(scores: _OracleScores) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(p [b, h, q, k], p_sink [b, h, q], lse [b, h, q])``: probabilities (a row that sees no key is all
    zeros, or gives everything to its sink), the sink's share, and the log of the denominator (-inf when empty)."""
    s = scores.s
    m = s.max(axis=-1)  # [b, h, q]
    if scores.sinks is not None:
        m = np.maximum(m, scores.sinks)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m[..., None])
    l = p.sum(axis=-1)  # noqa: E741
    p_sink = np.zeros_like(l) if scores.sinks is None else np.exp(scores.sinks - m)
    l = l + p_sink  # noqa: E741
    with np.errstate(divide="ignore"):
        lse = m + np.log(l)
    l_safe = np.where(l == 0.0, 1.0, l)
    return p / l_safe[..., None], p_sink / l_safe, lse


def attention_oracle(q, k, v, *, causal: bool = False, scale: float | None = None, **variants) -> np.ndarray:
    """The float64 NumPy answer, independent of JAX: what every error in the series is measured against.
    ``variants``: ``window``, ``softcap``, ``segment_ids``, ``sinks`` as :mod:`flashlib.masks` defines them."""
    scores = _oracle_scores(q, k, v, causal, scale, **variants)
    p, _, _ = _oracle_softmax(scores)
    return np.einsum("bhqk,bhkd->bhqd", p, scores.v)  # [b, h, q, dv]


def logsumexp_oracle(q, k, *, causal: bool = False, scale: float | None = None, **variants) -> np.ndarray:
    """Row log-sum-exp ``[b, h, q]`` of the scores in float64, sinks included (``-inf`` for a row that sees
    nothing)."""
    v = np.zeros(np.shape(k)[:-1] + (1,))
    return _oracle_softmax(_oracle_scores(q, k, v, causal, scale, **variants))[2]


def attention_vjp_oracle(q, k, v, do, *, causal: bool = False, scale: float | None = None, **variants):
    """The gradients ``(dq, dk, dv)`` of ``sum(attention(q, k, v) * do)`` in float64 NumPy, and ``dsinks``
    as a fourth when ``sinks=`` is given.

    The backward pass every flash-attention kernel implements, with nothing tiled::

        dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D) with D = rowsum(dO * O) = rowsum(P * dP),
        dQ = dS K * scale,  dK = dS^T Q * scale.

    Soft-capping multiplies dS by its derivative ``1 - tanh^2(s / c)``; a group's query heads add their dK and
    dV into their shared kv head; a sink is a key with no value, so ``dsink = -sum over rows of p_sink * D``.
    """
    scale = default_scale(np.shape(q)[-1]) if scale is None else scale
    scores = _oracle_scores(q, k, v, causal, scale, **variants)
    q, do = np.asarray(q, dtype=np.float64), np.asarray(do, dtype=np.float64)
    p, p_sink, _ = _oracle_softmax(scores)  # [b, h, q, k], [b, h, q]
    out = np.einsum("bhqk,bhkd->bhqd", p, scores.v)  # [b, h, q, dv]
    dv = np.einsum("bhqk,bhqd->bhkd", p, do)  # [b, h, k, dv]
    dp = np.einsum("bhqd,bhkd->bhqk", do, scores.v)  # [b, h, q, k]
    d = np.sum(do * out, axis=-1)  # [b, h, q]
    ds = p * (dp - d[..., None])  # [b, h, q, k]
    if scores.capped is not None:
        ds = ds * (1.0 - scores.capped**2)
    dq = np.einsum("bhqk,bhkd->bhqd", ds, scores.k) * scale  # [b, h, q, d]
    dk = np.einsum("bhqk,bhqd->bhkd", ds, q) * scale  # [b, h, k, d]
    kv_heads = np.shape(k)[1]
    dk, dv = (x.reshape(x.shape[0], kv_heads, -1, *x.shape[2:]).sum(axis=2) for x in (dk, dv))  # group -> kv head
    if scores.sinks is None:
        return dq, dk, dv
    return dq, dk, dv, -(p_sink * d).sum(axis=(0, 2))  # dsinks [h]
