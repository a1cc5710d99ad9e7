"""Notebook 00's exercise checkers (:mod:`flashlib.exercises.start_here`), run three ways: on the notebook's stub
(reported as not attempted), on plausible wrong answers (each fails with the message naming its mistake) and on a
solution (it passes)."""

from __future__ import annotations

import jax
import pytest
from jax.experimental import pallas as pl

from flashlib.checks import CheckFailed, exercise
from flashlib.exercises import start_here as nb00

# -- exercise 1: scaled_add, a Pallas kernel --------------------------------------------------------------------


def _scaled_add(x, y, alpha, interpret, *, grid=None, body=None):
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = (body or (lambda a, b: alpha * a + b))(x_ref[...], y_ref[...])

    tile = pl.BlockSpec((8, 128), lambda i, j: (i, j))
    return pl.pallas_call(kernel, grid=grid or (x.shape[0] // 8, x.shape[1] // 128), in_specs=[tile, tile],
                          out_specs=tile, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, y)


def scaled_add_solution(x, y, alpha, *, interpret=None):
    return _scaled_add(x, y, alpha, interpret)


def scaled_add_notebook_grid(x, y, alpha, *, interpret=None):  # the grid of the notebook's (32, 256) example
    return _scaled_add(x, y, alpha, interpret, grid=(4, 2))


def scaled_add_too_few_columns(x, y, alpha, *, interpret=None):  # one column of tiles: the rest never written
    return _scaled_add(x, y, alpha, interpret, grid=(x.shape[0] // 8, 1))


def scaled_add_both_scaled(x, y, alpha, *, interpret=None):
    return _scaled_add(x, y, alpha, interpret, body=lambda a, b: alpha * (a + b))


def scaled_add_fixed_alpha(x, y, alpha, *, interpret=None):  # the notebook's 0.5 baked in
    return _scaled_add(x, y, alpha, interpret, body=lambda a, b: 0.5 * a + b)


def scaled_add_without_pallas(x, y, alpha, *, interpret=None):
    return alpha * x + y


def scaled_add_old_signature(x, y, alpha):  # the notebook's first stub had no `interpret`
    return _scaled_add(x, y, alpha, None)


def _stub(*args, **kwargs):
    raise NotImplementedError


def test_scaled_add_stub_is_not_attempted(capsys):
    exercise("exercise 1", lambda: _stub, nb00.check_scaled_add)  # as the notebook calls it
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (scaled_add_notebook_grid, "case 'a \\(16, 384\\) array.*a block past the array's edge"),
    (scaled_add_too_few_columns, "case 'the notebook's .*never written: the grid must cover the whole array"),
    (scaled_add_both_scaled, "y is scaled too"),
    (scaled_add_fixed_alpha, "case 'alpha = -2.*alpha is fixed at 0.5"),
    (scaled_add_without_pallas, "no Pallas kernel runs"),
    (scaled_add_old_signature, "takes no `interpret` argument: keep the stub's signature"),
])
def test_scaled_add_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb00.check_scaled_add(wrong)


def test_scaled_add_solution_passes(capsys):
    nb00.check_scaled_add(scaled_add_solution)
    assert capsys.readouterr().out.startswith("passed: scaled_add")


# -- exercise 2: which block shapes lower ----------------------------------------------------------------------


def test_block_prediction_stub_is_not_attempted(capsys):
    exercise("exercise 2", lambda: _stub(), nb00.check_block_prediction)  # my_answer() raises for None
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    # "small tiles only": the full-width and whole-array blocks are left out
    ({(8, 128), (16, 256)}, "case 'block \\(8, 1024\\)': it lowers, but you left it out.*however large"),
    # "the rows are a multiple of 8, so (1024, 64) is fine"
    ({(8, 128), (16, 256), (8, 1024), (1024, 64), (1024, 1024)},
     "case 'block \\(1024, 64\\)': you predicted it lowers, the toolchain rejects it — .*columns 64 are neither "
     "divisible by 128"),
    ([(8, 128), (4, 100)], "\\[\\(4, 100\\)\\] not among the candidates"),
    (7, "give a set of \\(rows, cols\\) pairs"),
])
def test_block_prediction_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb00.check_block_prediction(wrong)


def test_block_prediction_solution_passes(capsys):
    nb00.check_block_prediction([[8, 128], (16, 256), (8, 1024), (1024, 1024)])  # lists of lists are fine too
    assert capsys.readouterr().out.startswith("passed: your prediction matches the TPU toolchain")


def test_the_truth_is_the_tiling_rule():
    """The checker asks the toolchain; what it says is the (8, 128)-or-whole-array rule."""
    assert [nb00.block_lowers(b)[0] for b in nb00.BLOCK_CANDIDATES] == [True, True, True, False, True]
