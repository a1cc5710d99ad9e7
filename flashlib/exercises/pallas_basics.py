"""Notebook 05's puzzles and exercises: a kernel whose index maps keep a block in place (a bias row added to
``x``), the tiled matmul with its f32 accumulator in VMEM scratch, then a fused bias, counting copies, and a
kernel to debug.

Kernels run in TPU interpret mode (``pltpu.InterpretParams()``): an out-of-bounds block index is an error there
(plain interpret mode clamps it, and a wrong map passes), and fresh scratch is NaN. What a run cannot show the
checkers read from the ``pallas_call`` itself (its jaxpr): the grid, each index map, and the dimension semantics;
what only the chip's compiler rejects (a block off the (8, 128) tiling) they ask Mosaic, by lowering for TPU.

Longer than 400 lines because the jaxpr inspection the three kernel checkers share lives here, beside them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib import tpu_compile
from flashlib.checks import CheckFailed
from flashlib.exercises.pallas_basics_solutions import (
    add_bias_solution,
    count_copies_solution,
    matmul_bias_solution,
    matmul_kernel_solution,
    matmul_solution,
    row_sum_fixed_solution,
)
from flashlib.exercises.puzzle import Puzzle
from flashlib.exercises.start_here import traced_eqns

__all__ = ["ADD_BIAS", "COUNT_COPIES", "MATMUL_BIAS", "ROW_SUM", "TILED_MATMUL", "check_add_bias",
           "check_count_copies", "check_matmul_bias", "check_row_sum", "check_tiled_matmul", "count_copies_solution",
           "matmul_bias_solution", "row_sum_fixed_solution"]
Point = tuple[int, ...]

# -- what a pallas_call says about itself ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """One ``pallas_call`` as traced: its grid, the index map of each input then output, its semantics."""

    grid: Point
    maps: tuple[Callable[..., Point], ...]
    semantics: tuple[str, ...]

    def ignored_axes(self, which: int) -> set[int]:
        """The grid axes (longer than 1) that map ``which`` ignores: for an output, the reduction axes."""
        index, points = self.maps[which], list(np.ndindex(*self.grid))
        return {axis for axis in range(len(self.grid)) if self.grid[axis] > 1 and all(
            index(*p) == index(*p[:axis], 0, *p[axis + 1:]) for p in points)}

    def copies(self, which: int) -> tuple[int, int]:
        """``(copies, different blocks)`` of map ``which`` in row-major order, as one TensorCore walks the grid."""
        blocks = [self.maps[which](*p) for p in np.ndindex(*self.grid)]
        return _changes(blocks), len(set(blocks))


def _changes(blocks: Sequence[Point]) -> int:
    """Copies of a block sequence: one at the first step, then one each time the index changes."""
    return 1 + sum(a != b for a, b in zip(blocks, blocks[1:], strict=False))


def _inspect(name: str, fn: Callable[..., Any], inputs: int, *args, **kwargs) -> _Call:
    """The single ``pallas_call`` that ``fn(*args, **kwargs)`` makes, with ``inputs`` inputs."""
    calls = [e for e in traced_eqns(jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args).jaxpr)
             if e.primitive.name == "pallas_call"]
    grid_mapping = calls[0].params["grid_mapping"] if len(calls) == 1 else None
    shapes, given = [tuple(v.aval.shape) for v in calls[0].invars[-inputs:]] if calls else [], [a.shape for a in args]
    if grid_mapping is None or grid_mapping.num_inputs != inputs or shapes != given:
        found = (f"{len(calls)} pallas_calls" if grid_mapping is None else f"{grid_mapping.num_inputs} kernel inputs"
                 if grid_mapping.num_inputs != inputs else f"kernel inputs of shapes {shapes}")
        raise CheckFailed(f"failed: {name} — {found}, expected one pallas_call taking the {inputs} arrays given, as "
                          f"they are ({given}): do all the work inside the kernel, not with jnp outside it")
    params = calls[0].params.get("compiler_params")
    if isinstance(params, dict) or hasattr(params, "values"):  # jax 0.7.2: {"mosaic_tpu": CompilerParams(...)}
        params = next(iter(params.values()), None)
    if isinstance(kwargs.get("interpret"), pltpu.InterpretParams) and not isinstance(
            calls[0].params.get("interpret"), pltpu.InterpretParams):
        raise CheckFailed(f"failed: {name} — it ignores its `interpret` argument: pass interpret=interpret to "
                          "pl.pallas_call (the checker asks for TPU interpret mode, which plain interpret mode is not)")
    grid = tuple(int(n) for n in grid_mapping.grid)
    semantics = getattr(params, "dimension_semantics", None) or ("arbitrary",) * len(grid)
    maps = tuple(lambda *p, c=m.index_map_jaxpr: tuple(int(v) for v in jax.core.eval_jaxpr(c.jaxpr, c.consts, *p))
                 for m in grid_mapping.block_mappings)
    return _Call(grid, maps, tuple("parallel" if "parallel" in str(s).lower() else "arbitrary" for s in semantics))


_OUT_OF_BOUNDS = re.compile(r'Out-of-bounds block index (\([^)]*\)) for (\w+) "([^"]+)" in iteration (\([^)]*\))'
                            r'.*?has shape (\([^)]*\))')
_OUT_OF_BOUNDS_ACCESS = re.compile(r"Out-of-bounds (read|write) of [^:]*: \w+ (\[.*?\]) but \w+ has shape (\([^)]*\))")


@contextlib.contextmanager
def _tpu_interpret(name: str, case: str, hint: str) -> Iterator[None]:
    """Turn TPU interpret mode's out-of-bounds error into a CheckFailed (its logged traceback is muted). After any
    error the interpreter's simulated memory is reset: jax 0.7.2 keeps it, and the next kernel would fail."""
    logger = logging.getLogger("jax._src.callback")
    was, logger.disabled = logger.disabled, True
    try:
        yield
    except Exception as error:  # XlaRuntimeError on jax 0.7.2, JaxRuntimeError later
        pltpu.reset_tpu_interpret_mode_state()
        found, access = _OUT_OF_BOUNDS.search(str(error)), _OUT_OF_BOUNDS_ACCESS.search(str(error))
        if found is None and access is None:
            raise
        what = (f"at grid step {found[4]} the index map of {found[2]} {found[3]} returned block {found[1]}, outside "
                f"its array {found[5]}" if found else
                f"a block {access[1]} of {access[2]} outside its array {access[3]}")
        raise CheckFailed(f"failed: {name}, case '{case}' — {what} (TPU interpret mode refuses out-of-bounds blocks; "
                          f"plain interpret mode would clamp them): {hint}") from None
    finally:
        logger.disabled = was


