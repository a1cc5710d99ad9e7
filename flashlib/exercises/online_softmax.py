"""Notebook 03's puzzles and exercise checkers.

Puzzles (the learner writes them; the notebook runs on the learner's version once it passes):
:data:`ONLINE_UPDATE`, folding one block of scores and values into a running ``(m, l, acc)`` state, and
:data:`MERGE_STATES`, merging two such states. Exercises: merging ``(m, l)`` pairs (:func:`check_merge_ml`), a
balanced merge tree (:func:`check_merge_tree`) and the one-pass row visited backwards
(:func:`check_online_attention_row_reversed`): :data:`MERGE_ML`, :data:`MERGE_TREE` and :data:`ROW_REVERSED`.
The solutions are in :mod:`flashlib.exercises.online_softmax_solutions`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from flashlib import reference
from flashlib.checks import CheckFailed
from flashlib.exercises.online_softmax_solutions import (
    merge_ml_solution,
    merge_states_solution,
    merge_tree_solution,
    online_attention_row_reversed_solution,
    online_update_solution,
)
from flashlib.exercises.puzzle import Puzzle
from flashlib.reference import SoftmaxState

__all__ = ["MERGE_ML", "MERGE_STATES", "MERGE_TREE", "ONLINE_UPDATE", "ROW_REVERSED", "check_merge_ml",
           "check_merge_states", "check_merge_tree", "check_online_attention_row_reversed", "check_online_update",
           "chunk_states", "merge_ml_solution", "merge_states_solution", "merge_tree_solution",
           "online_attention_row_reversed_solution", "online_update_solution"]


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
            if _close(m, want_l) and _close(l, want_m):
                raise CheckFailed(f"failed: merge_ml, case '{case}' — the result is (l, m): return m first, then l")
            raise CheckFailed(f"failed: merge_ml, case '{case}' — m is {m}, expected {want_m}: " + _empty_m(m, want_m))
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
        if not isinstance(result, SoftmaxState):
            raise CheckFailed(f"failed: merge_tree, {chunks} states {order} — got {type(result).__name__}: return "
                              "the one SoftmaxState left at the top of the tree")
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


# -- puzzles 1 and 2: the online update and the merge, judged on the whole state --------------------------

_NAN = ("NaN in the result: on a row with no visible key on either side (the state and the block, or the two "
        "states) m stays -inf, and e^(-inf - (-inf)) is NaN; exponentiate against a safe maximum (0 where the new "
        "m is -inf), and still return m = -inf for that row")
_NAN_FACTOR = ("NaN in the result on a row that has a visible key: an infinite factor met a zero; every rescale "
               "factor is e^(old maximum - new maximum), at most 1 (and 0 for a side that has seen nothing)")
_INF = ("inf in the result: an exponent was positive and e^x overflowed; exponentiate against the new maximum, "
        "so that every factor e^(x - m_new) is at most 1")
_DIVIDED = ("acc is already divided by l: keep acc the unnormalised sum of e^(s - m) v, as SoftmaxState defines "
            "it; the division comes once, at the very end (reference.state_output)")


def _empty_m(m: np.ndarray, want_m: np.ndarray) -> str:
    """Why ``m`` is wrong: the safe maximum returned on a row that has seen no key, or else not the larger one."""
    empty = np.isneginf(want_m)
    if m.shape == want_m.shape and empty.any() and np.isfinite(m[empty]).all() and np.allclose(m[~empty],
                                                                                            want_m[~empty]):
        return ("a row that has seen no key keeps m = -inf; the safe maximum (0 there) is only what you "
                "exponentiate against: return the maximum itself")
    return "the new maximum is the larger of the two maxima, row by row"


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=1e-5, atol=1e-6))


def _judge(what: str, case: str, answer: Any, want: SoftmaxState, rules: tuple[str, str],
           suspects: Sequence[tuple[str, np.ndarray, str]]) -> None:
    """Compare the learner's state with ``want``; ``suspects`` are ``(quantity, value, mistake)`` of known
    wrong answers, so that a match names the mistake; ``rules`` say how l and acc are made."""
    def failed(message: str) -> CheckFailed:
        return CheckFailed(f"failed: {what}, case '{case}' — {message}")

    want_m, want_l, want_acc = (np.asarray(x, np.float64) for x in want)
    try:
        m, l, acc = (np.asarray(x, np.float64) for x in (answer.m, answer.l, answer.acc))
    except AttributeError:
        raise failed(f"return SoftmaxState(m=..., l=..., acc=...) (the notebook reads state.m, state.l, "
                     f"state.acc); got {type(answer).__name__}") from None
    for name, got, shape in (("m", m, want_m.shape), ("l", l, want_l.shape), ("acc", acc, want_acc.shape)):
        if got.shape != shape:
            raise failed(f"{name} has shape {got.shape}, expected {shape}: m and l hold one number per query row, "
                         "acc one vector of d per row")
    if np.isinf(l).any() or np.isinf(acc).any() or (np.isinf(m) & (m > 0)).any():
        raise failed(_INF)  # before NaN: an overflow turns into NaN as soon as inf meets 0 or -inf
    nan_rows = np.isnan(m) | np.isnan(l) | np.isnan(acc).any(axis=-1)
    if nan_rows.any():
        raise failed(_NAN if (nan_rows & np.isneginf(want_m)).any() else _NAN_FACTOR)
    if not np.allclose(m, want_m, rtol=1e-6, atol=0.0):
        raise failed(f"m is {np.round(m, 4)}, expected {np.round(want_m, 4)}: {_empty_m(m, want_m)}")
    if not _close(acc, want_acc) and _close(acc, want_acc / np.where(want_l > 0, want_l, 1.0)[:, None]):
        raise failed(_DIVIDED)
    for name, got, expected, rule in (("l", l, want_l, rules[0]), ("acc", acc, want_acc, rules[1])):
        if _close(got, expected):
            continue
        for quantity, value, mistake in suspects:
            if quantity == name and _close(got, value):
                raise failed(f"{name} is off: {mistake}")
        row = int(np.unravel_index(np.argmax(np.abs(got - expected)), got.shape)[0])
        raise failed(f"{name} is off on row {row} (by up to {np.max(np.abs(got - expected)):.3g}): {rule}")


def _blocks(rng: np.random.Generator, rows: int, keys: int, dim: int, shift: Any = 0.0) -> tuple[Any, Any]:
    scores = rng.normal(size=(rows, keys)) * 2.0 + np.reshape(shift, (-1, 1))
    return jnp.asarray(scores, jnp.float32), jnp.asarray(rng.normal(size=(keys, dim)), jnp.float32)


def _update_cases() -> list[tuple[str, SoftmaxState, Any, Any]]:
    rng = np.random.default_rng(3)
    low, high = _state(*_blocks(rng, 3, 6, 4)), _state(*_blocks(rng, 3, 6, 4, shift=5.0))
    mixed = _state(*_blocks(rng, 3, 6, 4, shift=[4.0, 0.0, 4.0]))
    big = _state(*_blocks(rng, 3, 6, 4, shift=100.0))
    s_gappy, v_gappy = _blocks(rng, 3, 5, 4)
    s_gappy = s_gappy.at[0].set(-jnp.inf).at[1, ::2].set(-jnp.inf)  # row 0 sees nothing, row 1 some keys
    return [
        ("the first block: the state has seen no key yet", _empty(3, 4), *_blocks(rng, 3, 5, 4)),
        ("the block raises the maximum on every row", low, *_blocks(rng, 3, 5, 4, shift=5.0)),
        ("the block holds nothing larger than the maximum so far", high, *_blocks(rng, 3, 5, 4)),
        ("the maximum grows on some rows only", mixed, *_blocks(rng, 3, 5, 4, shift=[0.0, 4.0, 2.0])),
        ("scores around 100, where e^100 overflows float32", big, *_blocks(rng, 3, 5, 4, shift=101.0)),
        ("a fully masked block (every score -inf) after some keys", low, jnp.full((3, 5), -jnp.inf), v_gappy),
        ("a row that has seen no key meets a fully masked block", _empty(3, 4), s_gappy, v_gappy),
    ]


def check_online_update(online_update: Callable[[SoftmaxState, Any, Any], SoftmaxState]) -> None:
    """``online_update(state, s, v)``: the state after folding scores ``s [q, k]`` (``-inf`` for a masked key)
    and values ``v [k, d]`` into ``state``, against :func:`~flashlib.reference.merge_states` with the block's
    own state, case by case (a row that has seen nothing meeting a fully masked block included)."""
    cases = _update_cases()
    for case, state, s, v in cases:
        answer = online_update(state, s, v)
        block = reference.state_from_scores(s, v)
        want = reference.merge_states(state, block)
        m_new = np.asarray(want.m, np.float64)
        beta = np.exp(np.asarray(block.m, np.float64) - np.where(np.isfinite(m_new), m_new, 0.0))
        old_m, old_l, old_acc = (np.asarray(x, np.float64) for x in state)
        alpha = np.exp(old_m - np.where(np.isfinite(m_new), m_new, 0.0))
        old_max = np.exp(np.asarray(s, np.float64) - np.where(np.isfinite(old_m), old_m, 0.0)[:, None]).sum(-1)
        _judge("online_update", case, answer, want, (
            "l_new = alpha l_old + the block's sum of e^(s - m_new), with alpha = e^(m_old - m_new)",
            "acc_new = alpha acc_old + e^(s - m_new) @ v, with the same alpha as l"), [
            ("l", old_l + beta * np.asarray(block.l), "the old sum is not rescaled: multiply l_old by "
             "alpha = e^(m_old - m_new) before adding the block's sum"),
            ("acc", old_acc + beta[:, None] * np.asarray(block.acc), "the old acc is not rescaled: multiply it by "
             "the same alpha = e^(m_old - m_new) as l"),
            ("l", alpha * old_l + old_max, "the block's weights must be e^(s - m_new), against the new maximum, "
             "not the old one"),
            ("l", old_l + old_max, "the block's weights must be e^(s - m_new), against the new maximum, not the "
             "old one (and the old sum needs rescaling by alpha = e^(m_old - m_new))"),
        ])
    print(f"passed: online_update folds a block into (m, l, acc) in all {len(cases)} cases, fully masked blocks "
          "included")


def _holes(rng: np.random.Generator) -> tuple[SoftmaxState, SoftmaxState]:
    """Two states of 4 rows: row 0 seen by both sides, row 1 by the second only, row 2 by the first only,
    row 3 by neither."""
    s_a, v_a = _blocks(rng, 4, 5, 4)
    s_b, v_b = _blocks(rng, 4, 6, 4, shift=1.0)
    return (_state(s_a.at[1].set(-jnp.inf).at[3].set(-jnp.inf), v_a),
            _state(s_b.at[2].set(-jnp.inf).at[3].set(-jnp.inf), v_b))


def check_merge_states(merge_states: Callable[[SoftmaxState, SoftmaxState], SoftmaxState]) -> None:
    """``merge_states(a, b)``: the state of the union of two disjoint key sets, against
    :func:`flashlib.reference.merge_states`, case by case (empty sides and rows nobody has seen included)."""
    cases = [*_merge_cases(), ("rows seen by one side, by the other, by both and by neither",
                               *_holes(np.random.default_rng(4)))]
    for case, a, b in cases:
        answer = merge_states(a, b)
        sums = [(name, sum(np.asarray(getattr(side, name), np.float64) for side in (a, b))) for name in ("l", "acc")]
        _judge("merge_states", case, answer, reference.merge_states(a, b), (
            "l = l_a e^(m_a - m) + l_b e^(m_b - m), with m the larger maximum",
            "acc = acc_a e^(m_a - m) + acc_b e^(m_b - m), with the same factors as l"),
            [(name, value, f"{name}_a + {name}_b adds sums taken against different maxima: rescale each side "
              f"to the common maximum first, {name}_a e^(m_a - m) + {name}_b e^(m_b - m)") for name, value in sums])
    print(f"passed: merge_states merges (m, l, acc) in all {len(cases)} cases, empty sides and empty rows included")


# -- exercise 3: the one-pass row, blocks visited from the last to the first --------------------------------


class _Recorder:
    """An ``update`` that folds each block with the solution and records which keys of ``s`` it held."""

    def __init__(self, s: np.ndarray) -> None:
        self.key = {float(x): i for i, x in enumerate(s)}
        self.blocks: list[list[int | None]] = []

    def __call__(self, state: SoftmaxState, s_block: Any, v_block: Any) -> SoftmaxState:
        self.blocks.append([self.key.get(float(x)) for x in np.asarray(s_block, np.float64).ravel()])
        return online_update_solution(state, s_block, v_block)


def _spans(blocks: Sequence[Sequence[int]]) -> str:
    text = [f"{b[0]}-{b[-1]}" if len(b) > 1 else str(b[0]) for b in blocks[:5]]
    return ", ".join(text) + (", ..." if len(blocks) > 5 else "")


def check_online_attention_row_reversed(row_reversed: Callable[..., Any]) -> None:
    """``row_reversed(s, v, block, update=...)``: attention of one row of scores ``s [n]`` over values ``v [n, d]``,
    folding section 5's blocks (keys ``lo`` to ``lo + block - 1``) with ``update`` from the last to the first."""
    for keys, block, shift in ((16, 4, 0), (16, 1, 0), (16, 3, 0), (10, 4, 0), (12, 5, -120)):
        _check_reversed(row_reversed, keys, block, shift)
    print("passed: online_attention_row_reversed folds the blocks from the last to the first and gives attention "
          "over the row (16 keys in blocks of 4, 1 and 3; 10 keys in blocks of 4; scores near -120)")


