"""``impl="xla"``: JAX's own ``jax.nn.dot_product_attention``, adapted to the flashlib contract.

It is what ``impl="auto"`` uses where no hand-written kernel is native (CPU, GPU): XLA fuses it well and
it needs no interpret mode. Two adaptations: the layout (JAX wants ``[batch, seq, heads, head_dim]``) and
the mask (JAX's ``is_causal`` and ``local_window_size`` are top-left aligned, flashlib's are bottom-right,
and rows that see no key must be exact zeros, not an average over masked keys). So every mask — causal,
window, segment ids — goes in as one boolean ``mask``. Grouped-query attention is JAX's own (k and v with
fewer heads); soft-capping, sinks and a value head_dim of its own are not in ``jax.nn.dot_product_attention``,
and ``impl="xla"`` refuses them (``flashlib.attention`` names the implementations that have them).

The layout transposes sit behind ``lax.optimization_barrier``. Without it, under ``jax.jit`` XLA folds
them into ``jax.nn.dot_product_attention``'s bfloat16 einsums, and the CPU backend runs some of the dots
it makes that way (``P V`` and, in the backward, ``P^T dO``, when batch > 1) with a bfloat16 accumulator:
2-12x the error of naive bfloat16 attention (``dV`` 0.11 against 0.015 on ``[2, 2, 512 | 256, 32]``,
causal; ``tests/test_implementations.py``). Behind the barrier the transposes stay separate copies, as
they are when the function runs eagerly, and every dot keeps its f32 accumulator. The price is one
copy of q, k, v and the output (O(N) against attention's O(N^2)); the barrier's transpose rule puts the
same barrier in the backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flashlib import env
from flashlib.api import register
from flashlib.reference import variant_mask

__all__ = ["xla_attention"]


@register(
    "xla",
    description="jax.nn.dot_product_attention (XLA's fused attention), adapted to the contract",
    native_on=("cpu", "gpu", "tpu"),
    auto_priority=1,
    features=("gqa", "window", "segment_ids"),
)
def xla_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Attention through XLA. Same contract as :func:`flashlib.attention` (GQA, window and segment ids too)."""
    q_len, kv_len = q.shape[2], k.shape[2]
    to_bthd = (0, 2, 1, 3)  # [b, h, t, d] <-> [b, t, h, d]
    mask = variant_mask(q_len, kv_len, causal=causal, window=window, segment_ids=segment_ids)
    if mask is not None:
        mask = mask if mask.ndim == 4 else mask[None, None]  # [b or 1, 1, q, k], as JAX broadcasts it
    if env.backend() == "cpu" and q.dtype == jnp.bfloat16:
        # XLA:CPU has no bf16 matmul units (it converts to f32 itself) and mishandles bf16 dots both ways:
        # folded into bf16 dots it accumulates in bf16 (newest jax), and the bf16 x bf16 -> f32 dots behind
        # a barrier have no kernel on jax 0.7.2 (Colab's). So on the CPU bf16 runs in f32, rounded at the end.
        out = jax.nn.dot_product_attention(*(x.astype(jnp.float32).transpose(to_bthd) for x in (q, k, v)),
                                           scale=scale, mask=mask).transpose(to_bthd).astype(q.dtype)
    else:
        q_t, k_t, v_t = lax.optimization_barrier((q.transpose(to_bthd), k.transpose(to_bthd), v.transpose(to_bthd)))
        out_t = jax.nn.dot_product_attention(q_t, k_t, v_t, scale=scale, mask=mask)  # [b, q, h, d]
        out = lax.optimization_barrier(out_t).transpose(to_bthd)  # [b, h, q, d]
    if mask is not None:  # a row that sees no key is zeros, not JAX's average over its masked keys
        sees_a_key = jnp.any(mask, axis=-1, keepdims=True)  # [b or 1, 1, q, 1]
        out = jnp.where(sees_a_key, out, jnp.zeros((), out.dtype))
    return out
