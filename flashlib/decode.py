"""Decoding: a few new queries against a long KV cache, with split-KV (flash-decoding) — the pure-JAX stage and
the float64 oracle (issue 17's ground; the Pallas decode kernels build on this contract).

Training-style attention parallelises over query blocks. Generating text has one (or a few) new query tokens
per sequence against thousands of cached keys, so the work is split along the *keys* instead: each split
computes a partial softmax state ``(m, l, acc)`` over its slice of the cache, and the splits are merged with
notebook 03's identity (:func:`flashlib.reference.merge_states`), exactly.

The contract:

* ``q [batch, heads, q_len, head_dim]``: the ``q_len`` (1-16) newest tokens of each sequence;
* a cache — :class:`KVCache` (contiguous ``[batch, kv_heads, max_len, head_dim]``) or :class:`PagedKVCache`
  (a pool of pages ``[num_pages, kv_heads, page_size, head_dim]`` and a block table ``[batch, pages_per_seq]``
  naming each sequence's pages in order) — holding ``lengths[b]`` valid tokens per sequence, the new ones
  included (they were appended before attention, as a serving loop does);
* bottom-right causal among the new tokens: query ``i`` of sequence ``b`` sits at position ``lengths[b] -
  q_len + i`` and sees keys ``j <= lengths[b] - q_len + i``; positions ``>= lengths[b]`` are never seen —
  whatever the cache holds there (stale rows, NaN, an unused page still named in the block table), on every impl.
  A query whose position is negative (a sequence shorter than ``q_len``) sees no key and returns zeros;
* GQA: ``kv_heads`` divides ``heads`` (query head ``h`` reads kv head ``h // (heads // kv_heads)``);
* the variants of :mod:`flashlib.masks` that decoding models use: ``softcap`` (scores ``c tanh(s / c)``) and a
  sliding ``window=(left, right)`` — causal already, so a query at position ``p`` sees keys ``p - left .. p``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flashlib.arguments import check_scale, check_window_and_softcap
from flashlib.reference import SoftmaxState, default_scale, merge_states, state_from_scores, state_output

__all__ = ["KVCache", "PagedKVCache", "check_cache", "check_variants", "contiguous", "decode_oracle",
           "decode_reference", "decode_split_kv", "split_bounds"]


class KVCache(NamedTuple):
    """A contiguous cache: ``k [batch, kv_heads, max_len, head_dim]``, ``v [..., v_head_dim]``, ``lengths [batch]``."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array


class PagedKVCache(NamedTuple):
    """A paged cache: ``k_pages [num_pages, kv_heads, page_size, head_dim]``, ``v_pages`` likewise,
    ``block_table [batch, pages_per_seq]`` (int; entries past a sequence's last page are never read; a live entry
    outside the pool is refused by :func:`flashlib.kernels.decode_attention` where the table is concrete, and read
    as the nearest page, 0 or the last, where it is traced — on every impl),
    ``lengths [batch]``. Sequence ``b``'s token ``t`` is row ``t % page_size`` of page ``block_table[b, t //
    page_size]``."""

    k_pages: jax.Array
    v_pages: jax.Array
    block_table: jax.Array
    lengths: jax.Array