def _values(name: str, case: str, got, want, hint: str, atol: float = 1e-3) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise CheckFailed(f"failed: {name}, case '{case}' — output shape {got.shape}, expected {want.shape}")
    bad = ~(np.abs(got - want) <= atol)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CheckFailed(f"failed: {name}, case '{case}' — {int(bad.sum())} of {bad.size} values off, first at "
                          f"{where}: got {got[where]:.6g}, expected {want[where]:.6g}: {hint}")


def _ints(rng: np.random.Generator, shape: tuple[int, ...], dtype=jnp.bfloat16) -> jax.Array:
    """Small integers: every product and sum is exact, so a wrong sum is told apart from rounding."""
    return jnp.asarray(rng.integers(-3, 4, size=shape), dtype)


def _float32_written(name: str, case: str, out) -> np.ndarray:
    """``out`` as float64, checked float32 and without NaN blocks beside others (all NaN: the caller judges)."""
    o = np.isnan(np.atleast_2d(np.asarray(out, np.float64)))  # blocks of 128 x 128, whatever the shape
    nan = np.array([[o[r:r + 128, c:c + 128].any() for c in range(0, o.shape[1], 128)] for r in range(0, len(o), 128)])
    if out.dtype != jnp.float32:
        raise CheckFailed(f"failed: {name}, case '{case}' — output dtype {out.dtype}, expected float32: out_shape is "
                          "jax.ShapeDtypeStruct((m, n), jnp.float32), like the accumulator (bf16 rounds the sums)")
    if nan.any() and not nan.all():
        raise CheckFailed(f"failed: {name}, case '{case}' — output blocks "
                          f"{list(map(tuple, np.argwhere(nan).tolist()))} are never written (NaN): the grid must "
                          "cover every output block, (M // block, N // block, K // block) from x's and y's shapes")
    return np.asarray(out, np.float64)


