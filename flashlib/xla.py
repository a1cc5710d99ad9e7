"""``impl="xla"``: JAX's own ``jax.nn.dot_product_attention``, adapted to the flashlib contract.

It is what ``impl="auto"`` uses where no hand-written kernel is native (CPU, GPU): XLA fuses it well and
it needs no interpret mode. Two adaptations: the layout (JAX wants ``[batch, seq, heads, head_dim]``) and
the mask (JAX's ``is_causal`` is top-left aligned, flashlib's is bottom-right, and rows that see no key
must be exact zeros, not an average over masked keys).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashlib.api import register
from flashlib.reference import causal_mask

__all__ = ["xla_attention"]


@register(
    "xla",
    description="jax.nn.dot_product_attention (XLA's fused attention), adapted to the contract",
    native_on=("cpu", "gpu", "tpu"),
    auto_priority=1,
)
def xla_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False, scale: float | None = None
) -> jax.Array:
    """Attention through XLA. Same contract as :func:`flashlib.attention`."""
    q_len, kv_len = q.shape[2], k.shape[2]
    to_bthd = (0, 2, 1, 3)  # [b, h, t, d] <-> [b, t, h, d]
    mask = causal_mask(q_len, kv_len)[None, None] if causal else None  # [1, 1, q, k]
    out = jax.nn.dot_product_attention(
        q.transpose(to_bthd), k.transpose(to_bthd), v.transpose(to_bthd), scale=scale, mask=mask
    ).transpose(to_bthd)  # [b, h, q, d]
    if causal and q_len > kv_len:
        sees_a_key = (jnp.arange(q_len) + kv_len - q_len >= 0)[:, None]  # [q, 1]
        out = jnp.where(sees_a_key, out, jnp.zeros((), out.dtype))
    return out
