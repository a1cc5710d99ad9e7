"""Notebook 05's puzzles and exercises (:mod:`flashlib.exercises.pallas_basics`), run three ways: the notebook's
stub (reported as not attempted, the puzzle falls back to its solution), plausible wrong answers (each fails with
the message that names its mistake), and a solution (it passes). Kernels run in TPU interpret mode."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib.checks import CheckFailed
from flashlib.exercises import pallas_basics as nb05


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- puzzle 1: add_bias ------------------------------------------------------------------------------------------


def _add_bias(tile_map, bias_map, grid_rows_outside=False, out_map=None, bias_block=(1, 128), grid=None,
              broadcast=False, tile=(8, 128), row_block=8, col_block=128):
    def add_bias(x, b, *, interpret=True):
        def kernel(x_ref, b_ref, o_ref):
            o_ref[...] = x_ref[...] + b_ref[...]

        rows, cols = x.shape[0] // row_block, x.shape[1] // col_block
        return pl.pallas_call(kernel, grid=grid or ((rows, cols) if grid_rows_outside else (cols, rows)),
                              in_specs=[pl.BlockSpec(tile, tile_map), pl.BlockSpec(bias_block, bias_map)],
                              out_specs=pl.BlockSpec(tile, out_map or tile_map),
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=interpret)(x, jnp.broadcast_to(b, x.shape) if broadcast else b)
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
    # b's block shaped like x's: rows 1-7 of it lie past b's single row
    (_add_bias(lambda j, i: (i, j), lambda j, i: (0, j), bias_block=(8, 128)), "NaN in the output: a block read past "
     "b's one row"),
    # the grid of the notebook's [32, 512] example, hard-coded
    (_add_bias(lambda j, i: (i, j), lambda j, i: (0, j), grid=(4, 4)), r"outside its array \(16, 384\).*: the grid is "
     r"\(x.shape\[1\] // 128, x.shape\[0\] // 8\), from x's shape"),
    # b broadcast to [M, N] outside the kernel, then tiled like x: right numbers, an [M, N] bias in HBM
    # mutants of the solution (tests/mutants.py): a (9, 128) tile, right numbers in interpret mode, rejected by
    # Mosaic; the row count by // 7, one step past x's rows once there are 8 row blocks
    (_add_bias(lambda j, i: (i, j), lambda j, i: (0, j), tile=(9, 128)), r"does not lower for TPU: .*block \(9, 128\)"),
    (_add_bias(lambda j, i: (i, j), lambda j, i: (0, j), row_block=7),
     r"case 'x \[64, 128\]: 8 row blocks.*outside its array \(64, 128\)"),
    (_add_bias(lambda j, i: (i, j), lambda j, i: (i, j), bias_block=(8, 128), broadcast=True),
     r"kernel inputs of shapes \[\(16, 384\), \(16, 384\)\], expected one pallas_call taking the 2 arrays given, as"),
    # the column count by // 127: right for every width below 127 x 128 columns, traced at 16,384
    (_add_bias(lambda j, i: (i, j), lambda j, i: (0, j), col_block=127),
     r"case 'x \[16, 16384\]' — grid \(129, 2\), expected \(128, 2\)"),
])
def test_add_bias_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb05.check_add_bias(wrong)


def test_add_bias_solution_passes(capsys):
    assert nb05.ADD_BIAS.use(nb05.add_bias_solution) is nb05.add_bias_solution
    assert "passed: add_bias" in capsys.readouterr().out


def add_bias_whole_row(x, b, *, interpret=True):  # another valid style: all of b in VMEM, sliced in the kernel
    def kernel(x_ref, b_ref, o_ref):
        o_ref[...] = x_ref[...] + b_ref[:, pl.ds(pl.multiple_of(pl.program_id(0) * 128, 128), 128)]

    tile = pl.BlockSpec((8, 128), lambda j, i: (i, j))
    return pl.pallas_call(kernel, grid=(x.shape[1] // 128, x.shape[0] // 8),
                          in_specs=[tile, pl.BlockSpec(b.shape, lambda j, i: (0, 0))], out_specs=tile,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, b)


def test_add_bias_other_valid_style_passes(capsys):
    nb05.check_add_bias(add_bias_whole_row)
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


def _kernel(k_axis=2, last=lambda k, n: k == n - 1, f32=True, init_axis=None):
    def kernel(x_ref, y_ref, o_ref, acc_ref):
        k, n = pl.program_id(k_axis), pl.num_programs(k_axis)

        @pl.when((k if init_axis is None else pl.program_id(init_axis)) == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32 if f32 else None)

        @pl.when(last(k, n))
        def _():
            o_ref[...] = acc_ref[...]
    return kernel


def kernel_starting_from_the_first_product(x_ref, y_ref, o_ref, acc_ref):  # another valid style: no zeros
    k = pl.program_id(2)
    product = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = product

    @pl.when(k > 0)
    def _():
        acc_ref[...] += product

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...]


def _matmul(x_map=lambda i, j, k: (i, k), y_map=lambda i, j, k: (k, j), fixed_semantics=None, use_kernel=True,
            params=True, out_dtype=jnp.float32, fixed_block=None, square=False):
    def matmul(x, y, *, kernel=nb05.matmul_kernel_solution, block=128, semantics=("parallel", "parallel", "arbitrary"),
               interpret=True):
        (m, kk), n, block = x.shape, y.shape[1], fixed_block or block
        return pl.pallas_call(
            kernel if use_kernel else nb05.matmul_kernel_solution,
            grid=(m // block, (m if square else n) // block, kk // block),
            in_specs=[pl.BlockSpec((block, block), x_map), pl.BlockSpec((block, block), y_map)],
            out_specs=pl.BlockSpec((block, block), lambda i, j, k: (i, j)),
            out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
            scratch_shapes=[pltpu.VMEM((block, block), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=fixed_semantics or semantics) if params else None,
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
    (kernel_overwriting, "only the last k step's product reached the output: either acc_ref is overwritten"),
    (_kernel(init_axis=0), r"only the last k step's product reached the output: .* or init runs on every k step — "
                           r"zero it under pl.when\(pl.program_id\(2\) == 0\)"),
    (kernel_finalizing_first, "the last k step's product is missing"),
    (_kernel(last=lambda k, n: k == n), r"o_ref is never written \(NaN\), though acc_ref holds a sum: finalize must"),
    # the notebook's grid (2, 2, 3) has its last k at 2
    (_kernel(last=lambda k, n: k == 2), "case '1 k step.*o_ref is never written"),
    (_kernel(k_axis=0), r"init and finalize ran on every k step .*k is pl.program_id\(2\)"),
    (_kernel(f32=False), "jnp.dot of the two bf16 blocks returns bf16, rounded before it is added: pass prefer"),
])
def test_tiled_matmul_wrong_kernels_fail_with_their_hint(kernel, message):
    with pytest.raises(CheckFailed, match=message):
        nb05.check_tiled_matmul((kernel, nb05.matmul_solution))


@pytest.mark.parametrize("matmul, message", [
    (_matmul(y_map=lambda i, j, k: (j, k)), r"index map of input y_ref returned block \(2, 0\)"),  # Y's map swapped
    (_matmul(fixed_semantics=("parallel", "parallel", "parallel")), "k, the reduction axis, is marked 'parallel'"),
    (_matmul(fixed_semantics=("parallel", "parallel", "arbitrary")), "ignores its `semantics` argument"),
    (_matmul(use_kernel=False), "does not run the kernel it is given"),
    (_matmul(fixed_semantics=("arbitrary", "arbitrary", "arbitrary")), "ignores its `semantics` argument"),
    (_matmul(params=False), "ignores its `semantics` argument"),  # no compiler_params: all 'arbitrary'
    (_matmul(out_dtype=jnp.bfloat16), "output dtype bfloat16, expected float32"),  # out_shape like x's dtype
    (_matmul(fixed_block=128), r"grid \(4, 2, 4\), expected \(2, 1, 2\): it ignores its `block` argument"),
    (_matmul(square=True), r"case 'grid \(1, 3, 2\).*output blocks \[\(0, 1\), \(0, 2\)\] are never written"),
])
def test_tiled_matmul_wrong_wrappers_fail_with_their_hint(matmul, message):
    with pytest.raises(CheckFailed, match=message):
        nb05.check_tiled_matmul((nb05.matmul_kernel_solution, matmul))


def test_tiled_matmul_other_valid_kernel_passes(capsys):
    nb05.check_tiled_matmul((kernel_starting_from_the_first_product, nb05.matmul_solution))
    assert "passed: matmul in TPU interpret mode" in capsys.readouterr().out


def test_tiled_matmul_solution_passes(capsys):
    assert nb05.TILED_MATMUL.use(nb05.TILED_MATMUL.solution) is nb05.TILED_MATMUL.solution
    out = capsys.readouterr().out
    assert "passed: matmul_kernel" in out and "passed: matmul in TPU interpret mode" in out and "flashlib's" in out


# -- exercise 1: matmul_bias -------------------------------------------------------------------------------------


def _matmul_bias(bias_map=lambda i, j, k: (0, j), every_step=False, plain_interpret=False, at_init=False,
                 also_at_init=False, out_dtype=jnp.float32, square=False, broadcast=False, last_of=2, n_axis=1):
    def matmul_bias(x, y, bias, *, interpret=True):
        def kernel(x_ref, y_ref, b_ref, o_ref, acc_ref):
            k = pl.program_id(2)

            @pl.when(k == 0)
            def _():
                acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32) + (b_ref[...] if at_init or also_at_init else 0)

            acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
            if every_step:
                acc_ref[...] += b_ref[...]

            @pl.when(k == pl.num_programs(last_of) - 1)
            def _():
                o_ref[...] = (acc_ref[...] + (0 if every_step or at_init else b_ref[...])).astype(o_ref.dtype)

        (m, kk), n = x.shape, y.shape[n_axis]
        return pl.pallas_call(
            kernel, grid=(m // 128, (m if square else n) // 128, kk // 128),
            in_specs=[pl.BlockSpec((128, 128), lambda i, j, k: (i, k)),
                      pl.BlockSpec((128, 128), lambda i, j, k: (k, j)),
                      pl.BlockSpec((128, 128) if broadcast else (1, 128), bias_map)],
            out_specs=pl.BlockSpec((128, 128), lambda i, j, k: (i, j)),
            out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), scratch_shapes=[pltpu.VMEM((128, 128), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
            interpret=True if plain_interpret else interpret)(x, y, jnp.broadcast_to(bias, (m, n)) if broadcast else
                                                              bias)
    return matmul_bias


def _bias_outside(x, y, bias, *, interpret=True):  # right numbers, but the bias is not fused into the kernel
    return nb05.matmul_solution(x, y, interpret=interpret) + bias


def test_matmul_bias_stub_is_not_attempted(capsys):
    assert nb05.MATMUL_BIAS.use(_stub) is nb05.matmul_bias_solution
    assert "exercise 1: a fused bias: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    # the map that plain interpret mode let through: it clamps the out-of-bounds row block
    (_matmul_bias(bias_map=lambda i, j, k: (i, j)), r"index map of input b_ref returned block \(1, \d\)"),
    # the same map, run in plain interpret mode whatever the caller asks: it would pass there, clamped
    (_matmul_bias(bias_map=lambda i, j, k: (i, j), plain_interpret=True), "ignores its `interpret` argument"),
    (_matmul_bias(every_step=True), "the bias was added 3 times, once per k step"),
    (_matmul_bias(also_at_init=True), "the bias was added 2 times: add it once"),  # at init and in finalize
    (_matmul_bias(out_dtype=jnp.bfloat16), "output dtype bfloat16, expected float32"),
    # the bias broadcast to [M, N] outside the kernel, tiled like the output
    (_matmul_bias(bias_map=lambda i, j, k: (i, j), broadcast=True),
     r"kernel inputs of shapes .*\(256, 256\)\], expected .* as they are"),
    (_matmul_bias(square=True), r"output blocks \[\(0, 1\)\] are never written \(NaN\): the grid"),
    # mutants of the solution (tests/mutants.py) that passed while every case had N = K: finalize on the last
    # step of the column axis, and N read from y's rows
    (_matmul_bias(last_of=1), r"case 'grid \(1, 2, 3\).* — only the first 2 of the 3 k steps reached the output: "
                            r"finalize must run on the last k step"),
    (_matmul_bias(n_axis=0), r"case 'grid \(1, 2, 3\).*index map of input y_ref returned block \(0, 2\)"),
    (_bias_outside, "2 kernel inputs, expected one pallas_call taking the 3 arrays given"),
])
def test_matmul_bias_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb05.check_matmul_bias(wrong)


@pytest.mark.parametrize("answer", [nb05.matmul_bias_solution, _matmul_bias(at_init=True)])  # in finalize, or at init
def test_matmul_bias_solution_passes(answer, capsys):
    assert nb05.MATMUL_BIAS.use(answer) is answer
    out = capsys.readouterr().out
    assert out.startswith("passed: matmul_bias") and "exercise 1: a fused bias: passed" in out


# -- exercise 2: count_copies ------------------------------------------------------------------------------------


count_copies_solution = nb05.count_copies_solution


def count_copies_distinct(visits, index_map):  # counts different blocks, not changes
    return len({index_map(*point) for point in visits})


def count_copies_no_first(visits, index_map):  # forgets the first step's copy
    return count_copies_solution(visits, index_map) - 1


def count_copies_every_step(visits, index_map):
    return len(visits)


def count_copies_sorting(visits, index_map):  # sorts the walk first: every walk becomes row-major
    return count_copies_solution(sorted(visits), index_map)


def count_copies_runs(visits, index_map):  # another valid style: runs of equal block indices
    return len(list(itertools.groupby(index_map(*point) for point in visits)))


def test_count_copies_stub_is_not_attempted(capsys):
    assert nb05.COUNT_COPIES.use(_stub) is count_copies_solution
    assert "exercise 2: count the copies: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (count_copies_distinct, "walk 'k last', X's map — 6 copies, expected 12: .* not different blocks"),
    (count_copies_no_first, r"walk 'k last', X's map — 11 copies, expected 12: the first step copies its block too"),
    (count_copies_every_step, "walk 'k last', O's map — 12 copies, expected 4: a copy happens only when"),
    (count_copies_sorting, "walk 'k outermost', X's map — 12 copies, expected 6: count along `visits`, in the order"),
])
def test_count_copies_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb05.check_count_copies(wrong)


@pytest.mark.parametrize("answer", [count_copies_solution, count_copies_runs])
def test_count_copies_solution_passes(answer, capsys):
    assert nb05.COUNT_COPIES.use(answer) is answer
    out = capsys.readouterr().out
    assert out.startswith("passed: count_copies") and "exercise 2: count the copies: passed" in out


# -- exercise 3: row_sum_fixed -----------------------------------------------------------------------------------


def _row_sum(init=True, semantics=("parallel", "arbitrary"), init_axis=1, rows_per_step=8, columns_per_step=128):
    def row_sum_fixed(x, *, interpret=True):
        def kernel(x_ref, o_ref, acc_ref):
            if init:
                @pl.when(pl.program_id(init_axis) == 0)
                def _():
                    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

            acc_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True)
            o_ref[...] = acc_ref[...]

        return pl.pallas_call(
            kernel, grid=(x.shape[0] // rows_per_step, x.shape[1] // columns_per_step),
            in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
            out_specs=pl.BlockSpec((8, 1), lambda i, j: (i, 0)),
            out_shape=jax.ShapeDtypeStruct((x.shape[0], 1), jnp.float32),
            scratch_shapes=[pltpu.VMEM((8, 1), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics), interpret=interpret)(x)
    return row_sum_fixed


def test_row_sum_stub_is_not_attempted(capsys):
    assert nb05.ROW_SUM.use(_stub) is nb05.row_sum_fixed_solution
    assert "exercise 3: debug a kernel: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (_row_sum(semantics=("parallel", "parallel")), "grid axis 1 carries the running sum .* marked 'parallel'"),
    (_row_sum(init=False), "NaN in the output: fresh scratch is NaN"),
    # zeroed when the row index is 0: on every column step of row block 0
    (_row_sum(init_axis=0), r"only the last column block's sum reached the output: .*pl.program_id\(1\), is 0"),
    # the parallel axis moved, not removed: TPU interpret mode refuses it, the checker says why first
    (_row_sum(semantics=("arbitrary", "parallel")), "grid axis 1 carries the running sum .* marked 'parallel'"),
    # mutants of the solution (tests/mutants.py): grids whose step counts are right for 16 or 24 rows and 384 or 512
    # columns, wrong for 64 rows (// 7: 9 row steps) and for 16384 columns (// 127: 129 column steps)
    (_row_sum(rows_per_step=7), r"case 'x \[64, 16384\]' — grid \(9, 128\), expected \(8, 128\)"),
    (_row_sum(columns_per_step=127), r"case 'x \[64, 16384\]' — grid \(8, 129\), expected \(8, 128\)"),
])
def test_row_sum_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb05.check_row_sum(wrong)


def row_sum_into_output(x, *, interpret=True):  # another valid style: the resident output block is the accumulator
    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

        o_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True)

    return pl.pallas_call(kernel, grid=(x.shape[0] // 8, x.shape[1] // 128),
                          in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
                          out_specs=pl.BlockSpec((8, 1), lambda i, j: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct((x.shape[0], 1), jnp.float32), interpret=interpret)(x)


@pytest.mark.parametrize("answer", [nb05.row_sum_fixed_solution, _row_sum(semantics=("arbitrary", "arbitrary")),
                                    row_sum_into_output])
def test_row_sum_solution_passes(answer, capsys):
    assert nb05.ROW_SUM.use(answer) is answer
    out = capsys.readouterr().out
    assert out.startswith("passed: row_sum_fixed") and "exercise 3: debug a kernel: passed" in out
