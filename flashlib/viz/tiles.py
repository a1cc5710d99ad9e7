"""Real attention maps and the tiling of flash attention: which blocks a grid step reads, skips or masks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt
from matplotlib.axes import Axes
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from flashlib.viz.figures import PALETTE, block_spans, draw_tile, figure_and_axes

# -- Real attention -------------------------------------------------------------------------------


def plot_attention_map(
    probs: npt.ArrayLike, tokens_q: Sequence[str], tokens_k: Sequence[str] | None = None, ax: Axes | None = None,
    title: str | None = None,
) -> Figure:
    """Heat map of attention probabilities ``probs [q_len, kv_len]``: row ``i`` is where query token ``i`` looks.

    Keys run along the top, queries down the side; each row sums to one. ``tokens_k`` defaults to
    ``tokens_q`` (self-attention).
    """
    probs = np.asarray(probs, dtype=np.float64)
    tokens_k = tokens_q if tokens_k is None else tokens_k
    if probs.shape != (len(tokens_q), len(tokens_k)):
        raise ValueError(f"probs has shape {probs.shape}, tokens give ({len(tokens_q)}, {len(tokens_k)})")
    side = float(np.clip(0.28 * max(probs.shape), 4.0, 10.0))
    fig, ax = figure_and_axes(ax, (side + 1.2, side))
    im = ax.imshow(probs, cmap="Blues", vmin=0.0, vmax=max(float(probs.max()), 1e-12), aspect="equal")
    size = float(np.clip(0.55 * 72 * side / max(probs.shape), 4, 10))  # about half a row's height, in points
    ax.set_xticks(range(len(tokens_k)), labels=list(tokens_k), rotation=90, fontsize=size)
    ax.set_yticks(range(len(tokens_q)), labels=list(tokens_q), fontsize=size)
    ax.xaxis.tick_top()
    ax.set_xlabel("key", color=PALETTE["K"])
    ax.set_ylabel("query", color=PALETTE["Q"])
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, label="attention probability")
    if title:
        ax.set_title(title)
    return fig


# -- Tiling: one grid step of flash attention -----------------------------------------------------

TileKind = Literal["compute", "masked", "skipped"]


class TileStep(NamedTuple):
    """One grid step: which query block meets which key/value block, and what the kernel does there."""

    q_block: int
    kv_block: int
    kind: TileKind


def tiling_steps(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool = False) -> list[TileStep]:
    """The grid a flash attention kernel walks: row-major over ``(q_block, kv_block)``, kv fastest.

    ``kind`` is ``"compute"`` when every query in the tile sees every key, ``"skipped"`` when none does
    (causal, block entirely above the diagonal: no work at all) and ``"masked"`` when the diagonal cuts
    through the tile (compute, then mask elementwise). The causal diagonal is bottom-right aligned: query
    ``i`` sees keys ``j <= i + kv_len - q_len``, as in :func:`flashlib.reference.causal_visible`.
    """
    offset = kv_len - q_len
    steps = []
    for i, (q_lo, q_hi) in enumerate(block_spans(q_len, block_q)):
        for j, (k_lo, k_hi) in enumerate(block_spans(kv_len, block_k)):
            kind: TileKind = "compute"
            if causal and k_lo > (q_hi - 1) + offset:  # even the last query of the tile sees no key of it
                kind = "skipped"
            elif causal and (k_hi - 1) > q_lo + offset:  # the first query misses some key of it
                kind = "masked"
            steps.append(TileStep(i, j, kind))
    return steps


def plot_tiling_step(
    q_len: int, kv_len: int, block_q: int, block_k: int, step: int, *, causal: bool = False,
    ax: Axes | None = None, legend: bool = True, title: str | None = None,
) -> Figure:
    """One grid step of tiled attention, drawn as the four operands laid out like the matrix products.

    ``Q`` (left) is split into ``block_q`` row tiles, ``K^T`` (top) and ``V^T`` (bottom) into ``block_k``
    column tiles, the score matrix ``S = Q K^T`` sits in the middle and the output ``O`` on the right.
    At grid step ``step`` (see :func:`tiling_steps`) the kernel holds one Q tile and one K/V tile in fast
    memory, computes one ``block_q x block_k`` tile of S (gold, outlined), and folds it into the output tile
    of its row, which is accumulating (hatched) until the last kv step writes it out (solid). Earlier tiles
    of S are pale; with ``causal=True`` skipped tiles are grey, diagonal tiles are hatched red and the
    staircase marks the exact mask boundary. Head dimension is drawn with a fixed width: it is not tiled.
    """
    steps = tiling_steps(q_len, kv_len, block_q, block_k, causal)
    if not 0 <= step < len(steps):
        raise ValueError(f"step must be in [0, {len(steps)}), got {step}")
    cur_i, cur_j, cur_kind = steps[step]
    q_spans, k_spans = block_spans(q_len, block_q), block_spans(kv_len, block_k)
    big = max(q_len, kv_len)
    d, gap = 0.22 * big, 0.09 * big  # drawn width of the head dimension, space between operands
    width, height = kv_len + 2 * (d + gap), q_len + 2 * (d + gap)
    fig, ax = figure_and_axes(ax, (min(9.0, 1.6 + 6.0 * width / height), min(9.0, 6.0 * height / width + 1.2)))
    done = {(i, j) for i, j, _ in steps[:step]}
    last_j = len(k_spans) - 1
    strong, faint = 0.85, 0.12

    for i, (lo, hi) in enumerate(q_spans):  # Q tiles (left) and O tiles (right)
        draw_tile(ax, -gap - d, lo, d, hi - lo, PALETTE["Q"], strong if i == cur_i else faint)
        written = i < cur_i or (i == cur_i and cur_j == last_j)
        if i == cur_i and not written:  # accumulating in fast memory
            draw_tile(ax, kv_len + gap, lo, d, hi - lo, PALETTE["O"], 0.35, hatch="//", edge=PALETTE["O"])
        else:
            draw_tile(ax, kv_len + gap, lo, d, hi - lo, PALETTE["O"], 0.6 if written else faint)
    for j, (lo, hi) in enumerate(k_spans):  # K^T tiles (top) and V^T tiles (bottom)
        kv_alpha = (strong if cur_kind != "skipped" else 0.4) if j == cur_j else faint
        draw_tile(ax, lo, -gap - d, hi - lo, d, PALETTE["K"], kv_alpha)
        draw_tile(ax, lo, q_len + gap, hi - lo, d, PALETTE["V"], kv_alpha)
    for i, j, kind in steps:  # the score matrix, tile by tile
        (q_lo, q_hi), (k_lo, k_hi) = q_spans[i], k_spans[j]
        if kind == "skipped":
            color, alpha = PALETTE["skipped"], 0.55
        else:
            color, alpha = PALETTE["S"], 0.9 if (i, j) == (cur_i, cur_j) else (0.35 if (i, j) in done else 0.06)
        draw_tile(ax, k_lo, q_lo, k_hi - k_lo, q_hi - q_lo, color, alpha,
              hatch="///" if kind == "masked" else "", edge=PALETTE["masked"] if kind == "masked" else "white")
    if causal:  # exact elementwise boundary: row r sees columns < r + offset + 1
        rows = np.repeat(np.arange(q_len + 1), 2)[1:-1]
        cols = np.clip(np.repeat(np.arange(q_len) + kv_len - q_len + 1, 2), 0, kv_len)
        ax.plot(cols, rows, color=PALETTE["masked"], lw=1.2)
    (q_lo, q_hi), (k_lo, k_hi) = q_spans[cur_i], k_spans[cur_j]
    ax.add_patch(Rectangle((k_lo, q_lo), k_hi - k_lo, q_hi - q_lo, fill=False, lw=2.5, edgecolor=PALETTE["ink"]))

    font = {"fontsize": 11, "fontweight": "bold", "ha": "center", "va": "center"}
    ax.text(-gap - d / 2, -gap / 2, "Q", color=PALETTE["Q"], **font)  # labels sit in the gaps
    ax.text(-gap / 2, -gap - d / 2, r"$K^\top$", color=PALETTE["K"], **font)
    ax.text(-gap / 2, q_len + gap + d / 2, r"$V^\top$", color=PALETTE["V"], **font)
    ax.text(kv_len + gap + d / 2, -gap / 2, "O", color=PALETTE["O"], **font)
    ax.text(kv_len / 2, q_len + gap / 2, r"$S = QK^\top$", color=PALETTE["ink"], **{**font, "fontsize": 9})
    ax.set_xlim(-gap - d - 0.02 * big, kv_len + gap + d + 0.02 * big)
    ax.set_ylim(q_len + gap + d + 0.02 * big, -gap - d - 0.02 * big)  # row 0 at the top, like a matrix
    ax.set_aspect("equal")
    ax.axis("off")
    action = {"compute": "compute", "masked": "compute + mask", "skipped": "skip (no work)"}[cur_kind]
    default_title = f"grid step {step}/{len(steps) - 1}: Q tile {cur_i} × K/V tile {cur_j}\n{action}"
    ax.set_title(title or default_title, fontsize=10)
    if legend:
        keys = [("Q", "Q tile loaded"), ("K", "K tile"), ("V", "V tile"), ("S", "S tile computed")]
        handles = [Patch(color=PALETTE[key], label=label) for key, label in keys] + [
            Patch(facecolor=to_rgba(PALETTE["O"], 0.35), edgecolor=PALETTE["O"], hatch="//", label="O accumulating"),
            Patch(color=to_rgba(PALETTE["O"], 0.6), label="O written")]
        if causal:
            handles += [Patch(facecolor="white", edgecolor=PALETTE["masked"], hatch="///", label="masked (diagonal)"),
                        Patch(color=PALETTE["skipped"], label="skipped")]
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, fontsize=7, frameon=False)
    return fig


def plot_kv_schedule(
    steps: Sequence[TileStep], fetched: Sequence[int], *, ax: Axes | None = None, title: str | None = None,
) -> Figure:
    """Which key/value block each grid step of a flash-attention kernel has in VMEM, and when it is copied.

    One cell per grid step (rows: query blocks, columns: the kv grid index), coloured by what the step does
    (``steps`` from :func:`tiling_steps`: compute, masked, skipped). The number in a cell is ``fetched[s]``,
    the kv block the step's index map names. Pallas copies a block from HBM only when that index differs
    from the previous step's (the grid runs row by row), so those cells are outlined: the count of outlined
    cells is the number of k (and v) block copies, shown in the title.
    """
    if len(fetched) != len(steps):
        raise ValueError(f"need one fetched block per step: {len(steps)} steps, {len(fetched)} fetched")
    rows = 1 + max(s.q_block for s in steps)
    cols = 1 + max(s.kv_block for s in steps)
    fig, ax = figure_and_axes(ax, (1.2 + 0.55 * cols, 1.0 + 0.55 * rows))
    colors = {"compute": (PALETTE["S"], 0.75), "masked": (PALETTE["S"], 0.45), "skipped": (PALETTE["skipped"], 0.35)}
    copies = 0
    for n, (step, block) in enumerate(zip(steps, fetched, strict=True)):
        color, alpha = colors[step.kind]
        draw_tile(ax, step.kv_block, step.q_block, 1, 1, color, alpha, hatch="///" if step.kind == "masked" else "",
              edge=PALETTE["masked"] if step.kind == "masked" else "white")
        copied = n == 0 or block != fetched[n - 1]
        copies += copied
        if copied:
            ax.add_patch(Rectangle((step.kv_block + 0.06, step.q_block + 0.06), 0.88, 0.88, fill=False, lw=2,
                                   edgecolor=PALETTE["ink"]))
        ax.text(step.kv_block + 0.5, step.q_block + 0.5, str(block), ha="center", va="center", fontsize=9,
                fontweight="bold" if copied else "normal", color=PALETTE["ink"] if copied else "grey")
    ax.set_xlim(-0.05, cols + 0.05)
    ax.set_ylim(rows + 0.05, -0.05)
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(cols) + 0.5, labels=[str(j) for j in range(cols)])
    ax.set_yticks(np.arange(rows) + 0.5, labels=[str(i) for i in range(rows)])
    ax.tick_params(length=0, labelsize=8)
    ax.set_xlabel("kv grid step j", fontsize=9)
    ax.set_ylabel("query block i", fontsize=9)
    for side in ax.spines.values():
        side.set_visible(False)
    heading = f"{copies} k/v block copies for {len(steps)} grid steps"
    ax.set_title(f"{title}\n{heading}" if title else heading, fontsize=10)
    return fig


def plot_q_schedule(
    steps: Sequence[TileStep], fetched: Sequence[int], *, ax: Axes | None = None, title: str | None = None,
) -> Figure:
    """:func:`plot_kv_schedule` for the backward dK/dV kernel, whose grid is transposed: key blocks outer.

    ``steps`` in that kernel's grid order — by key block, then query block fastest (e.g.
    ``sorted(tiling_steps(...), key=lambda s: (s.kv_block, s.q_block))``). One row per key block (one
    program, which owns that block's dK and dV), one column per query grid step; the number in a cell is
    ``fetched[s]``, the query block (and dO, lse, D block) its index map names, outlined where it changes:
    a copy from HBM. The title counts those copies.
    """
    if len(fetched) != len(steps):
        raise ValueError(f"need one fetched block per step: {len(steps)} steps, {len(fetched)} fetched")
    swapped = [TileStep(s.kv_block, s.q_block, s.kind) for s in steps]  # draw key blocks as rows
    fig = plot_kv_schedule(swapped, fetched, ax=ax)
    ax = fig.axes[0] if ax is None else ax
    copies = sum(n == 0 or block != fetched[n - 1] for n, block in enumerate(fetched))
    ax.set_xlabel("query grid step i", fontsize=9)
    ax.set_ylabel("key block j", fontsize=9)
    heading = f"{copies} q/dO block copies for {len(steps)} grid steps"
    ax.set_title(f"{title}\n{heading}" if title else heading, fontsize=10)
    return fig
