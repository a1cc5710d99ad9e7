"""The teaching solutions of notebook 10's puzzles and exercises (:mod:`flashlib.exercises.decoding`): what each
``Puzzle.solution`` points at and what its hints' last level prints (as the stub's name, without ``_solution``)."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp

from flashlib.reference import SoftmaxState

__all__ = ["combine_splits_solution", "decode_intensity_solution", "merge_splits_solution", "page_to_copy_solution",
           "write_token_solution"]


def combine_splits_solution(states: Sequence[SoftmaxState]) -> jnp.ndarray:
    top = states[0].m
    for state in states[1:]:
        top = jnp.maximum(top, state.m)  # the common maximum m, -inf on a row no split saw
    safe = jnp.where(jnp.isfinite(top), top, 0.0)  # exp(-inf - 0) = 0, never exp(-inf + inf) = NaN
    total = sum(jnp.exp(s.m - safe) * s.l for s in states)  # each split's l rescaled by e^(m_i - m)
    acc = sum(jnp.exp(s.m - safe)[..., None] * s.acc for s in states)  # and its acc
    return jnp.where(total[..., None] > 0, acc / jnp.where(total > 0, total, 1.0)[..., None], 0.0)  # 0: l = 0


def page_to_copy_solution(step: int, length: int, table_row: Sequence[int], page_size: int) -> int:
    live_pages = -(-length // page_size)  # ceil: a page that is partly filled is live
    last = max(live_pages - 1, 0)  # an empty sequence still names a page: copied once, never computed
    return table_row[min(step, last)]  # past the last live page: the same page again, so no new copy


def merge_splits_solution(m2, l, acc):  # noqa: E741
    # m2 = m / ln 2 and l [splits, ...], acc [splits, ..., dv] -> the output [..., dv]
    top = jnp.max(m2, axis=0)  # [...]: the largest maximum, -inf where no split saw a key
    safe = jnp.where(jnp.isfinite(top), top, 0.0)  # [...]: exp2(-inf - 0) = 0, never exp2(-inf + inf) = NaN
    weights = jnp.exp2(m2 - safe)  # [splits, ...]: e^(m_i - m) = 2^(m2_i - m2), each split's rescale factor
    total = jnp.sum(weights * l, axis=0)  # [...]
    merged = jnp.sum(weights[..., None] * acc, axis=0)  # [..., dv]
    return jnp.where(total[..., None] > 0, merged / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def decode_intensity_solution(heads, kv_heads, head_dim, q_len, itemsize):
    flops = 4 * heads * q_len * head_dim  # per cached key: q·k and p·v for every query row, 2 FLOPs a multiply-add
    nbytes = 2 * kv_heads * head_dim * itemsize  # that key's K and V rows, once per kv head
    return flops / nbytes


def write_token_solution(k_pages, block_table, seq, position, k_new):
    page_size = k_pages.shape[2]
    page = block_table[seq, position // page_size]  # the pool page holding the sequence's logical page
    return k_pages.at[page, :, position % page_size].set(k_new)  # its slot, every kv head
