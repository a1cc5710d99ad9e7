"""Interactive versions of the pictures in :mod:`flashlib.viz`: a play button and a slider over the steps.

Thin on purpose: each picture is a plain :mod:`flashlib.viz` function, and a widget only redraws it when the
step changes. Every function returns the widget (a ``VBox``) without displaying it; the notebook does.

Portable across ipywidgets 7 (Colab) and 8: only ``IntSlider``, ``SelectionSlider``, ``Play``, ``Dropdown``,
``ToggleButtons``, ``jslink``, ``HBox``/``VBox`` and ``interactive_output`` are used. ipywidgets is imported
inside the functions, so ``import flashlib`` works without it.

A notebook rendered without a kernel (GitHub, nbviewer, ``jupyter nbconvert --to html``, JupyterLab before
Run All) cannot show a widget. So each explorer's output carries, beside the widget view, a still picture of
its first view (``image/png``) and a line of text saying what it is: a live frontend shows the widget, a
static one the picture (:class:`ExplorerBox`).
"""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Callable, Mapping

import numpy.typing as npt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from flashlib import perf_plots, viz
from flashlib.tuning import TableKey, TuningResult

__all__ = ["NO_BOUND", "SEGMENT_PATTERNS", "block_size_explorer", "design_segments", "draw_mask_design",
           "explorer_box", "mask_designer", "online_softmax_explorer", "segment_pattern", "step_through",
           "tiling_explorer", "vmem_budget_explorer"]

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _show(fig: Figure) -> None:
    """Display a finished figure in the current output (inside the widget's ``Output`` while redrawing).

    The figure comes from :func:`flashlib.viz.new_figure`, already closed in pyplot, so redraws never
    accumulate open figures.
    """
    from IPython.display import display

    display(fig)


@functools.cache
def _explorer_class():
    """:class:`ExplorerBox`, made on first use (ipywidgets is imported lazily)."""
    import ipywidgets as widgets

    class ExplorerBox(widgets.VBox):
        """A ``VBox`` whose output also holds a still picture and a text line for frontends without a kernel.

        Its display bundle is the widget view first (what a live frontend renders), then ``image/png`` (what
        GitHub, nbviewer and nbconvert's HTML render) and ``text/plain`` (instead of the children's repr).
        Works with ipywidgets 7 (``_ipython_display_``) and 8 (``_repr_mimebundle_``)."""

        still_png: str = ""
        still_text: str = ""

        def _repr_mimebundle_(self, include=None, exclude=None):
            view = {"model_id": self.model_id, "version_major": 2, "version_minor": 0}
            return {WIDGET_VIEW: view, "image/png": self.still_png, "text/plain": self.still_text}

        def _ipython_display_(self, **kwargs):
            from IPython.display import display

            display(self._repr_mimebundle_(), raw=True)

    return ExplorerBox


def explorer_box(children, still: Figure, what: str):
    """A ``VBox`` of ``children`` that shows ``still`` (the explorer's first view) where widgets cannot run.

    The still is saved as the inline backend saves the figures beside it (IPython's ``print_figure``: the
    figure's own dpi, ``rcParams["figure.dpi"]`` when :func:`flashlib.viz.new_figure` made it, and a tight box),
    so it is as large and as sharp as they are."""
    buffer = io.BytesIO()
    still.savefig(buffer, format="png", dpi=still.dpi, bbox_inches="tight")
    box = _explorer_class()(children)
    box.still_png = base64.b64encode(buffer.getvalue()).decode("ascii")
    box.still_text = f"[{what}: an interactive widget; run the notebook to use it. The picture is its first view.]"
    return box


