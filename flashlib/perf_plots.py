"""The pictures of notebook 08 (performance without a TPU), drawn from committed tables, never from live runs.

Every number here is libtpu's *static* cycle estimate (:mod:`flashlib.estimate`): the TPU compiler's model of
the final program, compiled ahead of time on a CPU machine and never checked against a real TPU. It is good
for comparing kernels and block sizes, not for predicting wall time, and it prices float32 and bfloat16 almost
the same. The tables it comes from:

* ``data/tuning/forward_blocks.json`` (:mod:`flashlib.tuning`): every block candidate per shape, with JAX's
  ``flash_attention`` as the yardstick;
* ``data/estimates/block_sweep.csv`` and ``seq_sweep.csv`` (``make_perf_lab_estimates.py``): block sizes
  down to 128, and XLA / flashlib / JAX across sequence lengths, with the compiler's FLOP and byte counts;
* ``data/optimisation/forward_steps.csv`` and ``backward_steps.csv``: the kernels' optimisation, step by step;
* ``data/estimates/variants_v5e.csv`` (``make_variant_estimates.py``, notebook 09): GQA/MQA and a sliding
  window.

Like :mod:`flashlib.viz`, each ``plot_*`` function takes data and an optional ``ax`` and returns the figure.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping, Sequence
from itertools import cycle
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

from flashlib import decode_estimate, hardware
from flashlib.hardware import MIB
from flashlib.kernels.block_sizes import BlockSizes, vmem_limit_bytes
from flashlib.perf_data import (  # the numbers these plots draw; re-exported for the notebooks
    BlockGrid,
    RooflinePoint,
    Row,
    StepCostFit,
    block_grid,
    first_number,
    fit_step_cost,
    group_steps,
    is_number,
    read_table,
    roofline_points,
    select,
    steps_table,
)
from flashlib.viz.figures import PALETTE, SERIES_COLORS, figure_and_axes

__all__ = [
    "BlockGrid", "RooflinePoint", "StepCostFit", "block_grid", "fit_step_cost", "group_steps", "plot_block_cycles",
    "decode_roofline_points", "plot_decode_roofline", "plot_gqa_estimates", "plot_optimisation_steps", "plot_roofline",
    "plot_seq_sweep", "plot_step_cost", "plot_steps_vs_baseline",
    "plot_vmem_by_blocks", "plot_window_scaling", "read_table", "roofline_points", "select", "steps_table",
]

IMPL_COLORS: dict[str, str] = {"xla": SERIES_COLORS[0], "pallas": SERIES_COLORS[1], "jax_flash": SERIES_COLORS[4],
                               "prefill": SERIES_COLORS[1], "contiguous": SERIES_COLORS[3], "forward": SERIES_COLORS[5]}
IMPL_NAMES: dict[str, str] = {"xla": "XLA (fused)", "pallas": "flashlib (Pallas)", "jax_flash": "JAX flash_attention",
                              "prefill": "prefill (flashlib forward, q_len = T, non-causal)",  # the decode roofline's
                              "contiguous": "decode kernel, 1 new token", "forward": "training kernel, 1 new token"}
RATIO_SCALE = (1.0, 2.0)  # heat-map colours: multiple of the best, x1 lightest, x2 and beyond darkest
DARK_RATIO = 1.5  # from here the cell's label is white
STATIC_NOTE = "libtpu's static estimate, compiled ahead of time: not a TPU measurement"


def _label(ax: Axes, xlabel: str, ylabel: str, title: str | None) -> Figure:
    """Axis labels and a title (legends are each plot's own: where they go depends on the data)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    return ax.figure  # type: ignore[return-value]


# -- The roofline ----------------------------------------------------------------------------------


def plot_roofline(points: Sequence[RooflinePoint], generation: str, ax: Axes | None = None,
                  title: str | None = None) -> Figure:
    """Log-log roofline of one chip (peak bf16 FLOP/s, HBM bandwidth, the ridge between) with ``points`` on it.

    Each implementation is one colour; its points are joined in order of sequence length and the longest is
    labelled with its length, so the eye follows each implementation as the sequence grows.
    """
    chip = hardware.CHIPS[generation]
    fig, ax = figure_and_axes(ax, (6.5, 4.6))
    intensities = [p.intensity for p in points] or [chip.ridge_point]
    x = np.geomspace(min(min(intensities), chip.ridge_point) / 4, max(max(intensities), chip.ridge_point) * 4, 200)
    ceiling = np.minimum(chip.peak_bf16_flops, chip.hbm_bandwidth * x) / 1e12  # [200] TFLOP/s
    ax.plot(x, ceiling, color=PALETTE["ink"], lw=2)
    ax.axvline(chip.ridge_point, color=PALETTE["ink"], ls=":", lw=1)
    ax.text(chip.ridge_point, chip.peak_bf16_flops / 1e12 * 1.08, f"ridge {chip.ridge_point:.0f} FLOP/B  ·  peak "
            f"{chip.peak_bf16_flops / 1e12:.0f} TFLOP/s", ha="center", va="bottom", fontsize=8, color=PALETTE["ink"])
    for impl in dict.fromkeys(p.impl for p in points):
        mine = sorted((p for p in points if p.impl == impl), key=lambda p: p.seq)
        color = IMPL_COLORS.get(impl, PALETTE["ink"])
        ax.plot([p.intensity for p in mine], [p.tflops for p in mine], "o-", color=color, ms=5, lw=1.2,
                label=IMPL_NAMES.get(impl, impl))
        ax.annotate(f"T={mine[-1].seq}", (mine[-1].intensity, mine[-1].tflops), textcoords="offset points",
                    xytext=(4, -10), fontsize=7, color=color)
    ax.set(xscale="log", yscale="log")
    ax.set_ylim(top=chip.peak_bf16_flops / 1e12 * 2.2)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="major", alpha=0.3)
    return _label(ax, "arithmetic intensity (ideal FLOPs / HBM byte)", "TFLOP/s at the derived clock",
                   title or f"{generation}: roofline and static estimates")


