"""The pictures of the series: plain matplotlib functions, headless and deterministic.

Every ``plot_*`` function takes data plus an optional ``ax`` and returns the :class:`~matplotlib.figure.Figure`
it drew on; none calls ``plt.show()``. Without ``ax`` the figure comes from :func:`new_figure`: made through
pyplot (so Jupyter's inline backend is set up to draw it) and closed at once, so nothing piles up in pyplot's
registry and a notebook shows a returned figure exactly once. The data helpers (:func:`tiling_steps`,
:func:`online_softmax_trace`) are pure Python/NumPy so the notebooks can check the pictures against the definitions.

One palette for the whole series (:data:`PALETTE`): Q blue, K orange, V green, O purple, scores gold,
masked red hatching, skipped grey.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import cycle
from typing import Literal, NamedTuple, TypedDict

import numpy as np
import numpy.typing as npt
from matplotlib.animation import FuncAnimation
from matplotlib.axes import Axes
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

__all__ = [
    "PALETTE", "SERIES_COLORS", "OnlineStep", "TileStep", "animate", "filmstrip", "format_bytes", "new_figure",
    "online_softmax_trace", "plot_attention_map", "plot_hbm_traffic", "plot_kv_schedule", "plot_matmul_step",
    "plot_memory_scaling", "plot_online_softmax_step", "plot_q_schedule", "plot_tiling_step", "plot_tpu_anatomy",
    "plot_vmem_budget", "tiling_steps", "to_jshtml",
]

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


def _figure_and_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
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


def _byte_axis(axis) -> None:
    """Log axis of bytes with ticks at powers of two (1 KiB, 4 KiB, ... ) instead of powers of ten."""
    axis.set_major_locator(LogLocator(base=2.0, numticks=8))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(format_bytes))


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
    fig, ax = _figure_and_axes(ax, (side + 1.2, side))
    im = ax.imshow(probs, cmap="Blues", vmin=0.0, vmax=max(float(probs.max()), 1e-12), aspect="equal")
    size = float(np.clip(260 / max(probs.shape), 4, 10))
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


def _spans(length: int, block: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each block along an axis; the last block may be short."""
    if length <= 0 or block <= 0:
        raise ValueError(f"length and block must be positive, got {length} and {block}")
    return [(lo, min(lo + block, length)) for lo in range(0, length, block)]


def tiling_steps(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool = False) -> list[TileStep]:
    """The grid a flash attention kernel walks: row-major over ``(q_block, kv_block)``, kv fastest.

    ``kind`` is ``"compute"`` when every query in the tile sees every key, ``"skipped"`` when none does
    (causal, block entirely above the diagonal: no work at all) and ``"masked"`` when the diagonal cuts
    through the tile (compute, then mask elementwise). The causal diagonal is bottom-right aligned: query
    ``i`` sees keys ``j <= i + kv_len - q_len``, as in :func:`flashlib.reference.causal_visible`.
    """
    offset = kv_len - q_len
    steps = []
    for i, (q_lo, q_hi) in enumerate(_spans(q_len, block_q)):
        for j, (k_lo, k_hi) in enumerate(_spans(kv_len, block_k)):
            kind: TileKind = "compute"
            if causal and k_lo > (q_hi - 1) + offset:  # even the last query of the tile sees no key of it
                kind = "skipped"
            elif causal and (k_hi - 1) > q_lo + offset:  # the first query misses some key of it
                kind = "masked"
            steps.append(TileStep(i, j, kind))
    return steps


