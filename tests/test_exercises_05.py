"""Notebook 05's puzzles and exercises (:mod:`flashlib.exercises.pallas_basics`), run three ways: the notebook's
stub (reported as not attempted, the puzzle falls back to its solution), plausible wrong answers (each fails with
the message that names its mistake), and a solution (it passes). Kernels run in TPU interpret mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib.checks import CheckFailed, exercise
from flashlib.exercises import pallas_basics as nb05


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- puzzle 1: add_bias ------------------------------------------------------------------------------------------


def _add_bias(tile_map, bias_map, grid_rows_outside=False, out_map=None):
    def add_bias(x, b, *, interpret=True):
        def kernel(x_ref, b_ref, o_ref):
            o_ref[...] = x_ref[...] + b_ref[...]

        rows, cols = x.shape[0] // 8, x.shape[1] // 128
        return pl.pallas_call(kernel, grid=(rows, cols) if grid_rows_outside else (cols, rows),
                              in_specs=[pl.BlockSpec((8, 128), tile_map), pl.BlockSpec((1, 128), bias_map)],
                              out_specs=pl.BlockSpec((8, 128), out_map or tile_map),
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, b)
    return add_bias


def test_add_bias_stub_falls_back_to_the_solution(capsys):
    assert nb05.ADD_BIAS.use(_stub) is nb05.add_bias_solution
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    # the maps written for a grid (i, j), while the grid is (j, i): rows and columns swapped
    (_add_bias(lambda j, i: (j, i), lambda j, i: (0, i)), r"index map of input x_ref returned block \(2, 0\)"),
    # x's map right, the output's still swapped (jax 0.7.2 reports the write, later jax the block index)
    (_add_bias(lambda j, i: (i, j), lambda j, i: (0, j), out_map=lambda j, i: (j, i)),
     r"(output o_ref returned block \(2, 0\),|write of \[\(slice\(16, 24, 1\).*\]) outside its array \(16, 384\)"),
    # b's map copied from x's: b has one row of blocks
    (_add_bias(lambda j, i: (i, j), lambda j, i: (i, j)), r"index map of input b_ref returned block \(1, 0\)"),
    # b's map names the inner (row) index: in bounds on 16 x 384, the wrong bias
    (_add_bias(lambda j, i: (i, j), lambda j, i: (0, i)), "values off.*b's map names column block j"),
    # right numbers, rows outside: b's block is fetched again at every step
    (_add_bias(lambda i, j: (i, j), lambda i, j: (0, j), grid_rows_outside=True),
     "b's block is copied 6 times for its 3 different blocks"),
])
def test_add_bias_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb05.check_add_bias(wrong)


def test_add_bias_solution_passes(capsys):
    assert nb05.ADD_BIAS.use(nb05.add_bias_solution) is nb05.add_bias_solution
    assert "passed: add_bias" in capsys.readouterr().out


# -- puzzle 2: the tiled matmul ------------------------------------------------------------------------------------


def kernel_without_init(x_ref, y_ref, o_ref, acc_ref):
    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...]


def kernel_writing_every_step(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
    o_ref[...] = acc_ref[...]


def kernel_overwriting(x_ref, y_ref, o_ref, acc_ref):  # = instead of +=
    acc_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...]


def kernel_finalizing_first(x_ref, y_ref, o_ref, acc_ref):  # writes the output before the last accumulate
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...]

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)


def _matmul(x_map=lambda i, j, k: (i, k), y_map=lambda i, j, k: (k, j), fixed_semantics=None, use_kernel=True):
    def matmul(x, y, *, kernel=nb05.matmul_kernel_solution, block=128, semantics=("parallel", "parallel", "arbitrary"),
               interpret=True):
        (m, kk), n = x.shape, y.shape[1]
        return pl.pallas_call(
            kernel if use_kernel else nb05.matmul_kernel_solution, grid=(m // block, n // block, kk // block),
            in_specs=[pl.BlockSpec((block, block), x_map), pl.BlockSpec((block, block), y_map)],
            out_specs=pl.BlockSpec((block, block), lambda i, j, k: (i, j)),
            out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
            scratch_shapes=[pltpu.VMEM((block, block), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=fixed_semantics or semantics),
            interpret=interpret)(x, y)
    return matmul


def test_tiled_matmul_stub_falls_back_to_the_solution(capsys):
    def matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
        raise NotImplementedError

    assert nb05.TILED_MATMUL.use((matmul_kernel, _stub)) is nb05.TILED_MATMUL.solution
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("kernel, message", [
    (kernel_without_init, "NaN in the output: TPU interpret mode fills fresh scratch with NaN"),
    (kernel_writing_every_step, r"o_ref is stored into on 2 k step\(s\) before the last"),
    (kernel_overwriting, "only the last k step's product reached the output"),
    (kernel_finalizing_first, "the last k step's product is missing"),
])
def test_tiled_matmul_wrong_kernels_fail_with_their_hint(kernel, message):
    with pytest.raises(CheckFailed, match=message):
        nb05.check_tiled_matmul((kernel, nb05.matmul_solution))


@pytest.mark.parametrize("matmul, message", [
    (_matmul(y_map=lambda i, j, k: (j, k)), r"index map of input y_ref returned block \(2, 0\)"),  # Y's map swapped
    (_matmul(fixed_semantics=("parallel", "parallel", "parallel")), "k, the reduction axis, is marked 'parallel'"),
    (_matmul(fixed_semantics=("parallel", "parallel", "arbitrary")), "ignores its `semantics` argument"),
    (_matmul(use_kernel=False), "does not run the kernel it is given"),
])
def test_tiled_matmul_wrong_wrappers_fail_with_their_hint(matmul, message):
    with pytest.raises(CheckFailed, match=message):
        nb05.check_tiled_matmul((nb05.matmul_kernel_solution, matmul))


def test_tiled_matmul_solution_passes(capsys):
    assert nb05.TILED_MATMUL.use(nb05.TILED_MATMUL.solution) is nb05.TILED_MATMUL.solution
    out = capsys.readouterr().out
    assert "passed: matmul_kernel" in out and "passed: matmul in TPU interpret mode" in out and "solved" in out


# -- exercise 1: matmul_bias -------------------------------------------------------------------------------------


def _matmul_bias(bias_map=lambda i, j, k: (0, j), every_step=False, plain_interpret=False):
    def matmul_bias(x, y, bias, *, interpret=True):
        def kernel(x_ref, y_ref, b_ref, o_ref, acc_ref):
            k = pl.program_id(2)

            @pl.when(k == 0)
            def _():
                acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

            acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
            if every_step:
                acc_ref[...] += b_ref[...]

            @pl.when(k == pl.num_programs(2) - 1)
            def _():
                o_ref[...] = acc_ref[...] + (0 if every_step else b_ref[...])

        (m, kk), n = x.shape, y.shape[1]
        return pl.pallas_call(
            kernel, grid=(m // 128, n // 128, kk // 128),
            in_specs=[pl.BlockSpec((128, 128), lambda i, j, k: (i, k)),
                      pl.BlockSpec((128, 128), lambda i, j, k: (k, j)), pl.BlockSpec((1, 128), bias_map)],
            out_specs=pl.BlockSpec((128, 128), lambda i, j, k: (i, j)),
            out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32), scratch_shapes=[pltpu.VMEM((128, 128), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
            interpret=True if plain_interpret else interpret)(x, y, bias)
    return matmul_bias


def _bias_outside(x, y, bias, *, interpret=True):  # right numbers, but the bias is not fused into the kernel
    return nb05.matmul_solution(x, y, interpret=interpret) + bias


def test_matmul_bias_stub_is_not_attempted(capsys):
    exercise("exercise 1", lambda: _stub, nb05.check_matmul_bias)
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    # the map that plain interpret mode let through: it clamps the out-of-bounds row block
    (_matmul_bias(bias_map=lambda i, j, k: (i, j)), r"index map of input b_ref returned block \(1, \d\)"),
    # the same map, run in plain interpret mode whatever the caller asks: it would pass there, clamped
    (_matmul_bias(bias_map=lambda i, j, k: (i, j), plain_interpret=True), "ignores its `interpret` argument"),
    (_matmul_bias(every_step=True), "the bias was added 2 times, once per k step"),
    (_bias_outside, "2 kernel inputs, expected one pallas_call taking the 3 arrays given"),
])
def test_matmul_bias_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb05.check_matmul_bias(wrong)


def test_matmul_bias_solution_passes(capsys):
    nb05.check_matmul_bias(_matmul_bias())
    assert capsys.readouterr().out.startswith("passed: matmul_bias")


# -- exercise 2: count_copies ------------------------------------------------------------------------------------


def count_copies_solution(visits, index_map):
    blocks = [index_map(*point) for point in visits]
    return 1 + sum(a != b for a, b in zip(blocks, blocks[1:], strict=False))


def count_copies_distinct(visits, index_map):  # counts different blocks, not changes
    return len({index_map(*point) for point in visits})


def count_copies_no_first(visits, index_map):  # forgets the first step's copy
    return count_copies_solution(visits, index_map) - 1


def count_copies_every_step(visits, index_map):
    return len(visits)


def test_count_copies_stub_is_not_attempted(capsys):
    exercise("exercise 2", lambda: _stub, nb05.check_count_copies)
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (count_copies_distinct, "walk 'k last', X's map — 6 copies, expected 12: .* not different blocks"),
    (count_copies_no_first, r"walk 'k last', X's map — 11 copies, expected 12: the first step copies its block too"),
    (count_copies_every_step, "walk 'k last', O's map — 12 copies, expected 4: a copy happens only when"),
])
def test_count_copies_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb05.check_count_copies(wrong)


def test_count_copies_solution_passes(capsys):
    nb05.check_count_copies(count_copies_solution)
    assert capsys.readouterr().out.startswith("passed: count_copies")


# -- exercise 3: row_sum_fixed -----------------------------------------------------------------------------------


def _row_sum(init=True, semantics=("parallel", "arbitrary")):
    def row_sum_fixed(x, *, interpret=True):
        def kernel(x_ref, o_ref, acc_ref):
            if init:
                @pl.when(pl.program_id(1) == 0)
                def _():
                    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

            acc_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True)
            o_ref[...] = acc_ref[...]

        return pl.pallas_call(
            kernel, grid=(x.shape[0] // 8, x.shape[1] // 128),
            in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
            out_specs=pl.BlockSpec((8, 1), lambda i, j: (i, 0)),
            out_shape=jax.ShapeDtypeStruct((x.shape[0], 1), jnp.float32),
            scratch_shapes=[pltpu.VMEM((8, 1), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics), interpret=interpret)(x)
    return row_sum_fixed


def test_row_sum_stub_is_not_attempted(capsys):
    exercise("exercise 3", lambda: _stub, nb05.check_row_sum)
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (_row_sum(semantics=("parallel", "parallel")), "grid axis 1 carries the running sum .* marked 'parallel'"),
    (_row_sum(init=False), "NaN in the output: fresh scratch is NaN"),
])
def test_row_sum_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb05.check_row_sum(wrong)


def test_row_sum_solution_passes(capsys):
    nb05.check_row_sum(_row_sum())
    assert capsys.readouterr().out.startswith("passed: row_sum_fixed")
