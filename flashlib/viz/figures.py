"""Figures for the series: the palette, figure creation, byte axes, filmstrips and animations."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from matplotlib.animation import FuncAnimation
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

PALETTE: dict[str, str] = {
    "Q": "#4C72B0", "K": "#DD8452", "V": "#55A868", "O": "#8172B3",  # the operands
    "S": "#CCB974", "masked": "#C44E52", "skipped": "#BBBBBB", "ink": "#333333",  # scores, causal mask, text
}
"""Colours shared by every picture: operands Q, K, V, O, the score matrix S, masked and skipped blocks."""

SERIES_COLORS: tuple[str, ...] = ("#C44E52", "#4C72B0", "#55A868", "#8172B3", "#DD8452", "#937860")
"""Line/bar colours for measured series, in order (the first, red, is usually the naive baseline)."""


def new_figure(figsize: tuple[float, float]) -> Figure:
    """A constrained-layout figure that pyplot no longer tracks: display it (or return it) and it shows once.

    Creating it through pyplot resolves the backend, which is what registers Jupyter's inline PNG renderer;
    closing it keeps the inline backend from showing it a second time at the end of the cell.
    """
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=figsize, layout="constrained")
    plt.close(fig)
    return fig


def figure_and_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    """``ax`` and its figure, or a new figure of ``figsize`` with one axes: every ``plot_*(..., ax=None)``."""
    if ax is not None:
        return ax.figure, ax  # type: ignore[return-value]
    fig = new_figure(figsize)
    return fig, fig.add_subplot()


def format_bytes(n: float, _pos: object = None) -> str:
    """``1536 -> '1.5 KiB'``: binary units for memory axes (also usable as a tick formatter)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:.4g} TiB"


def byte_axis(axis) -> None:
    """Log axis of bytes with ticks at powers of two (1 KiB, 4 KiB, ... ) instead of powers of ten."""
    axis.set_major_locator(LogLocator(base=2.0, numticks=8))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(format_bytes))


# -- Blocks on a grid ------------------------------------------------------------------------------


def block_spans(length: int, block: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each block along an axis; the last block may be short."""
    if length <= 0 or block <= 0:
        raise ValueError(f"length and block must be positive, got {length} and {block}")
    return [(lo, min(lo + block, length)) for lo in range(0, length, block)]


def draw_tile(ax: Axes, x: float, y: float, w: float, h: float, color: str, alpha: float, **kw) -> None:
    """A ``w x h`` rectangle at ``(x, y)`` filled with ``color`` at ``alpha``, outlined (``edge``, default white)."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, alpha=alpha, edgecolor="none"))
    ax.add_patch(Rectangle((x, y), w, h, facecolor="none", edgecolor=kw.pop("edge", "white"), **kw))


# -- Axes of measurement plots ----------------------------------------------------------------------


def finish_axes(ax: Axes, xlabel: str, ylabel: str, title: str | None) -> Figure:
    """Label a measurement plot's axes, add its legend and title; return its figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(frameon=False)
    if title:
        ax.set_title(title)
    return ax.figure  # type: ignore[return-value]


# -- Static and animated sequences (what a reader of the rendered notebook sees without a kernel) -


def filmstrip(
    draw_step: Callable[[int, Axes], object], steps: Sequence[int], ncols: int = 4,
    figsize: tuple[float, float] | None = None, suptitle: str | None = None,
) -> Figure:
    """A grid of small panels, ``draw_step(step, ax)`` for each step: the static stand-in for a widget.

    A notebook rendered on GitHub shows no widgets; a filmstrip shows the whole sequence at a glance.
    """
    steps = list(steps)
    ncols = max(1, min(ncols, len(steps)))
    nrows = -(-len(steps) // ncols)
    fig = new_figure(figsize or (3.3 * ncols, 3.0 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, step in zip(axes, steps, strict=False):
        draw_step(step, ax)
    for ax in axes[len(steps):]:
        ax.set_visible(False)
    if suptitle:
        fig.suptitle(suptitle)
    return fig


def animate(
    draw_step: Callable[[int, Axes], object], steps: Sequence[int], interval: int = 700,
    figsize: tuple[float, float] = (7.0, 5.0),
) -> FuncAnimation:
    """A :class:`~matplotlib.animation.FuncAnimation` with one frame per step (each frame redrawn from scratch).

    Render it with :func:`to_jshtml` for a self-contained player that survives notebook rendering.
    """
    steps = list(steps)
    fig = new_figure(figsize)

    def frame(n: int) -> list:
        fig.clear()
        draw_step(steps[n], fig.add_subplot())
        return []

    return FuncAnimation(fig, frame, frames=len(steps), interval=interval, blit=False, repeat=True)


def to_jshtml(anim: FuncAnimation, fps: float | None = None) -> str:
    """The animation as an HTML snippet with embedded frames and JavaScript controls (``IPython.display.HTML``)."""
    return anim.to_jshtml(fps=fps, default_mode="loop")
