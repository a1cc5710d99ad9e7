"""Every exercise checker moved into :mod:`flashlib.exercises`, run three ways: on the notebook's stub (it is
reported as not attempted, no traceback), on plausible wrong answers (each fails, with the message that points
at its mistake) and on a solution (it passes)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from flashlib import reference
from flashlib.checks import CheckFailed, exercise
from flashlib.exercises import online_softmax as nb03


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- 03 exercise 1: merge (m, l) ----------------------------------------------------------------------


def merge_ml_solution(m_a, l_a, m_b, l_b):
    m = jnp.maximum(m_a, m_b)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    return m, l_a * jnp.exp(m_a - safe) + l_b * jnp.exp(m_b - safe)


def merge_ml_unsafe(m_a, l_a, m_b, l_b):  # exponentiates against m itself: NaN when both sides are empty
    m = jnp.maximum(m_a, m_b)
    return m, l_a * jnp.exp(m_a - m) + l_b * jnp.exp(m_b - m)


def merge_ml_no_rescale(m_a, l_a, m_b, l_b):  # forgets that the sums were taken against different maxima
    return jnp.maximum(m_a, m_b), l_a + l_b


def merge_ml_first_max(m_a, l_a, m_b, l_b):  # keeps the first side's maximum
    safe = jnp.where(jnp.isfinite(m_a), m_a, 0.0)
    return m_a, l_a + l_b * jnp.exp(m_b - safe)


def test_merge_ml_stub_is_not_attempted(capsys):
    exercise("exercise 1", lambda: _stub, nb03.check_merge_ml)  # as the notebook calls it
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (merge_ml_unsafe, "NaN in the result"),
    (merge_ml_no_rescale, "must be rescaled"),
    (merge_ml_first_max, "the larger of the two"),
])
def test_merge_ml_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb03.check_merge_ml(wrong)


def test_merge_ml_solution_passes(capsys):
    nb03.check_merge_ml(merge_ml_solution)
    assert capsys.readouterr().out.startswith("passed: merge_ml")


# -- 03 exercise 2: merge a list as a balanced tree -----------------------------------------------------


def merge_tree_solution(states, merge=reference.merge_states):
    while len(states) > 1:
        paired = [merge(a, b) for a, b in zip(states[::2], states[1::2], strict=False)]
        states = paired + ([states[-1]] if len(states) % 2 else [])
    return states[0]


def merge_tree_left_fold(states, merge=reference.merge_states):  # right answer, wrong shape: depth n - 1
    result = states[0]
    for state in states[1:]:
        result = merge(result, state)
    return result


def merge_tree_drops_the_odd_one(states, merge=reference.merge_states):  # loses a state on an odd level
    while len(states) > 1:
        states = [merge(a, b) for a, b in zip(states[::2], states[1::2], strict=False)]
    return states[0]


def merge_tree_first_pair_only(states, merge=reference.merge_states):
    return merge(states[0], states[1])


@pytest.mark.parametrize("wrong, message", [
    (merge_tree_left_fold, "8 states in order — the merges are 7 deep, a balanced tree of 8 is 3"),
    (merge_tree_drops_the_odd_one, "6 states in order — the output differs"),
    (merge_tree_first_pair_only, "8 states in order — the output differs"),
])
def test_merge_tree_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb03.check_merge_tree(wrong)


def test_merge_tree_solution_passes(capsys):
    nb03.check_merge_tree(merge_tree_solution)
    assert "passed: merge_tree" in capsys.readouterr().out


def test_merge_tree_stub_is_not_attempted(capsys):
    exercise("exercise 2", lambda: _stub, nb03.check_merge_tree)
    assert "not attempted yet" in capsys.readouterr().out