def step_through(
    draw_step: Callable[[int, Axes], object],
    num_steps: int,
    description: str = "step",
    *,
    interval: int = 800,
    figsize: tuple[float, float] = (8.0, 5.0),
):
    """Play button + slider over ``range(num_steps)``; each new value redraws ``draw_step(step, ax)`` on a fresh figure.

    The play button drives the slider in the browser (``jslink``), so playback needs no round trip; the
    kernel only redraws when the slider's value arrives. ``interval`` is the time per step in milliseconds.
    """
    import ipywidgets as widgets

    if num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {num_steps}")
    last = num_steps - 1
    play = widgets.Play(value=0, min=0, max=last, step=1, interval=interval, description="play")
    slider = widgets.IntSlider(value=0, min=0, max=last, step=1, description=description, continuous_update=False)
    widgets.jslink((play, "value"), (slider, "value"))

    def redraw(step: int) -> None:
        fig = viz.new_figure(figsize)
        draw_step(step, fig.add_subplot())
        _show(fig)

    output = widgets.interactive_output(redraw, {"step": slider})
    still = viz.new_figure(figsize)
    draw_step(0, still.add_subplot())
    what = f"{num_steps} steps, {description} by {description}"
    return explorer_box([widgets.HBox([play, slider]), output], still, what)


def tiling_explorer(
    q_len: int,
    kv_len: int,
    block_q: int,
    block_k: int,
    causal: bool = False,
    *,
    interval: int = 900,
    figsize: tuple[float, float] = (7.5, 6.5),
):
    """Walk the grid of tiled attention step by step: :func:`flashlib.viz.plot_tiling_step` behind a slider.

    One step per ``(q_block, kv_block)`` pair, kv fastest, as a Pallas grid with the kv axis last; with
    ``causal=True`` the skipped (grey) and masked (hatched) tiles are visited too, as the grid visits them.
    """
    num_steps = len(viz.tiling_steps(q_len, kv_len, block_q, block_k, causal))

    def draw(step: int, ax: Axes) -> None:
        viz.plot_tiling_step(q_len, kv_len, block_q, block_k, step, causal=causal, ax=ax)

    return step_through(draw, num_steps, description="grid step", interval=interval, figsize=figsize)


def online_softmax_explorer(
    scores: npt.ArrayLike,
    values: npt.ArrayLike,
    block: int,
    *,
    interval: int = 1200,
    figsize: tuple[float, float] = (8.5, 4.2),
):
    """Stream one row of ``scores [n]`` (with ``values [n]`` or ``[n, d]``) through online softmax, block by block.

    Behind the slider is :func:`flashlib.viz.plot_online_softmax_step`: the running max and sum after each
    block, the rescale factor that block caused, and how far both are from their final values.
    """
    num_steps = len(viz.online_softmax_trace(scores, values, block))

    def draw(step: int, ax: Axes) -> None:
        viz.plot_online_softmax_step(scores, block, step, ax=ax, values=values)

    return step_through(draw, num_steps, description="block", interval=interval, figsize=figsize)


def _entry_summary(entry: TuningResult) -> str:
    """One line under the heat map: the best blocks and how they compare with JAX's kernel and the MXU floor."""
    best, base = entry.best, entry.baseline_best
    if best is None:
        jax = f"; JAX's best {base.label}: {base.cycles:,} cycles" if base is not None else ""
        return f"no flashlib estimate for this shape (each cell says why){jax}"
    line = (f"best q{best.block_q}/k{best.block_k}: {best.cycles:,} cycles, "
            f"{best.cycles / entry.mxu_floor:.2f}x MXU floor")
    if base is not None:
        line += f"; JAX's best {base.label}: {base.cycles:,} (flashlib/JAX {best.cycles / base.cycles:.2f})"
    return line


