"""The per-block workers of ring attention: one query chunk against one key/value chunk, forward and backward.

Ring attention (:mod:`flashlib.ring`) never calls an implementation on the whole sequence; it calls a
*worker* on one ``(query chunk, key chunk)`` pair at a time and merges the partial results with notebook
03's identity. A worker is two functions:

* ``forward(q, k, v, causal) -> (out, lse)``: the attention of ``q [b, h, c, d]`` over just these keys
  ``k, v [b, hk, r, d]`` (``out [b, h, c, dv]`` f32, unnormalised by any other chunk) and its row
  log-sum-exp ``lse [b, h, c]`` f32 (``-inf`` where a row sees none of these keys). ``(out, lse)`` is a
  softmax state: ``m = lse, l = 1, acc = out``.
* ``backward(q, k, v, out, lse, do, causal) -> (dq, dk, dv)`` in f32, where ``out`` and ``lse`` are the
  *global* ones (over every key of the sequence): then ``P = exp(s - lse)`` is this chunk's slice of the
  global probabilities and ``D = rowsum(dO * out)`` the global row term, so the chunk's gradients are exactly
  its share of the full backward (FlashAttention 2's backward, one key chunk at a time).

``causal=True`` is only asked for the diagonal pair (a chunk against itself: equal lengths, query ``i``
sees keys ``j <= i``); every other pair is either fully visible or skipped by the ring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from flashlib.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, blockwise_attention
from flashlib.blockwise_backward import attention_backward
from flashlib.kernels.options import resolve_call
from flashlib.kernels.scores import LN_2, LOG2_E
from flashlib.kernels.tpu_backward import backward as pallas_backward
from flashlib.kernels.tpu_forward import forward as pallas_forward
from flashlib.reference import causal_mask, state_from_scores

__all__ = ["WORKERS", "Worker", "make_worker"]

f32 = jnp.float32


class Worker(NamedTuple):
    """One implementation as a ring worker (see the module docstring for the two signatures)."""

    forward: Callable[..., tuple[jax.Array, jax.Array]]
    backward: Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def _repeat_kv(x: jax.Array, group: int) -> jax.Array:
    return x if group == 1 else jnp.repeat(x, group, axis=1)  # [b, hk, r, .] -> [b, h, r, .]


def _reference_worker(scale: float) -> Worker:
    """The naive worker: the chunk pair's full score matrix, in f32."""

    def scores(q, k, causal):  # [b, h, c, r]
        k = _repeat_kv(k.astype(f32), q.shape[1] // k.shape[1])
        s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(f32), k) * scale
        return jnp.where(causal_mask(q.shape[2], k.shape[2]), s, -jnp.inf) if causal else s

    def forward(q, k, v, causal):
        state = state_from_scores(scores(q, k, causal), _repeat_kv(v.astype(f32), q.shape[1] // k.shape[1]))
        m_safe = jnp.where(jnp.isfinite(state.m), state.m, 0.0)
        lse = m_safe + jnp.log(state.l)  # [b, h, c]   log(0) = -inf for a row that sees none of these keys
        return state.acc / jnp.where(state.l == 0.0, 1.0, state.l)[..., None], lse

    def backward(q, k, v, out, lse, do, causal):
        group = q.shape[1] // k.shape[1]
        p = jnp.exp(scores(q, k, causal) - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])  # [b, h, c, r]
        do = do.astype(f32)
        d = jnp.sum(do * out, axis=-1)  # [b, h, c]
        v_rep = _repeat_kv(v.astype(f32), group)
        ds = p * (jnp.einsum("bhqd,bhkd->bhqk", do, v_rep) - d[..., None])  # [b, h, c, r]
        dq = jnp.einsum("bhqk,bhkd->bhqd", ds, _repeat_kv(k.astype(f32), group)) * scale
        dk = jnp.einsum("bhqk,bhqd->bhkd", ds, q.astype(f32)) * scale  # [b, h, r, d] per query head
        dv = jnp.einsum("bhqk,bhqd->bhkd", p, do)
        b, hk = k.shape[:2]
        dk, dv = (x.reshape(b, hk, group, *x.shape[2:]).sum(axis=2) for x in (dk, dv))  # the group adds up
        return dq, dk, dv

    return Worker(forward, backward)


def _blockwise_worker(scale: float, block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K) -> Worker:
    """:mod:`flashlib.blockwise` as the worker. It computes in f32 whatever the input dtype (bf16 values are
    exact in f32), so the chunks go in as f32 and the partial results come out unrounded."""

    def forward(q, k, v, causal):
        return blockwise_attention(q.astype(f32), k.astype(f32), v.astype(f32), causal=causal, scale=scale,
                                   block_q=block_q, block_k=block_k, return_lse=True)

    def backward(q, k, v, out, lse, do, causal):
        dq, dk, dv, _ = attention_backward(q.astype(f32), k.astype(f32), v.astype(f32), out, lse, do,
                                           causal=causal, scale=scale, block_k=min(block_k, k.shape[2]))
        return dq, dk, dv

    return Worker(forward, backward)


def _pallas_worker(scale: float, block_sizes: Any = None, interpret: Any = None) -> Worker:
    """The Pallas TPU kernels as the worker (:mod:`flashlib.kernels`): the forward kernel with its base-2
    lse and an f32 output, the backward kernels fed the global lse. Block sizes are resolved per chunk
    shape, as the ring traces each pair. The backward kernels return gradients in the inputs' dtype, so a
    bf16 chunk's partial dK/dV are rounded once before the ring adds them in f32."""

    def resolved(q, k, v, causal):
        return resolve_call(q, k, v, causal=causal, scale=scale, block_sizes=block_sizes, interpret=interpret,
                            backward=True)

    def forward(q, k, v, causal):
        call = resolved(q, k, v, causal)
        out, lse2 = pallas_forward(q, k, v, causal=causal, scale=call.scale, sizes=call.sizes,
                                   interpret=call.interpret, return_lse=True, out_dtype=f32)
        return out, lse2 * LN_2

    def backward(q, k, v, out, lse, do, causal):
        call = resolved(q, k, v, causal)
        grads = pallas_backward(q, k, v, out, lse * LOG2_E, do.astype(q.dtype), None, causal=causal,
                                scale=call.scale, sizes=call.sizes, interpret=call.interpret)
        return tuple(g.astype(f32) for g in grads)

    return Worker(forward, backward)


WORKERS: dict[str, tuple[Callable[..., Worker], tuple[str, ...]]] = {
    "reference": (_reference_worker, ()),
    "blockwise": (_blockwise_worker, ("block_q", "block_k")),
    "pallas": (_pallas_worker, ("block_sizes", "interpret")),
}


def make_worker(impl: str, scale: float, options: dict[str, Any]) -> Worker:
    """The worker for ``impl`` with its ``options``; a ValueError naming the choices otherwise."""
    if impl not in WORKERS:
        raise ValueError(f"impl={impl!r} has no ring worker; choose one of {', '.join(map(repr, WORKERS))}")
    factory, accepted = WORKERS[impl]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"impl={impl!r} as a ring worker does not accept option(s) {', '.join(unknown)}; "
                         f"it accepts: {', '.join(accepted) or 'none'}")
    return factory(scale, **options)
