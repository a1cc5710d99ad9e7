"""Pictures of decoding (notebook 10): a block table mapping each sequence's pages to pages of the pool, the
paged decode kernel's grid walking those pages (one page a step, or ``pages_per_step`` of them), and split-KV's
partial softmax states merged into one.

Plain numbers in (a block table and lengths; each split's key range and its ``m`` and ``l``), a figure out;
nothing here imports :mod:`flashlib.decode`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from flashlib.viz.figures import PALETTE, SERIES_COLORS, draw_tile, figure_and_axes

__all__ = ["plot_block_table", "plot_paged_grid", "plot_pages_per_step", "plot_split_kv", "split_weights"]

SEQUENCE_COLORS = SERIES_COLORS[1:]  # one colour per sequence (blue, green, purple, ...)


def _hide_axes(ax: Axes) -> None:
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)


PAGE_WIDTH, PITCH = 4.0, 1.6  # a page's width and the rows' pitch, in data units
SKIPPED_INK = "#888888"  # text about skipped steps: the skipped grey, dark enough to read


def _draw_page(ax: Axes, x: float, y: float, page_size: int, filled: int, color: str,
               page_width: float = PAGE_WIDTH) -> None:
    """One page at ``(x, y)``: ``page_size`` token slots (one bar for big pages), the first ``filled`` in
    ``color``; dashed when it holds no token."""
    slots = page_size if page_size <= 16 else 1
    width = page_width / slots
    for slot in range(slots):
        share = min(max(filled - slot, 0), 1) if slots == page_size else filled / page_size
        draw_tile(ax, x + slot * width, y, width, 1.0, "white", 1.0, edge=PALETTE["ink"], lw=0.4)
        if share:
            draw_tile(ax, x + slot * width, y, width * share, 1.0, color, 0.8, edge=PALETTE["ink"], lw=0.4)
    ax.add_patch(Rectangle((x, y), page_width, 1.0, fill=False, edgecolor=PALETTE["ink"], lw=1.4,
                           ls="-" if filled else "--"))


def _block_table(block_table, lengths) -> np.ndarray:
    """``block_table`` as a ``[batch, pages_per_seq]`` array, with one length per row (else ValueError)."""
    table = np.asarray(block_table)
    if table.ndim != 2 or len(lengths) != table.shape[0]:
        raise ValueError(f"block_table must be [batch, pages_per_seq] with one length per row, got {table.shape} "
                         f"and {len(lengths)} lengths")
    return table


def plot_block_table(block_table: npt.ArrayLike, lengths: Sequence[int], page_size: int, num_pages: int, *,
                     ax: Axes | None = None, title: str | None = None) -> Figure:
    """Each sequence's pages in logical order (the left column, one slot per token, the filled slots in the
    sequence's colour) and the pool's ``num_pages`` pages (the right column), with an arrow from every live
    logical page ``j`` of sequence ``b`` to pool page ``block_table[b, j]``, labelled with that table entry.
    Pages past a sequence's length are dashed and marked not yet read; a pool page only such an entry names is
    marked as named but not yet read, and a pool page no entry names is marked free."""
    table = _block_table(block_table, lengths)
    batch, pages_per_seq = table.shape
    if any(not 0 <= n <= pages_per_seq * page_size for n in lengths):
        raise ValueError(f"lengths must be from 0 to {pages_per_seq * page_size}, got {list(lengths)}")
    rows = max(batch * pages_per_seq + batch - 1, num_pages)
    pool_x, top = PAGE_WIDTH + 10.0, (rows - 1) * PITCH
    width = pool_x + PAGE_WIDTH + 15.0  # from -9 to 6 past the pool (room for "named, not yet read")
    fig, ax = figure_and_axes(ax, (8.0, 8.0 * (top + 2.7) / width + 0.4))
    owner: dict[int, tuple[int, int]] = {}  # pool page -> (sequence, tokens it holds)
    named = {int(page) for page in table.ravel()}  # every pool page some entry names, read or not
    for b in range(batch):
        color, first = SEQUENCE_COLORS[b % len(SEQUENCE_COLORS)], b * (pages_per_seq + 1)
        live = -(-int(lengths[b]) // page_size)
        ax.text(-2.6, top - (first + (pages_per_seq - 1) / 2) * PITCH + 0.5, f"sequence {b}\n{int(lengths[b])} tokens",
                ha="right", va="center", fontsize=8, color=color)
        for j in range(pages_per_seq):
            y, page = top - (first + j) * PITCH, int(table[b, j])
            filled = min(max(int(lengths[b]) - j * page_size, 0), page_size)
            _draw_page(ax, 0.0, y, page_size, filled, color)
            ax.text(-0.3, y + 0.5, f"page {j}", ha="right", va="center", fontsize=7)
            if j >= live:
                # two lines, so the label ends left of where the arrows start (PAGE_WIDTH + 3.6)
                ax.text(PAGE_WIDTH + 0.3, y + 0.5, f"not yet read\n(table says {page})", ha="left", va="center",
                        fontsize=7, color=PALETTE["skipped"], linespacing=1.0)
                continue
            owner[page] = (b, filled)
            ax.text(PAGE_WIDTH + 0.3, y + 0.5, f"[{b},{j}] = {page}", ha="left", va="center", fontsize=7)
            ax.add_patch(FancyArrowPatch((PAGE_WIDTH + 3.6, y + 0.5), (pool_x - 0.1, top - page * PITCH + 0.5),
                                         arrowstyle="-|>", mutation_scale=9, color=color, lw=1.1, alpha=0.85))
    for page in range(num_pages):
        b, filled = owner.get(page, (-1, 0))
        y = top - page * PITCH
        _draw_page(ax, pool_x, y, page_size, filled, SEQUENCE_COLORS[b % len(SEQUENCE_COLORS)])
        note = "" if b >= 0 else "  named, not yet read" if page in named else "  free"
        ax.text(pool_x + PAGE_WIDTH + 0.3, y + 0.5, f"{page}{note}", ha="left",
                va="center", fontsize=7, color=PALETTE["ink"] if b >= 0 else PALETTE["skipped"])
    ax.text(PAGE_WIDTH / 2, top + 1.3, "logical pages", ha="center", fontsize=8)
    ax.text(PAGE_WIDTH + 1.8, top + 1.3, "block_table", ha="center", fontsize=8)
    ax.text(pool_x + PAGE_WIDTH / 2, top + 1.3, f"pool ({num_pages} pages)", ha="center", fontsize=8)
    ax.set_xlim(-9.0, width - 9.0)
    ax.set_ylim(-0.5, top + 2.2)
    _hide_axes(ax)
    ax.set_title(title or f"the block table: each sequence's live pages ({page_size} slots each) in the pool",
                 fontsize=9)
    return fig


def plot_paged_grid(block_table: npt.ArrayLike, lengths: Sequence[int], page_size: int, *, ax: Axes | None = None,
                    title: str | None = None) -> Figure:
    """The paged decode kernel's grid ``(batch, pages_per_seq)``: one row per sequence, one column per step ``j``.
    A step up to the sequence's last live page copies pool page ``block_table[b, j]`` (its tokens in the
    sequence's colour, the slots at and past the length hatched: masked) and computes it; past it the index map
    names the last live page again, so Pallas issues no copy, and ``pl.when`` skips the compute (grey)."""
    table = _block_table(block_table, lengths)
    batch, steps = table.shape
    if any(not 1 <= n <= steps * page_size for n in lengths):
        raise ValueError(f"lengths must be from 1 to {steps * page_size}, got {list(lengths)}")
    col, pitch = PAGE_WIDTH + 2.2, 3.4  # a step's width and a sequence's height, in data units
    top = (batch - 1) * pitch
    fig, ax = figure_and_axes(ax, (1.6 + 1.55 * steps, 1.0 + 1.0 * batch))
    for b in range(batch):
        n, color, y = int(lengths[b]), SEQUENCE_COLORS[b % len(SEQUENCE_COLORS)], top - b * pitch
        last = -(-n // page_size) - 1
        ax.text(-0.5, y + 0.5, f"sequence {b}\n{n} tokens", ha="right", va="center", fontsize=8, color=color)
        for j in range(steps):
            x, page = j * col, int(table[b, min(j, last)])
            if j > last:  # the same block index as the step before: no copy, and pl.when skips the body
                ax.add_patch(Rectangle((x, y), PAGE_WIDTH, 1.0, facecolor=PALETTE["skipped"], alpha=0.35,
                                       edgecolor=PALETTE["skipped"], lw=1.2, ls="--"))
                ax.text(x + PAGE_WIDTH / 2, y + 1.25, f"page {page} again:\nno copy", ha="center", va="bottom",
                        fontsize=7, color=SKIPPED_INK)
                ax.text(x + PAGE_WIDTH / 2, y - 0.2, "compute skipped", ha="center", va="top", fontsize=7,
                        color=SKIPPED_INK)
                continue
            filled = min(n - j * page_size, page_size)
            _draw_page(ax, x, y, page_size, filled, color)
            if filled < page_size:  # the tail of the last page: stale slots, masked
                tail_x = x + PAGE_WIDTH * filled / page_size
                ax.add_patch(Rectangle((tail_x, y), x + PAGE_WIDTH - tail_x, 1.0, facecolor="none", hatch="///",
                                       edgecolor=PALETTE["masked"], lw=0.0))
            ax.text(x + PAGE_WIDTH / 2, y + 1.25, f"copy page {page}", ha="center", va="bottom", fontsize=7,
                    color=PALETTE["ink"], fontweight="bold")
            first, end = j * page_size, j * page_size + filled - 1
            keys = f"keys {first}–{end}" if end > first else f"key {first}"
            masked = f"\n{page_size - filled} slot{'s' * (page_size - filled > 1)} masked" if filled < page_size else ""
            ax.text(x + PAGE_WIDTH / 2, y - 0.2, keys + masked, ha="center", va="top", fontsize=7,
                    color=PALETTE["masked"] if masked else PALETTE["ink"])
    for j in range(steps):
        phase = " (init)" if j == 0 else " (finalize)" if j == steps - 1 else ""
        ax.text(j * col + PAGE_WIDTH / 2, top + 2.5, f"step j = {j}{phase}", ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-4.2, steps * col - 1.4)
    ax.set_ylim(-1.6, top + 3.3)
    _hide_axes(ax)
    ax.set_title(title or "the grid (batch, pages_per_seq): each live page copied and computed once, nothing after "
                 "the last", fontsize=9)
    return fig


def _slot_page(page: int, last: int, slots: int) -> int:
    """The page index copy ``page % slots`` of a step names for the sequence's page ``page``: ``page`` while it is
    live (``<= last``), else that copy's own last live page (the kernel's ``_slot_block``), the index it named
    the step before, so Pallas issues no copy."""
    slot = page % slots
    if page <= last:
        return page
    return last - (last - slot) % slots if last >= slot else last


def plot_pages_per_step(table_row: Sequence[int], length: int, page_size: int, options: Sequence[int] = (1, 4), *,
                        ax: Axes | None = None, title: str | None = None) -> Figure:
    """One sequence's pages (its block-table row, in logical order) as the paged decode kernel's grid steps group
    them, one row per ``pages_per_step`` in ``options``: each step a box, its fixed cost a gold bar, then its
    ``pages_per_step`` page copies in flight (each labelled with the pool page it copies). A page past the
    length is not copied: its copy names the same pool page as the step before (that copy's own last live page,
    labelled "= page") and the kernel skips its compute (grey, dashed)."""
    row = [int(page) for page in table_row]
    if not 1 <= length <= len(row) * page_size:
        raise ValueError(f"length must be from 1 to {len(row) * page_size}, got {length}")
    if not options or any(not 1 <= n <= len(row) for n in options):
        raise ValueError(f"each pages_per_step must be from 1 to {len(row)}, got {list(options)}")
    last = -(-length // page_size) - 1  # the last live page
    page_w, gap, cost_w, step_gap, pitch = 1.3, 0.12, 0.4, 0.55, 3.4  # data units
    color = SEQUENCE_COLORS[0]
    widths = []
    for n in options:
        steps = -(-len(row) // n)
        widths.append(steps * (cost_w + gap + n * page_w + (n - 1) * gap + step_gap) - step_gap)
    width = max(widths)
    top = (len(options) - 1) * pitch
    fig, ax = figure_and_axes(ax, (max(0.38 * width + 0.8, 9.0), 1.15 + 1.2 * len(options)))  # room for the text
    for r, n in enumerate(options):
        y, steps = top - r * pitch, -(-len(row) // n)
        copies = last + 1
        flight = "one copy a step" if n == 1 else f"up to {n} copies in flight a step"
        ax.text(-0.1, y + 2.05, f"pages_per_step = {n}: {steps} grid steps, each with its fixed cost; {copies} page "
                f"copies, {flight}", ha="left", va="bottom", fontsize=8, fontweight="bold", color=PALETTE["ink"])
        x = 0.0
        for j in range(steps):
            pages = range(j * n, min((j + 1) * n, len(row)))
            box_w = cost_w + gap + len(pages) * page_w + (len(pages) - 1) * gap
            ax.add_patch(Rectangle((x - 0.08, y - 0.3), box_w + 0.16, 1.95, facecolor="none",
                                   edgecolor=PALETTE["ink"], lw=0.7))
            ax.add_patch(Rectangle((x, y), cost_w, 1.0, facecolor=PALETTE["S"], edgecolor=PALETTE["ink"], lw=0.5))
            ax.text(x + box_w / 2, y - 0.4, f"step {j}", ha="center", va="top", fontsize=7)
            px = x + cost_w + gap
            for p in pages:
                filled = min(max(length - p * page_size, 0), page_size)
                if filled:
                    _draw_page(ax, px, y, page_size, filled, color, page_w)
                    if filled < page_size:  # the tail of the last page: stale slots, masked
                        tail = px + page_w * filled / page_size
                        ax.add_patch(Rectangle((tail, y), px + page_w - tail, 1.0, facecolor="none", hatch="///",
                                               edgecolor=PALETTE["masked"], lw=0.0))
                    ax.text(px + page_w / 2, y + 1.12, f"{row[p]}", ha="center", va="bottom", fontsize=7)
                else:  # past the length: the same index as this copy's previous step, so no copy
                    ax.add_patch(Rectangle((px, y), page_w, 1.0, facecolor=PALETTE["skipped"], alpha=0.35,
                                           edgecolor=PALETTE["skipped"], lw=1.2, ls="--"))
                    ax.text(px + page_w / 2, y + 1.12, f"= {row[_slot_page(p, last, n)]}", ha="center", va="bottom",
                            fontsize=7, color=SKIPPED_INK)
                px += page_w + gap
            x += box_w + step_gap
    handles = [Rectangle((0, 0), 1, 1, facecolor=PALETTE["S"], edgecolor=PALETTE["ink"], lw=0.5),
               Rectangle((0, 0), 1, 1, facecolor=color, alpha=0.8, edgecolor=PALETTE["ink"], lw=0.5),
               Rectangle((0, 0), 1, 1, facecolor="none", hatch="///", edgecolor=PALETTE["masked"], lw=0.0),
               Rectangle((0, 0), 1, 1, facecolor=PALETTE["skipped"], alpha=0.35, edgecolor=PALETTE["skipped"],
                         ls="--")]
    labels = ["a grid step's fixed cost", "a page copied (above it: its pool page)",
              f"slots past the length {length}: masked", "past the length: same pool page (=) as the step before, "
              "no copy, no compute"]
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=7, frameon=False)
    ax.set_xlim(-0.3, width + 0.3)
    ax.set_ylim(-0.9, top + 2.6)
    _hide_axes(ax)
    ax.set_title(title or f"pages_per_step: one sequence of {length} tokens in {len(row)} pages of {page_size}, "
                 "grouped into grid steps", fontsize=9)
    return fig


def split_weights(m: Sequence[float], l: Sequence[float]) -> tuple[float, float, np.ndarray]:
    """The merge of splits with maxima ``m`` and sums ``l`` (one query row): ``(m, l, weights)``, where
    ``m = max m_i``, ``l = sum l_i e^(m_i - m)`` and ``weights[i] = l_i e^(m_i - m) / l`` is split ``i``'s share of
    the softmax (0 for a split that saw no key, ``m_i = -inf``; all 0 when no split saw one)."""
    m_i, l_i = np.asarray(m, np.float64), np.asarray(l, np.float64)
    top = float(m_i.max()) if m_i.size else -np.inf
    if not np.isfinite(top):
        return top, 0.0, np.zeros_like(l_i)
    scaled = l_i * np.exp(m_i - top)  # -inf - top = -inf: an empty split weighs 0
    total = float(scaled.sum())
    return top, total, scaled / total


def _number(x: float) -> str:
    return "−∞" if np.isneginf(x) else f"{x:.3g}"


def plot_split_kv(bounds: Sequence[tuple[int, int]], m: Sequence[float], l: Sequence[float],
                  length: int, *, ax: Axes | None = None, title: str | None = None) -> Figure:
    """Split-KV for one query row: the cache's keys cut into ``bounds`` (keys at and past ``length`` greyed),
    each split's partial state ``(m_i, l_i, acc_i)`` below it, and arrows into the merged state, each as wide as
    (proportional to) and labelled with the split's share of the softmax (:func:`split_weights`); the merge's
    formula is not written out (it is notebook 10's puzzle 1)."""
    if not (len(bounds) == len(m) == len(l)) or not bounds:
        raise ValueError(f"one (m, l) per split: got {len(bounds)} bounds, {len(m)} m and {len(l)} l")
    top, total, weights = split_weights(m, l)
    max_len = bounds[-1][1]
    width = 10.0  # the cache bar's width in data units, whatever its keys
    unit = width / max_len
    fig, ax = figure_and_axes(ax, (8.0, 4.6))
    centers = []
    for i, ((lo, hi), m_i, l_i) in enumerate(zip(bounds, m, l, strict=True)):
        live_hi = min(max(length, lo), hi)
        draw_tile(ax, lo * unit, 4.0, (live_hi - lo) * unit, 0.6, PALETTE["K"], 0.35 + 0.4 * (i % 2),
                  edge=PALETTE["ink"])
        if hi > live_hi:
            ax.add_patch(Rectangle((live_hi * unit, 4.0), (hi - live_hi) * unit, 0.6, facecolor=PALETTE["skipped"],
                                   hatch="//", edgecolor="white", alpha=0.6))
        ax.add_patch(Rectangle((lo * unit, 4.0), (hi - lo) * unit, 0.6, fill=False, edgecolor=PALETTE["ink"], lw=1.2))
        ax.text((lo + hi) / 2 * unit, 4.75, f"split {i}\nkeys {lo}–{hi - 1}", ha="center", va="bottom", fontsize=7)
        cx = (lo + hi) / 2 * unit
        centers.append(cx)
        empty = np.isneginf(m_i)
        ax.text(cx, 2.75, f"m_{i} = {_number(m_i)}\nl_{i} = {l_i:.3g}\nacc_{i}" + (" (no key)" if empty else ""),
                ha="center", va="center", fontsize=7,
                bbox={"boxstyle": "round", "facecolor": PALETTE["skipped"] if empty else "white",
                      "edgecolor": PALETTE["K"]})
        ax.add_patch(FancyArrowPatch((cx, 3.95), (cx, 3.25), arrowstyle="-|>", mutation_scale=8,
                                     color=PALETTE["ink"], lw=0.8))
        ax.add_patch(FancyArrowPatch((cx, 2.25), (width / 2, 0.95), arrowstyle="-|>", mutation_scale=8,
                                     color=PALETTE["O"], lw=10.0 * float(weights[i]), alpha=0.8))  # width ∝ share
        ax.text(cx + 0.3 * (width / 2 - cx), 1.86, f"{100 * weights[i]:.0f}%", ha="center", va="center",
                fontsize=7, color=PALETTE["O"], bbox={"boxstyle": "round,pad=0.15", "facecolor": "white",
                                                       "edgecolor": "none"})
    ax.plot([length * unit] * 2, [3.9, 4.7], color=PALETTE["masked"], lw=1.5)
    ax.text(length * unit + 0.08, 3.85, f"length {length}", ha="left", va="top", fontsize=7, color=PALETTE["masked"])
    ax.text(width / 2, 0.45, f"merged state: m = {_number(top)}, l = {total:.4g}\n→ one output row",
            ha="center", va="center", fontsize=8,
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": PALETTE["O"], "lw": 1.5})
    ax.set_xlim(-0.3, width + 0.9)
    ax.set_ylim(-0.2, 5.6)
    _hide_axes(ax)
    ax.set_title(title or "split-KV: each split's partial state; each arrow's width (and %) is that split's share "
                 "of the softmax", fontsize=9)
    return fig