def _check_reversed(row_reversed: Callable[..., Any], keys: int, block: int, shift: float) -> None:
    rng = np.random.default_rng(keys * 10 + block)
    s = (rng.normal(size=keys) * 2.0 + shift).astype(np.float32).astype(np.float64)  # distinct, exact in float32
    v = rng.normal(size=(keys, 8))
    record = _Recorder(s)
    out = row_reversed(s, v, block, update=record)
    case = f"failed: online_attention_row_reversed, case '{keys} keys in blocks of {block}" + (
        f", every score near {shift}' — " if shift else "' — ")
    want = [list(range(lo, min(lo + block, keys))) for lo in range(0, keys, block)][::-1]
    if not record.blocks:
        raise CheckFailed(case + "update was never called: fold each block into the state with "
                          "update(state, s[None, lo:hi], v[lo:hi]) (the checker passes an update that records the "
                          "keys of each block)")
    if any(None in b for b in record.blocks):
        raise CheckFailed(case + "update got scores that are not entries of s: pass the block's scores as they are, "
                          "s[None, lo:hi]")
    got = [sorted(b) for b in record.blocks]  # type: ignore[type-var]
    if got == want[::-1] and len(want) > 1:
        raise CheckFailed(case + f"the blocks were folded from the first to the last: start with the last block "
                          f"(keys {_spans(want[:1])}) and walk back to the first")
    if got != want:
        raise CheckFailed(case + f"the blocks were keys {_spans(got)}, expected {_spans(want)}: section 5's blocks "
                          "(keys lo to lo + block - 1 for lo = 0, block, 2 block, ...; only the last one may be "
                          "shorter), from the last to the first")
    out = np.asarray(out, np.float64)
    if shift and out.shape == (v.shape[1],) and not out.any():
        raise CheckFailed(case + "the output is zeros: e^(s - m) underflowed to 0, so m did not start at -inf; start "
                          "from the empty state, SoftmaxState(m=jnp.full(1, -jnp.inf), l=jnp.zeros(1), acc=...)")
    if out.shape != (v.shape[1],) or not np.allclose(out, _row_attention(s, v), rtol=1e-5, atol=1e-5):
        raise CheckFailed(case + f"the output (shape {out.shape}) is not attention over the row, a vector of "
                          f"{v.shape[1]}: the blocks are right, so look at what goes with them: the values of the "
                          "same keys, v[lo:hi], and acc / l once at the end (reference.state_output(state)[0])")


