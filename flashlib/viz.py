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
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

__all__ = [
    "PALETTE", "SERIES_COLORS", "OnlineStep", "TileStep", "animate", "filmstrip", "format_bytes", "new_figure",
    "online_softmax_trace", "plot_attention_map", "plot_hbm_traffic", "plot_memory_scaling",
    "plot_online_softmax_step", "plot_tiling_step", "tiling_steps", "to_jshtml",
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
