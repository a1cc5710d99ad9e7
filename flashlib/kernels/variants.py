"""What the Pallas kernels need of the attention variants (:mod:`flashlib.masks` gives their meaning): the static
half of a call, the soft-cap in base 2, and the layouts segment ids and sinks travel in.

* :class:`KernelVariants` — window, soft-cap and whether segment ids / sinks are present: hashable, so a
  ``jit`` static argument, and everything a kernel decides at trace time (which blocks may need a mask,
  whether a row can end up seeing no key).
* **soft-cap** (:func:`soft_cap`): the kernels' scores are base 2, ``s2 = s * log2(e)``, and ``c * tanh(s / c)``
  in base 2 is ``C * tanh(s2 / C)`` with ``C = c * log2(e)`` — the same function with a scaled cap. The
  backward multiplies ``dS`` by the cap's derivative ``1 - tanh^2``, from the ``tanh`` it recomputes.
* **segment ids** (:func:`segment_layouts`): a tile's mask compares a query's id with a key's, so the ids come
  in two layouts, both whole vregs: *columns* ``[b, T, 128]`` (an id per row, replicated over lanes, as ``m``
  and ``l`` are) and *rows* ``[b, 8, T]`` (an id per lane, replicated over sublanes, as the backward's lse
  rows are). Padding gets ids no real token has, so a padded key is never in a query's segment.
  Blocks whose segments cannot meet are skipped — no compute, no copy — through :func:`segment_blocks`:
  per-block tables (:func:`flashlib.masks.segment_block_table`) computed outside the kernel (ids are data)
  and handed in by scalar prefetch.
* **sinks** (:func:`sinks_tiles`): each head's sink logit in base 2 as one ``[8, 128]`` tile. The forward
  starts every row's running softmax from it — ``m = sink``, ``l = 1``, ``acc = 0``: the sink is a key of value
  zero seen first — so the lse includes it and a row that sees no key returns zeros. The backward needs
  nothing more in the kernels: with that lse the probabilities are right, and ``dsink = -sum_i P_sink,i D_i``
  is an O(N) reduction outside them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from flashlib import geometry, masks
from flashlib.geometry import MASK_VALUE
from flashlib.kernels.scores import LOG2_E
from flashlib.masks import Window
from flashlib.tiling import NUM_LANES, NUM_SUBLANES

__all__ = ["PAD_KV_SEGMENT", "PAD_Q_SEGMENT", "PLAIN", "KernelVariants", "SegmentBlocks", "mask_scores",
           "segment_blocks", "segment_layouts", "sinks_tiles", "soft_cap", "with_tables"]

# Segment ids given to padded positions: different from each other, so a padded query and a padded key never
# meet, and (being negative) from every real id a packer writes (ids are >= 0 by convention; a negative real
# id still never meets a padded key, whose positions are masked as padding anyway).
PAD_Q_SEGMENT, PAD_KV_SEGMENT = -1, -2


class KernelVariants(NamedTuple):
    """The static variants of one kernel call (a ``jit`` static argument)."""

    window: Window | None = None
    softcap: float | None = None
    segments: bool = False
    sinks: bool = False
    # False: segment ids without the scalar-prefetched block tables — every block in the band is visited and
    # masked. Slower; it exists to measure (a static estimate cannot see work under guards on SMEM data).
    block_tables: bool = True

    @property
    def uses_tables(self) -> bool:
        """Whether the kernels receive :class:`SegmentBlocks` by scalar prefetch (segment ids, tables on)."""
        return self.segments and self.block_tables

    @classmethod
    def of(cls, *, window=None, softcap=None, segment_ids=None, sinks=None) -> KernelVariants:
        """The static half of validated variant options (:func:`flashlib.api.validate_variants`)."""
        return cls(window=window, softcap=softcap, segments=segment_ids is not None, sinks=sinks is not None)

    def may_mask(self, causal: bool, has_padding: bool) -> bool:
        """Whether any block may need an element mask (else every visited block is plain)."""
        return causal or has_padding or self.window is not None or self.segments

    def has_blind_rows(self, causal: bool, q_len: int, kv_len: int) -> bool:
        """Whether a real query row may see no key at all, so that its running max stays ``MASK_VALUE`` and
        masked scores would count as ``exp2(0) = 1``: the band ends before key 0 for the first row (``q_len >
        kv_len`` causal, or a window's right side), or segments (a query whose segment has no key). With a
        sink the running max starts at the sink's logit and such rows are harmless."""
        if self.sinks:
            return False
        right = geometry.band(causal, self.window)[1]
        return self.segments or (right is not None and kv_len - q_len + right < 0)


PLAIN = KernelVariants()  # no variant: textbook attention (GQA and a value head_dim need no flag)


def soft_cap(s2: jax.Array, softcap: float) -> tuple[jax.Array, jax.Array]:
    """``(capped, t)``: base-2 scores ``s2`` soft-capped at ``softcap`` (in natural units), and ``t = tanh(s2 /
    C)`` whose ``1 - t^2`` is the cap's derivative (the backward's factor on ``dS``)."""
    cap2 = softcap * LOG2_E  # the cap in base-2 units
    t = jnp.tanh(s2 * (1.0 / cap2))
    return cap2 * t, t


def _padded(ids: jax.Array, length: int, fill: int) -> jax.Array:
    return jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, length - ids.shape[1])), constant_values=fill)