def decode_roofline_points(rows: Iterable[Row], generation: str, *, kinds: Sequence[str] = ("contiguous", "forward"),
                           heads: int = 32, kv_heads: int = 4, head_dim: int = 128,
                           dtype: str = "bfloat16") -> list[RooflinePoint]:
    """Roofline coordinates of ``decode_v5e.csv`` rows (one new token against a full cache; the shape defaults
    are that table's): the ideal work ``4 * batch * heads * kv_len * head_dim`` FLOPs over the cache's bytes
    (:func:`flashlib.decode_estimate.cache_bytes`) — ``heads / (kv_heads * itemsize)`` FLOPs per byte at any
    length — at the throughput the row's estimated cycles imply; ``impl`` is the row's kind, ``seq`` its kv_len.
    Only ``kinds`` are kept: by default not ``guarded`` and ``jax_paged``, whose guards the profiler credits as
    never run (the table's header), nor ``paged``, a lower bound when it copies several pages a step."""
    chip = hardware.CHIPS[generation]
    points = []
    for row in rows:
        if row.get("status") != "ok" or row["kind"] not in kinds:
            continue
        flops = 4 * row["batch"] * heads * row["kv_len"] * head_dim
        nbytes = decode_estimate.cache_bytes(row["batch"], kv_heads, row["kv_len"], head_dim, dtype)
        points.append(RooflinePoint(row["kind"], row["kv_len"], flops / nbytes,
                                    flops / (row["cycles"] / chip.clock_hz) / 1e12))
    return points


