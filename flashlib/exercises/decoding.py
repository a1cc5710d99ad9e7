"""Notebook 10's puzzles: :data:`COMBINE_SPLITS`, the output of split-KV decoding from its per-split softmax
states (notebook 03's merge, written by hand over the splits), and :data:`PAGE_TO_COPY`, the page a paged decode
kernel's index map asks for at a grid step (the block table followed, pages past the length never copied).

Exercises: the split-KV merge with base-2 maxima, as flashlib's TPU kernel keeps them (:func:`check_merge_splits`),
the arithmetic intensity of a decode step (:func:`check_decode_intensity`) and writing a new token's keys into its
page (:func:`check_write_token`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from flashlib import decode, hardware, reference
from flashlib.checks import CheckFailed
from flashlib.exercises.decoding_solutions import (
    combine_splits_solution,
    decode_intensity_solution,
    merge_splits_solution,
    page_to_copy_solution,
    write_token_solution,
)
from flashlib.exercises.puzzle import Puzzle
from flashlib.reference import SoftmaxState

__all__ = ["COMBINE_SPLITS", "DECODE_INTENSITY", "MERGE_SPLITS", "PAGE_TO_COPY", "WRITE_TOKEN",
           "check_combine_splits", "check_decode_intensity", "check_merge_splits", "check_page_to_copy",
           "check_write_token", "combine_splits_solution", "decode_intensity_solution", "merge_splits_solution",
           "page_to_copy_solution", "write_token_solution"]


# -- puzzle 1: the output from the splits' states ---------------------------------------------------------------


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


def _merged64(states: Sequence[SoftmaxState]) -> np.ndarray:
    """The splits' output in float64, merged as the solution does."""
    m, l, acc = _stacked(states)  # noqa: E741
    top = np.max(m, axis=0)
    weights = np.exp(m - np.where(np.isfinite(top), top, 0.0))
    total, merged = np.sum(weights * l, axis=0), np.sum(weights[..., None] * acc, axis=0)
    return np.where(total[..., None] > 0, merged / np.where(total > 0, total, 1.0)[..., None], 0.0)


def _forbidden(name: str) -> Callable[..., Any]:
    def call(*args, **kwargs):
        raise CheckFailed(f"failed: combine_splits calls reference.{name}: this puzzle is the merge itself — "
                          "rescale each split's l and acc to the common maximum with exp and add them, without "
                          "merge_states or state_output")
    return call


def check_combine_splits(combine_splits: Callable[[Sequence[SoftmaxState]], Any]) -> None:
    """``combine_splits(states)``: the decode output ``[batch, kv_heads, group * q_len, dv]`` from the splits'
    states, against the float64 oracle, case by case, then the first case with every ``m`` 90 higher and with one
    split's ``m`` 100 above the others'; written by hand
    (``reference.merge_states`` and ``state_output`` raise while it runs)."""
    cases = []
    for case, q, cache, splits in _split_cases():
        _, states = decode.decode_split_kv(q, cache, num_splits=splits, return_states=True)
        cases.append((case, list(states), np.asarray(decode.decode_oracle(q, cache), np.float64)))
    case, states, want = cases[0]  # every score 90 higher: l, acc and the output do not change, e^90 overflows float32
    cases.append((f"{case}, every m 90 higher", [s._replace(m=s.m + 90.0) for s in states], want))
    for top in (1, 0):  # one split's scores 100 above the others': the common maximum must be over every split
        shifted = [s._replace(m=s.m + 100.0) if i == top else s for i, s in enumerate(states)]
        cases.append((f"{case}, split {top}'s m 100 higher than the others'", shifted, _merged64(shifted)))
    outputs = {case: [np.asarray(reference.state_output(s), np.float64) for s in states]
               for case, states, _ in cases}
    merge_states, state_output = reference.merge_states, reference.state_output
    reference.merge_states, reference.state_output = _forbidden("merge_states"), _forbidden("state_output")
    try:
        for case, states, want in cases:
            _check_combined(combine_splits, case, states, want, outputs[case])
    finally:
        reference.merge_states, reference.state_output = merge_states, state_output
    print(f"passed: combine_splits merges the splits by hand into the oracle's output in all {len(cases)} cases, "
          "empty splits, blind rows and large scores included")