def block_size_explorer(table: Mapping[TableKey, TuningResult], *, figsize: tuple[float, float] = (6.8, 4.6)):
    """Pick a generation, sequence length, head_dim and causality; see every block candidate's static estimate.

    Instant: it only redraws :func:`flashlib.perf_plots.plot_block_cycles` from ``table`` (the committed tuned
    table, :func:`flashlib.tuning.load_tuned_table`), nothing is compiled. A combination the table lacks says so.
    """
    import ipywidgets as widgets

    if not table:
        raise ValueError("table is empty: pass flashlib.tuning.load_tuned_table(), the tuned table the package "
                         "ships (data/tuning/forward_blocks.json in a clone)")
    keys = list(table)

    def choices(field: str) -> list:
        return sorted({getattr(key, field) for key in keys})

    generation = widgets.Dropdown(options=choices("generation"), description="TPU")
    seq = widgets.Dropdown(options=choices("q_len"), description="seq")
    head_dim = widgets.Dropdown(options=choices("head_dim")[::-1], description="head_dim")
    causal = widgets.Dropdown(options=[("no", False), ("yes", True)], description="causal")
    dtype = keys[0].dtype

    def draw(generation: str, seq: int, head_dim: int, causal: bool) -> Figure:
        fig = viz.new_figure(figsize)
        ax = fig.add_subplot()
        entry = table.get(TableKey(generation, dtype, causal, head_dim, seq, seq))
        if entry is None:
            ax.set_axis_off()
            ax.text(0.5, 0.5, f"{generation} T={seq} d={head_dim} causal={causal}: not in the table", ha="center")
        else:
            perf_plots.plot_block_cycles(perf_plots.block_grid(entry), ax=ax)
            ax.set_xlabel(f"block_k\n{_entry_summary(entry)}", fontsize=8)
        return fig

    def redraw(generation: str, seq: int, head_dim: int, causal: bool) -> None:
        _show(draw(generation, seq, head_dim, causal))

    controls = {"generation": generation, "seq": seq, "head_dim": head_dim, "causal": causal}
    output = widgets.interactive_output(redraw, controls)
    still = draw(generation.value, seq.value, head_dim.value, causal.value)
    return explorer_box([widgets.HBox([generation, seq]), widgets.HBox([head_dim, causal]), output], still,
                        "block-size explorer over the tuned table")


def vmem_budget_explorer(
    parts: Callable[[int, int, int, str], Mapping[str, float]], limits: Mapping[str, float], *,
    block_q: int = 512, block_k: int = 512, head_dim: int = 128, dtype: str = "bfloat16",
):
    """Sliders for ``block_q``, ``block_k``, ``head_dim`` and a dtype; one stacked bar of ``parts(block_q,
    block_k, head_dim, dtype)`` (bytes by part, e.g. notebook 06's ``vmem_parts``) against ``limits`` (bytes
    by name, e.g. the scoped VMEM of v5e and v6e), drawn by :func:`flashlib.viz.plot_vmem_budget`."""
    import ipywidgets as widgets

    def slider(name: str, options: list[int], value: int):
        return widgets.SelectionSlider(options=options, value=value, description=name, continuous_update=False)

    controls = {
        "block_q": slider("block_q", [64, 128, 256, 512, 1024, 2048], block_q),
        "block_k": slider("block_k", [128, 256, 512, 1024, 2048], block_k),
        "head_dim": slider("head_dim", [64, 128, 256], head_dim),
        "dtype": widgets.ToggleButtons(options=["bfloat16", "float32"], value=dtype, description="dtype"),
    }

    def draw(block_q: int, block_k: int, head_dim: int, dtype: str) -> Figure:
        name = f"{block_q} x {block_k}\nd={head_dim}, {dtype}"
        return viz.plot_vmem_budget({name: parts(block_q, block_k, head_dim, dtype)}, limits)

    def redraw(**values) -> None:
        _show(draw(**values))

    output = widgets.interactive_output(redraw, controls)
    still = draw(**{name: control.value for name, control in controls.items()})
    rows = [widgets.HBox([controls["block_q"], controls["block_k"]]),
            widgets.HBox([controls["head_dim"], controls["dtype"]])]
    return explorer_box([*rows, output], still, "VMEM budget explorer")


SEGMENT_PATTERNS: tuple[str, ...] = ("none", "2 equal", "3 uneven", "4 short")
"""The segment layouts :func:`mask_designer` offers: one packed row cut in these proportions."""


def segment_pattern(name: str, length: int) -> list[int] | None:
    """Segment ids for ``length`` tokens in pattern ``name`` of :data:`SEGMENT_PATTERNS` (``None``: no segments)."""
    shares = {"none": None, "2 equal": (1, 1), "3 uneven": (3, 1, 2), "4 short": (1, 1, 1, 1)}[name]
    if shares is None:
        return None
    bounds = [round(length * sum(shares[:n]) / sum(shares)) for n in range(len(shares) + 1)]
    return [n for n in range(len(shares)) for _ in range(bounds[n], bounds[n + 1])]


def design_segments(name: str, q_len: int, kv_len: int) -> dict:
    """``q_segments`` and ``kv_segments`` for pattern ``name`` over one packed row of ``max(q_len, kv_len)``
    tokens, bottom-right aligned like the masks: the queries are the row's last ``q_len`` tokens, the keys its
    last ``kv_len`` (both ``None`` for ``"none"``)."""
    row = segment_pattern(name, max(q_len, kv_len))
    if row is None:
        return dict(q_segments=None, kv_segments=None)
    return dict(q_segments=row[len(row) - q_len:], kv_segments=row[len(row) - kv_len:])


