"""Notebook 10's puzzles: :data:`COMBINE_SPLITS`, the output of split-KV decoding from its per-split softmax
states (notebook 03's merge, applied to the splits), and :data:`PAGE_TO_COPY`, the page a paged decode kernel's
index map asks for at a grid step (the block table followed, pages past the length never copied).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from flashlib import decode, reference
from flashlib.checks import CheckFailed
from flashlib.exercises.puzzle import Puzzle
from flashlib.reference import SoftmaxState

__all__ = ["COMBINE_SPLITS", "PAGE_TO_COPY", "check_combine_splits", "check_page_to_copy",
           "combine_splits_solution", "page_to_copy_solution"]


# -- puzzle 1: the output from the splits' states ---------------------------------------------------------------


def combine_splits_solution(states: Sequence[SoftmaxState]) -> jnp.ndarray:
    merged = states[0]
    for state in states[1:]:
        merged = reference.merge_states(merged, state)
    return reference.state_output(merged)  # acc / l, and 0 on a row no split saw


def _split_cases() -> list[tuple[str, Any, decode.KVCache, int]]:
    rng = np.random.default_rng(10)

    def cache(lengths, max_len=24):
        return decode.KVCache(jnp.asarray(rng.normal(size=(len(lengths), 2, max_len, 8)) * 2.0, jnp.float32),
                              jnp.asarray(rng.normal(size=(len(lengths), 2, max_len, 8)), jnp.float32),
                              jnp.asarray(lengths, jnp.int32))

    def q(batch, q_len):
        return jnp.asarray(rng.normal(size=(batch, 4, q_len, 8)) * 2.0, jnp.float32)

    return [
        ("three splits of a full cache", q(1, 1), cache([24]), 3),
        ("a split that lies past the sequence's length (it has seen no key)", q(1, 2), cache([9]), 4),
        ("a sequence shorter than its new tokens (rows that see no key at all)", q(2, 3), cache([2, 20]), 2),
    ]


def check_combine_splits(combine_splits: Callable[[Sequence[SoftmaxState]], Any]) -> None:
    """``combine_splits(states)``: the decode output ``[batch, kv_heads, group * q_len, dv]`` from the splits'
    states, against the float64 oracle, case by case."""
    for case, q, cache, splits in _split_cases():
        _, states = decode.decode_split_kv(q, cache, num_splits=splits, return_states=True)
        want = decode.decode_oracle(q, cache)
        got = np.asarray(combine_splits(list(states)), np.float64)
        if got.size != want.size:
            raise CheckFailed(f"failed: combine_splits, case '{case}' — shape {got.shape}: return the output rows "
                              f"[batch, kv_heads, group * q_len, dv], like reference.state_output (size {want.size})")
        got = got.reshape(want.shape)
        if np.isnan(got).any():
            raise CheckFailed(f"failed: combine_splits, case '{case}' — NaN in the output: a split (or a row) that has "
                              "seen no key has m = -inf and l = 0; merge with reference.merge_states, which keeps such "
                              "a side at weight 0, and divide by l once at the end, where l = 0 gives 0")
        if not np.allclose(got, want, atol=1e-5):
            averaged = np.mean([np.asarray(reference.state_output(s)) for s in states], axis=0).reshape(want.shape)
            if np.allclose(got, averaged, atol=1e-5):
                raise CheckFailed(f"failed: combine_splits, case '{case}' — the splits' outputs are averaged: each "
                                  "split's share of the softmax is its l e^m, not 1 / num_splits; merge the states "
                                  "(m, l, acc) first, then normalise once")
            acc_sum = sum(np.asarray(s.acc, np.float64) for s in states)
            l_sum = sum(np.asarray(s.l, np.float64) for s in states)[..., None]
            with np.errstate(invalid="ignore", divide="ignore"):
                unscaled = np.where(l_sum > 0, acc_sum / np.where(l_sum > 0, l_sum, 1.0), 0.0).reshape(want.shape)
            if np.allclose(got, unscaled, atol=1e-5):
                raise CheckFailed(f"failed: combine_splits, case '{case}' — acc and l are added without rescaling: "
                                  "each split's acc and l are measured against its own maximum m; multiply each by "
                                  "exp(m_split - m_max) before adding (what merge_states does), then acc / l")
            raise CheckFailed(f"failed: combine_splits, case '{case}' — max error {np.max(np.abs(got - want)):.3g} "
                              "against the float64 oracle: merge every split's state exactly once, then acc / l")
    print(f"passed: combine_splits merges the splits into the oracle's output in all {len(_split_cases())} cases")


COMBINE_SPLITS = Puzzle(
    "puzzle 1: the output from the splits",
    check_combine_splits,
    combine_splits_solution,
    (
        "Each split's state `(m, l, acc)` describes its own keys, measured against its own maximum `m`. "
        "Notebook 03's `merge_states` combines two such states into the state of the union of their keys — "
        "exactly, and in any order.",
        "Fold the list: `merged = states[0]`, then `merged = reference.merge_states(merged, s)` for the rest. "
        "The output is `reference.state_output(merged)`, `acc / l`, which gives 0 on a row no split has seen "
        "(never average the splits' outputs: a split's weight is its `l e^m`).",
    ),
)


# -- puzzle 2: the page an index map copies ---------------------------------------------------------------------


def page_to_copy_solution(step: int, length: int, table_row: Sequence[int], page_size: int) -> int:
    live_pages = -(-length // page_size)  # ceil: a page that is partly filled is live
    last = max(live_pages - 1, 0)  # an empty sequence still names a page: copied once, never computed
    return table_row[min(step, last)]  # past the last live page: the same page again, so no new copy


def check_page_to_copy(page_to_copy: Callable[[int, int, Sequence[int], int], int]) -> None:
    """``page_to_copy(step, length, table_row, page_size)`` for every step of sequences of many lengths."""
    table_row = [7, 2, 9, 0, 5]  # a sequence's pages in the pool, in order; page_size 4: up to 20 tokens
    page_size = 4
    lengths = (13, 12, 1, 4, 5, 20, 0)
    for length in lengths:
        for step in range(len(table_row)):
            got = page_to_copy(step, length, list(table_row), page_size)
            want = page_to_copy_solution(step, length, table_row, page_size)
            if got == want:
                continue
            case = f"length {length}, page_size {page_size}, step {step}"
            last = max(-(-length // page_size) - 1, 0)
            if length % page_size == 0 and length and got == table_row[min(step, length // page_size)]:
                raise CheckFailed(f"failed: page_to_copy, {case} — {length} tokens fill exactly "
                                  f"{length // page_size} pages, so the last live page is index "
                                  f"{length // page_size - 1}: round the page count up (ceil), then subtract one")
            if step > last and got == table_row[step]:
                raise CheckFailed(f"failed: page_to_copy, {case} — page {got} is past the sequence's last live page "
                                  f"(index {last} of its table row): never copy it; return the last live page "
                                  "again, the same index as the step before, so the pipeline issues no copy")
            raise CheckFailed(f"failed: page_to_copy, {case} — got page {got}, expected {want} (table row "
                              f"{table_row}): the page of step min(step, last live page), looked up in the table")
    print(f"passed: page_to_copy follows the block table and stops at the last live page ({len(lengths)} lengths, "
          "empty and full pages included)")


PAGE_TO_COPY = Puzzle(
    "puzzle 2: the page to copy",
    check_page_to_copy,
    page_to_copy_solution,
    (
        "Step `j` wants the sequence's `j`-th page, `table_row[j]` — while that page holds tokens. How many "
        "pages hold tokens? `ceil(length / page_size)`; the last of them has index one less (and an empty "
        "sequence still needs *some* valid page to name: use index 0).",
        "Clamp the step to the last live page: `table_row[min(step, last)]`. Past it, every step names the same "
        "page as the step before, and Pallas copies a block only when its index changes.",
    ),
)