def _check_combined(combine_splits, case: str, states: list[SoftmaxState], want: np.ndarray,
                    outputs: list[np.ndarray]) -> None:
    got = np.asarray(combine_splits(list(states)), np.float64)
    if got.size != want.size:
        raise CheckFailed(f"failed: combine_splits, case '{case}' — shape {got.shape}: return the output rows "
                          f"[batch, kv_heads, group * q_len, dv], the shape of a state's acc (size {want.size})")
    got = got.reshape(want.shape)
    if "100 higher than" in case and not np.allclose(got, want, atol=1e-5):
        raise CheckFailed(f"failed: combine_splits, case '{case}' — wrong or overflowing output: the common "
                          "maximum m must be the largest m_i over every split (here split "
                          f"{case.split('split ')[-1][0]}'s), so that each factor exp(m_i - m) is at most 1")
    if "90 higher" in case and not np.allclose(got, want, atol=1e-5):
        raise CheckFailed(f"failed: combine_splits, case '{case}' (the same output) — the exponentials overflow "
                          "or lose the output: rescale by exp(m_i - m), m the largest m_i, so every factor is "
                          "at most 1")
    if np.isnan(got).any():
        raise CheckFailed(f"failed: combine_splits, case '{case}' — NaN in the output: a split (or a row) that has "
                          "seen no key has m = -inf and l = 0; where every m_i is -inf, exp(m_i - m) is "
                          "exp(-inf + inf) = NaN: rescale against a safe maximum (0 where it is -inf), and divide "
                          "by l once at the end, only where l > 0 (0 elsewhere)")
    if np.allclose(got, want, atol=1e-5):
        return
    averaged = np.mean(outputs, axis=0).reshape(want.shape)
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
                          "exp(m_split - m_max) before adding, then acc / l")
    raise CheckFailed(f"failed: combine_splits, case '{case}' — max error {np.max(np.abs(got - want)):.3g} "
                      "against the float64 oracle: m = the largest m_i, l = sum of l_i exp(m_i - m), acc = sum of "
                      "acc_i exp(m_i - m), every split exactly once, then acc / l")


COMBINE_SPLITS = Puzzle(
    "puzzle 1: the output from the splits",
    check_combine_splits,
    combine_splits_solution,
    (
        "Each split's `l` and `acc` are measured against its own maximum `m_i`, so they cannot be added as they "
        "are. Measure them all against one common maximum first — then they simply add, and you divide once.",
        "Three steps: the common maximum `m` over the splits (`jnp.maximum`, split by split); each split's factor "
        "`e^(m_i - m)`, at most 1, which multiplies its `l` and its `acc` (`acc` has one more axis: `[..., None]`); "
        "sum them, then `acc / l`. A split that saw no key has `m_i = -inf`, so its factor is 0 — unless every "
        "split is `-inf` on that row, where `-inf - (-inf)` is NaN: subtract a maximum that is 0 there instead, "
        "and divide only where the summed `l` is positive (such a row is 0).",
    ),
)


# -- puzzle 2: the page an index map copies ---------------------------------------------------------------------


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
        "Clamp the step to that last live index before you look it up in the row: past it, every step then names "
        "the same page as the step before, and Pallas copies a block only when its index changes. Stay in "
        "integers for the ceiling: floor division of the negated length rounds the other way.",
    ),
)


# -- exercises: the merge in base 2, decode's intensity, writing a token into its page ----------------------------


def _stacked(states: Sequence[SoftmaxState]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.stack([np.asarray(getattr(s, f), np.float64) for s in states]) for f in ("m", "l", "acc"))


def _merge_natural(m, l, acc):  # the merge with e^x: what a base-2 m2 must not be fed to as it is
    top = np.max(m, axis=0)
    weights = np.exp(m - np.where(np.isfinite(top), top, 0.0))
    total, merged = np.sum(weights * l, axis=0), np.sum(weights[..., None] * acc, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total[..., None] > 0, merged / np.where(total > 0, total, 1.0)[..., None], 0.0)