def plot_decode_roofline(points: Sequence[RooflinePoint], generation: str, ax: Axes | None = None,
                         title: str | None = None) -> Figure:
    """:func:`plot_roofline` with the memory-bound side of the ridge shaded and named: decode's points
    (:func:`decode_roofline_points`) beside prefill's (``roofline_points`` renamed ``"prefill"``)."""
    chip = hardware.CHIPS[generation]
    fig, ax = figure_and_axes(ax, (6.5, 4.6))
    plot_roofline(points, generation, ax=ax, title=title or f"{generation}: decoding and prefill on the roofline")
    for text in [t for t in ax.texts if t.get_text().startswith("T=")]:
        text.remove()  # plot_roofline's one label a series: relabelled below
    for impl in dict.fromkeys(p.impl for p in points):
        mine = sorted((p for p in points if p.impl == impl), key=lambda p: p.seq)
        color = IMPL_COLORS.get(impl, PALETTE["ink"])
        if len({p.intensity for p in mine}) == 1:  # one intensity: the points overlap, so one label names them all
            top = max(mine, key=lambda p: p.tflops)
            ax.annotate("T=" + ", ".join(f"{p.seq // 1024}k" if p.seq >= 1024 else str(p.seq) for p in mine),
                        (top.intensity, top.tflops), textcoords="offset points", xytext=(7, -4), fontsize=7,
                        color=color)
            continue
        past = [p for p in mine if p.intensity > chip.ridge_point][:1]  # the first point past the ridge
        for p in dict.fromkeys([mine[0], *past, mine[-1]]):
            ax.annotate(f"T={p.seq}", (p.intensity, p.tflops), textcoords="offset points", xytext=(5, -10),
                        fontsize=7, color=color)
    left, bottom = ax.get_xlim()[0], ax.get_ylim()[0]
    ax.axvspan(left, chip.ridge_point, color=PALETTE["skipped"], alpha=0.18, lw=0, zorder=0)
    ax.set_xlim(left=left)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 0.86))  # below the ridge label, above the line
    ax.text(chip.ridge_point / 1.2, bottom * 1.5, "memory bound", ha="right", fontsize=8, color=PALETTE["ink"])
    ax.text(chip.ridge_point * 1.2, bottom * 1.5, "compute bound", ha="left", fontsize=8, color=PALETTE["ink"])
    return fig


# -- Block sizes -----------------------------------------------------------------------------------


_STATUS_LABELS = {"refused": "refused\n(VMEM)", "profiler_crash": "profiler\ncrash", "compile_error": "compile\nerror"}


def plot_block_cycles(grid: BlockGrid, ax: Axes | None = None, title: str | None = None) -> Figure:
    """Heat map of estimated cycles over ``block_q`` (rows) x ``block_k`` (columns), each cell labelled with
    its cycles and its multiple of the best; the best is framed, cells without an estimate say why.

    The colour is the multiple of the best on one absolute scale (:data:`RATIO_SCALE`: white at x1, dark red
    from x2), the same for every panel: a cell 1% off the best looks like the best, whatever the panel's range.
    """
    fig, ax = figure_and_axes(ax, (1.6 + 1.25 * len(grid.block_ks), 1.2 + 0.9 * len(grid.block_qs)))
    ok = ~np.isnan(grid.cycles)
    best = np.nanmin(grid.cycles) if ok.any() else np.nan
    ratio = grid.cycles / best  # [nq, nk], NaN where there is no estimate
    if ok.any():
        ax.imshow(np.ma.masked_invalid(ratio), cmap="YlOrRd", norm=LogNorm(*RATIO_SCALE, clip=True))
    ax.imshow(np.where(ok, np.nan, 1.0), cmap="Greys", vmin=0, vmax=4)  # no estimate: light grey
    for i in range(len(grid.block_qs)):
        for j in range(len(grid.block_ks)):
            if ok[i, j]:
                text = f"{grid.cycles[i, j] / 1e3:,.0f}k\n×{ratio[i, j]:.2f}"
                dark = ratio[i, j] > DARK_RATIO
            else:
                text, dark = _STATUS_LABELS.get(grid.status[i, j], "not tried"), False
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else PALETTE["ink"])
    if grid.best is not None:
        i, j = grid.block_qs.index(grid.best[0]), grid.block_ks.index(grid.best[1])
        ax.add_patch(Rectangle((j - 0.48, i - 0.48), 0.96, 0.96, fill=False, lw=2.5, edgecolor=PALETTE["Q"]))
    ax.set_xticks(range(len(grid.block_ks)), labels=[str(b) for b in grid.block_ks])
    ax.set_yticks(range(len(grid.block_qs)), labels=[str(b) for b in grid.block_qs])
    return _label(ax, "block_k", "block_q", title or f"{grid.title}: estimated cycles (×best)")


