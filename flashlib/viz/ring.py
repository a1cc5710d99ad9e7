"""The causal ring's chunk pairs: for every device and ring step, which (query chunk, key chunk) pairs it
computes in full, as the causal diagonal, or skips.

Plain data in (per step and device a ``{(query chunk, key chunk): kind name}`` dict, as notebook 11's
``causal_pairs`` puzzle returns with its kinds named), a figure out; nothing here imports the ring itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Polygon, Rectangle

from flashlib.viz.figures import PALETTE, figure_and_axes

__all__ = ["PAIR_COLORS", "plot_chunk_pairs"]

PAIR_COLORS = {"full": PALETTE["S"], "diagonal": PALETTE["masked"], "skip": PALETTE["skipped"]}
"""The colour of each kind of chunk pair: full work gold, the causal diagonal red (half under the mask), none grey."""


def plot_chunk_pairs(pairs: Sequence[Sequence[Mapping[tuple[int, int], str]]], *, title: str | None = None,
                     ax: Axes | None = None) -> Figure:
    """``pairs[step][device]``: ``{(a, b): "full" | "diagonal" | "skip"}`` for the device's query chunks ``a``
    (rows of its small grid) against the key chunks ``b`` it holds that step (columns). One small grid per
    device (rows of the figure) and step (columns), each square labelled ``a,b``; a diagonal pair is drawn
    half filled, the causal triangle it computes."""
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
                    ax.text(x + 0.5, y + 0.5, f"{a},{b}", ha="center", va="center", fontsize=6,
                            color=PALETTE["ink"])
    ax.set_xlim(-0.2, steps * (side + gap) - gap + 0.2)
    ax.set_ylim(-0.2, n * (side + gap) - gap + 0.2)
    ax.set_aspect("equal")
    ax.set_xticks([s * (side + gap) + side / 2 for s in range(steps)], labels=[f"step {s}" for s in range(steps)])
    ax.set_yticks([(n - 1 - d) * (side + gap) + side / 2 for d in range(n)], labels=[f"dev {d}" for d in range(n)])
    ax.tick_params(length=0, labelsize=8)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.legend(handles=[Patch(facecolor=color, label=kind) for kind, color in PAIR_COLORS.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="chunk pair", title_fontsize=8)
    ax.set_title(title or "chunk pairs (query chunk, key chunk) per device and ring step", fontsize=9)
    return fig
