"""The teaching solutions of notebook 09's puzzles and exercises (the element rule of window + causal +
segments; a block's kind under a window; notebook 06's forward kernel with a soft-cap and a sink; a window's
compacted grid and its copies; the weight a sink takes), kept apart from their checkers in
:mod:`flashlib.exercises.variants`. Their source is what the notebook's hint cells show
(``notebooks/make_hint_cells.py``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

__all__ = ["NT_DIMS", "block_kind_solution", "flash_kernel_variants_solution", "sink_weight_solution",
           "visible_solution", "window_grid_solution"]

NT_DIMS = (((1,), (1,)), ((), ()))  # [m, d] x [n, d] -> [m, n]: q @ k.T without a transpose


def visible_solution(i, j, *, q_len, kv_len, causal, window, q_segment, kv_segment):
    centre = i + (kv_len - q_len)  # bottom-right: query i lines up with key i + offset
    if causal and j > centre:
        return False
    if window is not None:
        left, right = window
        if left is not None and j < centre - left:
            return False
        if right is not None and j > centre + right:
            return False
    return q_segment == kv_segment


def block_kind_solution(q_block, kv_block, *, block_q, block_k, q_len, kv_len, causal, window):
    left, right = (None, None) if window is None else window
    if causal:  # causal is the band's right side at 0
        right = 0 if right is None else min(right, 0)
    offset = kv_len - q_len
    first_row, last_row = q_block * block_q, (q_block + 1) * block_q - 1
    first_key, last_key = kv_block * block_k, (kv_block + 1) * block_k - 1
    # skip: the last row sees up to last_row + offset + right; the first row from first_row + offset - left
    if right is not None and first_key > last_row + offset + right:
        return "skip"
    if left is not None and last_key < first_row + offset - left:
        return "skip"
    # mask: padded keys, or a row that misses one of the block's keys (the first row the last key, the last
    # row the first key)
    if last_key >= kv_len:
        return "mask"
    if right is not None and last_key > first_row + offset + right:
        return "mask"
    if left is not None and first_key < last_row + offset - left:
        return "mask"
    return "plain"


def window_grid_solution():
    tokens, block, left = 256, 32, 63  # window=(63, 0): row r sees keys r - 63 to r (causal); 32 x 32 blocks
    ranges = []  # each query block's live key blocks: from its first row's left edge to its last row
    for q_block in range(tokens // block):
        first_row, last_row = q_block * block, (q_block + 1) * block - 1
        ranges.append((max(first_row - left, 0) // block, last_row // block))
    steps = max(last - first + 1 for first, last in ranges)  # the compacted kv grid: the longest range
    # step s of a query block fetches block first + s, clamped to its range (a step past it repeats the last)
    fetched = [min(first + s, last) for first, last in ranges for s in range(steps)]
    copies = 1 + sum(a != b for a, b in zip(fetched[:-1], fetched[1:], strict=True))  # a new index: a copy
    return steps, copies


def sink_weight_solution(scores, sink):
    scores = np.asarray(scores, np.float64)
    m = max(float(np.max(scores)), float(sink))  # shift by the largest logit, the sink included
    return float(np.exp(sink - m) / (np.exp(sink - m) + np.sum(np.exp(scores - m))))


def flash_kernel_variants_solution(q_ref, k_ref, v_ref, sink_ref, o_ref, m_ref, l_ref, acc_ref, *, scale, cap):
    kv_block = pl.program_id(3)

    @pl.when(kv_block == 0)  # the sink is a key of value 0 seen first: m = sink, l = exp(sink - m) = 1, acc = 0
    def init():
        m_ref[...] = jnp.broadcast_to(sink_ref[...], m_ref.shape)
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    s = lax.dot_general(q_ref[...], k_ref[...], NT_DIMS, preferred_element_type=jnp.float32) * scale  # [bq, bk]
    s = cap * jnp.tanh(s / cap)  # the soft-cap, on the scaled scores, before the running max
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next)
    m_ref[...] = m_next
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)

    @pl.when(kv_block == pl.num_programs(3) - 1)
    def finalize():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)
