"""The pictures of the series: plain matplotlib functions, headless and deterministic.

Every ``plot_*`` function takes data plus an optional ``ax`` and returns the :class:`~matplotlib.figure.Figure`
it drew on; none calls ``plt.show()``. Without ``ax`` the figure comes from :func:`new_figure`: made through
pyplot (so Jupyter's inline backend is set up to draw it) and closed at once, so nothing piles up in pyplot's
registry and a notebook shows a returned figure exactly once. The data helpers (:func:`tiling_steps`,
:func:`online_softmax_trace`) are pure Python/NumPy so the notebooks can check the pictures against the definitions.

One module per kind of picture — :mod:`~flashlib.viz.tiles` (attention maps, tiling and schedules),
:mod:`~flashlib.viz.masks` (the variants: visibility, block plans, soft-cap, head groups),
:mod:`~flashlib.viz.online_softmax`, :mod:`~flashlib.viz.memory`, :mod:`~flashlib.viz.mesh` (a device mesh,
the ring's steps and work), :mod:`~flashlib.viz.ring` (the causal ring's chunk pairs, a ring step's timeline),
:mod:`~flashlib.viz.decode` (a block table, the paged kernel's grid, split-KV's merge), :mod:`~flashlib.viz.tpu`
(the chip, a matmul step), :mod:`~flashlib.viz.figures` (palette, figures, filmstrips, animations) — and every
public name here, so a notebook needs only ``from flashlib import viz``.

One palette for the whole series (:data:`PALETTE`): Q blue, K orange, V green, O purple, scores gold,
masked red hatching, skipped grey.
"""

from flashlib.viz.decode import plot_block_table, plot_paged_grid, plot_pages_per_step, plot_split_kv, split_weights
from flashlib.viz.figures import PALETTE, SERIES_COLORS, animate, filmstrip, format_bytes, new_figure, to_jshtml
from flashlib.viz.masks import (
    KINDS,
    BlockPlan,
    block_plan,
    plot_block_plan,
    plot_fetch_schedule,
    plot_head_groups,
    plot_softcap,
    plot_visibility,
    visibility,
)
from flashlib.viz.memory import plot_hbm_traffic, plot_memory_scaling, plot_vmem_budget
from flashlib.viz.mesh import plot_mesh, plot_ring_step, plot_ring_work
from flashlib.viz.online_softmax import OnlineStep, online_softmax_trace, plot_online_softmax_step
from flashlib.viz.ring import PAIR_COLORS, PAIR_WORK, RingStepTime, plot_chunk_pairs, plot_ring_timeline, ring_timeline
from flashlib.viz.tiles import (
    TileStep,
    plot_attention_map,
    plot_kv_schedule,
    plot_q_schedule,
    plot_tiling_step,
    tiling_steps,
)
from flashlib.viz.tpu import (
    BufferedStep,
    double_buffer_schedule,
    plot_double_buffering,
    plot_matmul_step,
    plot_tpu_anatomy,
)

__all__ = [
    "KINDS", "PAIR_COLORS", "PALETTE", "SERIES_COLORS", "BlockPlan", "OnlineStep", "TileStep", "animate",
    "block_plan", "filmstrip", "format_bytes", "new_figure", "online_softmax_trace", "plot_attention_map",
    "plot_block_plan", "plot_block_table", "plot_chunk_pairs", "plot_fetch_schedule", "plot_hbm_traffic",
    "plot_head_groups", "plot_kv_schedule", "plot_matmul_step", "plot_memory_scaling", "plot_mesh",
    "plot_online_softmax_step", "plot_paged_grid", "plot_q_schedule", "plot_ring_step", "plot_ring_work",
    "plot_softcap", "plot_split_kv", "plot_tiling_step", "plot_tpu_anatomy", "plot_visibility", "plot_vmem_budget",
    "split_weights", "tiling_steps", "to_jshtml", "visibility",
    "PAIR_WORK", "RingStepTime", "plot_ring_timeline", "ring_timeline",  # notebook 11: a ring step's timeline
    "plot_pages_per_step",  # notebook 10: how pages_per_step groups a sequence's pages into grid steps
    "BufferedStep", "double_buffer_schedule", "plot_double_buffering",  # notebook 05: the copies under the compute
]
