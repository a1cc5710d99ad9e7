"""The performance lab's numbers, read and reduced: CSV tables of estimates, block grids, step-cost fits,
roofline coordinates, optimisation steps. No plotting here (:mod:`flashlib.perf_plots` draws these)."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from flashlib import cost, hardware
from flashlib.kernels.tuned_table import TuningResult

__all__ = [
    "BlockGrid", "RooflinePoint", "Row", "StepCostFit", "block_grid", "first_number", "fit_step_cost", "group_steps",
    "is_number", "read_table", "roofline_points", "select", "steps_table",
]

Row = dict[str, Any]


def _value(text: str) -> Any:
    """A CSV cell as Python: ``''`` -> None, ``'True'``/``'False'`` -> bool, numbers -> int or float."""
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_table(path: str | Path) -> list[Row]:
    """The rows of a CSV table (``#`` lines are its provenance and are skipped), cells converted by type.

    A missing file reads as no rows, so a notebook can show what is there while a table is still being made.
    """
    path = Path(path)
    if not path.exists():
        return []
    with path.open(newline="") as f:
        lines = [line for line in f if not line.startswith("#")]
    return [{key: _value(text) for key, text in row.items()} for row in csv.DictReader(lines)]


def is_number(value: Any) -> bool:
    """A cell that holds a measurement (not a status such as ``"profiler_crash"``, not empty)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def select(rows: Iterable[Row], **where: Any) -> list[Row]:
    """The rows whose columns equal every ``where`` value, e.g. ``select(rows, generation="v5e", seq=2048)``."""
    return [row for row in rows if all(row.get(key) == value for key, value in where.items())]


class RooflinePoint(NamedTuple):
    """One implementation on one chip: its arithmetic intensity and the throughput its estimate implies."""

    impl: str
    seq: int
    intensity: float  # ideal FLOPs per HBM byte the compiler counted
    tflops: float  # ideal FLOPs / (estimated cycles / the chip's derived clock), TFLOP/s


def roofline_points(rows: Iterable[Row], generation: str, *, batch: int = 1, heads: int = 8, head_dim: int = 128,
                    causal: bool = False) -> list[RooflinePoint]:
    """Roofline coordinates of the ``status == "ok"`` rows of ``seq_sweep.csv`` for one ``generation``; the
    shape defaults are that table's (its header says so).

    The work is the ideal count (:func:`flashlib.cost.attention_flops`: every implementation is credited with
    the same useful FLOPs); the bytes are the compiler's cost analysis of the same compile (XLA's include the
    score matrix it writes to HBM and reads back). Rows without that byte count are left out.
    """
    chip = hardware.CHIPS[generation]
    points = []
    for row in select(rows, generation=generation, status="ok"):
        if not is_number(row.get("hbm_bytes")):  # the compiler gave no cost analysis: no x coordinate
            continue
        flops = cost.attention_flops(batch, heads, row["seq"], row["seq"], head_dim, causal)
        seconds = row["cycles"] / chip.clock_hz
        points.append(RooflinePoint(row["impl"], row["seq"], flops / row["hbm_bytes"], flops / seconds / 1e12))
    return points


class BlockGrid(NamedTuple):
    """Estimates of one shape over a ``block_q x block_k`` grid of candidates."""

    block_qs: tuple[int, ...]
    block_ks: tuple[int, ...]
    cycles: np.ndarray  # [len(block_qs), len(block_ks)], NaN where there is no estimate
    status: np.ndarray  # [len(block_qs), len(block_ks)] of str: "ok", "refused", "profiler_crash", ... or ""
    mxu_floor: float
    title: str

    @property
    def best(self) -> tuple[int, int] | None:
        """``(block_q, block_k)`` with the fewest cycles, or None when nothing has an estimate."""
        if np.isnan(self.cycles).all():
            return None
        i, j = np.unravel_index(np.nanargmin(self.cycles), self.cycles.shape)
        return self.block_qs[i], self.block_ks[j]


def block_grid(source: TuningResult | Iterable[Row], generation: str | None = None) -> BlockGrid:
    """A :class:`BlockGrid` from a tuned-table entry (its flashlib trials; a cell tried with several
    ``block_k_major`` shows the fewest cycles among them), or from ``block_sweep.csv`` rows of one
    ``generation``."""
    if isinstance(source, TuningResult):
        trials = [(t.block_q, t.block_k, t.status, t.cycles) for t in source.trials]
        floor, shape = source.mxu_floor, f"T={source.q_len} d={source.head_dim}" + (" causal" if source.causal else "")
        title = f"{source.generation} {shape}"
    else:
        if generation is None:
            raise ValueError("block_grid(rows) needs generation=, e.g. block_grid(rows, generation='v5e')")
        rows = select(source, generation=generation)
        trials = [(r["block_q"], r["block_k"], r["status"], r["cycles"]) for r in rows]
        floor = next((r["mxu_floor"] for r in rows if r["mxu_floor"]), float("nan"))
        title = f"{generation} T={rows[0]['seq']}" if rows else generation
    block_qs = tuple(sorted({t[0] for t in trials}))
    block_ks = tuple(sorted({t[1] for t in trials}))
    cycles = np.full((len(block_qs), len(block_ks)), np.nan)  # [nq, nk]
    status = np.full((len(block_qs), len(block_ks)), "", dtype=object)  # [nq, nk]
    for block_q, block_k, outcome, value in trials:
        i, j = block_qs.index(block_q), block_ks.index(block_k)
        # Several trials per cell (one per block_k_major): the cell shows the best that has an estimate.
        if outcome == "ok":
            if np.isnan(cycles[i, j]) or value < cycles[i, j]:
                cycles[i, j], status[i, j] = value, outcome
        elif not status[i, j]:
            status[i, j] = outcome
    return BlockGrid(block_qs, block_ks, cycles, status, floor, title)


class StepCostFit(NamedTuple):
    """``cycles ≈ per_step * grid_steps + rest``, fitted by least squares over a block sweep."""

    per_step: float  # cycles every grid step pays, whatever its size
    rest: float  # cycles that do not depend on the number of steps (the work itself, done once)
    mxu_per_step: Mapping[int, float]  # steps -> MXU-floor cycles of one step's matmuls, for comparison


def fit_step_cost(rows: Iterable[Row]) -> StepCostFit:
    """Fit ``cycles = per_step * grid_steps + rest`` to the ``"ok"`` rows of a block sweep (one generation, one
    shape: the work is the same for every row, so what changes with the blocks is the number of steps)."""
    ok = [r for r in rows if r["status"] == "ok"]
    if len(ok) < 2:
        raise ValueError(f"fit_step_cost needs at least two rows with status 'ok', got {len(ok)}")
    steps = np.array([r["grid_steps"] for r in ok], dtype=np.float64)  # [n]
    cycles = np.array([r["cycles"] for r in ok], dtype=np.float64)  # [n]
    design = np.stack([steps, np.ones_like(steps)], axis=1)  # [n, 2]
    (per_step, rest), *_ = np.linalg.lstsq(design, cycles, rcond=None)
    floor_per_step = {int(s): r["mxu_floor"] / s for s, r in zip(steps, ok, strict=True)}
    return StepCostFit(float(per_step), float(rest), floor_per_step)


def group_steps(rows: Iterable[Row], value: str, by: Sequence[str] = ("generation", "seq", "causal"),
                skip_steps: Sequence[str] = ()) -> dict[tuple[Any, ...], list[Row]]:
    """``{shape: [one row per step]}`` from an optimisation table: rows grouped by the ``by`` columns, steps in
    the order they were appended; where a step has several rows for one shape (configurations tried), the one
    with the smallest ``value``. Rows whose ``value`` is not a number (a refusal, a profiler crash) and rows of
    ``skip_steps`` (e.g. a reference row that is not a step of the kernel) are left out."""
    best: dict[tuple[Any, ...], dict[Any, Row]] = {}
    for row in rows:
        if not is_number(row.get(value)) or row["step"] in skip_steps:
            continue
        steps = best.setdefault(tuple(row[key] for key in by), {})
        if row["step"] not in steps or row[value] < steps[row["step"]][value]:
            steps[row["step"]] = row
    return {shape: list(steps.values()) for shape, steps in best.items()}


def first_number(rows: Sequence[Row], column: str | None) -> float | None:
    return next((row[column] for row in rows if column and is_number(row.get(column))), None)


def steps_table(rows: Sequence[Row], value: str = "cycles", baseline: str = "jax_best", width: int = 60) -> str:
    """The steps as aligned text: step, change (cut to ``width``), ``value``, × the first step, × ``baseline``
    (the row's own, else the first row's that has one)."""
    step_width = max([4] + [len(str(r["step"])) for r in rows])
    lines = [f"{'step':<{step_width}}  {'change':<{width}}  {value:>12}  {'x first':>7}  {'x JAX':>6}"]
    first = rows[0][value] if rows else None
    shared = first_number(rows, baseline)
    for r in rows:
        change = str(r["change"])
        change = change if len(change) <= width else change[: width - 1] + "…"
        jax_best = r[baseline] if is_number(r.get(baseline)) else shared
        vs_jax = f"{r[value] / jax_best:.2f}" if jax_best else "-"
        lines.append(f"{r['step']!s:<{step_width}}  {change:<{width}}  {r[value]:>12,}  {r[value] / first:>7.2f}  "
                     f"{vs_jax:>6}")
    return "\n".join(lines)
