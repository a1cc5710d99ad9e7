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


@register("reference", description="naive softmax attention: materialises the full [q_len, kv_len] score matrix")
def attention_naive(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False, scale: float | None = None
) -> jax.Array:
    """Stage 1: build the full score matrix, softmax it, multiply by V. Memory is O(q_len * kv_len).

    Inputs in bf16 are multiplied on the MXU with f32 accumulation; the softmax runs in f32.
    """
    scale = default_scale(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale  # [b, h, q, k]
    mask = causal_mask(q.shape[2], k.shape[2]) if causal else None
    state = state_from_scores(s, v.astype(jnp.float32), mask)
    return state_output(state).astype(q.dtype)  # [b, h, q, d]


def _oracle_scores(q, k, causal: bool, scale: float | None) -> np.ndarray:
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if causal:
        q_len, kv_len = q.shape[2], k.shape[2]
        visible = causal_visible(np.arange(q_len)[:, None], np.arange(kv_len)[None, :], q_len=q_len, kv_len=kv_len)
        s = np.where(visible, s, -np.inf)
    return s


def attention_oracle(q, k, v, *, causal: bool = False, scale: float | None = None) -> np.ndarray:
    """The float64 NumPy answer, independent of JAX: what every error in the series is measured against."""
    s = _oracle_scores(q, k, causal, scale)  # [b, h, q, k]
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)  # noqa: E741
    out = np.einsum("bhqk,bhkd->bhqd", p, np.asarray(v, dtype=np.float64))
    return out / np.where(l == 0.0, 1.0, l)


def logsumexp_oracle(q, k, *, causal: bool = False, scale: float | None = None) -> np.ndarray:
    """Row log-sum-exp of the scores in float64 (``-inf`` for a row that sees no key): ``[b, h, q]``."""
    s = _oracle_scores(q, k, causal, scale)
    m = s.max(axis=-1)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return m_safe + np.log(np.exp(s - m_safe[..., None]).sum(axis=-1))


def _oracle_probabilities(q, k, causal: bool, scale: float | None) -> np.ndarray:
    """Softmax probabilities ``[b, h, q, k]`` in float64; a row that sees no key is all zeros."""
    s = _oracle_scores(q, k, causal, scale)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)  # noqa: E741
    return p / np.where(l == 0.0, 1.0, l)


def attention_vjp_oracle(
    q, k, v, do, *, causal: bool = False, scale: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gradients ``(dq, dk, dv)`` of ``sum(attention(q, k, v) * do)`` in float64 NumPy.

    The backward pass every flash-attention kernel implements, with nothing tiled::

        dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D) with D = rowsum(dO * O) = rowsum(P * dP),
        dQ = dS K * scale,  dK = dS^T Q * scale.
    """
    scale = default_scale(np.shape(q)[-1]) if scale is None else scale
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    p = _oracle_probabilities(q, k, causal, scale)  # [b, h, q, k]
    out = np.einsum("bhqk,bhkd->bhqd", p, v)  # [b, h, q, d]
    dv = np.einsum("bhqk,bhqd->bhkd", p, do)  # [b, h, k, d]
    dp = np.einsum("bhqd,bhkd->bhqk", do, v)  # [b, h, q, k]
    d = np.sum(do * out, axis=-1, keepdims=True)  # [b, h, q, 1]
    ds = p * (dp - d)  # [b, h, q, k]
    dq = np.einsum("bhqk,bhkd->bhqd", ds, k) * scale  # [b, h, q, d]
    dk = np.einsum("bhqk,bhqd->bhkd", ds, q) * scale  # [b, h, k, d]
    return dq, dk, dv