# -- puzzle 1: a bias row that stays put ---------------------------------------------------------------------


def check_add_bias(add_bias: Callable[..., Any]) -> None:
    """``add_bias(x, b, interpret=...)`` in TPU interpret mode on three shapes, then how often b's block is copied."""
    x, b = jnp.zeros((16, 384), jnp.float32), jnp.zeros((1, 384), jnp.float32)  # 2 x 3 blocks, as the first case
    call, rng = _inspect("add_bias", add_bias, 2, x, b, interpret=pltpu.InterpretParams()), np.random.default_rng(5)
    maps = ("the grid is (x.shape[1] // 128, x.shape[0] // 8), from x's shape; each index map gets the grid indices "
            "in the grid's order, (j, i), and returns one block index per array dimension, (row block, column block); "
            "b has a single row of blocks")
    for case, (m, n) in [("x [16, 384]: 2 row blocks, 3 column blocks", (16, 384)),
                         ("x [32, 512]: 4 x 4 blocks", (32, 512)), ("x [8, 256]: one row block", (8, 256)),
                         ("x [64, 128]: 8 row blocks, one column block", (64, 128))]:
        x, b = jnp.asarray(rng.normal(size=(m, n)), jnp.float32), jnp.asarray(rng.normal(size=(1, n)), jnp.float32)
        with _tpu_interpret("add_bias", case, maps):
            got = add_bias(x, b, interpret=pltpu.InterpretParams())
        if np.isnan(np.asarray(got)).any():
            raise CheckFailed(f"failed: add_bias, case '{case}' — NaN in the output: a block read past b's one row "
                              "(b's blocks are (1, 128), not (8, 128)), or an output block was never written (x's "
                              "and the output's maps name block (i, j))")
        _values("add_bias", case, got, np.asarray(x) + np.asarray(b), "that block got another block's x or "
                "b: x's and the output's maps name the same block (i, j), b's map names column block j", atol=1e-6)
    lowered = tpu_compile.lower_for_tpu(functools.partial(add_bias, interpret=False), x, b)
    if not lowered.ok:  # interpret mode takes any block shape; Mosaic, which compiles for the chip, does not
        raise CheckFailed(f"failed: add_bias — it does not lower for TPU: {lowered.summary}; x's tile is (8, 128), "
                          "b's (1, 128) (a block dimension equal to the array's whole dimension is allowed too)")
    copies, blocks = call.copies(1)
    if copies != blocks:
        raise CheckFailed(f"failed: add_bias — b's block is copied {copies} times for its {blocks} different "
                          "blocks (a copy each time its index changes from the previous step): put the column axis "
                          "outside, grid (N // 128, M // 8), so that b's index stays the same for the inner steps")
    wide = _inspect("add_bias", add_bias, 2, jnp.zeros((16, 16384), jnp.float32), jnp.zeros((1, 16384), jnp.float32),
                    interpret=pltpu.InterpretParams())
    if wide.grid != (128, 2):  # traced, not run: a grid whose counts are right only for narrow x
        raise CheckFailed(f"failed: add_bias, case 'x [16, 16384]' — grid {wide.grid}, expected (128, 2): one step per "
                          "[8, 128] block of x, grid=(x.shape[1] // 128, x.shape[0] // 8)")
    print("passed: add_bias in TPU interpret mode (4 shapes), lowers for TPU, each block of b copied once")