def check_cache(q, cache: KVCache | PagedKVCache) -> None:
    """Shapes and dtypes of ``q`` and ``cache`` against the contract; a ``ValueError`` naming the argument."""
    if not isinstance(cache, (KVCache, PagedKVCache)):
        raise ValueError(f"cache must be a KVCache or a PagedKVCache, got {type(cache).__name__}")
    if len(q.shape) != 4:
        raise ValueError(f"q must be [batch, heads, q_len, head_dim], got shape {tuple(q.shape)}")
    batch, heads, q_len, d = q.shape
    paged = isinstance(cache, PagedKVCache)
    k, v = (cache.k_pages, cache.v_pages) if paged else (cache.k, cache.v)
    for name, size in (("batch", batch), ("heads", heads), ("q_len", q_len), ("head_dim", d)):
        if size < 1:
            raise ValueError(f"empty input: q's {name} is {size} (q {tuple(q.shape)}); every size must be >= 1 "
                             "(decode at least one new token: skip the call otherwise)")
    what = "k_pages [num_pages, kv_heads, page_size, head_dim]" if paged else "k [batch, kv_heads, max_len, head_dim]"
    if len(k.shape) != 4 or k.shape[-1] != d or (not paged and k.shape[0] != batch):
        raise ValueError(f"the cache's {what} does not fit q {tuple(q.shape)}: got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"the cache's v {tuple(v.shape)} must match k {tuple(k.shape)} but for the last axis")
    if min(k.shape[:3]) < 1 or v.shape[-1] < 1:
        raise ValueError(f"empty cache: k {tuple(k.shape)}, v {tuple(v.shape)}; every size must be >= 1")
    if heads % k.shape[1]:
        raise ValueError(f"the cache's kv_heads ({k.shape[1]}) must divide q's heads ({heads})")
    if tuple(cache.lengths.shape) != (batch,) or not jnp.issubdtype(cache.lengths.dtype, jnp.integer):
        got = f"{cache.lengths.dtype}{list(cache.lengths.shape)}"
        raise ValueError(f"lengths must be [batch] = ({batch},) ints, got {got}")
    if paged and (len(cache.block_table.shape) != 2 or cache.block_table.shape[0] != batch
                  or cache.block_table.shape[1] < 1 or not jnp.issubdtype(cache.block_table.dtype, jnp.integer)):
        raise ValueError(f"block_table must be [batch, pages_per_seq] ints with batch {batch} and at least one page, "
                         f"got {cache.block_table.dtype}{list(cache.block_table.shape)}")


def contiguous(cache: KVCache | PagedKVCache) -> KVCache:
    """The cache as :class:`KVCache` (a paged one gathered through its block table: ``max_len = pages_per_seq
    * page_size``). What the oracle reads, and the plain way to check a paged kernel."""
    if isinstance(cache, KVCache):
        return cache
    # [b, pages_per_seq]; an entry outside the pool reads its nearest page, as the Pallas kernel's index map does
    # (a traced table cannot be checked: a negative id would otherwise wrap to the pool's end)
    pages = jnp.clip(jnp.asarray(cache.block_table), 0, cache.k_pages.shape[0] - 1)

    def gather(pool: jax.Array) -> jax.Array:
        seq = pool[pages]  # [b, pages_per_seq, kv_heads, page_size, d]
        seq = jnp.moveaxis(seq, 2, 1)  # [b, kv_heads, pages_per_seq, page_size, d]
        return seq.reshape(seq.shape[0], seq.shape[1], -1, seq.shape[-1])  # [b, kv_heads, max_len, d]

    return KVCache(gather(cache.k_pages), gather(cache.v_pages), jnp.asarray(cache.lengths))


def _contiguous_float64(cache: KVCache | PagedKVCache) -> tuple[np.ndarray, np.ndarray]:
    """:func:`contiguous`'s k and v in float64 NumPy, for the oracle: the same gather, independent of JAX."""
    if isinstance(cache, KVCache):
        return np.asarray(cache.k, np.float64), np.asarray(cache.v, np.float64)
    pages = np.clip(np.asarray(cache.block_table), 0, np.shape(cache.k_pages)[0] - 1)  # as contiguous() reads it

    def gather(pool) -> np.ndarray:
        seq = np.moveaxis(np.asarray(pool, np.float64)[pages], 2, 1)  # [b, kv_heads, pages_per_seq, page_size, d]
        return seq.reshape(seq.shape[0], seq.shape[1], -1, seq.shape[-1])  # [b, kv_heads, max_len, d]

    return gather(cache.k_pages), gather(cache.v_pages)


def check_variants(softcap: Any = None, window: Any = None) -> tuple[float | None, int | None]:
    """``(softcap, left)`` checked: decoding takes :mod:`flashlib.masks`' soft-cap and sliding window. Decoding
    is causal, so only the window's left side narrows anything (query ``i`` at position ``p`` sees keys ``p -
    left <= j <= p``); a right side is accepted and has no effect."""
    given = check_window_and_softcap(window, softcap)
    return given.get("softcap"), (given["window"][0] if "window" in given else None)


def _visible(q_len: int, max_len: int, lengths: jax.Array, start: int = 0, stop: int | None = None,
             left: int | None = None) -> jax.Array:
    """``[batch, q_len, stop - start]``: query ``i`` sees key ``j`` (in ``[start, stop)``) of its sequence (within
    ``left`` keys of its own position, with a window)."""
    stop = max_len if stop is None else stop
    lengths = jnp.asarray(lengths)[:, None, None]  # [b, 1, 1]
    q_pos = lengths - q_len + jnp.arange(q_len)[None, :, None]  # [b, q, 1]
    kv_pos = jnp.arange(start, stop)[None, None, :]  # [1, 1, k]
    visible = (kv_pos <= q_pos) & (kv_pos < lengths)
    return visible if left is None else visible & (kv_pos >= q_pos - left)


def _partial_state(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float,
                   softcap: float | None = None) -> SoftmaxState:
    """The softmax state of queries ``q [b, h, q, d]`` over keys ``k [b, hk, n, d]`` (``visible [b, q, n]``),
    a group's query heads folded as rows of one tile per kv head: ``[b, hk, g * q_len, ...]``."""
    batch, heads, q_len, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    rows = q.reshape(batch, kv_heads, group * q_len, d)  # [b, hk, g*q, d]   the group's heads as rows
    s = jnp.einsum("bnrd,bnkd->bnrk", rows, k, preferred_element_type=jnp.float32) * scale  # [b, hk, g*q, k]
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)  # [b, hk, g*q, k]
    mask = jnp.tile(visible, (1, group, 1))[:, None]  # [b, 1, g*q, k]
    # a key no row sees (past the length, before every window) has probability 0, but 0 * NaN is NaN: its value
    # is selected away, not multiplied, so whatever the cache holds there never reaches the output
    seen = jnp.any(visible, axis=1)[:, None, :, None]  # [b, 1, k, 1]
    return state_from_scores(s, jnp.where(seen, v.astype(jnp.float32), 0.0), mask)