def _row_attention(s: np.ndarray, v: np.ndarray) -> np.ndarray:
    p = np.exp(s - s.max())
    return p @ v / p.sum()


# -- the puzzles ------------------------------------------------------------------------------------------

ONLINE_UPDATE = Puzzle("puzzle 1: the online update", check_online_update, online_update_solution, (
    "Work on all query rows at once. The new maximum is `m_new = max(m_old, the block's largest score)`, row by "
    "row (`jnp.maximum` of `state.m` and `jnp.max(s, axis=-1)`). Everything already in `l` and `acc` was measured "
    "against `m_old`, so it all shrinks by one factor per row, `alpha = exp(m_old - m_new)`; the block's own "
    "weights are `p = exp(s - m_new)`, each at most 1.",
    "`l = alpha * state.l + p.sum(axis=-1)` and `acc = alpha[:, None] * state.acc + p @ v`, with no division: acc "
    "stays unnormalised. One trap is left: a row that has seen no key and meets a fully masked block has "
    "`m_old = m_new = -inf`, and `exp(-inf - (-inf))` is NaN. Exponentiate against "
    "`m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)` instead (and still return `m_new` as `m`).",
))

MERGE_STATES = Puzzle("puzzle 2: merging two states", check_merge_states, merge_states_solution, (
    "Bring both sides to the common maximum `m = max(m_a, m_b)`, row by row. Side A's `l` and `acc` were "
    "measured against `m_a`, so they are multiplied by `alpha = exp(m_a - m)`; side B's by `beta = exp(m_b - m)`. "
    "Then add.",
    "`l = alpha * a.l + beta * b.l` and `acc = alpha[:, None] * a.acc + beta[:, None] * b.acc`. A side that has "
    "seen no key (`m = -inf`, `l = 0`) gets the factor 0, unless the other side is empty too: then `m = -inf` "
    "and `exp(-inf - (-inf))` is NaN, so exponentiate against `m_safe = jnp.where(jnp.isfinite(m), m, 0.0)`.",
))


