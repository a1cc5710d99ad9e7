"""The teaching solutions of notebook 09's puzzles and exercises (the element rule of window + causal +
segments; a block's kind under a window; the copies a window's compacted grid makes; the weight a sink takes),
kept apart from their checkers in :mod:`flashlib.exercises.variants`. Their source is what the notebook's
hint cells show (``notebooks/make_hint_cells.py``)."""

from __future__ import annotations

import numpy as np

__all__ = ["block_kind_solution", "sink_weight_solution", "visible_solution"]


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


def sink_weight_solution(scores, sink):
    scores = np.asarray(scores, np.float64)
    m = max(float(np.max(scores)), float(sink))  # shift by the largest logit, the sink included
    return float(np.exp(sink - m) / (np.exp(sink - m) + np.sum(np.exp(scores - m))))