ADD_BIAS = Puzzle("puzzle 1: add a bias row", check_add_bias, add_bias_solution, (
    "Start from `copy` in section 2: the same `pallas_call`, with a second input. The grid is `(N // 128, M // 8)`, "
    "column blocks outside, so every index map is called as `index_map(j, i)` and returns a block index in the "
    "order of the array's dimensions, `(row block, column block)`.",
    "`x` and the output: `pl.BlockSpec((8, 128), lambda j, i: (i, j))`. `b`: `pl.BlockSpec((1, 128), lambda j, i: "
    "(0, j))`, row block 0 (its only one) whatever `i` is, so it stays put while `i` runs. The kernel is one line, "
    "`o_ref[...] = x_ref[...] + b_ref[...]`: the `[1, 128]` row broadcasts over the 8 rows."))


# -- puzzle 2: the tiled matmul, accumulator in scratch ----------------------------------------------------------


def _spied_matmul(kernel, x, y, block: int = 128):
    """``kernel`` on the right grid: output, o_ref stores before the last k, last acc_ref, any dot below float32."""

    def spy(x_ref, y_ref, o_ref, early_ref, last_acc_ref, acc_ref):  # outputs come before scratch
        k = pl.program_id(2)

        @pl.when(k == 0)
        def _():
            early_ref[...] = jnp.zeros(early_ref.shape, jnp.int32)

        before = jax.lax.bitcast_convert_type(o_ref[...], jnp.int32)
        kernel(x_ref, y_ref, o_ref, acc_ref)
        stored = jnp.any(jax.lax.bitcast_convert_type(o_ref[...], jnp.int32) != before)
        early_ref[...] += jnp.where(stored & (k < pl.num_programs(2) - 1), 1, 0)
        last_acc_ref[...] = acc_ref[...]

    (m, kk), n = x.shape, y.shape[1]
    grid, tile = (m // block, n // block, kk // block), (block, block)
    call = pl.pallas_call(
        spy, grid=grid, in_specs=[pl.BlockSpec(tile, lambda i, j, k: (i, k)),
                                  pl.BlockSpec(tile, lambda i, j, k: (k, j))],
        out_specs=[pl.BlockSpec(tile, lambda i, j, k: (i, j)), pl.BlockSpec((8, 128), lambda i, j, k: (i, j)),
                   pl.BlockSpec(tile, lambda i, j, k: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((m, n), jnp.float32),
                   jax.ShapeDtypeStruct((8 * grid[0], 128 * grid[1]), jnp.int32),
                   jax.ShapeDtypeStruct((m, n), jnp.float32)],
        scratch_shapes=[pltpu.VMEM(tile, jnp.float32)], interpret=pltpu.InterpretParams(),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")))
    body = next(e for e in jax.make_jaxpr(call)(x, y).eqns if e.primitive.name == "pallas_call").params["jaxpr"]
    narrow = any(e.primitive.name == "dot_general" and e.outvars[0].aval.dtype != "float32" for e in traced_eqns(body))
    out, early, last_acc = call(x, y)
    return out, int(np.asarray(early).max()), np.asarray(last_acc), narrow


def _check_kernel(kernel) -> None:
    rng = np.random.default_rng(6)
    for case, (m, kk, n) in [("3 k steps: X [128, 384] @ Y [384, 128]", (128, 384, 128)),
                             ("1 k step, init and finalize on the same step: X [128, 128] @ Y [128, 256]",
                              (128, 128, 256))]:
        x, y = _ints(rng, (m, kk)), _ints(rng, (kk, n))
        with _tpu_interpret("matmul_kernel", case, "the kernel reads and writes whole blocks: x_ref[...], o_ref[...]"):
            out, early, last_acc, narrow = _spied_matmul(kernel, x, y)
        got, name = np.asarray(out, np.float64), "matmul_kernel"
        x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
        terms = [x64[:, s:s + 128] @ y64[s:s + 128] for s in range(0, kk, 128)]
        if np.isnan(got).all() and not np.isnan(last_acc).any():
            raise CheckFailed(f"failed: {name}, case '{case}' — o_ref is never written (NaN), though acc_ref holds a "
                              "sum: finalize must run on the last k step, pl.when(k == pl.num_programs(2) - 1), "
                              "whatever the number of k steps")
        if np.isnan(got).any():
            raise CheckFailed(f"failed: {name}, case '{case}' — NaN in the output: TPU interpret mode fills fresh "
                              "scratch with NaN (a TPU leaves garbage there): zero acc_ref under pl.when(k == 0) "
                              "before the first +=")
        if len(terms) > 1 and np.array_equal(got, terms[-1]) and early == len(terms) - 1:
            raise CheckFailed(f"failed: {name}, case '{case}' — init and finalize ran on every k step (the output, "
                              "stored every step, is the last product): k is pl.program_id(2), the last grid axis")
        for wrong, hint in [(terms[-1], "only the last k step's product reached the output: either acc_ref is "
                             "overwritten (=, not +=) or init runs on every k step — zero it under pl.when("
                             "pl.program_id(2) == 0)"),
                            (sum(terms[:-1]), "the last k step's product is missing: accumulate, then finalize"),
                            (sum(terms[1:]), "the first k step's product is lost: init (zeroing) must come before "
                             "the first accumulate")]:
            if len(terms) > 1 and np.array_equal(got, wrong):
                raise CheckFailed(f"failed: {name}, case '{case}' — {hint}")
        _values(name, case, got, sum(terms), "acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], "
                "preferred_element_type=jnp.float32) on every k step, o_ref written from acc_ref at the last")
        if narrow:
            raise CheckFailed(f"failed: {name}, case '{case}' — jnp.dot of the two bf16 blocks returns bf16, rounded "
                              "before it is added: pass preferred_element_type=jnp.float32 (the MXU sums in f32)")
        if early:
            raise CheckFailed(f"failed: {name}, case '{case}' — o_ref is stored into on {early} k step(s) before the "
                              "last: the right numbers, but wasted stores; accumulate in acc_ref and write o_ref once, "
                              "under pl.when(k == pl.num_programs(2) - 1)")
    print("passed: matmul_kernel in TPU interpret mode (3 k steps and 1), scratch initialised, output written once")


def _check_wrapper(matmul) -> None:
    def marker(x_ref, y_ref, o_ref, acc_ref):
        o_ref[...] = jnp.full(o_ref.shape, 7.0, o_ref.dtype)

    ones = jnp.ones((128, 128), jnp.bfloat16)
    if not np.all(np.asarray(matmul(ones, ones, kernel=marker, interpret=True)) == 7.0):
        raise CheckFailed("failed: matmul — it does not run the kernel it is given: pass its `kernel` argument "
                          "to pl.pallas_call (later cells swap in a broken kernel)")
    rng, name = np.random.default_rng(7), "matmul"
    x, y = _ints(rng, (256, 384)), _ints(rng, (384, 256))  # grid (2, 2, 3)
    call = _inspect(name, matmul, 2, x, y, interpret=pltpu.InterpretParams())
    if len(call.grid) != 3 or call.ignored_axes(2) != {2}:
        raise CheckFailed(f"failed: {name} — grid {call.grid} with the output's index map ignoring axes "
                          f"{sorted(call.ignored_axes(2))}: the grid is (i, j, k) with k, the reduction, last; the "
                          "output's map is (i, j), ignoring k, so its block stays in VMEM across the reduction")
    if call.semantics[2] != "arbitrary":
        raise CheckFailed(f"failed: {name} — k, the reduction axis, is marked 'parallel' ({call.semantics}): its "
                          "steps share the accumulator, so they must run in order; mark it 'arbitrary'")
    asked = ("parallel", "arbitrary", "arbitrary")  # not the default, nor what no compiler_params means
    if _inspect(name, matmul, 2, x, y, semantics=asked, interpret=True).semantics != asked:
        raise CheckFailed(f"failed: {name} — it ignores its `semantics` argument: pass compiler_params="
                          "pltpu.CompilerParams(dimension_semantics=semantics) (section 6 swaps in other semantics)")
    maps = "the grid is (M // block, N // block, K // block); for step (i, j, k) X's block is (i, k), Y's (k, j), "
    for case, (m, kk, n) in [("grid (1, 3, 2): X [128, 256] @ Y [256, 384]", (128, 256, 384)),
                             ("grid (2, 2, 2): X [256, 256] @ Y [256, 256]", (256, 256, 256))]:
        x, y = _ints(rng, (m, kk)), _ints(rng, (kk, n))
        with _tpu_interpret(name, case, maps + "the output's (i, j)"):
            got = matmul(x, y, kernel=matmul_kernel_solution, interpret=pltpu.InterpretParams())
        _values(name, case, _float32_written(name, case, got), np.asarray(x, np.float64) @ np.asarray(y, np.float64),
                "check the index maps: " + maps[maps.index("for"):] + "the output's (i, j)")
    big = _inspect(name, matmul, 2, jnp.zeros((512, 512), jnp.bfloat16), jnp.zeros((512, 256), jnp.bfloat16),
                   kernel=matmul_kernel_solution, block=256, interpret=True).grid
    if big != (2, 1, 2):
        raise CheckFailed(f"failed: {name} — with block=256, X [512, 512] @ Y [512, 256] runs on the grid {big}, "
                          "expected (2, 1, 2): " + ("it ignores its `block` argument; use it for the grid, the "
                          "BlockSpecs and the scratch" if big == (4, 2, 4) else "the grid is (M // block, N // block, "
                          "K // block), M and K from x's shape, N from y's"))
    print("passed: matmul in TPU interpret mode (grids (1, 3, 2) and (2, 2, 2)), k last and 'arbitrary'")


def check_tiled_matmul(answer: tuple[Callable[..., Any], Callable[..., Any]]) -> None:
    """``(matmul_kernel, matmul)``: the kernel on the checker's own grid, then the ``pallas_call`` around it."""
    _check_kernel(answer[0])
    _check_wrapper(answer[1])


TILED_MATMUL = Puzzle("puzzle 2: a tiled matmul with an accumulator", check_tiled_matmul,
                      (matmul_kernel_solution, matmul_solution), (
    "The kernel, in this order: under `@pl.when(k == 0)` zero `acc_ref`; on every step add "
    "`jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)` into it; under "
    "`@pl.when(k == pl.num_programs(2) - 1)` copy `acc_ref` into `o_ref`. `k` is `pl.program_id(2)`.",
    "The call: `grid=(m // block, n // block, kk // block)`; for step `(i, j, k)` X's block is `(i, k)`, Y's "
    "`(k, j)`, the output's `(i, j)`; `scratch_shapes=[pltpu.VMEM((block, block), jnp.float32)]`; "
    "`compiler_params=pltpu.CompilerParams(dimension_semantics=semantics)`; `out_shape` float32 `[m, n]`; "
    "and pass `kernel` and `interpret` through."))


# -- exercises -------------------------------------------------------------------------------------------------


def check_matmul_bias(matmul_bias: Callable[..., Any]) -> None:
    """Exercise 1: ``matmul_bias(x, y, bias, interpret=...)`` = ``x @ y + bias`` in one kernel, in TPU interpret
    mode (where a bias index map that leaves the bias's single row of blocks is an error, not clamped)."""
    rng, name = np.random.default_rng(8), "matmul_bias"
    x, y, bias = jnp.zeros((256, 256), jnp.bfloat16), jnp.zeros((256, 256), jnp.bfloat16), jnp.zeros((1, 256))
    _inspect(name, matmul_bias, 3, x, y, bias, interpret=pltpu.InterpretParams())
    for case, (m, kk, n) in [("grid (1, 2, 3): X [128, 384] @ Y [384, 256]", (128, 384, 256)),  # N != K
                             ("grid (2, 2, 2): X [256, 256] @ Y [256, 256]", (256, 256, 256))]:
        x, y = _ints(rng, (m, kk)), _ints(rng, (kk, n))
        bias = jnp.asarray(rng.integers(1, 4, size=(1, n)), jnp.float32)
        with _tpu_interpret(name, case, "the bias [1, N] has one row of blocks of shape (1, block): for step "
                            "(i, j, k) it is block (0, j), whatever i and k"):
            got = _float32_written(name, case, matmul_bias(x, y, bias, interpret=pltpu.InterpretParams()))
        product, steps = np.asarray(x, np.float64) @ np.asarray(y, np.float64), kk // 128
        if np.isnan(got).any():
            raise CheckFailed(f"failed: {name}, case '{case}' — NaN in the output: zero the accumulator at k == 0")
        for times in range(2, steps + 2):
            if np.array_equal(got, product + times * np.asarray(bias)):
                raise CheckFailed(f"failed: {name}, case '{case}' — the bias was added {times} times" + (
                    ", once per k step" if times == steps else "") + ": add it once, in finalize")
        if np.array_equal(got, product):
            raise CheckFailed(f"failed: {name}, case '{case}' — no bias in the output: add bias_ref[...] in finalize")
        x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
        for done in range(1, steps):  # finalize ran after `done` of the k steps, and the later ones never got out
            if np.array_equal(got, x64[:, :128 * done] @ y64[:128 * done] + np.asarray(bias)):
                raise CheckFailed(f"failed: {name}, case '{case}' — only the first {done} of the {steps} k steps "
                                  "reached the output: finalize must run on the last k step, under pl.when(k == "
                                  "pl.num_programs(2) - 1) (axis 2, the k axis: here the axes have different lengths)")
        _values(name, case, got, product + np.asarray(bias), "x @ y accumulated over k, plus the bias block (0, j) "
                "(the bias's index map is lambda i, j, k: (0, j))")
    print("passed: matmul_bias in TPU interpret mode (grids (1, 2, 3) and (2, 2, 2)), bias added once, in the kernel")


MATMUL_BIAS = Puzzle("exercise 1: a fused bias", check_matmul_bias, matmul_bias_solution, (
    "Start from `matmul` and its kernel: the same grid `(M // 128, N // 128, K // 128)`, the same accumulator. The "
    "bias is a third input; at step `(i, j, k)` the kernel needs the part of it above output block `(i, j)`: a "
    "`[1, 128]` piece, column block `j`.",
    "Its spec is `pl.BlockSpec((1, 128), lambda i, j, k: (0, j))`: the bias has a single row of blocks, so the row "
    "block is 0 whatever `i` and `k` are. The kernel takes `b_ref` after `y_ref`, and in `finalize` writes "
    "`o_ref[...] = acc_ref[...] + b_ref[...]` (the row broadcasts over the 128 rows): once, not on every `k` step.",
))


def check_count_copies(count_copies: Callable[[Sequence[Point], Callable[..., Point]], int]) -> None:
    """Exercise 2: ``count_copies(visits, index_map)`` for the matmul's X, Y and output maps on three walks of the
    grid (2, 2, 3): k last in order, k last with (i, j) shuffled as TPU interpret mode does, and k outermost."""
    maps = {"X": lambda i, j, k: (i, k), "Y": lambda i, j, k: (k, j), "O": lambda i, j, k: (i, j)}
    blocks = [(1, 0), (0, 1), (1, 1), (0, 0)]  # a fixed shuffle of the (i, j) blocks
    walks = {"k last": [(i, j, k) for i in range(2) for j in range(2) for k in range(3)],
             "k last, (i, j) shuffled": [(i, j, k) for i, j in blocks for k in range(3)],
             "k outermost": [(i, j, k) for k in range(3) for i in range(2) for j in range(2)]}
    for walk, visits in walks.items():
        for label, index_map in maps.items():
            got, want = count_copies(list(visits), index_map), _changes([index_map(*p) for p in visits])
            distinct = len({index_map(*p) for p in visits})
            row_major = _changes([index_map(*p) for p in sorted(visits)])
            hint = ("count along `visits`, in the order given: this walk is not the grid's row-major order"
                    if walk != "k last" and got == row_major != want else
                    "a block is copied again each time the index changes back to it, so count changes from one step "
                    "to the next, not different blocks" if got == distinct else
                    "the first step copies its block too (+1)" if got == want - 1 else
                    "a copy happens only when the block index differs from the previous step's" if got == len(visits)
                    else "count the steps whose block index differs from the previous step's, plus the first")
            if got != want:
                raise CheckFailed(f"failed: count_copies, walk '{walk}', {label}'s map — {got} copies, expected "
                                  f"{want}: {hint}")
    print("passed: count_copies on three walks. With k outermost the output is written back 12 times instead of 4, "
          "and consecutive steps belong to different output blocks, so one scratch accumulator could no longer carry "
          "a running sum: that is why k goes last")


COUNT_COPIES = Puzzle("exercise 2: count the copies", check_count_copies, count_copies_solution, (
    "Turn the walk into the sequence of block indices this map asks for, `[index_map(*point) for point in "
    "visits]`, in the order given (do not sort it: the order is the point).",
    "The first step copies its block; after that a step copies only when its block differs from the previous "
    "step's. Compare neighbours with `zip(blocks, blocks[1:])`, count the pairs that differ, and add 1.",
))


def check_row_sum(row_sum_fixed: Callable[..., Any]) -> None:
    """Exercise 3: ``row_sum_fixed(x, interpret=...)``, the row sums ``[M, 1]`` walked in column blocks, in TPU
    interpret mode on two shapes; an axis the output's index map ignores (the reduction) must be 'arbitrary'."""
    rng, name = np.random.default_rng(9), "row_sum_fixed"
    for case, shape in [("x [16, 512]: 4 column blocks", (16, 512)), ("x [24, 384]: 3 column blocks", (24, 384))]:
        x = jnp.asarray(rng.integers(-3, 4, size=shape), jnp.float32)
        call = _inspect(name, row_sum_fixed, 1, x, interpret=pltpu.InterpretParams())
        parallel = [axis for axis in call.ignored_axes(1) if call.semantics[axis] == "parallel"]
        if parallel:
            raise CheckFailed(f"failed: {name}, case '{case}' — grid axis {parallel[0]} carries the running sum (the "
                              f"output's index map ignores it) but is marked 'parallel' ({call.semantics}): TPU "
                              "interpret mode shuffles it and a TPU may split it; mark it 'arbitrary'")
        with _tpu_interpret(name, case, "the column axis walks x's blocks; the output has one column of blocks"):
            got = np.asarray(row_sum_fixed(x, interpret=pltpu.InterpretParams()), np.float64)
        if np.isnan(got).any():
            raise CheckFailed(f"failed: {name}, case '{case}' — NaN in the output: fresh scratch is NaN in TPU "
                              "interpret mode; zero acc_ref under pl.when on the first column step")
        if np.array_equal(got[:8], np.asarray(x, np.float64)[:8, -128:].sum(axis=1, keepdims=True)):
            raise CheckFailed(f"failed: {name}, case '{case}' — only the last column block's sum reached the output: "
                              "acc_ref is zeroed on every column step; zero it only when the column index, "
                              "pl.program_id(1), is 0")
        _values(name, case, got, np.asarray(x, np.float64).sum(axis=1, keepdims=True),
                "each row's sum over every column block: zero acc_ref when the column index, pl.program_id(1), is 0 "
                "(for every row block), and add every column block into it")
    wide = _inspect(name, row_sum_fixed, 1, jnp.zeros((64, 16384), jnp.float32), interpret=pltpu.InterpretParams())
    if wide.grid != (8, 128):  # traced, not run: a grid whose counts are right only for small shapes
        raise CheckFailed(f"failed: {name}, case 'x [64, 16384]' — grid {wide.grid}, expected (8, 128): one step per "
                          "[8, 128] block of x, grid=(x.shape[0] // 8, x.shape[1] // 128)")
    print("passed: row_sum_fixed in TPU interpret mode (2 shapes): accumulator initialised, column axis 'arbitrary'")


ROW_SUM = Puzzle("exercise 3: debug a kernel", check_row_sum, row_sum_fixed_solution, (
    "One bug is in the kernel, one in the call. The kernel adds into `acc_ref` on every step, but what is in it "
    "before the first add? (TPU interpret mode fills fresh scratch with NaN.) And grid axis 1, the columns, carries "
    "the running sum from one step to the next: what does `\"parallel\"` promise about its steps?",
    "Zero the accumulator under `@pl.when(pl.program_id(1) == 0)`, at the first column block of every row block "
    "(not `pl.program_id(0)`, the row index). Mark the column axis `\"arbitrary\"`: `dimension_semantics="
    "(\"parallel\", \"arbitrary\")`, so its steps run in order on one core. The output's index map ignores `j`, "
    "so its block stays in VMEM across the row.",
))
