"""Checkers of notebook 03's exercises: merging two ``(m, l)`` pairs, and merging many states as a tree."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from flashlib import reference
from flashlib.checks import CheckFailed
from flashlib.reference import SoftmaxState

__all__ = ["check_merge_ml", "check_merge_tree", "chunk_states"]


def _state(scores: np.ndarray, values: np.ndarray) -> SoftmaxState:
    return reference.state_from_scores(jnp.asarray(scores, jnp.float32), jnp.asarray(values, jnp.float32))


def _empty(rows: int, dim: int) -> SoftmaxState:
    return SoftmaxState(m=jnp.full(rows, -jnp.inf), l=jnp.zeros(rows), acc=jnp.zeros((rows, dim)))


def _merge_cases() -> list[tuple[str, SoftmaxState, SoftmaxState]]:
    rng = np.random.default_rng(0)
    low = _state(rng.normal(size=(3, 5)), rng.normal(size=(5, 4)))  # scores ~ N(0, 1)
    high = _state(rng.normal(size=(3, 7)) + 4.0, rng.normal(size=(7, 4)))  # larger maxima on every row
    mixed = _state(rng.normal(size=(3, 6)) * 3.0, rng.normal(size=(6, 4)))  # larger on some rows only
    empty = _empty(3, 4)
    return [
        ("the second side has the larger maxima", low, high),
        ("the first side has the larger maxima", high, low),
        ("each side wins on some rows", low, mixed),
        ("the first side has seen no key yet (m = -inf, l = 0)", empty, low),
        ("the second side has seen no key yet", high, empty),
        ("neither side has seen a key", empty, empty),
    ]


def check_merge_ml(merge_ml: Callable[[Any, Any, Any, Any], tuple[Any, Any]]) -> None:
    """``merge_ml(m_a, l_a, m_b, l_b) -> (m, l)`` against :func:`flashlib.reference.merge_states`, case by case."""
    for case, a, b in _merge_cases():
        m, l = (np.asarray(x, np.float64) for x in merge_ml(a.m, a.l, b.m, b.l))  # noqa: E741
        want = reference.merge_states(a, b)
        want_m, want_l = np.asarray(want.m, np.float64), np.asarray(want.l, np.float64)
        if np.isnan(m).any() or np.isnan(l).any():
            raise CheckFailed(f"failed: merge_ml, case '{case}' — NaN in the result: an empty side has m = -inf, "
                              "and -inf - (-inf) is NaN; exponentiate against a safe maximum (0 where m is -inf)")
        if m.shape != want_m.shape or not np.array_equal(m, want_m):
            raise CheckFailed(f"failed: merge_ml, case '{case}' — m is {m}, expected {want_m}: the merged maximum "
                              "is the larger of the two, row by row")
        if not np.allclose(l, want_l, rtol=1e-6, atol=0.0):
            raise CheckFailed(f"failed: merge_ml, case '{case}' — l is {l}, expected {want_l}: each side's sum must "
                              "be rescaled to the new maximum, l = l_a e^(m_a - m) + l_b e^(m_b - m)")
    print(f"passed: merge_ml merges (m, l) in all {len(_merge_cases())} cases, empty sides included")


def chunk_states(chunks: int = 8, keys: int = 64, dim: int = 16, seed: int = 1) -> list[SoftmaxState]:
    """One query's states over ``chunks`` disjoint chunks of ``keys`` keys (split-KV decoding in miniature)."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(1, chunks * keys)) * 3.0
    values = rng.normal(size=(chunks * keys, dim))
    return [_state(scores[:, i * keys:(i + 1) * keys], values[i * keys:(i + 1) * keys]) for i in range(chunks)]


class _Depth:
    """A merge that records how deep the tree of merges is: a leaf is 0, a merge is one more than its deeper side."""

    def __init__(self) -> None:
        self.depth: dict[int, int] = {}
        self.made: list[SoftmaxState] = []  # kept alive, so no id is reused while the tree is built

    def __call__(self, a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
        merged = reference.merge_states(a, b)
        self.made.append(merged)
        self.depth[id(merged)] = 1 + max(self.depth.get(id(a), 0), self.depth.get(id(b), 0))
        return merged


def check_merge_tree(merge_tree: Callable[..., SoftmaxState], sizes: Sequence[int] = (8, 6, 5)) -> None:
    """``merge_tree(states, merge=reference.merge_states)``: for lists of each of ``sizes`` states, the same
    output in any order, by a balanced tree (depth ceil(log2(n)); a left-to-right fold has depth n - 1)."""
    for chunks in sizes:
        _check_tree(merge_tree, chunks)
    print(f"passed: merge_tree gives the same output in any order, by a balanced tree ({', '.join(map(str, sizes))} "
          "states)")


def _check_tree(merge_tree: Callable[..., SoftmaxState], chunks: int) -> None:
    states = chunk_states(chunks)
    want = reference.state_output(_fold(states))
    shuffled = [states[i] for i in np.random.default_rng(0).permutation(chunks)]
    for order, given in (("in order", states), ("reversed", states[::-1]), ("shuffled", shuffled)):
        merge = _Depth()
        result = merge_tree(list(given), merge=merge)
        got = np.asarray(reference.state_output(result), np.float64)
        if not np.allclose(got, np.asarray(want, np.float64), atol=1e-5):
            raise CheckFailed(
                f"failed: merge_tree, {chunks} states {order} — the output differs from merging them one by one: "
                "merge every state exactly once (a list of odd length carries its last one up)")
        depth, balanced = merge.depth.get(id(result), 0), int(np.ceil(np.log2(chunks)))
        if depth != balanced:
            raise CheckFailed(
                f"failed: merge_tree, {chunks} states {order} — the merges are {depth} deep, a balanced tree of "
                f"{chunks} is {balanced}: merge neighbours in pairs, then the pairs, and so on (use `merge`, not "
                "merge_states, so the checker can see the tree)")


def _fold(states: Sequence[SoftmaxState]) -> SoftmaxState:
    result = states[0]
    for state in states[1:]:
        result = reference.merge_states(result, state)
    return result