# -- the exercises ----------------------------------------------------------------------------------------

MERGE_ML = Puzzle("exercise 1: merge (m, l) only", check_merge_ml, merge_ml_solution, (
    "It is `merge_states` without `acc`: the merged maximum is `m = jnp.maximum(m_a, m_b)`, and each side's sum "
    "was taken against its own maximum, so it is rescaled to `m` before the two are added.",
    "`l = l_a * exp(m_a - m) + l_b * exp(m_b - m)`, returned as `(m, l)`. Where neither side has seen a key, "
    "`m = -inf` and `exp(-inf - (-inf))` is NaN: exponentiate against `m_safe = jnp.where(jnp.isfinite(m), m, "
    "0.0)` instead, and still return `m` itself.",
))

MERGE_TREE = Puzzle("exercise 2: order does not matter", check_merge_tree, merge_tree_solution, (
    "Work level by level: merge neighbours in pairs, `(0, 1)`, `(2, 3)`, ..., which halves the list; repeat "
    "until one state is left. Each level adds one to the depth, so 8 states take 3 levels. Call `merge(a, b)` "
    "every time, never `merge_states` directly.",
    "`while len(states) > 1:` pair them with `zip(states[::2], states[1::2])`, and when the list has odd length "
    "append its last state, unmerged, to the new level (`states[-1]`); at the end return `states[0]`, the state "
    "itself, not a list.",
))

ROW_REVERSED = Puzzle("exercise 3: backwards", check_online_attention_row_reversed,
                      online_attention_row_reversed_solution, (
    "Start from section 5's `online_attention_row`: the same empty state (`m = -inf`, `l = 0`, `acc = 0`), the "
    "same blocks `s[None, lo : lo + block]` with their values `v[lo : lo + block]`, the same `acc / l` at the "
    "end. Only the order of the `lo`s changes.",
    "`for lo in reversed(range(0, len(s), block))`: the same starts, last first, so the last (shorter) block "
    "comes first. Fold each with `state = update(state, s[None, lo : lo + block], v[lo : lo + block])` and "
    "return `reference.state_output(state)[0]`.",
))
