"""Pictures of the attention variants (notebook 09): the ``[q_len, kv_len]`` visibility matrix, the soft-cap
curve, which kv head each query head reads, and a mask's *block plan* — what a kernel does with each
``(query block, key block)`` (skip, mask, or run plain) and which key block each grid step fetches.

The data helpers (:func:`visibility`, :func:`block_plan`) are plain NumPy on :mod:`flashlib.masks` and
:mod:`flashlib.geometry`, the rules the kernels themselves evaluate, so a notebook can check a picture
against the kernel's own decisions.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.colors import ListedColormap, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from flashlib import geometry, masks
from flashlib.viz.figures import PALETTE, figure_and_axes

__all__ = ["KINDS", "BlockPlan", "block_plan", "plot_block_plan", "plot_fetch_schedule", "plot_head_groups",
           "plot_softcap", "plot_visibility", "visibility"]

KINDS = ("skipped", "masked", "plain")  # a block's kind, by index: what the kernel's pl.when guards decide


def visibility(q_len: int, kv_len: int, *, causal: bool = False, window=None, q_segments=None,
               kv_segments=None) -> np.ndarray:
    """``[q_len, kv_len]`` bool: True where query ``i`` may attend key ``j`` (one row of segment ids each, or
    none)."""
    rows, cols = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    visible = masks.element_visible(rows, cols, q_len=q_len, kv_len=kv_len, causal=causal, window=window)
    visible = np.broadcast_to(visible, (q_len, kv_len)).copy()
    if q_segments is not None:
        visible &= masks.segments_visible(np.asarray(q_segments), np.asarray(kv_segments))
    return visible


class BlockPlan(NamedTuple):
    """What a forward kernel does for one (batch, head), with ``block_k`` keys per grid step."""

    kinds: np.ndarray  # [num_q_blocks, num_kv_blocks]: index into KINDS
    empty: np.ndarray  # [num_q_blocks, num_kv_blocks]: computed, no element visible (id ranges overlap, share no id)
    fetched: np.ndarray  # [num_q_blocks, kv_steps]: the key block grid step (i, s) has in VMEM
    computes: np.ndarray  # [num_q_blocks, kv_steps]: whether grid step (i, s) runs its body
    compacted: bool  # the kv grid axis walks only each query block's live range (a window's left edge)

    @property
    def copies(self) -> int:
        """Copies of k (and of v) from HBM: the first step, and every step whose block index changes."""
        flat = self.fetched.ravel()
        return 1 + int(np.count_nonzero(np.diff(flat)))

    @property
    def counts(self) -> dict[str, int]:
        """How many blocks of each kind."""
        return {kind: int(np.sum(self.kinds == n)) for n, kind in enumerate(KINDS)}


def block_plan(q_len: int, kv_len: int, block_q: int, block_k: int, *, causal: bool = False, window=None,
               q_segments=None, kv_segments=None) -> BlockPlan:
    """The kernel's decisions for one (batch, head), from :mod:`flashlib.geometry`: a block outside the band is
    skipped, and with segment ids so is one whose segments cannot meet (:func:`flashlib.masks.segment_block_table`,
    the table the kernels get by scalar prefetch); a visited one is masked when it straddles the band's edge,
    holds padded keys, or segments are given (ids are data: every visited block builds the mask); else plain.
    The kv grid axis is :func:`geometry.live_steps` long when it compacts, else every key block; each step
    fetches :func:`geometry.fetched_block` (with segments, the table's fetch for it)."""
    num_q, num_kv = -(-q_len // block_q), -(-kv_len // block_k)
    blocks = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal, window=window)
    i, j = np.arange(num_q)[:, None], np.arange(num_kv)[None, :]
    visible = np.broadcast_to(geometry.block_is_visible(i, j, **blocks), (num_q, num_kv))
    table_fetch = None
    if q_segments is not None:  # the blocks whose segments can meet, and what a skipped step fetches instead
        q_ids = np.pad(np.asarray(q_segments), (0, num_q * block_q - q_len))[None]
        kv_ids = np.pad(np.asarray(kv_segments), (0, num_kv * block_k - kv_len))[None]
        live, table_fetch = (np.asarray(x)[0] for x in masks.segment_block_table(
            q_ids, kv_ids, outer_len=q_len, inner_len=kv_len, outer_block=block_q, inner_block=block_k,
            band_visible=visible, xp=np))
        visible = visible & live
    needs = np.broadcast_to(geometry.block_needs_mask(i, j, **blocks) | (q_segments is not None), (num_q, num_kv))
    kinds = np.where(visible, np.where(needs, 1, 2), 0)
    padded = np.zeros((num_q * block_q, num_kv * block_k), bool)
    padded[:q_len, :kv_len] = visibility(q_len, kv_len, causal=causal, window=window, q_segments=q_segments,
                                         kv_segments=kv_segments)
    seen = padded.reshape(num_q, block_q, num_kv, block_k).any(axis=(1, 3))
    live = dict(outer_block=block_q, inner_block=block_k, num_inner=num_kv, q_len=q_len, kv_len=kv_len,
                causal=causal, window=window)
    compacted = geometry.compacts(causal, window)
    steps = geometry.live_steps(num_q, **live)
    s = np.arange(steps)[None, :]
    visited, is_live = geometry.visited_block(i, s, **live)
    fetched = np.broadcast_to(geometry.fetched_block(i, s, **live), (num_q, steps))
    if table_fetch is not None:
        fetched = table_fetch[np.arange(num_q)[:, None], fetched]
    in_range = np.minimum(np.broadcast_to(visited, (num_q, steps)), num_kv - 1)
    computes = np.broadcast_to(is_live, (num_q, steps)) & visible[np.arange(num_q)[:, None], in_range]
    return BlockPlan(kinds=kinds, empty=visible & ~seen, fetched=np.array(fetched), computes=np.array(computes),
                     compacted=bool(compacted))


def _cells(ax: Axes, cols, rows, color: str, alpha: float, *, hatch: str = "", edge: str = "white",
           inset: float = 0.0, lw: float = 1.0) -> None:
    """Unit squares at ``(cols[n], rows[n])``, filled with ``color`` at ``alpha`` and outlined in ``edge`` (with
    ``hatch``), as two collections of vertex arrays: a few artists however many cells (a 24 x 24 grid of
    single patches took seconds to draw). ``color="none"``: the outline alone."""
    x, y = np.asarray(cols, float)[:, None] + inset, np.asarray(rows, float)[:, None] + inset
    side = 1 - 2 * inset
    squares = np.stack([x + np.array([0, side, side, 0]), y + np.array([0, 0, side, side])], axis=-1)  # [n, 4, 2]
    if not len(squares):
        return
    if color != "none":
        ax.add_collection(PolyCollection(squares, facecolor=to_rgba(color, alpha), edgecolor="none"))
    ax.add_collection(PolyCollection(squares, facecolor="none", edgecolor=edge, hatch=hatch or None, lw=lw))


def _cell_points(ax: Axes, rows: int, cols: int) -> float:
    """About the side, in points, of one cell of a ``rows x cols`` equal-aspect grid on ``ax``: from the axes' size
    before layout, less a fifth for the titles and labels the layout makes room for (enough to pick a font size
    and a line width)."""
    box = ax.get_position()
    width, height = box.width * ax.figure.get_figwidth(), box.height * ax.figure.get_figheight()
    return 0.8 * 72 * min(width / max(cols, 1), height / max(rows, 1))


def _grid_axes(ax: Axes, rows: int, cols: int, xlabel: str, ylabel: str) -> None:
    ax.set_xlim(-0.05, cols + 0.05)
    ax.set_ylim(rows + 0.05, -0.05)
    ax.set_aspect("equal")
    every = int(np.ceil(9 / _cell_points(ax, rows, cols)))  # a label per 9 points or more: two digits fit
    ax.set_xticks(np.arange(0, cols, every) + 0.5, labels=[str(n) for n in range(0, cols, every)])
    ax.set_yticks(np.arange(0, rows, every) + 0.5, labels=[str(n) for n in range(0, rows, every)])
    ax.tick_params(length=0, labelsize=7)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    for side in ax.spines.values():
        side.set_visible(False)


def plot_visibility(visible: np.ndarray, *, ax: Axes | None = None, title: str | None = None,
                    block_q: int | None = None, block_k: int | None = None) -> Figure:
    """The ``[q_len, kv_len]`` visibility matrix: gold where query ``i`` sees key ``j``, white elsewhere;
    with ``block_q``/``block_k``, the block grid on top."""
    q_len, kv_len = visible.shape
    fig, ax = figure_and_axes(ax, (1.0 + 0.18 * kv_len, 0.8 + 0.18 * q_len))
    ax.imshow(visible, cmap=ListedColormap(["white", PALETTE["S"]]), vmin=0, vmax=1, interpolation="nearest",
              extent=(-0.5, kv_len - 0.5, q_len - 0.5, -0.5))
    if block_q and block_k:
        for x in np.arange(0, kv_len + 1, block_k):
            ax.axvline(x - 0.5, color=PALETTE["ink"], lw=0.8)
        for y in np.arange(0, q_len + 1, block_q):
            ax.axhline(y - 0.5, color=PALETTE["ink"], lw=0.8)
    ax.set_xlabel("key j", fontsize=9)
    ax.set_ylabel("query i", fontsize=9)
    ax.tick_params(labelsize=7)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def plot_block_plan(plan: BlockPlan, *, ax: Axes | None = None, title: str | None = None) -> Figure:
    """One cell per ``(query block, key block)``: plain (gold), masked (hatched red), skipped (grey); a cross
    marks a computed block in which no element is visible (id ranges that overlap but share no id)."""
    rows, cols = plan.kinds.shape
    fig, ax = figure_and_axes(ax, (1.2 + 0.45 * cols, 1.0 + 0.45 * rows))
    style = {0: (PALETTE["skipped"], 0.35, "", "white"), 1: (PALETTE["S"], 0.45, "///", PALETTE["masked"]),
             2: (PALETTE["S"], 0.85, "", "white")}
    for kind in (0, 2, 1):  # masked last: its red outline on top of its neighbours' white ones
        color, alpha, hatch, edge = style[kind]
        rows_, cols_ = np.nonzero(plan.kinds == kind)
        _cells(ax, cols_, rows_, color, alpha, hatch=hatch, edge=edge)
    crosses = [seg for i, j in zip(*np.nonzero(plan.empty), strict=True)
               for seg in (((j + 0.2, i + 0.2), (j + 0.8, i + 0.8)), ((j + 0.2, i + 0.8), (j + 0.8, i + 0.2)))]
    if crosses:
        ax.add_collection(LineCollection(crosses, colors=PALETTE["ink"], lw=1))
    _grid_axes(ax, rows, cols, "key block j", "query block i")
    counts = plan.counts
    heading = f"{counts['plain']} plain, {counts['masked']} masked, {counts['skipped']} skipped"
    ax.set_title(f"{title}\n{heading}" if title else heading, fontsize=10)
    handles = [Patch(facecolor=PALETTE["S"], alpha=0.85, label="plain"),
               Patch(facecolor="white", edgecolor=PALETTE["masked"], hatch="///", label="masked"),
               Patch(facecolor=PALETTE["skipped"], alpha=0.35, label="skipped")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return fig


def plot_fetch_schedule(plan: BlockPlan, *, ax: Axes | None = None, title: str | None = None) -> Figure:
    """One cell per grid step (rows: query blocks, columns: kv grid steps), the number the key block its index
    map fetches (where a cell is big enough to read it); gold where the step computes, grey where it skips;
    outlined where the block index changes, i.e. where Pallas copies a k (and a v) block from HBM. The title
    counts the copies."""
    rows, cols = plan.fetched.shape
    fig, ax = figure_and_axes(ax, (1.2 + 0.45 * cols, 1.0 + 0.45 * rows))
    flat = plan.fetched.ravel()
    copied = np.r_[True, flat[1:] != flat[:-1]].reshape(rows, cols)  # the block index changed: Pallas copies
    for live, color, alpha in ((True, PALETTE["S"], 0.7), (False, PALETTE["skipped"], 0.35)):
        i, s = np.nonzero(plan.computes == live)
        _cells(ax, s, i, color, alpha)
    cell = _cell_points(ax, rows, cols)
    i, s = np.nonzero(copied)
    _cells(ax, s, i, "none", 0.0, edge=PALETTE["ink"], inset=0.06, lw=min(1.8, cell / 10))
    size = min(8.0, cell / 1.6)  # a two-digit number fits the cell
    if size >= 5:  # else the cells are too small to read: the outlines and the title's count tell the copies
        for (i, s), block in np.ndenumerate(plan.fetched):
            ax.text(s + 0.5, i + 0.5, str(int(block)), ha="center", va="center", fontsize=size,
                    fontweight="bold" if copied[i, s] else "normal",
                    color=PALETTE["ink"] if copied[i, s] else "grey")
    _grid_axes(ax, rows, cols, "kv grid step" + (" (compacted)" if plan.compacted else ""), "query block i")
    heading = f"{plan.copies} k/v block copies, {plan.fetched.size} grid steps"
    ax.set_title(f"{title}\n{heading}" if title else heading, fontsize=10)
    return fig


def plot_softcap(caps=(5.0, 15.0, 30.0), *, limit: float = 60.0, ax: Axes | None = None) -> Figure:
    """``c * tanh(s / c)`` against the raw score ``s`` for each cap ``c``: the identity near 0, flat at ``±c``."""
    fig, ax = figure_and_axes(ax, (5.0, 3.4))
    s = np.linspace(-limit, limit, 401)
    ax.plot(s, s, color="grey", ls="--", lw=1, label="no cap")
    for cap, color in zip(caps, ("#C44E52", "#4C72B0", "#55A868", "#8172B3"), strict=False):
        ax.plot(s, cap * np.tanh(s / cap), color=color, label=f"c = {cap:g}")
    ax.set_ylim(-limit, limit)
    ax.set_xlabel("score s")
    ax.set_ylabel("capped score")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title("soft-cap: c · tanh(s / c)", fontsize=10)
    return fig


def plot_head_groups(heads: int, kv_heads: int, *, ax: Axes | None = None, title: str | None = None) -> Figure:
    """Query heads (top) and the kv head each reads (bottom): head ``h`` reads ``h // (heads // kv_heads)``."""
    fig, ax = figure_and_axes(ax, (0.6 + 0.45 * heads, 1.8))
    group = heads // kv_heads
    kv_x = [(g * group + (group - 1) / 2) for g in range(kv_heads)]
    for h in range(heads):
        ax.plot([h, kv_x[h // group]], [1, 0], color=PALETTE["ink"], lw=0.8)
        ax.add_patch(Rectangle((h - 0.3, 0.95), 0.6, 0.3, color=PALETTE["Q"]))
    for g, x in enumerate(kv_x):
        ax.add_patch(Rectangle((x - 0.3, -0.25), 0.6, 0.3, color=PALETTE["K"]))
        ax.text(x, -0.45, f"kv {g}", ha="center", va="top", fontsize=7)
    ax.set_xlim(-0.6, heads - 0.4)
    ax.set_ylim(-0.8, 1.4)
    ax.set_axis_off()
    ax.set_title(title or f"{heads} query heads, {kv_heads} kv heads (group {group})", fontsize=9)
    return fig