def _unfold(out: jax.Array, heads: int) -> jax.Array:
    batch, kv_heads, rows, dv = out.shape
    return out.reshape(batch, heads, rows // (heads // kv_heads), dv)


def decode_reference(q: jax.Array, cache: KVCache | PagedKVCache, *, scale: float | None = None,
                     softcap: float | None = None, window=None) -> jax.Array:
    """Decoding attention in one piece (every cached key at once): ``[batch, heads, q_len, v_head_dim]``;
    ``softcap`` and ``window`` as in :func:`check_variants`."""
    check_cache(q, cache)
    softcap, left = check_variants(softcap, window)
    cache = contiguous(cache)
    scale = default_scale(q.shape[-1]) if scale is None else check_scale(scale)
    visible = _visible(q.shape[2], cache.k.shape[2], cache.lengths, left=left)
    state = _partial_state(q, cache.k, cache.v, visible, scale, softcap)
    return _unfold(state_output(state), q.shape[1]).astype(q.dtype)


def split_bounds(max_len: int, num_splits: int) -> list[tuple[int, int]]:
    """``num_splits`` contiguous key ranges covering ``[0, max_len)``, as equal as whole keys allow."""
    if not (isinstance(num_splits, int) and 1 <= num_splits <= max_len):
        raise ValueError(f"num_splits must be an int from 1 to the cache length {max_len}, got {num_splits!r}")
    edges = np.linspace(0, max_len, num_splits + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def decode_split_kv(q: jax.Array, cache: KVCache | PagedKVCache, *, num_splits: int, scale: float | None = None,
                    return_states: bool = False, softcap: float | None = None, window=None):
    """Flash-decoding in pure JAX: one partial state per key split (independent: on a TPU they run in
    parallel), then the states merged — pairwise, as a balanced tree — into the output.

    With ``return_states`` also returns the per-split states (``[b, hk, g*q_len]`` rows), for the notebook."""
    check_cache(q, cache)
    softcap, left = check_variants(softcap, window)
    cache = contiguous(cache)
    scale = default_scale(q.shape[-1]) if scale is None else check_scale(scale)
    q_len, max_len = q.shape[2], cache.k.shape[2]
    states = []
    for start, stop in split_bounds(max_len, num_splits):
        visible = _visible(q_len, max_len, cache.lengths, start, stop, left)  # [b, q, stop - start]
        states.append(_partial_state(q, cache.k[:, :, start:stop], cache.v[:, :, start:stop], visible, scale,
                                     softcap))
    level = list(states)
    while len(level) > 1:  # a balanced tree of merges: depth ceil(log2(num_splits))
        merged = [merge_states(a, b) for a, b in zip(level[::2], level[1::2], strict=False)]
        level = merged + ([level[-1]] if len(level) % 2 else [])
    out = _unfold(state_output(level[0]), q.shape[1]).astype(q.dtype)
    return (out, states) if return_states else out


def decode_oracle(q, cache: KVCache | PagedKVCache, *, scale: float | None = None, softcap: float | None = None,
                  window=None) -> np.ndarray:
    """The float64 NumPy answer, sequence by sequence: plain attention over that sequence's ``lengths[b]``
    cached keys, bottom-right causal (what the contract's positions mean, written without them); with a
    window only the ``left`` keys before each query's own, with a soft-cap its scores capped."""
    check_cache(q, cache)
    softcap, left = check_variants(softcap, window)
    q = np.asarray(q, np.float64)
    k, v = _contiguous_float64(cache)
    batch, heads, q_len, d = q.shape
    group = heads // k.shape[1]
    scale = default_scale(d) if scale is None else scale
    out = np.zeros((batch, heads, q_len, v.shape[-1]))
    for b, length in enumerate(np.asarray(cache.lengths).tolist()):
        for h in range(heads):
            for i in range(q_len):
                last = length - q_len + i  # this query's own position: it sees keys 0..last
                first = 0 if left is None else max(last - left, 0)  # (a window: only the last left + 1)
                if last < 0:
                    continue
                s = scale * k[b, h // group, first: last + 1] @ q[b, h, i]  # [last + 1 - first]
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(s - s.max())
                out[b, h, i] = p @ v[b, h // group, first: last + 1] / p.sum()
    return out
