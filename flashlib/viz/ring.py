"""The causal ring's chunk pairs: for every device and ring step, which (query chunk, key chunk) pairs it
computes in full, as the causal diagonal, or skips; and one device's timeline of a ring step, the next
key/value transfer in flight while those pairs run.

Plain data in (per step and device a ``{(query chunk, key chunk): kind name}`` dict, as notebook 11's
``causal_pairs`` puzzle returns with its kinds named), a figure out; nothing here imports the ring itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Polygon, Rectangle
from matplotlib.transforms import blended_transform_factory

from flashlib.viz.figures import PALETTE, figure_and_axes

__all__ = ["PAIR_COLORS", "PAIR_WORK", "RingStepTime", "plot_chunk_pairs", "plot_ring_timeline", "ring_timeline"]

PAIR_COLORS = {"full": PALETTE["S"], "diagonal": PALETTE["masked"], "skip": PALETTE["skipped"]}
"""The colour of each kind of chunk pair: full work gold, the causal diagonal red (half under the mask), none grey."""

PAIR_WORK = {"full": 1.0, "diagonal": 0.5, "skip": 0.0}
"""The work of each kind of chunk pair, in full pairs: the diagonal computes half its scores, a skipped pair none."""


def plot_chunk_pairs(pairs: Sequence[Sequence[Mapping[tuple[int, int], str]]], *, title: str | None = None,
                     ax: Axes | None = None) -> Figure:
    """``pairs[step][device]``: ``{(a, b): "full" | "diagonal" | "skip"}`` for the device's query chunks ``a``
    (rows of its small grid) against the key chunks ``b`` it holds that step (columns). One small grid per
    device (rows of the figure) and step (columns), each square labelled ``a,b``; a diagonal pair is drawn
    half filled, the causal triangle it computes, its label in the masked half."""
    steps, n = len(pairs), len(pairs[0])
    side = max(len({a for a, _ in p}) for row in pairs for p in row)
    gap = 0.6
    fig, ax = figure_and_axes(ax, (1.0 + 1.05 * steps * (side + gap) / 2, 0.8 + 1.0 * n * (side + gap) / 2))
    for s, row in enumerate(pairs):
        for d, cell in enumerate(row):
            x0, y0 = s * (side + gap), (n - 1 - d) * (side + gap)
            queries, keys = sorted({a for a, _ in cell}), sorted({b for _, b in cell})
            for r, a in enumerate(queries):
                for c, b in enumerate(keys):
                    kind = cell[(a, b)]
                    x, y = x0 + c, y0 + side - 1 - r
                    if kind == "diagonal":  # the lower-left triangle: query i sees keys 0..i
                        ax.add_patch(Polygon([(x, y + 1), (x, y), (x + 1, y)], facecolor=PAIR_COLORS[kind]))
                        ax.add_patch(Polygon([(x, y + 1), (x + 1, y + 1), (x + 1, y)], facecolor=PAIR_COLORS["skip"],
                                             alpha=0.35))  # the masked half: later keys
                        ax.add_patch(Rectangle((x, y), 1, 1, facecolor="none", edgecolor="white"))
                    else:
                        ax.add_patch(Rectangle((x, y), 1, 1, facecolor=PAIR_COLORS[kind], edgecolor="white"))
                    at = (x + 0.68, y + 0.7) if kind == "diagonal" else (x + 0.5, y + 0.5)  # clear of the triangle
                    ax.text(*at, f"{a},{b}", ha="center", va="center", fontsize=8.5, color=PALETTE["ink"])
    ax.set_xlim(-0.2, steps * (side + gap) - gap + 0.2)
    ax.set_ylim(-0.2, n * (side + gap) - gap + 0.2)
    ax.set_aspect("equal")
    ax.set_xticks([s * (side + gap) + side / 2 for s in range(steps)], labels=[f"step {s}" for s in range(steps)])
    ax.set_yticks([(n - 1 - d) * (side + gap) + side / 2 for d in range(n)], labels=[f"dev {d}" for d in range(n)])
    ax.tick_params(length=0, labelsize=8)
    ax.set_xlabel("in each small grid: query chunks down, key/value chunks across (square a,b)", fontsize=8)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.legend(handles=[Patch(facecolor=color, label=kind) for kind, color in PAIR_COLORS.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="chunk pair", title_fontsize=8)
    ax.set_title(title or "chunk pairs (query chunk, key chunk) per device and ring step", fontsize=9)
    return fig


@dataclass(frozen=True)
class RingStepTime:
    """One ring step on one device's (schematic) clock: its chunk-pair kernels back to back from ``start``,
    the transfer of the next chunks from ``start`` to ``start + transfer`` (none at the last step: nothing left
    to send), and its ``end``, when both are done: a transfer longer than the compute leaves a wait."""

    step: int
    start: float
    pairs: tuple[tuple[tuple[int, int], str, float, float], ...]  # ((a, b), kind, t0, t1) in schedule order
    compute_end: float
    transfer_end: float | None
    end: float


def ring_timeline(steps: Sequence[Mapping[tuple[int, int], str]], *, transfer: float,
                  skip: float = 0.12) -> list[RingStepTime]:
    """``steps[s]``: ``{(a, b): "full" | "diagonal" | "skip"}`` of one device at ring step ``s``, in the order
    its conditionals run; ``transfer``: how long sending the next key/value chunks takes, in full chunk pairs.
    A full pair lasts 1, a diagonal 1/2 and a skipped pair ``skip`` (its conditional still runs, and does
    nothing); a step ends when its kernels and its transfer are both done, and the next starts then."""
    if transfer < 0 or skip < 0:
        raise ValueError(f"transfer and skip must be >= 0, got {transfer} and {skip}")
    timeline, now = [], 0.0
    for s, cell in enumerate(steps):
        start, pairs = now, []
        for ab, kind in cell.items():
            length = PAIR_WORK[kind] or skip
            pairs.append((tuple(ab), kind, now, now + length))
            now += length
        sends = s < len(steps) - 1
        transfer_end = start + transfer if sends else None
        end = max(now, transfer_end or now)
        timeline.append(RingStepTime(s, start, tuple(pairs), now, transfer_end, end))
        now = end
    return timeline


def plot_ring_timeline(steps: Sequence[Mapping[tuple[int, int], str]], *, transfer: float, skip: float = 0.12,
                       streams: Sequence[str] = ("k", "v"), xmax: float | None = None, xlabel: str | None = None,
                       title: str | None = None, legend: bool = True, ax: Axes | None = None) -> Figure:
    """One device's ring steps (:func:`ring_timeline`) on a time line: below, its chunk-pair kernels by kind
    (labelled ``a,b``), then a hatched wait if the transfer is not done yet; above, one lane per chunk in
    flight (``streams``), a bar from its ``collective-permute-start`` (triangle) to its ``-done`` (bar)."""
    timeline = ring_timeline(steps, transfer=transfer, skip=skip)
    fig, ax = figure_and_axes(ax, (10.0, 0.9 + 0.55 * (len(streams) + 1)))
    height = 0.62
    for t in timeline:
        ax.axvline(t.start, color=PALETTE["ink"], linewidth=0.6, linestyle=(0, (3, 3)), alpha=0.6)
        ax.text(t.start + 0.05, 1.0, f"step {t.step}", transform=blended_transform_factory(ax.transData, ax.transAxes),
                ha="left", va="bottom", fontsize=8)
        for (a, b), kind, t0, t1 in t.pairs:
            ax.add_patch(Rectangle((t0, -height / 2), t1 - t0, height, facecolor=PAIR_COLORS[kind],
                                   edgecolor="white", linewidth=1.0))
            if kind != "skip":
                ax.text((t0 + t1) / 2, 0, f"{a},{b}", ha="center", va="center", fontsize=8, color=PALETTE["ink"])
        if t.end > t.compute_end:
            ax.add_patch(Rectangle((t.compute_end, -height / 2), t.end - t.compute_end, height, facecolor="white",
                                   edgecolor=PALETTE["masked"], hatch="///", linewidth=0.8))
        if t.transfer_end is None:
            ax.text(t.start + 0.1, (len(streams) + 1) / 2, "nothing left to send", ha="left", va="center",
                    fontsize=8, color=PALETTE["ink"], style="italic")
        for index, name in enumerate(streams if t.transfer_end is not None else ()):
            lane = len(streams) - index  # the first stream on top: it starts first
            color = PALETTE["V"] if name == "v" else PALETTE["K"]
            ax.add_patch(Rectangle((t.start, lane - height / 3), t.transfer_end - t.start, 2 * height / 3,
                                   facecolor=color, alpha=0.55, edgecolor="none"))
            ax.plot([t.start], [lane], marker=">", color=PALETTE["ink"], markersize=6)
            ax.plot([t.transfer_end], [lane], marker="|", color=PALETTE["ink"], markersize=14, markeredgewidth=2)
    ax.set_xlim(-0.1, xmax if xmax is not None else timeline[-1].end + 0.1)
    ax.set_ylim(-0.6, len(streams) + 0.5)
    ax.set_yticks(range(len(streams) + 1), labels=["chunk pairs", *(f"{name} chunks to\nthe next device"
                                                                     for name in reversed(streams))])
    ax.tick_params(axis="y", length=0, labelsize=8)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    schematic = "time, schematic (a full chunk pair = 1, a diagonal 1/2, a skipped pair a sliver)"
    ax.set_xlabel(schematic if xlabel is None else xlabel, fontsize=8)
    if legend:
        handles = [Patch(facecolor=color, label=kind) for kind, color in PAIR_COLORS.items()]
        handles += [Patch(facecolor="white", edgecolor=PALETTE["masked"], hatch="///", label="wait for -done"),
                    Line2D([], [], marker=">", color=PALETTE["ink"], linestyle="none",
                           label="collective-permute-start"),
                    Line2D([], [], marker="|", color=PALETTE["ink"], linestyle="none", markersize=10,
                           markeredgewidth=2, label="collective-permute-done")]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=9, pad=14)
    return fig
