"""Notebook 10's puzzles run three ways: the notebook's stub (reported as not attempted, the solution handed
back), plausible wrong answers (each fails with the message that names its mistake) and the solution (passes)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from flashlib import reference
from flashlib.checks import CheckFailed
from flashlib.exercises import decoding as nb10


def _stub(*args, **kwargs):
    raise NotImplementedError


def test_the_stubs_are_reported_as_not_attempted(capsys):
    assert nb10.COMBINE_SPLITS.use(_stub) is nb10.combine_splits_solution
    assert nb10.PAGE_TO_COPY.use(_stub) is nb10.page_to_copy_solution
    assert capsys.readouterr().out.count("not attempted yet") == 2


def test_the_solutions_pass():
    nb10.check_combine_splits(nb10.combine_splits_solution)
    nb10.check_page_to_copy(nb10.page_to_copy_solution)


def _averaged(states):  # each split normalised on its own, then the mean: ignores the splits' weights
    return jnp.mean(jnp.stack([reference.state_output(s) for s in states]), axis=0)


def _unsafe_merge(states):  # rescales against the new maximum itself: NaN where both sides have seen no key
    m = states[0].m
    l, acc = states[0].l, states[0].acc  # noqa: E741
    for s in states[1:]:
        new = jnp.maximum(m, s.m)
        a, b = jnp.exp(m - new), jnp.exp(s.m - new)
        l, acc, m = a * l + b * s.l, a[..., None] * acc + b[..., None] * s.acc, new  # noqa: E741
    return acc / l[..., None]


def _no_rescale(states):  # acc and l summed as they are: each split measured against its own maximum
    acc, l = sum(s.acc for s in states), sum(s.l for s in states)  # noqa: E741
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def _last_split_only(states):
    return reference.state_output(states[-1])


@pytest.mark.parametrize("answer, message", [
    (_averaged, "the splits' outputs are averaged"),
    (_unsafe_merge, "NaN in the output"),
    (_no_rescale, "acc and l are added without rescaling: .* exp\\(m_split - m_max\\)"),
    (_last_split_only, "max error"),
])
def test_wrong_combinations_are_named(answer, message):
    with pytest.raises(CheckFailed, match=message):
        nb10.check_combine_splits(answer)


def _unclamped(step, length, table_row, page_size):
    return table_row[step]


def _floor(step, length, table_row, page_size):
    return table_row[min(step, length // page_size)]


def _no_empty_page(step, length, table_row, page_size):
    return table_row[min(step, -(-length // page_size) - 1)]  # -1 for an empty sequence: the table's last entry


@pytest.mark.parametrize("answer, message", [
    (_unclamped, r"page 5 is past the sequence's last live page \(index 3"),
    (_floor, "12 tokens fill exactly 3 pages"),
    (_no_empty_page, r"length 0, page_size 4, step 0 — got page 5, expected 7"),
])
def test_wrong_pages_are_named(answer, message):
    with pytest.raises(CheckFailed, match=message):
        nb10.check_page_to_copy(answer)


def test_the_hints_end_in_the_solutions():
    for puzzle in (nb10.COMBINE_SPLITS, nb10.PAGE_TO_COPY):
        assert puzzle.levels == 3 and "def " in puzzle.solution_source()
    assert np.isfinite(np.asarray(nb10.combine_splits_solution([reference.SoftmaxState(
        m=jnp.full((1,), -jnp.inf), l=jnp.zeros((1,)), acc=jnp.zeros((1, 2)))]))).all()
