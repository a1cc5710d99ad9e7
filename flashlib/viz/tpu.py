"""The TPU as a kernel sees it (HBM, VMEM, the MXU), one matmul step of a kernel's grid, and the double-buffered
copies that overlap a grid step's compute."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from matplotlib.axes import Axes
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle

from flashlib.viz.figures import PALETTE, draw_tile, figure_and_axes

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
    (elementwise), the EUP (transcendentals: ``exp``, ``exp2``, ``log``, reciprocals), the XLU (cross-lane
    work: transposes, the last step of a row reduction) and the MXUs (matmuls). The keyword arguments are the
    figures printed in the boxes (defaults: TPU v5e, per TensorCore; v6e: ``mxu="2 × 256×256"``).
    """
    fig, ax = figure_and_axes(ax, (11.0, 5.6))
    ink = PALETTE["ink"]
    _box(ax, 0.0, 0.3, 2.3, 5.3, "HBM", f"{hbm}\n\nthe whole arrays:\nq, k, v, out\n\noff-chip memory:\n"
         "large, but far\nslower than VMEM", PALETTE["skipped"], alpha=0.35)
    ax.add_patch(FancyBboxPatch((3.4, 0.0), 8.65, 5.9, boxstyle="round,pad=0.02,rounding_size=0.15",
                                facecolor="none", edgecolor=ink, lw=1.2, ls="--"))
    ax.text(7.7, 6.0, f"one TensorCore ({chip})", ha="center", va="bottom", fontsize=10, color=ink)
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
    units = (  # (title, body, colour, alpha), top to bottom, each fed from the vector registers
        ("VPU", "elementwise on vregs:\n+, ×, max, where", PALETTE["V"], 0.18),
        ("EUP", "transcendentals:\nexp, exp2, log, 1/x", PALETTE["K"], 0.18),
        ("XLU", "cross-lane: transpose,\nrow reductions", PALETTE["O"], 0.18),
        ("MXU", f"{mxu} systolic\nmatmul: bf16 in, f32 out", PALETTE["S"], 0.3),
    )
    height, gap = 1.2, 0.2
    for i, (name, body, color, alpha) in enumerate(units):
        y = 5.7 - (i + 1) * height - i * gap
        _box(ax, 9.8, y, 2.1, height, name, body, color, alpha=alpha)
        _arrow(ax, (9.25, y + height / 2), (9.75, y + height / 2))
    _arrow(ax, (2.35, 2.0), (3.55, 2.0), "DMA\n(BlockSpec\ncopies)")
    _arrow(ax, (6.55, 2.0), (7.15, 2.0), "load/\nstore")
    ax.set_xlim(-0.1, 12.2)
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
    fig, ax = figure_and_axes(ax, (5.5, 5.2))
    gap, strong, faint = 0.45, 0.85, 0.1
    seen = visits[: step + 1]
    for (a, c), (dx, dy), key in (((num_i, num_k), (-num_k - gap, 0), "X"), ((num_k, num_j), (0, -num_k - gap), "Y")):
        for r in range(a):
            for col in range(c):
                now = (r, col) == ((i, k) if key == "X" else (k, j))
                was = any(((v[0], v[2]) if key == "X" else (v[2], v[1])) == (r, col) for v in seen)
                color = PALETTE["Q"] if key == "X" else PALETTE["K"]
                draw_tile(ax, dx + col, dy + r, 1, 1, color, strong if now else (0.3 if was else faint))
    finished = [(v[0], v[1]) for v in seen[:-1] if v[2] == num_k - 1]
    for r in range(num_i):
        for col in range(num_j):
            if (r, col) == (i, j):
                draw_tile(ax, col, r, 1, 1, PALETTE["O"], 0.35, hatch="//", edge=PALETTE["O"])
            elif (r, col) in finished:
                draw_tile(ax, col, r, 1, 1, PALETTE["O"], 0.6)
                ax.text(col + 0.5, r + 0.5, f"#{finished.index((r, col)) + 1}", ha="center", va="center",
                        fontsize=9, color="white", fontweight="bold")
            else:
                draw_tile(ax, col, r, 1, 1, PALETTE["O"], faint)
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


# -- Double buffering: the copy of block s + 1 under the compute of block s ----------------------------