def check_merge_splits(merge_splits: Callable[[Any, Any, Any], Any]) -> None:
    """``merge_splits(m2, l, acc)``: the output ``[..., dv]`` from the splits' states stacked on a leading axis, with
    the maxima in base 2 as flashlib's TPU kernel keeps them — ``m2 = m / ln 2`` and ``l`` ``[splits, ...]``,
    ``acc`` ``[splits, ..., dv]`` — against the float64 oracle, then the first case with every ``m2`` 200 higher."""
    cases = []
    for case, q, cache, splits in _split_cases():
        _, states = decode.decode_split_kv(q, cache, num_splits=splits, return_states=True)
        m, l, acc = _stacked(states)  # noqa: E741
        cases.append((case, m / np.log(2.0), l, acc,
                      np.asarray(decode.decode_oracle(q, cache), np.float64).reshape(acc.shape[1:])))
    case, m2, l, acc, want = cases[0]  # 2^200 is past float32's range, for a merge that does not subtract the max
    cases.append((f"{case}, every m2 200 higher", m2 + 200.0, l, acc, want))
    for case, m2, l, acc, want in cases:  # noqa: E741
        got = np.asarray(merge_splits(jnp.asarray(m2, jnp.float32), jnp.asarray(l, jnp.float32),
                                      jnp.asarray(acc, jnp.float32)), np.float64)

        def failed(message: str, case: str = case) -> CheckFailed:
            return CheckFailed(f"failed: merge_splits, case '{case}' — {message}")

        if got.shape != want.shape:
            raise failed(f"shape {got.shape}, expected {want.shape}: reduce over the leading (splits) axis only — "
                         "the maximum is m2.max(axis=0), the sums are over axis 0")
        if "200 higher" in case and not np.allclose(got, want, atol=1e-5):
            raise failed("the same output, but the powers overflow or lose it: rescale by 2^(m2_i - M2), M2 the "
                         "largest m2_i, so every factor is at most 1")
        if np.isnan(got).any():
            raise failed("NaN in the output: where every split saw no key, m2.max(axis=0) is -inf and "
                         "exp2(-inf - (-inf)) is NaN; exponentiate against a safe maximum (0 where it is -inf), and "
                         "divide by l only where l > 0 (a row no split saw is 0)")
        if np.allclose(got, want, atol=1e-5):
            continue
        if np.allclose(got, _merge_natural(m2, l, acc), atol=1e-5):
            raise failed("the factors are e^(m2_i - M2): m2 is in base 2 (m2 = m / ln 2), so a split's factor "
                         "e^(m_i - M) is 2^(m2_i - M2): use jnp.exp2")
        top = np.max(m2, axis=0)
        weights = np.exp2(m2 - np.where(np.isfinite(top), top, 0.0))  # [splits, ...]
        merged_acc = np.sum(weights[..., None] * acc, axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            averaged = np.mean(np.where(l[..., None] > 0, acc / np.where(l > 0, l, 1.0)[..., None], 0.0), axis=0)
            unscaled = np.sum(acc, axis=0) / np.where(l.sum(0) > 0, l.sum(0), 1.0)[..., None]
        if np.allclose(got, merged_acc, atol=1e-5):
            raise failed("this is the merged acc, not yet the output: divide by the merged l once at the end")
        if np.allclose(got, averaged, atol=1e-5):
            raise failed("the splits' outputs are averaged: a split's share of the softmax is l_i 2^(m2_i - M2), "
                         "not 1 / num_splits; rescale and add acc and l first, then divide once")
        if np.allclose(got, unscaled, atol=1e-5):
            raise failed("acc and l are summed without rescaling: each split's acc and l are measured against its "
                         "own maximum; multiply both by exp2(m2_i - M2), M2 the largest m2_i, before adding")
        raise failed(f"max error {np.max(np.abs(got - want)):.3g} against the float64 oracle: M2 = max over "
                     "splits, l = sum of l_i 2^(m2_i - M2), acc = sum of acc_i 2^(m2_i - M2), output = acc / l")
    print(f"passed: merge_splits merges base-2 states into the oracle's output in all {len(cases)} cases, empty "
          "splits, blind rows and large scores included")


MERGE_SPLITS = Puzzle(
    "exercise 1: the merge in base 2",
    check_merge_splits,
    merge_splits_solution,
    (
        "`e^x = 2^(x / ln 2)`. A split's factor `e^(m_i - m)` in puzzle 1 is therefore `2^(m2_i - M2)` with "
        "`m2_i = m_i / ln 2` and `M2` the largest `m2_i` — the same maximum, in other units. `l` and `acc` do not "
        "change: only the exponent's base does.",
        "Puzzle 1's merge on stacked arrays: `M2 = m2.max(axis=0)`; a safe maximum (0 where `M2` is -inf); "
        "factors `jnp.exp2(m2 - safe)`, `[splits, ...]`; sum the rescaled `l` and `acc` (factor `[..., None]`) "
        "over axis 0, and divide once, only where the summed `l` is positive.",
    ),
)


INTENSITY_CASES = (  # (heads, kv_heads, head_dim, q_len, itemsize)
    (32, 4, 128, 1, 2), (32, 32, 128, 1, 2), (8, 1, 64, 1, 4), (32, 4, 128, 4, 2), (16, 16, 256, 1, 1),
)


_INTENSITY_MISTAKES = (  # (a wrong formula, the mistake it makes)
    (lambda h, kv, d, q, b: decode_intensity_solution(h, kv, d, q, b) / 2,
     "half the FLOPs: per cached key a query head does q·k and p·v, head_dim multiply-adds each, and a "
     "multiply-add is 2 FLOPs: 4 * head_dim per key per query row"),
    (lambda h, kv, d, q, b: decode_intensity_solution(h, kv, d, q, b) * 2,
     "twice the intensity: the step reads K *and* V, 2 * kv_heads * head_dim * itemsize bytes per cached key"),
    (lambda h, kv, d, q, b: decode_intensity_solution(h, h, d, q, b),
     "the cache is stored per kv head, not per query head: the bytes scale with kv_heads, and the heads of a "
     "GQA group share each byte"),
    (lambda h, kv, d, q, b: decode_intensity_solution(h, kv, d, 1, b),
     "q_len is missing: every new token attends to every cached key, so the FLOPs scale with q_len while the "
     "bytes do not"),
    (lambda h, kv, d, q, b: decode_intensity_solution(h, kv, d, q, 1),
     "itemsize is missing: a bf16 element is 2 bytes, a float32 one 4"),
)


def check_decode_intensity(decode_intensity: Callable[[int, int, int, int, int], float]) -> None:
    """``decode_intensity(heads, kv_heads, head_dim, q_len, itemsize)``: FLOPs per byte of K and V a decode step
    reads (the cache dominates the bytes; q and the output are left out). A wrong answer is judged on every
    case at once, so that the mistake it names is the one that explains them all."""
    got = [float(decode_intensity(*case)) for case in INTENSITY_CASES]
    want_all = [decode_intensity_solution(*case) for case in INTENSITY_CASES]
    wrong = [i for i, want in enumerate(want_all) if not np.isclose(got[i], want, rtol=1e-6)]
    if wrong:
        heads, kv_heads, head_dim, q_len, itemsize = INTENSITY_CASES[wrong[0]]
        want = want_all[wrong[0]]
        where = (f"failed: decode_intensity, heads {heads}, kv_heads {kv_heads}, head_dim {head_dim}, q_len "
                 f"{q_len}, itemsize {itemsize} — got {got[wrong[0]]:g}, expected {want:g}")
        for formula, mistake in _INTENSITY_MISTAKES:
            if all(np.isclose(g, formula(*case), rtol=1e-6) for g, case in zip(got, INTENSITY_CASES, strict=True)):
                raise CheckFailed(f"{where}: {mistake}")
        raise CheckFailed(f"{where}: FLOPs 4 * heads * q_len * kv_len * head_dim over bytes 2 * kv_heads * kv_len * "
                          "head_dim * itemsize (kv_len cancels)")
    ridge = hardware.CHIPS["v5e"].ridge_point
    per_token = want_all[0]
    print(f"passed: decode_intensity in all {len(INTENSITY_CASES)} cases; GQA 8:1 in bf16 is {per_token:g} FLOP/B "
          f"per new token, so only q_len >= {int(np.ceil(ridge / per_token))} new tokens a step would reach v5e's "
          f"ridge ({ridge:.0f} FLOP/B)")


DECODE_INTENSITY = Puzzle(
    "exercise 2: decode's intensity",
    check_decode_intensity,
    decode_intensity_solution,
    (
        "Count per cached key: every query row (`heads * q_len` of them) does a dot product with its K row and "
        "adds its V row weighted by p: `head_dim` multiply-adds each. The bytes are that key's K and V rows.",
        "Per cached key, each of those rows does two dot products of length `head_dim` (q·k, then p·v), and a "
        "multiply-add is 2 FLOPs. For the bytes, ask how many K rows and V rows that key has: one per *kv* head, "
        "not per query head — a GQA group shares them.",
    ),
)


def check_write_token(write_token: Callable[[Any, Any, int, int, Any], Any]) -> None:
    """``write_token(k_pages, block_table, seq, position, k_new)``: the pool ``[num_pages, kv_heads, page_size,
    head_dim]`` with token ``position`` of sequence ``seq`` (``k_new [kv_heads, head_dim]``) written into its slot."""
    rng = np.random.default_rng(27)
    page_size, num_pages = 4, 10
    pool = rng.normal(size=(num_pages, 2, page_size, 8)).astype(np.float32)
    table = rng.permutation(num_pages)[:8].reshape(2, 4)
    cases = [(0, 0), (0, 3), (0, 5), (1, 4), (1, 15), (1, 9)]
    for seq, position in cases:
        k_new = rng.normal(size=(2, 8)).astype(np.float32)
        args = (jnp.asarray(pool), jnp.asarray(table, jnp.int32), seq, position, jnp.asarray(k_new))
        want = np.asarray(write_token_solution(*args), np.float32)
        got = np.asarray(write_token(*args), np.float32)
        case = f"sequence {seq}, position {position}, page_size {page_size}, table row {table[seq].tolist()}"
        if got.shape != want.shape:
            raise CheckFailed(f"failed: write_token, {case} — shape {got.shape}, expected {want.shape}: return the "
                              "whole pool with one slot written")
        if np.array_equal(got, want):
            continue
        logical = position // page_size
        wrong_page = pool.copy()
        wrong_page[logical, :, position % page_size] = k_new
        swapped = pool.copy()
        swapped[int(table[seq][position % page_size]), :, logical] = k_new
        if np.array_equal(got, wrong_page):
            raise CheckFailed(f"failed: write_token, {case} — written to pool page {logical}, the sequence's "
                              f"logical page: look it up in the block table, block_table[seq, {logical}] = "
                              f"{int(table[seq][logical])}")
        if np.array_equal(got, swapped):
            raise CheckFailed(f"failed: write_token, {case} — page and slot are swapped: the page is position // "
                              "page_size (looked up in the table), the slot within it position % page_size")
        if np.array_equal(got, pool):
            raise CheckFailed(f"failed: write_token, {case} — the pool is unchanged: return the updated pool "
                              "(with jnp: k_pages.at[page, :, slot].set(k_new))")
        changed = sorted({int(p) for p in np.argwhere(got != pool)[:, 0]})
        raise CheckFailed(f"failed: write_token, {case} — pages {changed} changed, expected only page "
                          f"{int(table[seq][logical])}, slot {position % page_size}, every kv head")
    print(f"passed: write_token puts each new token in slot position % page_size of page "
          f"block_table[seq, position // page_size] ({len(cases)} tokens, two sequences)")


WRITE_TOKEN = Puzzle(
    "exercise 3: where a new token goes",
    check_write_token,
    write_token_solution,
    (
        "Token `position` is in the sequence's logical page `position // page_size`, at slot `position % "
        "page_size`; the block table says which pool page holds that logical page.",
        "Two lookups: the block table at the sequence's row and its logical page gives the pool page; inside that "
        "page, the slot. The pool's axes are `[num_pages, kv_heads, page_size, head_dim]`: keep every kv head. "
        "jnp arrays are immutable: `.at[index].set(value)` returns the updated copy.",
    ),
)
