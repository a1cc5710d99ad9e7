"""Online softmax, one block at a time: the trace of running max, sum and output, and its picture."""

from __future__ import annotations

from typing import TypedDict

import numpy as np
import numpy.typing as npt
from matplotlib.axes import Axes
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from flashlib.viz.figures import PALETTE, block_spans, figure_and_axes

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
    for step, (lo, hi) in enumerate(block_spans(s.shape[-1], block)):
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
    title: str | None = None, show: str = "weights",
) -> Figure:
    """One row of scores streamed in blocks: the running state after folding in block ``step`` (0-based).

    ``show="weights"`` (the default) draws what the state holds: each key's weight ``exp(s - m)`` against the
    running max ``m``, at most 1. Keys of the blocks seen before are pale, with an outline at the height they
    had before this block (``exp(s - m_old)``): when the max grows, they all shrink by the same factor
    ``alpha``. The block just folded in is strong; keys not seen yet are grey ticks at 0.
    ``show="scores"`` draws the raw scores instead, with lines at the running max ``m`` (solid), the max
    before this block ``m_old`` (dotted) and the true row max (dashed).

    The box (``legend=True``) compares ``m`` and ``l`` with their final values, gives the rescale factor
    ``alpha = exp(m_old - m)`` applied to the old ``l`` and ``acc``, and the share of the final softmax mass seen
    so far, ``l exp(m - m_final) / l_final``; with ``values`` also ``acc[0] / l``, the first entry of the output
    over the keys seen so far (the box has room for one number, not the vector). With ``legend=False`` (small
    panels) the key numbers go in the title.
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
    if show not in ("weights", "scores"):
        raise ValueError(f"show must be 'weights' or 'scores', got {show!r}")
    fig, ax = figure_and_axes(ax, (8.0, 4.0))
    idx = np.arange(s.size)
    colors = [to_rgba(PALETTE["K"], 0.4) if k < cur["lo"] else to_rgba(PALETTE["K"]) if k < cur["hi"]
              else to_rgba(PALETTE["skipped"], 0.5) for k in idx]
    if show == "weights":
        seen = idx < cur["hi"]
        weights = np.where(seen, np.exp(s - m), 0.0)  # [n]  what l and acc are made of, against the running m
        ax.bar(idx, weights, width=0.85, color=colors, label="weight exp(s − m)")
        ax.plot(idx[~seen], np.zeros(int((~seen).sum())), "|", color=PALETTE["skipped"], ms=8)
        if step > 0:  # the earlier blocks before this block's rescale: alpha times taller than now
            before = idx < cur["lo"]
            ax.bar(idx[before], np.exp(s[before] - m_old), width=0.85, fill=False, edgecolor=PALETTE["masked"],
                   lw=1.0, ls="--", label=f"before this block (× α = {alpha:.2f} since)")
        ax.axhline(1.0, color=PALETTE["ink"], ls="--", lw=0.8)
        ax.set_ylim(0.0, 1.0 + (0.9 if legend else 0.1))  # headroom for the box, but the axis stops at 1:
        ax.set_yticks([0.0, 0.25, 0.5, 0.75, 1.0])  # a weight exp(s - m) is never above 1
        ax.spines["left"].set_bounds(0.0, 1.0)
    else:
        ax.bar(idx, s, width=0.85, color=colors)
        ax.axhline(0.0, color=PALETTE["ink"], lw=0.6)
        ax.axhline(m_fin, color=PALETTE["ink"], ls="--", lw=1, label=f"final max {m_fin:.2f}")
        ax.axhline(m, color=PALETTE["masked"], lw=1.8, label=f"running m = {m:.2f}")
        if np.isfinite(m_old):
            ax.axhline(m_old, color=PALETTE["masked"], lw=1.2, ls=":", label=f"m_old = {m_old:.2f}")
        low, high = min(0.0, float(s.min())), max(0.0, float(s.max()))
        ax.set_ylim(low - 0.05 * (high - low), high + (0.8 if legend else 0.1) * max(high - low, 1e-9))
    for lo, _ in block_spans(s.size, block)[1:]:
        ax.axvline(lo - 0.5, color=PALETTE["ink"], lw=0.6, ls=":", alpha=0.6)
    ax.axvspan(cur["lo"] - 0.5, cur["hi"] - 0.5, color=PALETTE["K"], alpha=0.08)
    heading = title or f"after block {step}/{len(trace) - 1} (keys {cur['lo']}–{cur['hi'] - 1})"
    if legend:
        lines = [f"m_old = {m_old:.3g} → m = {m:.3g}   (final {m_fin:.3g})",
                 f"α = exp(m_old − m) = {alpha:.3g}" + ("  (first block)" if step == 0 else ""),
                 f"l = {l:.4g}   (final {l_fin:.4g})",
                 f"softmax mass seen: {100 * l * np.exp(m - m_fin) / l_fin:.0f}%"]
        if values is not None:
            out, out_fin = (float(np.ravel(t["acc"])[0] / t["l"]) for t in (cur, final))
            lines.append(f"acc[0] / l = {out:.4g}   (final {out_fin:.4g})")  # entry 0 of the output vector
        ax.text(0.01, 0.98, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=8, family="monospace",
                bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": PALETTE["skipped"]})
        ax.legend(loc="upper right", fontsize=8, frameon=False)
    elif title is None:
        heading += f"\nm = {m:.3g}, α = {alpha:.3g}, l = {l:.3g}"
    ax.set_xlabel("key index")
    ax.set_ylabel("weight exp(s − m)" if show == "weights" else "score")
    ax.set_title(heading, fontsize=10)
    return fig