def draw_mask_design(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool, left, right,
                     segments: str, figsize: tuple[float, float] = (11.0, 4.2)) -> Figure:
    """Three panels for one mask: the element visibility with the block grid, each block's kind
    (:func:`flashlib.viz.block_plan`), and the key block each grid step fetches (the copies issued)."""
    window = None if left is None and right is None else (left, right)
    ids = design_segments(segments, q_len, kv_len)
    fig = viz.new_figure(figsize)
    axes = fig.subplots(1, 3, width_ratios=[1.0, 1.0, 1.0])
    visible = viz.visibility(q_len, kv_len, causal=causal, window=window, **ids)
    viz.plot_visibility(visible, ax=axes[0], block_q=block_q, block_k=block_k,
                        title=f"q_len {q_len}, kv_len {kv_len}, window {window}")
    plan = viz.block_plan(q_len, kv_len, block_q, block_k, causal=causal, window=window, **ids)
    viz.plot_block_plan(plan, ax=axes[1], title="what each block does")
    viz.plot_fetch_schedule(plan, ax=axes[2], title="the key block each grid step fetches")
    return fig


NO_BOUND = "none"
"""The mask designer's window-side value for an unbounded side (``None`` in a window). A dropdown cannot hold
``None``: ipywidgets reads it as no selection and shows the dropdown blank."""


def _window_side(value):
    """A window side from a dropdown: :data:`NO_BOUND` is ``None``, anything else the number it is."""
    return None if value == NO_BOUND else value


def mask_designer(q_len: int = 48, kv_len: int = 64, block_q: int = 8, block_k: int = 8, *, causal: bool = True,
                  window=(12, 0), segments: str = "none", figsize: tuple[float, float] = (11.0, 4.2)):
    """Design a mask — causal, a window ``(left, right)`` (``None``: unbounded, ``"none"`` in the dropdowns), a
    segment pattern, the lengths and blocks — and see which elements are visible, which blocks the kernel skips,
    masks or runs plain, and which key block each grid step fetches (:func:`draw_mask_design`). Nothing is
    compiled: a redraw is NumPy on :mod:`flashlib.geometry`'s rules and one figure of a few collections."""
    import ipywidgets as widgets

    sides = [(NO_BOUND, NO_BOUND)] + [(str(n), n) for n in (0, 1, 2, 4, 8, 12, 16, 24, 32)]
    left, right = (None, None) if window is None else window
    lengths = [8, 16, 24, 32, 40, 48, 56, 64, 80, 96]
    controls = {
        "q_len": widgets.Dropdown(options=lengths, value=q_len, description="q_len"),
        "kv_len": widgets.Dropdown(options=lengths, value=kv_len, description="kv_len"),
        "block_q": widgets.Dropdown(options=[4, 8, 16, 32], value=block_q, description="block_q"),
        "block_k": widgets.Dropdown(options=[4, 8, 16, 32], value=block_k, description="block_k"),
        "causal": widgets.Dropdown(options=[("yes", True), ("no", False)], value=causal, description="causal"),
        "left": widgets.Dropdown(options=sides, value=NO_BOUND if left is None else left, description="left"),
        "right": widgets.Dropdown(options=sides, value=NO_BOUND if right is None else right, description="right"),
        "segments": widgets.Dropdown(options=list(SEGMENT_PATTERNS), value=segments, description="segments"),
    }

    def draw(left, right, **values) -> Figure:
        return draw_mask_design(left=_window_side(left), right=_window_side(right), **values, figsize=figsize)

    def redraw(**values) -> None:
        _show(draw(**values))

    output = widgets.interactive_output(redraw, controls)
    still = draw(**{name: control.value for name, control in controls.items()})
    rows = [widgets.HBox([controls[a], controls[b]]) for a, b in (("q_len", "kv_len"), ("block_q", "block_k"),
                                                                  ("causal", "segments"), ("left", "right"))]
    return explorer_box([*rows, output], still, "mask designer")
