"""Pictures of attention beyond one chip: a mesh with each device's block, and the ring's steps and work.

Plain data in (device grids, chunk lists, work counts from :func:`flashlib.ring.ring_schedule`), a figure out;
nothing here imports the ring itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, Rectangle

from flashlib.viz.figures import PALETTE, draw_tile, figure_and_axes

__all__ = ["plot_mesh", "plot_ring_step", "plot_ring_work"]


def plot_mesh(labels: Sequence[Sequence[str]], axis_names: tuple[str, str], *, title: str | None = None,
              ax: Axes | None = None) -> Figure:
    """A 2-D device mesh: one box per device (``labels[row][col]``, e.g. its device id and its block of q),
    rows along ``axis_names[0]`` and columns along ``axis_names[1]``."""
    rows, cols = len(labels), len(labels[0])
    fig, ax = figure_and_axes(ax, (1.9 * cols + 1.0, 1.2 * rows + 1.0))
    for r in range(rows):
        for c in range(cols):
            draw_tile(ax, c, rows - 1 - r, 0.92, 0.88, PALETTE["Q"], 0.18 + 0.5 * (r * cols + c) / (rows * cols),
                      edge=PALETTE["ink"])
            ax.text(c + 0.46, rows - 1 - r + 0.44, labels[r][c], ha="center", va="center", fontsize=8)
    ax.set_xlim(-0.1, cols)
    ax.set_ylim(-0.1, rows)
    ax.set_xticks([c + 0.46 for c in range(cols)], labels=[f"{axis_names[1]}={c}" for c in range(cols)])
    ax.set_yticks([rows - 1 - r + 0.44 for r in range(rows)], labels=[f"{axis_names[0]}={r}" for r in range(rows)])
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    if title:
        ax.set_title(title)
    return fig


def plot_ring_step(step: int, queries: Sequence[Sequence[int]], holding: Sequence[Sequence[int]],
                   work: Sequence[float], *, full_work: float, merged: Sequence[Sequence[int]] | None = None,
                   title: str | None = None, ax: Axes | None = None) -> Figure:
    """One ring step: ``n`` devices on a circle, device ``i`` keeping query chunks ``queries[i]`` and holding
    key/value chunks ``holding[i]`` this step, filled by its share of the busiest possible step's work
    (``work[i] / full_work``; grey: nothing to compute); arrows show where the chunks go next. ``merged[i]``,
    if given: the key/value chunks device ``i``'s running ``(out, lse)`` holds after this step's merge."""
    n = len(queries)
    radius = 0.3 if n > 4 else 0.42  # neighbours on the unit circle are 2 sin(pi / n) apart
    fig, ax = figure_and_axes(ax, (4.2, 4.2))
    angles = np.pi / 2 - 2 * np.pi * np.arange(n) / n
    xy = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    for i in range(n):
        share = work[i] / full_work if full_work else 0.0
        color = PALETTE["skipped"] if share == 0 else PALETTE["S"]
        ax.add_patch(Circle(xy[i], radius, facecolor=color, alpha=0.25 + 0.75 * min(share, 1.0),
                            edgecolor=PALETTE["ink"]))
        label = f"dev {i}\nq {','.join(map(str, queries[i]))}\nkv {','.join(map(str, holding[i]))}"
        if merged is not None:
            label += f"\nout: kv {','.join(map(str, merged[i]))}"
        ax.text(*xy[i], label, ha="center", va="center", fontsize=8 if merged is None else 7.5)
        start, end = xy[i] * 0.62, xy[(i + 1) % n] * 0.62
        if n > 1:
            ax.add_patch(FancyArrowPatch(start, end, arrowstyle="->", mutation_scale=9, color=PALETTE["K"],
                                         connectionstyle="arc3,rad=-0.25"))
    edge = max(1.32, 1.06 + radius)  # the circles whole
    ax.set_xlim(-edge, edge)
    ax.set_ylim(-edge, edge)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"step {step}", fontsize=9)
    return fig


def plot_ring_work(work: np.ndarray, *, vmax: float | None = None, title: str | None = None,
                   ax: Axes | None = None) -> Figure:
    """``work [steps, devices]`` as a heat map (0 to ``vmax``, default its own maximum: pass one ``vmax`` to
    compare two maps), each step's busiest devices outlined, every one tied at the maximum: the ring waits for
    them. A step where every device does the same work outlines none (no device holds the others up)."""
    work = np.asarray(work, np.float64)
    fig, ax = figure_and_axes(ax, (4.6, 3.6))
    ax.imshow(work, cmap="YlOrBr", vmin=0, vmax=vmax or max(work.max(), 1.0), aspect="auto")
    for s, row in enumerate(work):
        busiest = np.flatnonzero(row == row.max())
        for d in busiest if len(busiest) < len(row) else ():
            ax.add_patch(Rectangle((d - 0.5, s - 0.5), 1, 1, fill=False, edgecolor=PALETTE["masked"], linewidth=1.5))
    ax.set_xlabel("device")
    ax.set_ylabel("ring step")
    ax.set_xticks(range(work.shape[1]))
    ax.set_yticks(range(work.shape[0]))
    if title:
        ax.set_title(title, fontsize=9)
    return fig
