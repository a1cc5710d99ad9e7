"""The TPU's tiling rule, as numbers and helpers every layer above reads: lanes, sublanes, rounding, padding.

A TPU vector register holds an ``[8, 128]`` tile of 32-bit values: 8 *sublanes* by 128 *lanes*. A block
that Pallas copies into VMEM is a whole number of such tiles in its last two dimensions (or spans the whole
array dimension). Along rows the multiple grows as the dtype shrinks, because narrower values are packed
per 32-bit sublane: 8 rows for float32, 16 for bfloat16 (:func:`sublanes`).

This module is the ground of the library: it imports nothing from flashlib, so the kernels, their block
sizes, the cost model and the pure-JAX stages all read one definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "F32_BYTES", "KERNELS", "NUM_LANES", "NUM_SUBLANES", "blocks_first", "pad_to_multiple", "round_up", "sublanes",
]

NUM_LANES = 128  # lanes of a vector register: the minor (last) dimension of a tile
NUM_SUBLANES = 8  # sublanes of a vector register for 32-bit values: the second-minor dimension
F32_BYTES = 4  # the kernels' running statistics, accumulators and score tiles are float32 whatever the input
# The Pallas kernels, by the one name each has in block-size fields, cost counts and estimates: the forward,
# the dK/dV kernel, the separate dQ kernel, and the dK/dV kernel that accumulates dQ^T too ("fused", tiled
# like "dkv").
KERNELS: tuple[str, ...] = ("forward", "dkv", "dq", "fused")


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``x``."""
    return -(-x // multiple) * multiple


def sublanes(dtype) -> int:
    """Rows of one ``[rows, 128]`` register tile for ``dtype``: 8 for float32, 16 for bfloat16."""
    return NUM_SUBLANES * F32_BYTES // np.dtype(dtype).itemsize


def pad_to_multiple(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """Zero-pad ``axis`` of ``x`` up to the next multiple of ``multiple`` (no copy when already aligned)."""
    extra = -x.shape[axis] % multiple
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def blocks_first(x: jax.Array, block: int) -> jax.Array:
    """``[b, h, n*block, d]`` -> ``[n, b, h, block, d]``: the block index leads so ``scan`` can walk it."""
    batch, heads, length, head_dim = x.shape
    return jnp.moveaxis(x.reshape(batch, heads, length // block, block, head_dim), 2, 0)
