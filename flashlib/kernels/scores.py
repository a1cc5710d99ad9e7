"""What every Pallas kernel computes its scores and row statistics with: one definition for the forward
and both backward kernels, so the backward recomputes the very probabilities the forward normalised.

Scores are kept in base 2 (``s * log2(e)``): the softmax then needs ``exp2``, which is what ``exp`` lowers
to anyway after a multiply by ``log2(e)``. The forward's log-sum-exp residual is base 2 as well
(``lse2 = lse * log2(e)``); :func:`flashlib.kernels.tpu_forward.natural_lse` converts it for a caller.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from flashlib.tiling import NUM_LANES, NUM_SUBLANES

__all__ = ["LN_2", "LOG2_E", "NT_DIMS", "base2_scores", "lanes_to", "sublanes_to"]

LOG2_E = 1.0 / math.log(2.0)  # exp(x) = exp2(x * log2(e))
LN_2 = math.log(2.0)
NT_DIMS = (((1,), (1,)), ((), ()))  # [m, d] x [n, d] -> [m, n]: contract the last dims (q k^T without a transpose)


def base2_scores(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``a b^T * scale * log2(e)`` in f32: scores in base 2. ``a [m, d]``, ``b [n, d]`` -> ``[m, n]``.

    The scale is applied to the f32 product, not folded into ``q`` beforehand: ``q * scale * log2(e)``
    rounded back to bfloat16 moves each score by up to ~|s| * 2^-9, which at large logits (|s| ~ 50) made
    the bf16 forward several times less accurate than naive attention, and — recomputed from the
    unrounded ``q`` — broke the backward (issue 11).
    """
    return lax.dot_general(a, b, NT_DIMS, preferred_element_type=jnp.float32) * (scale * LOG2_E)


def lanes_to(x: jax.Array, width: int) -> jax.Array:
    """A lane-replicated ``[rows, 128]`` tile as ``[rows, width]``: whole-vreg copies, then a slice."""
    repeats = -(-width // NUM_LANES)
    return (jnp.tile(x, (1, repeats)) if repeats > 1 else x)[:, :width]


def sublanes_to(rows: jax.Array, height: int) -> jax.Array:
    """A sublane-replicated ``[8, n]`` row block as ``[height, n]``: whole-vreg copies when ``height`` is a
    multiple of 8, else a broadcast of its first row."""
    if height % NUM_SUBLANES == 0:
        return jnp.tile(rows, (height // NUM_SUBLANES, 1))
    return jnp.broadcast_to(rows[:1], (height, rows.shape[1]))