def segment_layouts(segment_ids: tuple[jax.Array, jax.Array], q_padded_len: int,
                    kv_padded_len: int) -> dict[str, jax.Array]:
    """The ids of ``(q_segments [b, q_len], kv_segments [b, kv_len])``, padded, in the two layouts the kernels
    read: ``q_columns [b, Tq, 128]``, ``q_rows [b, 8, Tq]``, ``kv_columns [b, Tk, 128]``, ``kv_rows [b, 8, Tk]``
    (int32; 128x and 8x the ids, a few bytes per token beside a 256-byte bf16 head_dim-128 row)."""
    q_ids = _padded(segment_ids[0], q_padded_len, PAD_Q_SEGMENT)  # [b, Tq]
    kv_ids = _padded(segment_ids[1], kv_padded_len, PAD_KV_SEGMENT)  # [b, Tk]

    def columns(ids):  # [b, T] -> [b, T, 128]
        return jnp.broadcast_to(ids[:, :, None], (*ids.shape, NUM_LANES))

    def rows(ids):  # [b, T] -> [b, 8, T]
        return jnp.broadcast_to(ids[:, None, :], (ids.shape[0], NUM_SUBLANES, ids.shape[1]))

    return {"q_columns": columns(q_ids), "q_rows": rows(q_ids), "kv_columns": columns(kv_ids),
            "kv_rows": rows(kv_ids)}


def sinks_tiles(sinks: jax.Array) -> jax.Array:
    """``[heads]`` sink logits (natural log) as ``[heads, 8, 128]`` f32 tiles in base 2, one per head."""
    base2 = sinks.astype(jnp.float32) * LOG2_E  # [heads]
    return jnp.broadcast_to(base2[:, None, None], (sinks.shape[0], NUM_SUBLANES, NUM_LANES))


def mask_scores(scores: jax.Array, q_start, kv_start, *, keys_on_rows: bool, q_len: int, kv_len: int,
                causal: bool, window: Window | None = None, q_ids: jax.Array | None = None,
                kv_ids: jax.Array | None = None) -> jax.Array:
    """``scores`` with every invisible element set to ``MASK_VALUE``: a padded key, a key outside the band
    (:func:`flashlib.geometry.band`: causal, window), or (``q_ids``, ``kv_ids`` given, each already broadcast
    to the tile's shape) a key of another segment. ``keys_on_rows``: the tile is transposed, ``[block_k,
    block_q]`` (else ``[block_q, block_k]``); ``q_start``, ``kv_start``: the positions of its first query and key.

    The backward kernels' mask, in absolute positions; the forward kernel builds the same rule relative to
    the tile's corner (an iota difference against one scalar), which estimated fewer cycles there and more
    here (``data/optimisation/backward_README.md``)."""
    q_axis, kv_axis = (1, 0) if keys_on_rows else (0, 1)
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, scores.shape, q_axis)  # like scores
    kv_pos = kv_start + lax.broadcasted_iota(jnp.int32, scores.shape, kv_axis)  # like scores
    visible = kv_pos < kv_len  # like scores
    left, right = geometry.band(causal, window)
    diagonal = q_pos + (kv_len - q_len)  # like scores: each query's diagonal key
    if right is not None:
        visible &= kv_pos <= diagonal + right
    if left is not None:
        visible &= kv_pos >= diagonal - left
    if q_ids is not None:
        visible &= q_ids == kv_ids
    return jnp.where(visible, scores, MASK_VALUE)


class SegmentBlocks(NamedTuple):
    """Which block pairs can meet, for kernels that skip blocks between segments (scalar prefetch, SMEM).

    Both ``[batch * num_outer * num_inner]`` int32, flattened (a 1-D SMEM array is not padded to tiles), indexed
    ``(b * num_outer + outer) * num_inner + inner``: ``live`` is 1 where the pair lies in the band and its id
    ranges overlap; ``fetch`` is the inner block an index map fetches there — the pair's own when live, else
    the last live one before it (the first live one when none is), so a skipped step repeats its
    neighbour's index and the pipeline copies nothing for it."""

    live: jax.Array
    fetch: jax.Array


def segment_blocks(outer_ids: jax.Array, inner_ids: jax.Array, *, outer_len: int, inner_len: int,
                   outer_block: int, inner_block: int, band_visible) -> SegmentBlocks:
    """:class:`SegmentBlocks` for padded ids ``outer_ids [b, To]``, ``inner_ids [b, Ti]`` (real lengths
    ``outer_len``, ``inner_len``) and the band's static block visibility ``band_visible [num_outer, num_inner]``:
    :func:`flashlib.masks.segment_block_table`, flattened for SMEM."""
    live, fetch = masks.segment_block_table(outer_ids, inner_ids, outer_len=outer_len, inner_len=inner_len,
                                            outer_block=outer_block, inner_block=inner_block,
                                            band_visible=band_visible)
    return SegmentBlocks(live.astype(jnp.int32).reshape(-1), fetch.astype(jnp.int32).reshape(-1))


def with_tables(grid: dict, num_tables: int) -> dict:
    """``pallas_call`` keywords for a grid (``grid``, ``in_specs``, ``out_specs``, ``scratch_shapes``): as they
    are, or — with block tables to prefetch (:class:`SegmentBlocks`) — as a ``PrefetchScalarGridSpec`` whose
    first ``num_tables`` operands land in SMEM before the grid runs (index maps and the kernel receive them
    first)."""
    if not num_tables:
        return grid
    return {"grid_spec": pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=num_tables, **grid)}
