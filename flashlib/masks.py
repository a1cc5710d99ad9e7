"""The attention variants real models run, as one contract: which key each query sees, and what else joins
its softmax. Every implementation gives these options one meaning; this module writes the element-level rules
once (the block-level geometry of the causal mask is :mod:`flashlib.geometry`).

Bottom-right alignment throughout: with ``offset = kv_len - q_len``, query ``i`` lines up with key ``i +
offset`` (the last query with the last key, the KV-cache convention of FlashAttention >= 2.1).

* **causal** — query ``i`` sees keys ``j <= i + offset``.
* **window** ``(left, right)`` — query ``i`` sees keys ``i + offset - left <= j <= i + offset + right``; either
  side may be ``None`` (unbounded). ``window=(w, 0)`` with ``causal=True`` is local causal attention over the
  last ``w + 1`` keys (Mistral, Gemma-2's local layers).
* **segment_ids** ``(q_segments [batch, q_len], kv_segments [batch, kv_len])`` — a query sees only keys of its
  own segment (packed sequences).
* **softcap** ``c`` — scores become ``c * tanh(s / c)`` before the mask and softmax (Gemma-2).
* **sinks** ``[heads]`` — one extra logit per head that joins every row's softmax denominator and carries no
  value (gpt-oss): a row can put weight on "nothing".
* **GQA / MQA** — ``k, v`` have ``kv_heads`` dividing q's ``heads``; query head ``h`` reads kv head
  ``h // (heads // kv_heads)``. **Value head_dim** may differ from q's and k's; the output takes v's.

All combine with each other, with ``causal`` and ``scale``, at any lengths. A row that sees no key returns
zeros (with sinks too: the sink carries no value).

NaN (or inf) in what a row cannot see. A *key* a row cannot see never reaches it: its score is replaced before the
softmax, on every implementation. A *value* a row cannot see is multiplied by a probability of exactly 0, and
``0 * NaN`` is NaN: in :func:`flashlib.attention` a NaN value reaches every row that shares a score tile with it —
every row for ``"reference"`` and ``"xla"``, the rows of the blocks that are not skipped for ``"blockwise"`` and
``"pallas"``. So keep values finite (pad with zeros, not NaN). Decoding is the exception: a cache's positions
``>= lengths[b]`` are never seen on any :func:`flashlib.kernels.decode_attention` impl, whatever they hold — their
values are selected away, not multiplied (:mod:`flashlib.decode`). Both claims: ``tests/test_refusals.py``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from flashlib.geometry import causal_visible

__all__ = ["FEATURES", "Window", "check_softcap", "check_window", "element_visible", "segment_block_table",
           "segments_visible", "window_visible"]

Window = tuple[int | None, int | None]

# The variants an implementation may declare it supports (``register(..., features=...)``), in words.
FEATURES: dict[str, str] = {
    "gqa": "grouped-query attention (k and v with fewer heads than q)",
    "value_head_dim": "a value head_dim different from q's and k's",
    "window": "a sliding window (window=)",
    "softcap": "logit soft-capping (softcap=)",
    "segment_ids": "packed sequences (segment_ids=)",
    "sinks": "attention sinks (sinks=)",
}


def check_window(window: Any) -> Window | None:
    """``window`` as ``(left, right)`` with ints >= 0 or ``None`` per side, or a ``ValueError`` naming the fix."""
    if window is None:
        return None
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise ValueError(f"window must be a pair (left, right) of key counts (or None per side), got {window!r}; "
                         "e.g. window=(127, 0) with causal=True for local attention over the last 128 keys")
    sides = []
    for side, value in zip(("left", "right"), window, strict=True):
        if value is None:
            sides.append(None)
            continue
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"window's {side} side must be an int >= 0 or None (unbounded), got {value!r}")
        sides.append(int(value))
    return (sides[0], sides[1])


def check_softcap(softcap: Any) -> float | None:
    """``softcap`` as a float (``None`` stays ``None``), or a ``ValueError`` naming the fix."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not (isinstance(softcap, (int, float, np.floating, np.integer))
                                         and np.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite number (Gemma-2 uses 50.0), got {softcap!r}")
    return float(softcap)