def _tile(ax: Axes, x: float, y: float, w: float, h: float, color: str, alpha: float, **kw) -> None:
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, alpha=alpha, edgecolor="none"))
    ax.add_patch(Rectangle((x, y), w, h, facecolor="none", edgecolor=kw.pop("edge", "white"), **kw))


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
    q_spans, k_spans = _spans(q_len, block_q), _spans(kv_len, block_k)
    big = max(q_len, kv_len)
    d, gap = 0.22 * big, 0.09 * big  # drawn width of the head dimension, space between operands
    width, height = kv_len + 2 * (d + gap), q_len + 2 * (d + gap)
    fig, ax = _figure_and_axes(ax, (min(9.0, 1.6 + 6.0 * width / height), min(9.0, 6.0 * height / width + 1.2)))
    done = {(i, j) for i, j, _ in steps[:step]}
    last_j = len(k_spans) - 1
    strong, faint = 0.85, 0.12

    for i, (lo, hi) in enumerate(q_spans):  # Q tiles (left) and O tiles (right)
        _tile(ax, -gap - d, lo, d, hi - lo, PALETTE["Q"], strong if i == cur_i else faint)
        written = i < cur_i or (i == cur_i and cur_j == last_j)
        if i == cur_i and not written:  # accumulating in fast memory
            _tile(ax, kv_len + gap, lo, d, hi - lo, PALETTE["O"], 0.35, hatch="//", edge=PALETTE["O"])
        else:
            _tile(ax, kv_len + gap, lo, d, hi - lo, PALETTE["O"], 0.6 if written else faint)
    for j, (lo, hi) in enumerate(k_spans):  # K^T tiles (top) and V^T tiles (bottom)
        kv_alpha = (strong if cur_kind != "skipped" else 0.4) if j == cur_j else faint
        _tile(ax, lo, -gap - d, hi - lo, d, PALETTE["K"], kv_alpha)
        _tile(ax, lo, q_len + gap, hi - lo, d, PALETTE["V"], kv_alpha)
    for i, j, kind in steps:  # the score matrix, tile by tile
        (q_lo, q_hi), (k_lo, k_hi) = q_spans[i], k_spans[j]
        if kind == "skipped":
            color, alpha = PALETTE["skipped"], 0.55
        else:
            color, alpha = PALETTE["S"], 0.9 if (i, j) == (cur_i, cur_j) else (0.35 if (i, j) in done else 0.06)
        _tile(ax, k_lo, q_lo, k_hi - k_lo, q_hi - q_lo, color, alpha,
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
    fig, ax = _figure_and_axes(ax, (1.2 + 0.55 * cols, 1.0 + 0.55 * rows))
    colors = {"compute": (PALETTE["S"], 0.75), "masked": (PALETTE["S"], 0.45), "skipped": (PALETTE["skipped"], 0.35)}
    copies = 0
    for n, (step, block) in enumerate(zip(steps, fetched, strict=True)):
        color, alpha = colors[step.kind]
        _tile(ax, step.kv_block, step.q_block, 1, 1, color, alpha, hatch="///" if step.kind == "masked" else "",
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

# -- Online softmax, one block at a time ----------------------------------------------------------


class OnlineStep(TypedDict):
    """The running state after folding in block ``step`` (keys ``lo:hi``) — see :func:`online_softmax_trace`."""

    step: int
    lo: int
    hi: int
    m_old: np.ndarray
    m: np.ndarray
    alpha: np.ndarray
    l: np.ndarray
    acc: np.ndarray


def online_softmax_trace(scores: npt.ArrayLike, values: npt.ArrayLike, block: int) -> list[OnlineStep]:
    """Online softmax over ``scores [..., n]`` with ``values [n]`` or ``[n, d]``, one ``block`` of keys at a time.

    Straight from the definitions, in float64 NumPy, one dict per block with the state *after* it:
    ``m = max(m_old, max(s_blk))``, ``alpha = exp(m_old - m)`` (what the old ``l`` and ``acc`` are rescaled
    by; 0 on the first block, where ``m_old = -inf``), ``l = alpha l_old + sum exp(s_blk - m)`` and
    ``acc = alpha acc_old + exp(s_blk - m) @ v_blk``. The last entry gives the softmax: ``acc / l``.
    Scores of ``-inf`` are masked keys; a row that has seen none keeps ``m = -inf, l = 0``.
    """
    s = np.asarray(scores, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if v.shape[:1] != s.shape[-1:]:
        raise ValueError(f"values {v.shape} must have one row per key ({s.shape[-1]})")
    m = np.full(s.shape[:-1], -np.inf)
    l = np.zeros(s.shape[:-1])  # noqa: E741
    acc = np.zeros(s.shape[:-1] + v.shape[1:])
    trace: list[OnlineStep] = []
    for step, (lo, hi) in enumerate(_spans(s.shape[-1], block)):
        s_blk = s[..., lo:hi]
        m_new = np.maximum(m, s_blk.max(axis=-1))
        m_safe = np.where(np.isfinite(m_new), m_new, 0.0)
        alpha = np.exp(m - m_safe)
        p = np.exp(s_blk - m_safe[..., None])
        l = alpha * l + p.sum(axis=-1)  # noqa: E741
        alpha_acc = alpha.reshape(alpha.shape + (1,) * (v.ndim - 1))
        acc = alpha_acc * acc + np.tensordot(p, v[lo:hi], axes=(-1, 0))
        trace.append(OnlineStep(step=step, lo=lo, hi=hi, m_old=m, m=m_new, alpha=alpha, l=l, acc=acc))
        m = m_new
    return trace


def plot_online_softmax_step(
    scores_row: npt.ArrayLike, block: int, step: int, ax: Axes | None = None, *,
    values: npt.ArrayLike | None = None, legend: bool = True,
    title: str | None = None,
) -> Figure:
    """One row of scores streamed in blocks: the running state after folding in block ``step`` (0-based).

    Bars are the scores: blocks already seen are pale, the block just folded in is strong, the rest grey.
    Lines mark the running max ``m`` (solid), the max before this block ``m_old`` (dotted) and the true row
    max (dashed). The box (``legend=True``) compares ``m`` and ``l`` with their final values, gives the rescale
    factor ``alpha = exp(m_old - m)`` applied to the old ``l`` and ``acc``, and the share of the final softmax
    mass seen so far, ``l exp(m - m_final) / l_final``; with ``values`` also ``acc / l`` (its first entry),
    the output over the keys seen so far. With ``legend=False`` (small panels) the key numbers go in the title.
    """
    s = np.asarray(scores_row, dtype=np.float64)
    if s.ndim != 1:
        raise ValueError(f"scores_row must be 1-D, got shape {s.shape}")
    trace = online_softmax_trace(s, np.ones_like(s) if values is None else values, block)
    if not 0 <= step < len(trace):
        raise ValueError(f"step must be in [0, {len(trace)}), got {step}")
    cur, final = trace[step], trace[-1]
    m, m_old, alpha, l, m_fin, l_fin = (float(x) for x in (cur["m"], cur["m_old"], cur["alpha"], cur["l"],
                                                           final["m"], final["l"]))
    fig, ax = _figure_and_axes(ax, (8.0, 4.0))
    idx = np.arange(s.size)
    ax.bar(idx, s, width=0.85, color=[to_rgba(PALETTE["K"], 0.4) if k < cur["lo"] else to_rgba(PALETTE["K"])
                                      if k < cur["hi"] else to_rgba(PALETTE["skipped"], 0.5) for k in idx])
    ax.axhline(0.0, color=PALETTE["ink"], lw=0.6)
    for lo, _ in _spans(s.size, block)[1:]:
        ax.axvline(lo - 0.5, color=PALETTE["ink"], lw=0.6, ls=":", alpha=0.6)
    ax.axvspan(cur["lo"] - 0.5, cur["hi"] - 0.5, color=PALETTE["K"], alpha=0.08)
    ax.axhline(m_fin, color=PALETTE["ink"], ls="--", lw=1, label=f"final max {m_fin:.2f}")
    ax.axhline(m, color=PALETTE["masked"], lw=1.8, label=f"running m = {m:.2f}")
    if np.isfinite(m_old):
        ax.axhline(m_old, color=PALETTE["masked"], lw=1.2, ls=":", label=f"m_old = {m_old:.2f}")
    low, high = min(0.0, float(s.min())), max(0.0, float(s.max()))
    ax.set_ylim(low - 0.05 * (high - low), high + (0.8 if legend else 0.1) * max(high - low, 1e-9))
    heading = title or f"after block {step}/{len(trace) - 1} (keys {cur['lo']}–{cur['hi'] - 1})"
    if legend:
        lines = [f"m_old = {m_old:.3g} → m = {m:.3g}   (final {m_fin:.3g})",
                 f"α = exp(m_old − m) = {alpha:.3g}" + ("  (first block)" if step == 0 else ""),
                 f"l = {l:.4g}   (final {l_fin:.4g})",
                 f"softmax mass seen: {100 * l * np.exp(m - m_fin) / l_fin:.0f}%"]
        if values is not None:
            out, out_fin = (float(np.ravel(t["acc"])[0] / t["l"]) for t in (cur, final))
            lines.append(f"acc / l = {out:.4g}   (final {out_fin:.4g})")
        ax.text(0.01, 0.98, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=8, family="monospace",
                bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": PALETTE["skipped"]})
        ax.legend(loc="upper right", fontsize=8, frameon=False)
    elif title is None:
        heading += f"\nm = {m:.3g}, α = {alpha:.3g}, l = {l:.3g}"
    ax.set_xlabel("key index")
    ax.set_ylabel("score")
    ax.set_title(heading, fontsize=10)
    return fig


# -- Measurements ---------------------------------------------------------------------------------


def _finish(ax: Axes, xlabel: str, ylabel: str, title: str | None) -> Figure:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(frameon=False)
    if title:
        ax.set_title(title)
    return ax.figure  # type: ignore[return-value]


def plot_memory_scaling(
    lengths: Sequence[int], series: Mapping[str, Sequence[float]], ax: Axes | None = None,
    ylabel: str = "peak memory", title: str | None = None,
) -> Figure:
    """Log-log memory (bytes) against sequence length, one line per method, with ``∝ N`` and ``∝ N²`` guides.

    On log-log axes a power law is a straight line whose slope is its exponent, so a method whose line
    runs parallel to the ``N²`` guide materialises the score matrix and one parallel to ``N`` does not.
    ``lengths`` ascending; use NaN for a missing point (say, an out-of-memory run) and the line just stops.
    """
    x = np.asarray(lengths, dtype=np.float64)
    fig, ax = _figure_and_axes(ax, (6.5, 4.5))
    for (name, ys), color in zip(series.items(), cycle(SERIES_COLORS)):
        ax.loglog(x, np.asarray(ys, dtype=np.float64), "o-", color=color, label=name, lw=2)
    firsts = [float(ys[0]) for ys in series.values() if len(ys) and np.isfinite(ys[0])]
    anchor = min(firsts) if firsts else 1.0
    for power, label in ((1, "∝ N"), (2, "∝ N²")):
        guide = anchor * (x / x[0]) ** power
        ax.loglog(x, guide, ls="--", color=PALETTE["skipped"], lw=1, zorder=0)
        ax.annotate(label, (x[-1], guide[-1]), textcoords="offset points", xytext=(-2, 4), ha="right", fontsize=9,
                    color="grey")
    _byte_axis(ax.yaxis)
    ax.set_xticks(x, labels=[str(int(n)) for n in x])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(True, which="major", alpha=0.3)
    return _finish(ax, "sequence length N", ylabel, title)


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
    fig, ax = _figure_and_axes(ax, (1.6 + 1.2 * len(lengths) * max(1, len(names)) / 2, 4.2))
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
        _byte_axis(ax.yaxis)
    else:
        ax.yaxis.set_major_formatter(FuncFormatter(format_bytes))
    ax.set_xticks(x, labels=[str(n) for n in lengths])
    return _finish(ax, "sequence length", ylabel, title)


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
    fig, ax = _figure_and_axes(ax, (8.0, 1.3 + 0.45 * max(len(names), 1)))
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
        ax.axvline(limit / mib, color=PALETTE["ink"], ls=style, lw=1.2)
        ax.text(limit / mib, len(names) - 0.45, f" {name}: {limit / mib:g} MiB", fontsize=8, va="bottom",
                color=PALETTE["ink"])
    ax.set_yticks(y, labels=names)
    ax.set_ylim(-0.6, len(names) - 0.1)
    ax.set_xlim(0, max(float(left.max(initial=0.0)), max(limits.values(), default=0) / mib) * 1.22)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), borderaxespad=4.6, ncol=max(len(parts), 1), fontsize=8,
              frameon=False)  # under the x label
    ax.set_xlabel("VMEM (MiB)")
    if title:
        ax.set_title(title, fontsize=10)
    return fig


# -- The TPU as a kernel sees it, and a kernel's grid ---------------------------------------------


def _box(ax: Axes, x: float, y: float, w: float, h: float, title: str, body: str, color: str,
         alpha: float = 0.18) -> None:
    """A rounded, tinted box with a bold title on top and smaller text under it."""
    style = "round,pad=0.02,rounding_size=0.12"
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=color, alpha=alpha, edgecolor="none"))
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor="none", edgecolor=color, lw=1.5))
    lines = title.count("\n") + 1
    ax.text(x + w / 2, y + h - 0.12, title, ha="center", va="top", fontsize=10.5, fontweight="bold",
            color=PALETTE["ink"])
    ax.text(x + w / 2, y + h - 0.2 - 0.32 * lines, body, ha="center", va="top", fontsize=8.5,
            color=PALETTE["ink"], linespacing=1.35)


