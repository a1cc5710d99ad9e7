"""Notebook 00's exercise checkers (:mod:`flashlib.exercises.start_here`), run three ways: on the notebook's stub
(reported as not attempted), on plausible wrong answers (each fails with the message naming its mistake) and on a
solution (it passes)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib.checks import CheckFailed
from flashlib.exercises import start_here as nb00

# -- exercise 1: scaled_add, a Pallas kernel --------------------------------------------------------------------


def _scaled_add(x, y, alpha, interpret, *, grid=None, body=None, index_map=lambda i, j: (i, j), block=(8, 128)):
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = (body or (lambda a, b: alpha * a + b))(x_ref[...], y_ref[...])

    tile = pl.BlockSpec(block, index_map)
    return pl.pallas_call(kernel, grid=grid or (x.shape[0] // 8, x.shape[1] // 128), in_specs=[tile, tile],
                          out_specs=tile, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, y)


scaled_add_solution = nb00.scaled_add_solution


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


def scaled_add_plain_interpret(x, y, alpha, *, interpret=None):  # "works on my laptop": interpret=True baked in
    return _scaled_add(x, y, alpha, True)


def scaled_add_scaling_outside(x, y, alpha, *, interpret=None):  # the notebook's `add` kernel, fed alpha * x
    return _scaled_add(alpha * x, y, alpha, interpret, body=lambda a, b: a + b)


def scaled_add_first_column_only(x, y, alpha, *, interpret=None):  # right grid, index map stuck on column block 0
    return _scaled_add(x, y, alpha, interpret, index_map=lambda i, j: (i, 0))


def scaled_add_nine_row_blocks(x, y, alpha, *, interpret=None):  # (9, 128) blocks: interpret mode pads (mutant)
    return _scaled_add(x, y, alpha, interpret, block=(9, 128))


def scaled_add_rows_over_seven(x, y, alpha, *, interpret=None):  # x.shape[0] // 7: right up to 48 rows (mutant)
    return _scaled_add(x, y, alpha, interpret, grid=(x.shape[0] // 7, x.shape[1] // 128))


def scaled_add_cols_over_127(x, y, alpha, *, interpret=None):  # x.shape[1] // 127: right below 16256 columns (mutant)
    return _scaled_add(x, y, alpha, interpret, grid=(x.shape[0] // 8, x.shape[1] // 127))


def scaled_add_alpha_in_smem(x, y, alpha, *, interpret=None):  # another valid style: alpha as an SMEM input
    def kernel(alpha_ref, x_ref, y_ref, o_ref):
        o_ref[...] = alpha_ref[0] * x_ref[...] + y_ref[...]

    tile = pl.BlockSpec((8, 128), lambda i, j: (i, j))
    return pl.pallas_call(kernel, grid=(x.shape[0] // 8, x.shape[1] // 128),
                          in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), tile, tile], out_specs=tile,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=interpret)(jnp.full((1,), alpha, jnp.float32), x, y)


@functools.partial(jax.jit, static_argnames=("alpha", "interpret"))
def scaled_add_jitted_rows(x, y, alpha, *, interpret=None):  # another valid style: jitted, full-width row blocks
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = alpha * x_ref[...] + y_ref[...]

    rows = pl.BlockSpec((8, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(kernel, grid=(x.shape[0] // 8,), in_specs=[rows, rows], out_specs=rows,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, y)


def _stub(*args, **kwargs):
    raise NotImplementedError


def test_scaled_add_stub_is_not_attempted(capsys):
    assert nb00.SCALED_ADD.use(_stub) is nb00.scaled_add_solution  # as the notebook calls it
    assert "exercise 1: scaled_add: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (scaled_add_notebook_grid, "case 'a \\(16, 384\\) array.*a block past the array's edge"),
    (scaled_add_too_few_columns, "case 'the notebook's .*never written: the grid \\(4, 1\\) must cover the whole"),
    (scaled_add_both_scaled, "y is scaled too"),
    (scaled_add_fixed_alpha, "case 'alpha = -2.*alpha is fixed at 0.5"),
    (scaled_add_without_pallas, "no Pallas kernel runs"),
    (scaled_add_old_signature, "takes no `interpret` argument: keep the stub's signature"),
    (scaled_add_plain_interpret, "ignores its `interpret` argument: pass interpret=interpret to pl.pallas_call"),
    (scaled_add_scaling_outside, "arithmetic outside the kernel \\(mul on whole arrays"),
    (scaled_add_first_column_only, "although the grid \\(4, 2\\) has a step per tile: the output's index map sends "
     "several steps to one tile"),
    (scaled_add_nine_row_blocks, "lowered for TPU .*interpret mode computes the right numbers, but the TPU "
     "toolchain rejects the kernel: block shape breaks the TPU tiling rule"),
    (scaled_add_rows_over_seven, "case 'a tall \\(56, 128\\) array.*a block past the array's edge"),
    (scaled_add_cols_over_127, "case 'a wide \\(8, 16384\\) array.*a block past the array's edge"),
])
def test_scaled_add_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb00.check_scaled_add(wrong)


@pytest.mark.parametrize("answer", [scaled_add_solution, scaled_add_alpha_in_smem, scaled_add_jitted_rows])
def test_scaled_add_solution_passes(answer, capsys):
    nb00.check_scaled_add(answer)
    assert capsys.readouterr().out.startswith("passed: scaled_add")


def test_scaled_add_exercise_passes_the_solution(capsys):
    assert nb00.SCALED_ADD.use(nb00.scaled_add_solution) is nb00.scaled_add_solution
    assert capsys.readouterr().out.splitlines()[-1].startswith("exercise 1: scaled_add: passed")


# -- exercise 2: which block shapes lower ----------------------------------------------------------------------


def test_block_prediction_stub_is_not_attempted(capsys):
    assert nb00.BLOCK_PREDICTION.use(_stub) == nb00.block_prediction_solution()  # the notebook's stub raises
    assert "exercise 2: which block shapes lower: not attempted yet" in capsys.readouterr().out


RIGHT = {(8, 128), (1020, 128), (8, 1000), (1020, 1000)}


@pytest.mark.parametrize("wrong, message", [
    # "only multiples of (8, 128)": the blocks that take a whole dimension of the array are left out
    ({(8, 128)}, "case 'block \\(1020, 128\\)': it lowers, but you left it out — its rows 1020 are equal to the "
     "array's.*or equal the array's"),
    # "the whole array or (8, 128) tiles": a block that takes one whole dimension is left out
    ({(8, 128), (1020, 1000)}, "case 'block \\(1020, 128\\)': it lowers.*case 'block \\(8, 1000\\)': it lowers, "
     "but you left it out — its rows 8 are divisible by 8, its columns 1000 are equal to the array's"),
    # "the rows are a multiple of 8, so (16, 64) is fine"
    (RIGHT | {(16, 64)}, "case 'block \\(16, 64\\)': you predicted it lowers, the toolchain rejects it — .*columns 64 "
     "are neither divisible by 128 nor the array's"),
    # "12 rows: fewer than the array's, so fine"
    (RIGHT | {(12, 128)}, "case 'block \\(12, 128\\)': you predicted it lowers.*its rows 12 are neither divisible by "
     "8 nor the array's"),
    ([(8, 128), (4, 100)], "\\[\\(4, 100\\)\\] not among the candidates"),
    (7, "give a set of \\(rows, cols\\) pairs"),
])
def test_block_prediction_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb00.check_block_prediction(wrong)


def test_block_prediction_solution_passes(capsys):
    nb00.check_block_prediction([[8, 128], (1020, 128), (8, 1000), (1020, 1000)])  # lists of lists are fine too
    assert capsys.readouterr().out.startswith("passed: your prediction matches the TPU toolchain")
    assert nb00.BLOCK_PREDICTION.use(nb00.block_prediction_solution) == RIGHT
    assert capsys.readouterr().out.splitlines()[-1] == "exercise 2: which block shapes lower: passed"


def test_the_truth_is_the_tiling_rule():
    """The checker asks the toolchain; what it says is the (8, 128)-or-whole-array rule."""
    assert [nb00.block_lowers(b)[0] for b in nb00.BLOCK_CANDIDATES] == [True, False, False, True, True, True]