def window_visible(q_pos, kv_pos, *, q_len: int, kv_len: int, window: Window):
    """True where key ``kv_pos`` lies inside query ``q_pos``'s window (ints, NumPy or JAX arrays)."""
    left, right = window
    centre = q_pos + (kv_len - q_len)
    inside = True
    if left is not None:
        inside = inside & (kv_pos >= centre - left)
    if right is not None:
        inside = inside & (kv_pos <= centre + right)
    return inside


def segments_visible(q_segments, kv_segments):
    """``[..., q_len, kv_len]``: True where the query's segment id equals the key's (broadcast over batch)."""
    return q_segments[..., :, None] == kv_segments[..., None, :]


def element_visible(q_pos, kv_pos, *, q_len: int, kv_len: int, causal: bool, window: Window | None = None):
    """True where query ``q_pos`` may attend key ``kv_pos`` by position (causal and window; segments are data,
    see :func:`segments_visible`). ``True`` (a Python bool) when nothing masks by position."""
    visible = causal_visible(q_pos, kv_pos, q_len=q_len, kv_len=kv_len) if causal else True
    if window is not None:
        visible = visible & window_visible(q_pos, kv_pos, q_len=q_len, kv_len=kv_len, window=window)
    return visible


def _id_ranges(ids, length: int, block: int, xp=jnp):
    """``(low, high)`` ``[b, blocks]``: the smallest and largest id among each block's real positions (a block
    of padding alone gets an empty range, low > high)."""
    batch, padded = ids.shape
    real = xp.arange(padded) < length  # [T]
    big = np.iinfo(np.int32).max
    low = xp.where(real, ids, big).reshape(batch, padded // block, block).min(-1)  # [b, blocks]
    high = xp.where(real, ids, -big).reshape(batch, padded // block, block).max(-1)  # [b, blocks]
    return low, high


def segment_block_table(outer_ids, inner_ids, *, outer_len: int, inner_len: int, outer_block: int,
                        inner_block: int, band_visible, xp=jnp):
    """``(live, fetch)`` ``[b, num_outer, num_inner]``: which pairs of blocks can meet, and the block a kernel's
    index map fetches for each pair — what the Pallas kernels receive by scalar prefetch to skip blocks
    between segments (ids are data, so this is computed outside the kernel, per call).

    ``outer_ids [b, To]``, ``inner_ids [b, Ti]``: segment ids padded to whole blocks (``outer_len``,
    ``inner_len`` are real); ``band_visible [num_outer, num_inner]``: the band's static block visibility. Two
    blocks can meet only if their id ranges overlap — exact for packed (non-decreasing) ids, conservative for
    any others. ``fetch`` is the pair's own block when live, else the last live block before it (the first live
    one when none is): a skipped step repeats its neighbour's index, so the pipeline copies nothing for it.
    ``xp=np`` computes the same tables in NumPy (the pictures: no JAX dispatch, no compile per shape).
    """
    outer_ids, inner_ids = xp.asarray(outer_ids, xp.int32), xp.asarray(inner_ids, xp.int32)
    outer_low, outer_high = _id_ranges(outer_ids, outer_len, outer_block, xp)  # [b, no]
    inner_low, inner_high = _id_ranges(inner_ids, inner_len, inner_block, xp)  # [b, ni]
    overlap = (outer_low[:, :, None] <= inner_high[:, None, :]) & (inner_low[:, None, :] <= outer_high[:, :, None])
    live = overlap & xp.asarray(band_visible)[None]  # [b, no, ni]
    inner = xp.arange(live.shape[-1], dtype=xp.int32)
    cummax = np.maximum.accumulate if xp is np else lax.cummax
    last_live = cummax(xp.where(live, inner, -1), axis=2)  # [b, no, ni]   the last live block so far
    first_live = xp.argmax(live, axis=2).astype(xp.int32)[..., None]  # [b, no, 1]   0 when none is
    return live, xp.where(last_live >= 0, last_live, first_live)