def _arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], label: str = "") -> None:
    """A double-headed arrow (data moves both ways) with an optional label above its middle."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="<|-|>", mutation_scale=12, lw=1.4, color=PALETTE["ink"]))
    if label:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.12, label, ha="center", va="bottom",
                fontsize=8, color=PALETTE["ink"], linespacing=1.2)


def plot_tpu_anatomy(
    ax: Axes | None = None, *, chip: str = "TPU v5e", hbm: str = "16 GB · 819 GB/s",
    vmem: str = "128 MiB; one kernel gets\n16 MiB by default (scoped)", smem: str = "1 MiB",
    mxu: str = "4 × 128×128", title: str | None = None,
) -> Figure:
    """The memories and units a Pallas TPU kernel programs, with where each piece of a kernel lives.

    HBM holds the whole arrays; a kernel's BlockSpecs copy blocks of them into VMEM by DMA (double-buffered,
    so the next step's copy overlaps this step's compute); the scalar unit reads SMEM and runs the grid loop
    and the index maps; vector registers of ``[8 sublanes × 128 lanes]`` 32-bit values feed the VPU
    (elementwise) and the MXUs (matmuls). The keyword arguments are the figures printed in the boxes
    (defaults: TPU v5e, per TensorCore).
    """
    fig, ax = _figure_and_axes(ax, (11.0, 5.6))
    ink = PALETTE["ink"]
    _box(ax, 0.0, 0.3, 2.3, 5.3, "HBM", f"{hbm}\n\nthe whole arrays:\nq, k, v, out\n\noff-chip memory:\n"
         "large, but far\nslower than VMEM", PALETTE["skipped"], alpha=0.35)
    ax.add_patch(FancyBboxPatch((3.4, 0.0), 8.2, 5.9, boxstyle="round,pad=0.02,rounding_size=0.15",
                                facecolor="none", edgecolor=ink, lw=1.2, ls="--"))
    ax.text(7.5, 6.0, f"one TensorCore ({chip})", ha="center", va="bottom", fontsize=10, color=ink)
    _box(ax, 3.6, 4.1, 2.9, 1.6, "scalar unit + SMEM", f"SMEM {smem}: scalars.\nRuns the grid loop and\n"
         "the index maps; issues DMAs", PALETTE["O"])
    _box(ax, 3.6, 0.3, 2.9, 3.5, "VMEM", f"{vmem}\n\nthis step's blocks of\nq, k, v, out (two of each:\n"
         "double-buffered), and\nscratch that outlives a\nstep (m, l, acc)", PALETTE["Q"])
    _box(ax, 7.2, 0.3, 2.0, 5.4, "vector\nregisters", "each [8 × 128] × 32 bit\n= 4 KiB (bf16: [16 × 128],\n"
         "two values per 32 bits)", PALETTE["V"], alpha=0.12)
    x0, y0, w, h = 7.45, 0.6, 1.5, 2.0  # one vreg: 8 sublanes (rows) x 128 lanes (thin columns)
    ax.add_patch(Rectangle((x0, y0), w, h, facecolor=PALETTE["V"], alpha=0.55, edgecolor=ink, lw=0.8))
    for lane in range(1, 128):
        ax.plot([x0 + lane * w / 128] * 2, [y0, y0 + h], color="white", lw=0.5 if lane % 8 else 0.9, alpha=0.7)
    for sublane in range(1, 8):
        ax.plot([x0, x0 + w], [y0 + sublane * h / 8] * 2, color="white", lw=1.2)
    ax.text(x0 + w / 2, y0 + h + 0.08, "128 lanes →", ha="center", va="bottom", fontsize=8, color=ink)
    ax.text(x0 - 0.06, y0 + h / 2, "8 sublanes", ha="right", va="center", rotation=90, fontsize=8, color=ink)
    ax.text(x0 + w / 2, y0 - 0.08, "one vreg", ha="center", va="top", fontsize=8, color=ink)
    _box(ax, 9.9, 3.0, 1.5, 2.7, "VPU", "elementwise\non whole\nvregs: +, ×,\nmax, exp,\nwhere", PALETTE["V"])
    _box(ax, 9.9, 0.3, 1.5, 2.4, "MXU", f"{mxu}\nsystolic\nmatmul:\nbf16 in,\nf32 out", PALETTE["S"], alpha=0.3)
    _arrow(ax, (2.35, 2.0), (3.55, 2.0), "DMA\n(BlockSpec\ncopies)")
    _arrow(ax, (6.55, 2.0), (7.15, 2.0), "load/\nstore")
    _arrow(ax, (9.25, 4.3), (9.85, 4.3))
    _arrow(ax, (9.25, 1.5), (9.85, 1.5))
    ax.set_xlim(-0.1, 11.7)
    ax.set_ylim(-0.15, 6.4)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or "A TPU as a Pallas kernel sees it: copy blocks HBM → VMEM, compute on registers",
                 fontsize=11)
    return fig


def plot_matmul_step(
    grid: tuple[int, int, int], visits: Sequence[tuple[int, int, int]], step: int, *, ax: Axes | None = None,
    legend: bool = True, title: str | None = None,
) -> Figure:
    """One step of a tiled matmul ``O = X @ Y`` on the grid ``(i, j, k)``, with ``visits`` the order the grid
    was walked (e.g. recorded from TPU interpret mode).

    ``X`` (left) is ``grid[0] x grid[2]`` blocks, ``Y`` (top) ``grid[2] x grid[1]``, ``O`` (bottom right)
    ``grid[0] x grid[1]``. At ``visits[step] = (i, j, k)`` the step multiplies ``X[i, k]`` by ``Y[k, j]`` into
    the f32 accumulator of ``O[i, j]`` (hatched while it sits in VMEM). Like the kernel, it initialises the
    accumulator at ``k == 0`` and writes ``O[i, j]`` at ``k == grid[2] - 1``; a finished output block shows
    when it was finished (``#1``, ``#2``, ...), which is the order the grid's parallel axes were visited.
    """
    num_i, num_j, num_k = grid
    if not 0 <= step < len(visits):
        raise ValueError(f"step must be in [0, {len(visits)}), got {step}")
    i, j, k = visits[step]
    fig, ax = _figure_and_axes(ax, (5.5, 5.2))
    gap, strong, faint = 0.45, 0.85, 0.1
    seen = visits[: step + 1]
    for (a, c), (dx, dy), key in (((num_i, num_k), (-num_k - gap, 0), "X"), ((num_k, num_j), (0, -num_k - gap), "Y")):
        for r in range(a):
            for col in range(c):
                now = (r, col) == ((i, k) if key == "X" else (k, j))
                was = any(((v[0], v[2]) if key == "X" else (v[2], v[1])) == (r, col) for v in seen)
                color = PALETTE["Q"] if key == "X" else PALETTE["K"]
                _tile(ax, dx + col, dy + r, 1, 1, color, strong if now else (0.3 if was else faint))
    finished = [(v[0], v[1]) for v in seen[:-1] if v[2] == num_k - 1]
    for r in range(num_i):
        for col in range(num_j):
            if (r, col) == (i, j):
                _tile(ax, col, r, 1, 1, PALETTE["O"], 0.35, hatch="//", edge=PALETTE["O"])
            elif (r, col) in finished:
                _tile(ax, col, r, 1, 1, PALETTE["O"], 0.6)
                ax.text(col + 0.5, r + 0.5, f"#{finished.index((r, col)) + 1}", ha="center", va="center",
                        fontsize=9, color="white", fontweight="bold")
            else:
                _tile(ax, col, r, 1, 1, PALETTE["O"], faint)
    if k == num_k - 1:
        ax.text(j + 0.5, i + 0.5, "write", ha="center", va="center", fontsize=8, color=PALETTE["ink"])
    for (x, y, w, h) in ((-num_k - gap + k, i, 1, 1), (j, -num_k - gap + k, 1, 1), (j, i, 1, 1)):
        ax.add_patch(Rectangle((x, y), w, h, fill=False, lw=2.2, edgecolor=PALETTE["ink"]))
    font = {"fontsize": 10, "fontweight": "bold", "ha": "center", "va": "center"}
    ax.text(-num_k / 2 - gap, -gap / 2 - 0.05, "X", color=PALETTE["Q"], **font)
    ax.text(-gap / 2, -num_k / 2 - gap, "Y", color=PALETTE["K"], **font)
    ax.text(num_j / 2, num_i + 0.3, "O = X @ Y", color=PALETTE["O"], **{**font, "fontsize": 9})
    ax.set_xlim(-num_k - gap - 0.1, num_j + 0.1)
    ax.set_ylim(num_i + 0.6, -num_k - gap - 0.1)
    ax.set_aspect("equal")
    ax.axis("off")
    phases = (["init acc"] if k == 0 else []) + ["acc += X·Y"] + (["write O"] if k == num_k - 1 else [])
    ax.set_title(title or f"step {step}/{len(visits) - 1}: (i, j, k) = ({i}, {j}, {k})\n" + ", ".join(phases),
                 fontsize=10)
    if legend:
        handles = [Patch(color=PALETTE["Q"], label="X block"), Patch(color=PALETTE["K"], label="Y block"),
                   Patch(facecolor=to_rgba(PALETTE["O"], 0.35), edgecolor=PALETTE["O"], hatch="//",
                         label="acc in VMEM"), Patch(color=to_rgba(PALETTE["O"], 0.6), label="O written (#order)")]
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=7, frameon=False)
    return fig


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
