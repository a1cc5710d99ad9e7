"""Memory pictures: attention's memory against sequence length, HBM traffic, a VMEM budget."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import cycle

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullLocator

from flashlib.viz.figures import PALETTE, SERIES_COLORS, byte_axis, figure_and_axes, finish_axes, format_bytes

# -- Measurements ---------------------------------------------------------------------------------


def plot_memory_scaling(
    lengths: Sequence[int], series: Mapping[str, Sequence[float]], ax: Axes | None = None,
    ylabel: str = "peak memory", title: str | None = None, guides_at: str | None = None,
) -> Figure:
    """Log-log memory (bytes) against sequence length, one line per method, with ``∝ N`` and ``∝ N²`` guides.

    On log-log axes a power law is a straight line whose slope is its exponent, so a method whose line
    runs parallel to the ``N²`` guide materialises the score matrix and one parallel to ``N`` does not.
    ``lengths`` ascending; use NaN for a missing point (say, an out-of-memory run) and the line just stops.
    The guides start at the lowest first point, or, with ``guides_at`` (a key of ``series``), at half that
    series' first point, so they run just below the line the text compares them with.
    """
    x = np.asarray(lengths, dtype=np.float64)
    fig, ax = figure_and_axes(ax, (6.5, 4.5))
    for (name, ys), color in zip(series.items(), cycle(SERIES_COLORS)):
        ax.loglog(x, np.asarray(ys, dtype=np.float64), "o-", color=color, label=name, lw=2)
    if guides_at is not None:
        anchor = 0.5 * float(series[guides_at][0])
    else:
        firsts = [float(ys[0]) for ys in series.values() if len(ys) and np.isfinite(ys[0])]
        anchor = min(firsts) if firsts else 1.0
    for power, label in ((1, "∝ N"), (2, "∝ N²")):
        guide = anchor * (x / x[0]) ** power
        ax.loglog(x, guide, ls="--", color=PALETTE["skipped"], lw=1, zorder=0)
        ax.annotate(label, (x[-1], guide[-1]), textcoords="offset points", xytext=(7, 0), ha="left", va="center",
                    fontsize=9, color="grey")  # right of the last length: clear of every marker
    byte_axis(ax.yaxis)
    ax.set_xticks(x, labels=[str(int(n)) for n in x])
    ax.set_xlim(x[0] / (x[-1] / x[0]) ** 0.05, x[-1] * (x[-1] / x[0]) ** 0.12)  # room on the right for the labels
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(True, which="major", alpha=0.3)
    return finish_axes(ax, "sequence length N", ylabel, title)


def plot_hbm_traffic(
    traffic: Mapping[str, Mapping[int, float]], ax: Axes | None = None, ylabel: str = "HBM bytes moved",
    title: str | None = None, log: bool = True,
) -> Figure:
    """Grouped bars of counted HBM traffic: ``traffic[method][seq_len] = bytes``, one group per length.

    With exactly two methods each group is labelled with the ratio first / second (e.g. naive / tiled):
    the factor the tiled kernel saves by never writing the score matrix to HBM.
    """
    names = list(traffic)
    lengths = sorted({n for per_len in traffic.values() for n in per_len})
    fig, ax = figure_and_axes(ax, (1.6 + 1.2 * len(lengths) * max(1, len(names)) / 2, 4.2))
    width = 0.8 / max(1, len(names))
    x = np.arange(len(lengths))
    for k, (name, color) in enumerate(zip(names, cycle(SERIES_COLORS))):
        ys = [traffic[name].get(n, np.nan) for n in lengths]
        ax.bar(x + (k - (len(names) - 1) / 2) * width, ys, width, color=color, label=name)
    if len(names) == 2:
        for xi, n in zip(x, lengths, strict=True):
            a, b = traffic[names[0]].get(n), traffic[names[1]].get(n)
            if a and b:
                top = max(a, b) * (1.3 if log else 1.02)
                ax.text(xi, top, f"×{a / b:.3g}", ha="center", va="bottom", fontsize=9, color=PALETTE["ink"])
    if log:
        ax.set_yscale("log")
        ax.margins(y=0.15)
        byte_axis(ax.yaxis)
    else:
        ax.yaxis.set_major_formatter(FuncFormatter(format_bytes))
    ax.set_xticks(x, labels=[str(n) for n in lengths])
    return finish_axes(ax, "sequence length", ylabel, title)


def plot_vmem_budget(
    configs: Mapping[str, Mapping[str, float]], limits: Mapping[str, float], ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """Horizontal stacked bars of VMEM bytes, one bar per configuration, against vertical limit lines.

    ``configs[name][part] = bytes`` (e.g. ``{"512 x 512": {"q, k, v, out (x2)": ..., "scratch": ...}}``; every
    configuration has the same parts, in the same order); ``limits[name] = bytes`` (e.g. the scoped-VMEM
    limits of v5e and v6e). Each bar ends with its total in MiB, red when it exceeds the smallest limit.
    """
    names = list(configs)
    parts = list(next(iter(configs.values()))) if names else []
    mib = float(1 << 20)
    fig, ax = figure_and_axes(ax, (8.0, 1.3 + 0.45 * max(len(names), 1)))
    y = np.arange(len(names))[::-1]
    left = np.zeros(len(names))
    for part, color in zip(parts, cycle(SERIES_COLORS[1:] + SERIES_COLORS[:1])):
        widths = np.array([configs[name][part] for name in names], dtype=np.float64) / mib
        ax.barh(y, widths, left=left, color=color, label=part, height=0.6)
        left += widths
    smallest = min(limits.values(), default=np.inf) / mib
    for yi, total in zip(y, left, strict=True):
        ax.text(total, yi, f" {total:.1f} MiB", va="center", fontsize=8,
                color=PALETTE["masked"] if total > smallest else PALETTE["ink"])
    for (name, limit), style in zip(limits.items(), cycle(["--", ":", "-."])):
        # named in the legend, not beside the line: limits close together (16 and 32 MiB on a wide axis) collide
        ax.axvline(limit / mib, color=PALETTE["ink"], ls=style, lw=1.2, label=f"{name}: {limit / mib:g} MiB")
    ax.set_yticks(y, labels=names)
    ax.set_ylim(-0.6, len(names) - 0.1)
    ax.set_xlim(0, max(float(left.max(initial=0.0)), max(limits.values(), default=0) / mib) * 1.22)
    entries = len(parts) + len(limits)  # in rows of up to three: one long row would squeeze the axes to fit its width
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), borderaxespad=4.6, ncol=min(max(entries, 1), 3),
              fontsize=8, frameon=False)  # under the x label
    ax.set_xlabel("VMEM (MiB)")
    if title:
        ax.set_title(title, fontsize=10)
    return fig