def plot_step_cost(rows: Iterable[Row], fit: StepCostFit, ax: Axes | None = None, title: str | None = None) -> Figure:
    """Estimated cycles against grid steps (one point per ``block_q x block_k``, labelled) with the fitted line:
    its slope is the fixed cost of one grid step."""
    ok = [r for r in rows if r["status"] == "ok"]
    fig, ax = figure_and_axes(ax, (6.5, 4.4))
    steps = np.array([r["grid_steps"] for r in ok])  # [n]
    ax.scatter(steps, [r["cycles"] for r in ok], color=SERIES_COLORS[1], zorder=3)
    fewest = min(ok, key=lambda r: r["cycles"])
    for r in ok:  # the crowded corner of few steps gets one label: the fastest
        if r["grid_steps"] >= steps.max() / 4 or r is fewest:
            ax.annotate(f"{r['block_q']}×{r['block_k']}", (r["grid_steps"], r["cycles"]), textcoords="offset points",
                        xytext=(6, -10 if r["block_q"] > r["block_k"] else 2), fontsize=7, color=PALETTE["ink"])
    line = np.linspace(0, steps.max() * 1.05, 50)  # [50]
    ax.plot(line, fit.per_step * line + fit.rest, "--", color=SERIES_COLORS[0],
            label=f"fit: {fit.per_step:,.0f} cycles per step + {fit.rest / 1e3:,.0f}k")
    floor = next(r["mxu_floor"] for r in ok)
    ax.axhline(floor, color=PALETTE["ink"], ls=":", lw=1, label=f"MXU floor {floor / 1e3:,.0f}k")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y / 1e6:g}M"))
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, alpha=0.3)
    return _label(ax, "grid steps (batch × heads × q blocks × k blocks)", "estimated cycles", title)


