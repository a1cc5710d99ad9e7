"""The geometry of the causal mask: which query sees which key, and which blocks of a grid that decides.

Bottom-right alignment throughout (the KV-cache convention of FlashAttention >= 2.1): query ``i`` sees key
``j`` when ``j <= i + kv_len - q_len``. One rule at three grains:

* elements — :func:`causal_visible`, for the oracle, the pure-JAX stages and the kernels' element masks;
* blocks — :func:`block_is_visible`, :func:`block_needs_mask`, :func:`last_key_seen`,
  :func:`first_query_seeing`: what a kernel's ``pl.when`` guards and index maps decide per grid step;
* grids — :func:`first_query_blocks`, :func:`last_kv_blocks`, :func:`visited_blocks`, :func:`forward_tiles`:
  the same decisions for a whole grid at once, which :mod:`flashlib.cost` counts.

Everything is plain arithmetic, so one function runs on Python ints, NumPy arrays and the traced program
ids inside a kernel: the kernel and its cost estimate cannot disagree about a block. Like JAX's splash
attention keeps its mask geometry beside its masks, this module is the only place the rule is written.
"""

from __future__ import annotations

import numpy as np

from flashlib.tiling import round_up

__all__ = [
    "MASK_VALUE",
    "block_is_visible",
    "block_needs_mask",
    "causal_visible",
    "first_query_blocks",
    "first_query_seeing",
    "forward_tiles",
    "last_key_seen",
    "last_kv_blocks",
    "splits_rows",
    "visited_blocks",
]

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # a kernel's masked score: finite, so `s - m` is never -inf - -inf


def causal_visible(q_pos, kv_pos, *, q_len: int, kv_len: int):
    """True where the query at position ``q_pos`` may attend the key at ``kv_pos``.

    Bottom-right aligned: query ``i`` sees keys ``j <= i + kv_len - q_len``. Works on ints, NumPy and JAX
    arrays alike (broadcasting), so the oracle, the blockwise loop and the kernels share one rule.
    """
    return kv_pos <= q_pos + (kv_len - q_len)


def block_is_visible(q_block, kv_block, *, block_q: int, block_k: int, q_len: int, kv_len: int, causal: bool):
    """True unless the whole key block lies above the diagonal for every row of the query block.

    The block's last row (padding rows included) sees keys up to ``(q_block + 1) * block_q - 1 + kv_len -
    q_len``; the key block starts at ``kv_block * block_k``.
    """
    if not causal:
        return True
    return kv_block * block_k <= last_key_seen(q_block, block_q=block_q, q_len=q_len, kv_len=kv_len)


def block_needs_mask(q_block, kv_block, *, block_q: int, block_k: int, q_len: int, kv_len: int, causal: bool):
    """True where a visited block must build an element mask: it holds padded keys, or (causal) its last
    key lies beyond what the block's first row may see, so it straddles the diagonal."""
    holds_padding = (kv_block + 1) * block_k > kv_len
    if not causal:
        return holds_padding
    straddles = (kv_block + 1) * block_k - 1 > q_block * block_q + (kv_len - q_len)
    return holds_padding | straddles


def last_key_seen(q_block, *, block_q: int, q_len: int, kv_len: int):
    """The last key position any row of the query block may see (its last row's limit; may be < 0)."""
    return (q_block + 1) * block_q - 1 + (kv_len - q_len)


def first_query_seeing(kv_block, *, block_k: int, q_len: int, kv_len: int):
    """The first query position that may see any key of the key block (may be < 0: every query does).

    Query ``i`` sees key ``j`` when ``j <= i + kv_len - q_len``; the block's first key is ``kv_block * block_k``.
    Query block ``i`` visits key block ``j`` (:func:`block_is_visible`) exactly when ``i >= max(first, 0) //
    block_q``, which is where the dK/dV kernel's query index map clamps.
    """
    return kv_block * block_k - (kv_len - q_len)


def first_query_blocks(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool) -> np.ndarray:
    """``[num_kv_blocks]``: the first query block each key block needs, where the dK/dV q index map clamps."""
    num_kv_blocks = round_up(kv_len, block_k) // block_k
    if not causal:
        return np.zeros(num_kv_blocks, dtype=int)
    first = first_query_seeing(np.arange(num_kv_blocks), block_k=block_k, q_len=q_len, kv_len=kv_len)  # [nk]
    return np.maximum(first, 0) // block_q


def last_kv_blocks(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool) -> np.ndarray:
    """``[num_q_blocks]``: the last key block each query block needs, where its k/v index map clamps."""
    num_q_blocks, num_kv_blocks = round_up(q_len, block_q) // block_q, round_up(kv_len, block_k) // block_k
    if not causal:
        return np.full(num_q_blocks, num_kv_blocks - 1)
    last_key = last_key_seen(np.arange(num_q_blocks), block_q=block_q, q_len=q_len, kv_len=kv_len)  # [nq]
    return np.clip(last_key // block_k, 0, num_kv_blocks - 1)  # a block that sees no key still holds block 0


def visited_blocks(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool) -> int:
    """Grid steps of one (batch, head) that compute, i.e. are not skipped as above the diagonal."""
    q_blocks = np.arange(round_up(q_len, block_q) // block_q)[:, None]  # [nq, 1]
    kv_blocks = np.arange(round_up(kv_len, block_k) // block_k)[None, :]  # [1, nk]
    geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal)
    visible = block_is_visible(q_blocks, kv_blocks, **geometry)  # [nq, nk], or True when not causal
    return int(np.broadcast_to(visible, (q_blocks.size, kv_blocks.size)).sum())


def splits_rows(block_q: int, block_k: int, causal: bool) -> bool:
    """Whether the forward kernel runs a masked sub-block as ``[block_k]``-row chunks, each skipped, masked or
    plain on its own: causal, with ``block_q`` a multiple of a smaller ``block_k`` (so a chunk is square)."""
    return causal and block_q > block_k and block_q % block_k == 0


def forward_tiles(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool) -> tuple[int, int]:
    """``(sub-blocks, row chunks)``: the whole ``[block_q, block_k]`` sub-blocks and the ``[block_k, block_k]``
    row chunks one (batch, head) of the forward kernel computes. Without row chunks (:func:`splits_rows`) every
    visited sub-block is whole; with them, a sub-block that needs a mask runs only its visible chunks."""
    q_blocks = np.arange(round_up(q_len, block_q) // block_q)[:, None]  # [nq, 1]
    kv_blocks = np.arange(round_up(kv_len, block_k) // block_k)[None, :]  # [1, nk]
    grid = (q_blocks.size, kv_blocks.size)
    geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal)
    visible = np.broadcast_to(block_is_visible(q_blocks, kv_blocks, **geometry), grid)  # [nq, nk]
    if not splits_rows(block_q, block_k, causal):
        return int(visible.sum()), 0
    masked = visible & np.broadcast_to(block_needs_mask(q_blocks, kv_blocks, **geometry), grid)  # [nq, nk]
    chunks = block_q // block_k
    chunk_blocks = (q_blocks * chunks)[..., None] + np.arange(chunks)  # [nq, 1, chunks]: chunk index in the sequence
    chunk_visible = block_is_visible(chunk_blocks, kv_blocks[..., None], **dict(geometry, block_q=block_k))
    return int((visible & ~masked).sum()), int((masked[..., None] & chunk_visible).sum())