class BufferedStep(NamedTuple):
    """One grid step of a double-buffered pipeline: its block's VMEM buffer and when it is copied and used."""

    step: int
    buffer: int  # which of the two VMEM buffers holds this step's block: step % 2
    copy: tuple[float, float]  # (start, end) of the DMA HBM -> VMEM
    compute: tuple[float, float]  # (start, end) of the step's compute on that buffer


def double_buffer_schedule(num_steps: int, copy_time: float = 0.6, compute_time: float = 1.0) -> list[BufferedStep]:
    """When each copy and each compute runs in Pallas' double-buffered pipeline (one DMA engine, one core).

    Before the grid, block 0 is copied: nothing to overlap it with. Step ``s`` then waits for its copy, issues
    the copy of block ``s + 1`` into the other buffer (the one step ``s - 1`` just finished with), and computes
    on block ``s``; the last step has no copy left to issue and computes alone.
    """
    if num_steps < 1 or copy_time <= 0 or compute_time <= 0:
        raise ValueError(f"need num_steps >= 1 and positive times, got {num_steps}, {copy_time}, {compute_time}")
    copies, steps = [(0.0, copy_time)], []
    done = 0.0  # when the previous step's compute ended
    for s in range(num_steps):
        start = max(copies[s][1], done)  # the block is in VMEM and the core is free
        if s + 1 < num_steps:
            copies.append((start, start + copy_time))  # issued as step s begins, into the other buffer
        done = start + compute_time
        steps.append(BufferedStep(s, s % 2, copies[s], (start, done)))
    return steps


def plot_double_buffering(num_steps: int = 5, copy_time: float = 0.6, compute_time: float = 1.0, *,
                          ax: Axes | None = None, title: str | None = None) -> Figure:
    """The timeline of :func:`double_buffer_schedule`: a DMA lane (HBM → VMEM copies) over a compute lane, one
    bar per grid step in each, coloured by the VMEM buffer the block lands in. The first copy runs alone
    (exposed), each later copy under the previous step's compute, and the last step computes alone."""
    steps = double_buffer_schedule(num_steps, copy_time, compute_time)
    fig, ax = figure_and_axes(ax, (9.0, 2.9))
    colors = (PALETTE["Q"], PALETTE["V"])
    lanes = {"copy": 1.0, "compute": 0.0}
    for st in steps:
        for lane, (start, end), label in (("copy", st.copy, f"copy {st.step}"),
                                          ("compute", st.compute, f"step {st.step}")):
            ax.add_patch(Rectangle((start, lanes[lane] - 0.3), end - start, 0.6, facecolor=colors[st.buffer],
                                   alpha=0.85 if lane == "copy" else 0.45, edgecolor="white", lw=1.5))
            ax.text((start + end) / 2, lanes[lane], label, ha="center", va="center", fontsize=8.5,
                    color="white" if lane == "copy" else PALETTE["ink"], fontweight="bold")
    end = steps[-1].compute[1]
    idle = ((0.0, steps[0].compute[0], lanes["compute"], "idle: waits\nfor copy 0"),  # the exposed first copy
            (*steps[-1].compute, lanes["copy"], "no copy left:\nstep alone"))  # the last step, nothing under it
    for start, stop, lane, label in idle:
        ax.add_patch(Rectangle((start, lane - 0.3), stop - start, 0.6, fill=False, ls="--", lw=1.0,
                               edgecolor=PALETTE["masked"]))
        ax.text((start + stop) / 2, lane, label, ha="center", va="center", fontsize=8, color=PALETTE["masked"])
    ink = PALETTE["ink"]
    ax.set_yticks([1.0, 0.0], labels=["DMA engine\nHBM → VMEM", "compute\n(TensorCore)"])
    ax.tick_params(axis="y", length=0, labelsize=9)
    ax.set_xticks([])
    ax.set_xlim(-0.05 * end, 1.02 * end)
    ax.set_ylim(-0.55, 1.55)
    ax.set_xlabel("time →", fontsize=9, color=ink)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    handles = [Patch(color=colors[b], alpha=0.85, label=f"VMEM buffer {b}") for b in (0, 1)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8, frameon=False)
    ax.set_title(title or f"Double buffering over {num_steps} grid steps: the copy of block s + 1 runs under "
                 "the compute of block s", fontsize=10)
    return fig