def plot_vmem_by_blocks(head_dim: int, dtype, block_qs: Sequence[int] = (128, 256, 512, 1024, 2048),
                        block_ks: Sequence[int] = (128, 256, 512, 1024, 2048),
                        generations: Sequence[str] = ("v5e", "v6e"), ax: Axes | None = None,
                        title: str | None = None) -> Figure:
    """flashlib's VMEM estimate (:meth:`BlockSizes.vmem_bytes`) against ``block_k``, one line per ``block_q``,
    under the scoped-VMEM limit of each generation (horizontal lines)."""
    fig, ax = figure_and_axes(ax, (7.5, 4.4))
    for block_q, color in zip(block_qs, cycle(SERIES_COLORS[1:] + SERIES_COLORS[:1])):
        mib = [BlockSizes(block_q, block_k).vmem_bytes(head_dim, dtype) / MIB for block_k in block_ks]
        ax.plot(block_ks, mib, "o-", color=color, ms=4, label=f"block_q={block_q}")
    for generation, style in zip(generations, cycle(["--", ":", "-."])):
        limit = vmem_limit_bytes(generation) / MIB
        # in the legend, not beside the line: two limits a factor 2 apart collide as text on a log axis
        ax.axhline(limit, color=PALETTE["masked"], ls=style, lw=1.2, label=f"{generation} scoped limit {limit:g} MiB")
    ax.set(xscale="log", yscale="log")
    ax.set_xticks(list(block_ks), labels=[str(b) for b in block_ks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_locator(LogLocator(base=2.0))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(True, which="major", alpha=0.3)
    return _label(ax, "block_k", "VMEM (MiB, flashlib's estimate)", title or f"VMEM per grid step, head_dim="
                   f"{head_dim} {np.dtype(dtype).name}")


# -- Implementations across lengths ----------------------------------------------------------------


def plot_seq_sweep(rows: Iterable[Row], generation: str, baseline: str = "xla", ax: Axes | None = None,
                   title: str | None = None) -> Figure:
    """Estimated cycles over the MXU floor against sequence length, one line per implementation (1.0 would be
    every MXU busy every cycle); above each length, flashlib's cycles over ``baseline``'s (below 1, in green:
    flashlib's kernel is estimated faster)."""
    rows = select(rows, generation=generation, status="ok")
    fig, ax = figure_and_axes(ax, (6.8, 4.6))
    seqs = sorted({r["seq"] for r in rows})
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = sorted(select(rows, impl=impl), key=lambda r: r["seq"])
        ax.plot([r["seq"] for r in mine], [r["cycles"] / r["mxu_floor"] for r in mine], "o-",
                color=IMPL_COLORS.get(impl), label=IMPL_NAMES.get(impl, impl), ms=4)
    ax.axhline(1.0, color=PALETTE["ink"], ls=":", lw=1, label="MXU floor")
    top = max((r["cycles"] / r["mxu_floor"] for r in rows), default=1.0)
    for seq in seqs:
        ours, theirs = select(rows, seq=seq, impl="pallas"), select(rows, seq=seq, impl=baseline)
        if ours and theirs:
            ratio = ours[0]["cycles"] / theirs[0]["cycles"]
            ax.text(seq, top * 1.5, f"×{ratio:.2f}", ha="center", fontsize=8,
                    color=PALETTE["masked"] if ratio > 1 else PALETTE["V"])
    ax.set(xscale="log", yscale="log")
    ax.set_ylim(0.8, top * 2.5)
    ax.set_xticks(seqs, labels=[str(s) for s in seqs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_locator(LogLocator(base=10.0, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(True, which="major", alpha=0.3)
    return _label(ax, "sequence length", "estimated cycles / MXU floor",
                  title or f"{generation}: flashlib / {IMPL_NAMES.get(baseline, baseline)} above each length")


# -- The optimisation story ------------------------------------------------------------------------


def plot_optimisation_steps(rows: Sequence[Row], value: str = "cycles", baseline: str | None = "jax_best",
                            floor: str | None = "mxu_floor", ax: Axes | None = None,
                            title: str | None = None) -> Figure:
    """One bar per optimisation step (``rows`` in order, one shape) of column ``value``, each labelled with its
    multiple of the first step; ``baseline`` (JAX's best) dashed and ``floor`` (the MXU floor) dotted, from the
    first row that has them."""
    if not rows:
        raise ValueError("plot_optimisation_steps needs at least one row: select one shape from the steps table")
    fig, ax = figure_and_axes(ax, (1.8 + 1.1 * len(rows), 4.4))
    values = np.array([r[value] for r in rows], dtype=np.float64)  # [steps]
    x = np.arange(len(rows))
    ax.bar(x, values, color=[SERIES_COLORS[0]] + [SERIES_COLORS[1]] * (len(rows) - 1), width=0.65)
    for xi, v in zip(x, values, strict=True):
        ax.text(xi, v * 0.97, f"{v / 1e3:,.0f}k\n×{v / values[0]:.2f}", ha="center", va="top", fontsize=8,
                color="white")  # inside the bar: clear of the reference lines drawn across it
    top = values.max()
    for column, style, label in ((baseline, "--", "JAX's best"), (floor, ":", "MXU floor")):
        level = first_number(rows, column)
        if level is not None:
            ax.axhline(level, color=PALETTE["ink"], ls=style, lw=1.2, label=f"{label} {level / 1e3:,.0f}k")
            top = max(top, level)
    ax.set_xticks(x, labels=[_step_label(r["step"]) for r in rows], fontsize=8)
    ax.set_ylim(0, top * 1.25)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y / 1e3:,.0f}k"))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    return _label(ax, "optimisation step (see the table)", f"estimated {value.replace('_', ' ')}", title)


def _step_label(step: object, width: int = 12) -> str:
    """A step name wrapped at ``_`` and ``-`` (never inside a word): ``fused_dq_blocks`` -> ``fused_dq_\nblocks``."""
    parts = str(step).replace("_", "_ ").replace("-", "- ").split(" ")
    return textwrap.fill(" ".join(parts), width, break_long_words=False).replace("_ ", "_").replace("- ", "-")


def _series_styles(story: Mapping[tuple[Any, ...], Sequence[Row]]) -> list[tuple[str, Any, str]]:
    """``(colour, line style, marker)`` per shape, never repeated: the colour by the shape's second key (the
    sequence length), the line style by its first (the chip), the marker by its third (causal or not)."""
    shapes = list(story)
    lengths = dict.fromkeys(s[1:2] for s in shapes)
    colours = {key: SERIES_COLORS[i % len(SERIES_COLORS)] for i, key in enumerate(lengths)}
    styles = {key: ["-", "--", ":", "-."][i % 4] for i, key in enumerate(dict.fromkeys(s[:1] for s in shapes))}
    return [(colours[s[1:2]], styles[s[:1]], "s" if len(s) > 2 and s[2] else "o") for s in shapes]


def plot_steps_vs_baseline(story: Mapping[tuple[Any, ...], Sequence[Row]], value: str = "cycles",
                           baseline: str = "jax_best", ax: Axes | None = None, title: str | None = None) -> Figure:
    """All shapes of a :func:`group_steps` story on one chart: ``value`` over ``baseline`` (JAX's best) at each
    step, one line per shape; below the dashed line at 1, flashlib's kernel is estimated faster than JAX's."""
    fig, ax = figure_and_axes(ax, (7.5, 4.4))
    order = list(dict.fromkeys(row["step"] for rows in story.values() for row in rows))  # steps as first recorded
    for (shape, rows), (color, style, marker) in zip(story.items(), _series_styles(story), strict=True):
        shared = first_number(rows, baseline)
        points = [(order.index(r["step"]), r[value] / (r[baseline] if is_number(r.get(baseline)) else shared))
                  for r in rows if shared or is_number(r.get(baseline))]
        if points:
            xs, ys = zip(*points, strict=True)
            name = " ".join(str(part) for part in shape[:2]) + (" causal" if len(shape) > 2 and shape[2] else "")
            ax.plot(xs, ys, marker=marker, ls=style, color=color, label=name, ms=5)
    ax.axhline(1.0, color=PALETTE["ink"], ls=(0, (6, 3)), lw=1.0, label="JAX's best")
    ax.set_xticks(range(len(order)), labels=[_step_label(step) for step in order], fontsize=8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(True, alpha=0.3)
    return _label(ax, "optimisation step", f"{value.replace('_', ' ')} / JAX's best (lower is better)", title)


def plot_gqa_estimates(rows: Sequence[Row], ax: Axes | None = None, title: str | None = None) -> Figure:
    """GQA/MQA rows of ``variants_v5e.csv``: the K/V bytes the kernel's copies move (bars), the K/V bytes held
    in HBM (crosses) and cycles (dots) per kv-head count, non-causal and causal, each relative to multi-head
    attention (``kv_heads == heads``)."""
    fig, ax = figure_and_axes(ax, (6.4, 3.6))
    rows = sorted(rows, key=lambda row: (row["causal"], -row["kv_heads"]))
    labels = [f"{'causal' if r['causal'] else 'full'}\n{r['heads']}q/{r['kv_heads']}kv" for r in rows]
    mha = {r["causal"]: r for r in rows if r["kv_heads"] == r["heads"]}
    x = np.arange(len(rows))
    ax.bar(x, [r["kv_bytes_read"] / mha[r["causal"]]["kv_bytes_read"] for r in rows], color=SERIES_COLORS[1],
           alpha=0.6, label="K/V bytes copied / MHA's")
    # crosses left of centre, dots right: at MHA all three are 1.0, and side by side neither hides the other
    ax.plot(x - 0.18, [r["kv_bytes"] / mha[r["causal"]]["kv_bytes"] for r in rows], "x", color=PALETTE["ink"],
            ms=7, mew=1.5, label="K/V bytes held / MHA's")
    ax.plot(x + 0.18, [r["cycles"] / mha[r["causal"]]["cycles"] for r in rows], "o", color=SERIES_COLORS[0],
            label="cycles / MHA's")
    ax.set_xticks(x, labels=labels, fontsize=8)
    ax.set_ylim(0, 1.25)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.legend(frameon=False, fontsize=8, loc="upper right")
    return _label(ax, "", "relative to MHA", title)


def plot_window_scaling(rows: Sequence[Row], ax: Axes | None = None, title: str | None = None) -> Figure:
    """Window rows of ``variants_v5e.csv``: cycles against T on log-log axes, with the line a cost linear in T
    would follow from the shortest length (and the quadratic one for comparison)."""
    fig, ax = figure_and_axes(ax, (5.0, 3.6))
    rows = sorted(rows, key=lambda row: row["T"])
    t = np.array([r["T"] for r in rows], float)
    cycles = np.array([r["cycles"] for r in rows], float)
    ax.loglog(t, cycles, "o-", color=SERIES_COLORS[1], label=f"window {rows[0]['window']}")
    ax.loglog(t, cycles[0] * t / t[0], ls="--", color="grey", label="linear in T")
    ax.loglog(t, cycles[0] * (t / t[0]) ** 2, ls=":", color=SERIES_COLORS[0], label="quadratic in T")
    ax.set_xticks(t, labels=[f"{int(n) // 1024}k" for n in t])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.legend(frameon=False, fontsize=8)
    return _label(ax, "sequence length T", "static estimate (cycles)", title)
