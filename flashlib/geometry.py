"""The geometry of the mask's band: which query sees which key, and which blocks of a grid that decides.

Bottom-right alignment throughout (the KV-cache convention of FlashAttention >= 2.1): query ``i`` sees key
``j`` when ``j <= i + kv_len - q_len`` (causal), or — with a sliding window ``(left, right)`` — when ``j`` lies
within ``left`` keys before and ``right`` keys after that diagonal key. Causal attention is the band ``(None,
0)`` (:func:`band`). One rule at three grains:

* elements — :func:`causal_visible` (and :mod:`flashlib.masks` for windows and segments), for the oracle,
  the pure-JAX stages and the kernels' element masks;
* blocks — :func:`block_is_visible`, :func:`block_needs_mask`, :func:`last_key_seen`, :func:`first_key_seen`,
  :func:`first_query_seeing`, :func:`last_query_seeing`, :func:`live_range`: what a kernel's ``pl.when``
  guards and index maps decide per grid step;
* grids — :func:`first_query_blocks`, :func:`last_kv_blocks`, :func:`visited_blocks`, :func:`forward_tiles`,
  :func:`live_steps` (and :func:`live_range` on an array of outer blocks), :func:`live_schedule`: the same
  decisions for a whole grid at once, which :mod:`flashlib.cost` counts (windows included) and the kernels size
  (or, causal, tabulate) their grids by.

Everything is plain arithmetic, so one function runs on Python ints, NumPy arrays and the traced program
ids inside a kernel: the kernel and its cost estimate cannot disagree about a block. Like JAX's splash
attention keeps its mask geometry beside its masks, this module is the only place the rule is written.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from flashlib.tiling import round_up

__all__ = [
    "MASK_VALUE",
    "band",
    "block_is_visible",
    "block_needs_mask",
    "causal_visible",
    "compacts",
    "compacted_schedule",
    "compacts_by_table",
    "fetched_block",
    "first_key_seen",
    "first_query_blocks",
    "first_query_seeing",
    "forward_tiles",
    "last_key_seen",
    "last_kv_blocks",
    "last_query_seeing",
    "live_range",
    "live_schedule",
    "live_steps",
    "scheduled_pair",
    "splits_rows",
    "visited_block",
    "visited_blocks",
]

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # a kernel's masked score: finite, so `s - m` is never -inf - -inf


def causal_visible(q_pos, kv_pos, *, q_len: int, kv_len: int):
    """True where the query at position ``q_pos`` may attend the key at ``kv_pos``.

    Bottom-right aligned: query ``i`` sees keys ``j <= i + kv_len - q_len``. Works on ints, NumPy and JAX
    arrays alike (broadcasting), so the oracle, the blockwise loop and the kernels share one rule.
    """
    return kv_pos <= q_pos + (kv_len - q_len)


def band(causal: bool, window=None) -> tuple[int | None, int | None]:
    """``(left, right)``: the keys query ``i`` may see, as offsets from its diagonal key ``i + kv_len - q_len``
    (``None``: unbounded on that side). Causal attention is the band ``(None, 0)``; a window ``(left, right)``
    narrows it (:mod:`flashlib.masks`); both together take the narrower right side."""
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def block_is_visible(q_block, kv_block, *, block_q: int, block_k: int, q_len: int, kv_len: int, causal: bool,
                     window=None):
    """True unless every element of the block lies outside the band (:func:`band`): above the diagonal
    (causal, or past a window's right side) or left of a window's left side, for every row of the query block.

    The block's rows (padding rows included) together see keys ``first_key_seen`` to ``last_key_seen``; the
    key block spans ``kv_block * block_k`` to ``(kv_block + 1) * block_k - 1``.
    """
    left, right = band(causal, window)
    visible = True
    if right is not None:
        visible = kv_block * block_k <= last_key_seen(q_block, block_q=block_q, q_len=q_len, kv_len=kv_len,
                                                      right=right)
    if left is not None:
        visible = visible & ((kv_block + 1) * block_k - 1 >= first_key_seen(q_block, block_q=block_q, q_len=q_len,
                                                                             kv_len=kv_len, left=left))
    return visible


def block_needs_mask(q_block, kv_block, *, block_q: int, block_k: int, q_len: int, kv_len: int, causal: bool,
                     window=None):
    """True where a visited block must build an element mask: it holds padded keys, or some row of it does
    not see all of its keys — its last key lies beyond what the block's first row may see (it straddles the
    diagonal or a window's right edge), or its first key lies before what the last row may see (a window's
    left edge)."""
    holds_padding = (kv_block + 1) * block_k > kv_len
    left, right = band(causal, window)
    needs = holds_padding
    if right is not None:
        needs = needs | ((kv_block + 1) * block_k - 1 > q_block * block_q + (kv_len - q_len) + right)
    if left is not None:
        needs = needs | (kv_block * block_k < (q_block + 1) * block_q - 1 + (kv_len - q_len) - left)
    return needs


def last_key_seen(q_block, *, block_q: int, q_len: int, kv_len: int, right: int = 0):
    """The last key position any row of the query block may see (its last row's limit; may be < 0), for a
    band reaching ``right`` keys past the diagonal (0: causal)."""
    return (q_block + 1) * block_q - 1 + (kv_len - q_len) + right


def first_key_seen(q_block, *, block_q: int, q_len: int, kv_len: int, left: int):
    """The first key position any row of the query block may see (its first row's limit; may be < 0 or past
    the keys), for a band reaching ``left`` keys before the diagonal."""
    return q_block * block_q + (kv_len - q_len) - left


def first_query_seeing(kv_block, *, block_k: int, q_len: int, kv_len: int, right: int = 0):
    """The first query position that may see any key of the key block (may be < 0: every query does).

    Query ``i`` sees key ``j`` when ``j <= i + kv_len - q_len + right`` (``right`` 0: causal); the block's first
    key is ``kv_block * block_k``. Query block ``i`` visits key block ``j`` (:func:`block_is_visible`) exactly
    when ``i >= max(first, 0) // block_q``, which is where the dK/dV kernel's query index map clamps.
    """
    return kv_block * block_k - (kv_len - q_len) - right


def last_query_seeing(kv_block, *, block_k: int, q_len: int, kv_len: int, left: int):
    """The last query position that may see any key of the key block, for a band reaching ``left`` keys
    before the diagonal: query ``i`` sees key ``j`` when ``j >= i + kv_len - q_len - left``."""
    return (kv_block + 1) * block_k - 1 - (kv_len - q_len) + left


def live_range(outer, *, outer_block: int, inner_block: int, num_inner: int, q_len: int, kv_len: int,
               causal: bool, window=None, keys_inner: bool = True):
    """``(first, last)`` inner blocks that block ``outer`` of the other axis needs, clamped to ``[0, num_inner
    - 1]`` (``last < first`` never: an outer block that needs nothing gets one block, which its guard skips).

    ``keys_inner``: the inner axis holds key blocks and ``outer`` is a query block (the forward and dQ
    kernels); else the inner axis holds query blocks and ``outer`` is a key block (the dK/dV kernel). Works on
    ints, NumPy arrays and traced program ids (``lax.div``-free: floors of values clamped to >= 0).
    """
    left, right = band(causal, window)
    geo = dict(q_len=q_len, kv_len=kv_len)
    maximum, minimum = _ops(outer)
    everything = (0 * outer, 0 * outer + num_inner * inner_block - 1)  # an unbounded side, shaped like outer
    if keys_inner:
        first = everything[0] if left is None else first_key_seen(outer, block_q=outer_block, left=left, **geo)
        last = everything[1] if right is None else last_key_seen(outer, block_q=outer_block, right=right, **geo)
    else:
        first = everything[0] if right is None else first_query_seeing(outer, block_k=outer_block, right=right, **geo)
        last = everything[1] if left is None else last_query_seeing(outer, block_k=outer_block, left=left, **geo)
    first = minimum(_floor_div(maximum(first, 0), inner_block), num_inner - 1)
    last = maximum(minimum(_floor_div(maximum(last, 0), inner_block), num_inner - 1), first)
    return first, last


def compacts(causal: bool, window=None) -> bool:
    """Whether a kernel's inner grid axis walks only each outer block's :func:`live_range` (grid compaction):
    for a band bounded on the left (a window), where the live range stays the same length as the sequences
    grow. Otherwise the inner axis is every block, and the band's guard skips what lies outside it."""
    return band(causal, window)[0] is not None


def compacts_by_table(causal: bool, window=None, *, segments: bool = False) -> bool:
    """Whether the forward kernel may walk a table of its live (query block, key step) pairs
    (:func:`live_schedule`, scalar-prefetched) instead of the full ``num_q_blocks x num_kv_steps`` grid: a band
    bounded on the right only (causal), where the pairs above the diagonal are about half of the grid and
    :func:`compacts` does not apply. Not with segment ids, whose own block tables are indexed by the full
    grid (those calls keep the full grid and its guards)."""
    left, right = band(causal, window)
    return left is None and right is not None and not segments


def live_schedule(num_q_blocks: int, num_kv_steps: int, *, block_q: int, kv_step: int, q_len: int, kv_len: int,
                  causal: bool, window=None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(q_block, kv_step, first, last)``, each ``[num_live]`` int32: the (query block, key step) pairs a
    compacted forward grid walks (:func:`compacts_by_table`), query block major and key steps ascending, so a
    query block's steps are consecutive and its output block stays resident until its last one. ``first`` and
    ``last`` are 1 at a query block's first and last live step (``init`` and ``finalize`` run there).

    The pairs are those :func:`block_is_visible` keeps at the grain of whole key steps; a query block that
    sees no key at all (every row before key 0: ``q_len > kv_len``) keeps one step, key step 0, whose
    sub-blocks its guard skips, so that ``init`` and ``finalize`` still write its zeros."""
    q_blocks, steps = np.arange(num_q_blocks)[:, None], np.arange(num_kv_steps)[None, :]  # [nq, 1], [1, nk]
    visible = np.array(np.broadcast_to(block_is_visible(
        q_blocks, steps, block_q=block_q, block_k=kv_step, q_len=q_len, kv_len=kv_len, causal=causal,
        window=window), (num_q_blocks, num_kv_steps)))  # [nq, nk]
    visible[~visible.any(axis=1), 0] = True  # a blind query block: one step, skipped by its guard
    q_block, kv_steps = np.nonzero(visible)  # [num_live] each, row-major: query block major
    new_block = q_block[1:] != q_block[:-1]  # [num_live - 1]
    first = np.concatenate([[True], new_block])  # [num_live]
    last = np.concatenate([new_block, [True]])  # [num_live]
    return tuple(x.astype(np.int32) for x in (q_block, kv_steps, first, last))


def compacted_schedule(compact: bool | None, num_q_blocks: int, num_kv_steps: int, *, block_q: int, kv_step: int,
                       q_len: int, kv_len: int, causal: bool, window=None, segments: bool = False):
    """The forward's decision: :func:`live_schedule` where its grid compacts, else None. ``compact`` None (the
    default): where :func:`compacts_by_table` allows it and the schedule drops a step of the full grid; False:
    never (the full grid, skipping by program-id guards); True: wherever allowed, else ``ValueError``."""
    if not compacts_by_table(causal, window, segments=segments):
        if compact:
            raise ValueError("compact=True needs a band bounded on the right only (causal) and no segment ids")
        return None
    if compact is False:
        return None
    schedule = live_schedule(num_q_blocks, num_kv_steps, block_q=block_q, kv_step=kv_step, q_len=q_len,
                             kv_len=kv_len, causal=causal, window=window)
    if compact is None and schedule[0].size == num_q_blocks * num_kv_steps:  # nothing to drop
        return None
    return schedule


def scheduled_pair(t, starts: tuple[int, ...], num_live: int):
    """``(q_block, kv_step, first, last)`` at live step ``t`` of a causal :func:`live_schedule` whose query blocks
    start at live steps ``starts`` (its ``first`` entries' indices), computed from ``t`` by comparisons with those
    constants rather than read from the tables: a causal query block's live steps are key steps ``0..last``.
    On ints and traced program ids alike (``len(starts)`` scalar compares and selects per call)."""
    q_block, start, end = 0 * t, 0 * t, 0 * t + num_live  # end: the next query block's first live step
    for s in starts[1:]:
        q_block = q_block + (t >= s)
        start = _select(t >= s, s, start)
    for s in reversed(starts[1:]):
        end = _select(t < s, s, end)
    return q_block, t - start, t == start, t == end - 1


def _select(condition, a, b):
    return np.where(condition, a, b) if isinstance(condition, (bool, np.bool_, np.ndarray)) else jnp.where(
        condition, a, b)


def visited_block(outer, step, *, outer_block: int, inner_block: int, num_inner: int, q_len: int, kv_len: int,
                  causal: bool, window=None, keys_inner: bool = True):
    """``(block, live)``: the inner block that grid step ``step`` of outer block ``outer`` computes on, and
    whether the step computes at all. Compacting (:func:`compacts`): ``first + step`` of the live range, live
    up to its last block; otherwise block ``step`` itself, always live (the kernels' :func:`block_is_visible`
    guard does the skipping)."""
    if not compacts(causal, window):
        return step, True
    first, last = live_range(outer, outer_block=outer_block, inner_block=inner_block, num_inner=num_inner,
                             q_len=q_len, kv_len=kv_len, causal=causal, window=window, keys_inner=keys_inner)
    return first + step, first + step <= last


def fetched_block(outer, step, *, outer_block: int, inner_block: int, num_inner: int, q_len: int, kv_len: int,
                  causal: bool, window=None, keys_inner: bool = True):
    """The inner block an index map fetches at grid step ``step`` of outer block ``outer``: the visited block
    (:func:`visited_block`) clamped into the live range, so a step that skips repeats its neighbour's index
    and the pipeline copies nothing for it. Without compaction only the band's right side clamps (causal):
    a query block's keys stop at its last visible block, a key block's queries start at its first."""
    geo = dict(outer_block=outer_block, inner_block=inner_block, num_inner=num_inner, q_len=q_len, kv_len=kv_len,
               causal=causal, window=window, keys_inner=keys_inner)
    if compacts(causal, window):
        first, last = live_range(outer, **geo)
        return _ops(outer)[1](first + step, last)
    right = band(causal, window)[1]
    if right is None:
        return step
    maximum, minimum = _ops(outer)
    if keys_inner:  # the last key block the query block sees
        last_key = maximum(last_key_seen(outer, block_q=outer_block, q_len=q_len, kv_len=kv_len, right=right), 0)
        return minimum(step, _floor_div(last_key, inner_block))
    first_query = maximum(first_query_seeing(outer, block_k=outer_block, q_len=q_len, kv_len=kv_len, right=right), 0)
    return maximum(step, _floor_div(first_query, inner_block))


def live_steps(num_outer: int, *, outer_block: int, inner_block: int, num_inner: int, q_len: int, kv_len: int,
               causal: bool, window=None, keys_inner: bool = True) -> int:
    """The inner grid axis a kernel needs when it walks each outer block's :func:`live_range` from its
    ``first`` block: the longest range. With a two-sided window this stays constant as the sequences grow
    (the cost is linear in length); with causal alone or no mask it is every inner block (the kernels do not
    compact then: :func:`compacts`)."""
    if not compacts(causal, window):
        return num_inner
    first, last = live_range(np.arange(num_outer), outer_block=outer_block, inner_block=inner_block,
                             num_inner=num_inner, q_len=q_len, kv_len=kv_len, causal=causal, window=window,
                             keys_inner=keys_inner)
    return int(np.max(last - first + 1))


def _ops(x):
    """``(maximum, minimum)`` for ``x``'s kind: NumPy for ints and NumPy arrays, jnp for traced values."""
    if isinstance(x, (int, np.integer, np.ndarray)):
        return np.maximum, np.minimum
    return jnp.maximum, jnp.minimum


def _floor_div(x, d: int):
    """``x // d`` for ``x >= 0``: ``lax.div`` (truncation) on traced values — Mosaic lowers it without the
    sign() jnp's floor division needs — and ``//`` on NumPy."""
    if isinstance(x, (int, np.integer, np.ndarray)):
        return x // d
    return lax.div(x, d)


def first_query_blocks(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool) -> np.ndarray:
    """``[num_kv_blocks]``: the first query block each key block needs, where the dK/dV q index map clamps
    (no window; :func:`live_range` with ``keys_inner=False`` is the rule with one)."""
    num_kv_blocks = round_up(kv_len, block_k) // block_k
    if not causal:
        return np.zeros(num_kv_blocks, dtype=int)
    first = first_query_seeing(np.arange(num_kv_blocks), block_k=block_k, q_len=q_len, kv_len=kv_len)  # [nk]
    return np.maximum(first, 0) // block_q


def last_kv_blocks(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool) -> np.ndarray:
    """``[num_q_blocks]``: the last key block each query block needs, where its k/v index map clamps (no window;
    :func:`live_range` is the rule with one)."""
    num_q_blocks, num_kv_blocks = round_up(q_len, block_q) // block_q, round_up(kv_len, block_k) // block_k
    if not causal:
        return np.full(num_q_blocks, num_kv_blocks - 1)
    last_key = last_key_seen(np.arange(num_q_blocks), block_q=block_q, q_len=q_len, kv_len=kv_len)  # [nq]
    return np.clip(last_key // block_k, 0, num_kv_blocks - 1)  # a block that sees no key still holds block 0


def visited_blocks(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool, window=None) -> int:
    """Grid steps of one (batch, head) that compute: the blocks inside the band (:func:`block_is_visible`), i.e.
    not skipped as above the diagonal or outside the window. A compacted grid (:func:`compacts`) visits the same
    blocks: every visible block lies in its outer block's :func:`live_range`."""
    return int(_visible(q_len, kv_len, block_q, block_k, causal, window).sum())


def _visible(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool, window=None) -> np.ndarray:
    """``[num_q_blocks, num_kv_blocks]``: :func:`block_is_visible` over the grid (blocks of real keys only)."""
    q_blocks = np.arange(round_up(q_len, block_q) // block_q)[:, None]  # [nq, 1]
    kv_blocks = np.arange(round_up(kv_len, block_k) // block_k)[None, :]  # [1, nk]
    geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal, window=window)
    visible = block_is_visible(q_blocks, kv_blocks, **geometry)  # [nq, nk], or True when nothing masks
    return np.broadcast_to(visible, (q_blocks.size, kv_blocks.size))


def splits_rows(block_q: int, block_k: int, causal: bool) -> bool:
    """Whether the forward kernel runs a masked sub-block as ``[block_k]``-row chunks, each skipped, masked or
    plain on its own: causal, with ``block_q`` a multiple of a smaller ``block_k`` (so a chunk is square)."""
    return causal and block_q > block_k and block_q % block_k == 0


def forward_tiles(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool, window=None,
                  segments: bool = False) -> tuple[int, int]:
    """``(sub-blocks, row chunks)``: the whole ``[block_q, block_k]`` sub-blocks and the ``[block_k, block_k]``
    row chunks one (batch, head) of the forward kernel computes. Without row chunks (:func:`splits_rows`; never
    with ``segments``, whose every visited block builds the mask whole) every visited sub-block is whole; with
    them, a sub-block that needs a mask runs only its visible chunks. ``window``: the band's blocks only."""
    geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal, window=window)
    visible = _visible(q_len, kv_len, block_q, block_k, causal, window)  # [nq, nk]
    if segments or not splits_rows(block_q, block_k, causal):
        return int(visible.sum()), 0
    q_blocks, kv_blocks = np.arange(visible.shape[0])[:, None], np.arange(visible.shape[1])[None, :]
    masked = visible & np.broadcast_to(block_needs_mask(q_blocks, kv_blocks, **geometry), visible.shape)  # [nq, nk]
    chunks = block_q // block_k
    chunk_blocks = (q_blocks * chunks)[..., None] + np.arange(chunks)  # [nq, 1, chunks]: chunk index in the sequence
    chunk_visible = block_is_visible(chunk_blocks, kv_blocks[..., None], **dict(geometry, block_q=block_k))
    return int((visible & ~masked).sum()), int((masked[..., None] & chunk_visible).sum())
