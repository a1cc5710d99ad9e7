"""Notebook 00's exercises, each a :class:`~flashlib.exercises.puzzle.Puzzle` (checker, graded hints, solution): a
first Pallas kernel (:data:`SCALED_ADD`), and which block shapes the TPU toolchain accepts
(:data:`BLOCK_PREDICTION`, a value answer).

``scaled_add(x, y, alpha, *, interpret=None)`` runs under :class:`pltpu.InterpretParams` (TPU semantics on the
CPU: a block index past the array's edge is an error, and output the kernel never writes reads as NaN), on
shapes other than the notebook's, so a grid copied from the notebook's ``(32, 256)`` example is caught; then it
is lowered for TPU, which enforces the ``(8, 128)`` tiling rule that interpret mode does not (a ``(9, 128)``
block runs there, padded past the edge).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import flashlib.env
from flashlib.checks import CheckFailed
from flashlib.exercises.puzzle import Puzzle
from flashlib.tpu_compile import lower_for_tpu

__all__ = ["BLOCK_CANDIDATES", "BLOCK_PREDICTION", "SCALED_ADD", "block_lowers", "block_prediction_solution",
           "check_block_prediction", "check_scaled_add", "scaled_add_solution"]


# -- exercise 1: scaled_add ------------------------------------------------------------------------------------


_SCALED_ADD_CASES = (
    ("the notebook's (32, 256) arrays, alpha = 0.5", (32, 256), 0.5),
    ("alpha = -2 (a different alpha)", (32, 256), -2.0),
    ("a (16, 384) array, alpha = 3 (a different grid)", (16, 384), 3.0),
    ("a tall (56, 128) array, alpha = 1.5 (seven row tiles)", (56, 128), 1.5),
    ("a wide (8, 16384) array, alpha = 1 (128 column tiles)", (8, 16384), 1.0),
)


def _scaled_add_mistake(got: np.ndarray, x: np.ndarray, y: np.ndarray, alpha: float, grid: tuple) -> str:
    if np.isnan(got).any() and grid == (x.shape[0] // 8, x.shape[1] // 128):
        return (f"part of the output is NaN, so some tiles were never written, although the grid {grid} has a step "
                "per tile: the output's index map sends several steps to one tile; step (i, j) writes tile (i, j)")
    if np.isnan(got).any():
        return (f"part of the output is NaN, so some tiles were never written: the grid {grid} must cover the whole "
                "array, (x.shape[0] // 8, x.shape[1] // 128) for (8, 128) tiles")
    for want, mistake in (
        (alpha * (x + y), "y is scaled too: only x is multiplied by alpha"),
        (x + alpha * y, "alpha multiplies y; it should multiply x"),
        (x + y, "alpha is not applied: the kernel adds x and y as `add` does"),
        (0.5 * x + y, "alpha is fixed at 0.5: use the `alpha` argument (the kernel can close over it)"),
    ):
        if np.allclose(got, want, atol=1e-5):
            return mistake
    return ("the output is not alpha * x + y (if the formula is right, check the index maps: step (i, j) reads and "
            "writes tile (i, j) of every array)")


def traced_eqns(jaxpr) -> Iterator[Any]:
    """Every equation of ``jaxpr``, inside ``jit``s too, but not inside a kernel (notebook 05's checkers use it)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and eqn.primitive.name != "pallas_call":
                    yield from traced_eqns(inner)


def _traced(where: str, scaled_add: Callable, x, y, alpha: float) -> tuple[int, ...]:
    """The grid of the one ``pallas_call`` that ``scaled_add`` makes, after checking how it is called."""
    params = pltpu.InterpretParams()
    try:
        eqns = list(traced_eqns(jax.make_jaxpr(lambda x, y: scaled_add(x, y, alpha, interpret=params))(x, y).jaxpr))
    except TypeError as err:
        if "interpret" not in str(err):
            raise
        raise CheckFailed(f"{where} scaled_add takes no `interpret` argument: keep the stub's signature, "
                          "scaled_add(x, y, alpha, *, interpret=None), and pass it to pl.pallas_call") from None
    calls = [eqn for eqn in eqns if eqn.primitive.name == "pallas_call"]
    if not calls:
        raise CheckFailed(f"{where} no Pallas kernel runs: write it with pl.pallas_call, starting from `add`")
    if not any(isinstance(call.params.get("interpret"), pltpu.InterpretParams) for call in calls):
        raise CheckFailed(f"{where} it ignores its `interpret` argument: pass interpret=interpret to pl.pallas_call "
                          "(the checker asks for TPU interpret mode, which interpret=True is not)")
    outside = sorted({eqn.primitive.name for eqn in eqns if eqn.primitive.name in _ARITHMETIC})
    if outside:
        raise CheckFailed(f"{where} arithmetic outside the kernel ({', '.join(outside)} on whole arrays, with jnp): "
                          "the kernel gets x and y as they are and computes alpha * x_ref[...] + y_ref[...] itself "
                          "(it can close over alpha)")
    return tuple(int(n) for n in calls[0].params["grid_mapping"].grid)


_ARITHMETIC = {"mul", "add", "add_any", "sub", "div", "neg", "integer_pow", "pow"}


def check_scaled_add(scaled_add: Callable) -> None:
    """``scaled_add(x, y, alpha, interpret=...)``: a Pallas kernel computing ``alpha * x + y``."""
    for case, shape, alpha in _SCALED_ADD_CASES:
        rows, cols = shape
        cpu = jax.devices("cpu")[0]  # the interpreter runs on the host, on a TPU machine too
        x = jax.device_put(np.arange(rows * cols, dtype=np.float32).reshape(shape) / cols, cpu)
        y = jax.device_put(np.random.default_rng(rows).normal(size=shape).astype(np.float32), cpu)
        where = f"failed: scaled_add, case '{case}' —"
        grid = _traced(where, scaled_add, x, y, alpha)
        pltpu.reset_tpu_interpret_mode_state()  # an earlier attempt that raised mid-kernel leaves it dirty
        logger = logging.getLogger("jax._src.callback")  # mute the interpreter's logged traceback of a bad block
        was, logger.disabled = logger.disabled, True
        try:
            out = scaled_add(x, y, alpha, interpret=pltpu.InterpretParams())
        except Exception as err:  # the interpreter's bounds check, raised from inside the kernel's run
            pltpu.reset_tpu_interpret_mode_state()  # so the next kernel interpreted in this process starts clean
            if "Out-of-bounds block index" not in str(err):
                raise
            raise CheckFailed(f"{where} a grid step reads a block past the array's edge: compute the grid from "
                              "x.shape, (x.shape[0] // 8, x.shape[1] // 128), and let step (i, j) read tile "
                              "(i, j)") from None
        finally:
            logger.disabled = was
        if tuple(np.shape(out)) != shape:
            raise CheckFailed(f"{where} output shape {tuple(np.shape(out))}, expected {shape} like x")
        got, want = np.asarray(out, np.float64), alpha * np.asarray(x, np.float64) + np.asarray(y, np.float64)
        if not np.allclose(got, want, atol=1e-5):
            raise CheckFailed(f"{where} {_scaled_add_mistake(got, np.asarray(x), np.asarray(y), alpha, grid)}")
    # Interpret mode lets a block of (9, 128) run, padded past the edge; the TPU's Mosaic lowering does not.
    spec = jax.ShapeDtypeStruct((16, 384), jnp.float32)
    lowered = lower_for_tpu(lambda x, y: scaled_add(x, y, 3.0, interpret=False), spec, spec)
    if not lowered.ok:
        raise CheckFailed(f"failed: scaled_add, case 'a (16, 384) array, lowered for TPU (interpret=False)' — "
                          f"interpret mode computes the right numbers, but the TPU toolchain rejects the kernel: "
                          f"{lowered.summary}; use (8, 128) tiles, as `add` does")
    print(f"passed: scaled_add is a Pallas kernel computing alpha * x + y in all {len(_SCALED_ADD_CASES)} cases "
          "(another alpha, other grids), and it lowers for TPU")


def scaled_add_solution(x, y, alpha, *, interpret=None):
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = alpha * x_ref[...] + y_ref[...]  # one [8, 128] tile; the kernel closes over alpha

    if interpret is None:  # compiled on a TPU, interpreted anywhere else
        interpret = flashlib.env.interpret_default()
    tile = pl.BlockSpec((8, 128), lambda i, j: (i, j))  # grid step (i, j) -> tile (i, j)
    return pl.pallas_call(
        kernel,
        grid=(x.shape[0] // 8, x.shape[1] // 128),  # one step per tile, from x's own shape
        in_specs=[tile, tile],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=interpret,
    )(x, y)


SCALED_ADD = Puzzle(
    "exercise 1: scaled_add",
    check_scaled_add,
    scaled_add_solution,
    (
        "Start from a copy of `add`: the grid, the `BlockSpec`s and the `interpret` argument stay as they are. "
        "Only the kernel's one line changes: it computes `alpha * x + y` on its tile.",
        "The kernel is a function of the refs only, but it can close over `alpha`: define it inside "
        "`scaled_add`, with `o_ref[...] = alpha * x_ref[...] + y_ref[...]`. Keep "
        "`grid=(x.shape[0] // 8, x.shape[1] // 128)` (computed from `x`, not the example's `(4, 2)`) and pass "
        "`interpret=interpret` to `pl.pallas_call`.",
    ),
)


# -- exercise 2: which block shapes lower ----------------------------------------------------------------------


BLOCK_CANDIDATES = ((8, 128), (16, 64), (12, 128), (1020, 128), (8, 1000), (1020, 1000))
_ARRAY = (1020, 1000)  # neither dimension a multiple of the (8, 128) tile: the rule's "or equal" clause decides


def _add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


@functools.cache
def block_lowers(block: tuple[int, int]) -> tuple[bool, str]:
    """Whether the add kernel with ``block`` tiles lowers for TPU on a float32 ``(1020, 1000)`` array (the grid
    covers it, partial blocks at the edges), and what the toolchain said."""
    def fn(x, y):
        tile = pl.BlockSpec(block, lambda i, j: (i, j))
        grid = (pl.cdiv(_ARRAY[0], block[0]), pl.cdiv(_ARRAY[1], block[1]))
        return pl.pallas_call(_add_kernel, grid=grid, in_specs=[tile, tile], out_specs=tile,
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)

    spec = jax.ShapeDtypeStruct(_ARRAY, jnp.float32)
    result = lower_for_tpu(fn, spec, spec)
    return result.ok, result.summary


def _why(block: tuple[int, int]) -> str:
    rows = "divisible by 8" if block[0] % 8 == 0 else ("equal to the array's" if block[0] == _ARRAY[0] else
                                                       "neither divisible by 8 nor the array's")
    cols = "divisible by 128" if block[1] % 128 == 0 else ("equal to the array's" if block[1] == _ARRAY[1] else
                                                          "neither divisible by 128 nor the array's")
    return f"its rows {block[0]} are {rows}, its columns {block[1]} are {cols}"


def check_block_prediction(prediction: Iterable) -> None:
    """``prediction``: the set of :data:`BLOCK_CANDIDATES` that lower for a ``(1020, 1000)`` float32 array,
    compared with the toolchain's verdict on each one; every wrong one is named with the rule it breaks or keeps."""
    try:
        predicted = {tuple(int(n) for n in block) for block in prediction}
    except (TypeError, ValueError):
        raise CheckFailed("failed: block prediction — give a set of (rows, cols) pairs, e.g. {(8, 128)}") from None
    strangers = sorted(predicted - set(BLOCK_CANDIDATES))
    if strangers:
        raise CheckFailed(f"failed: block prediction — {strangers} not among the candidates {list(BLOCK_CANDIDATES)}")
    wrong = []
    for block in BLOCK_CANDIDATES:
        ok, said = block_lowers(block)
        if ok and block not in predicted:
            wrong.append(f"case 'block {block}': it lowers, but you left it out — {_why(block)}; the rule asks "
                         "only that each of the last two block dimensions be divisible by (8, 128) or equal the "
                         "array's, however large the block")
        elif not ok and block in predicted:
            wrong.append(f"case 'block {block}': you predicted it lowers, the toolchain rejects it — {_why(block)} "
                         f"(the toolchain: {said})")
    if wrong:
        raise CheckFailed("failed: block prediction — " + "; ".join(wrong))
    print(f"passed: your prediction matches the TPU toolchain on all {len(BLOCK_CANDIDATES)} block shapes")


def block_prediction_solution():
    # a block lowers when each of its last two dimensions is divisible by (8, 128) or equals the array's
    array_rows, array_cols = 1020, 1000
    candidates = [(8, 128), (16, 64), (12, 128), (1020, 128), (8, 1000), (1020, 1000)]

    def lowers(rows, cols):
        return (rows % 8 == 0 or rows == array_rows) and (cols % 128 == 0 or cols == array_cols)

    return {block for block in candidates if lowers(*block)}


BLOCK_PREDICTION = Puzzle(
    "exercise 2: which block shapes lower",
    check_block_prediction,
    block_prediction_solution,
    (
        "The rule is about each of the block's last two dimensions on its own: the rows must be divisible by 8 "
        "*or* equal the array's rows, the columns divisible by 128 *or* equal the array's columns. How large the "
        "block is does not matter to the rule (VMEM is another question).",
        "Go through the six shapes one dimension at a time. `(8, 128)` tiles by `(8, 128)`. `(1020, 128)` has all "
        "of the array's 1020 rows and `(8, 1000)` all of its 1000 columns, so the other clause lets them through, "
        "and `(1020, 1000)` is the whole array. `(16, 64)` has 64 columns and `(12, 128)` 12 rows: neither a "
        "multiple nor the array's.",
    ),
    answer_is_value=True,
)
