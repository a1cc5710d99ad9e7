"""Notebooks 05 and 06's Pallas pictures: the double-buffered pipeline's timeline (each copy under the step
before it, the first copy exposed, the last step alone) and the VMEM budget explorer (a still picture, redraws)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported anywhere: no display needed

import base64  # noqa: E402

import pytest  # noqa: E402
from conftest import PICTURE_TEST_MARKS  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from flashlib import viz, widgets  # noqa: E402

pytestmark = PICTURE_TEST_MARKS


@pytest.mark.parametrize(("copy_time", "compute_time"), [(0.6, 1.0), (1.4, 1.0), (1.0, 1.0)])
def test_double_buffer_schedule_overlaps_each_copy_with_the_step_before(copy_time, compute_time):
    steps = viz.double_buffer_schedule(5, copy_time, compute_time)
    assert [st.buffer for st in steps] == [0, 1, 0, 1, 0]  # two buffers, alternating
    assert steps[0].copy == (0.0, copy_time)  # exposed: the core starts once block 0 is in
    assert steps[0].compute[0] == copy_time
    for before, after in zip(steps, steps[1:], strict=False):
        assert after.copy[0] == before.compute[0]  # issued as the step before begins...
        assert after.compute[0] == max(after.copy[1], before.compute[1])  # ...and waited for by its own step
        assert before.copy[1] <= after.copy[0]  # one DMA engine: copies never overlap each other
    assert steps[-1].compute[0] >= steps[-1].copy[1]  # the last step computes alone: no copy after it
    total = steps[-1].compute[1]
    assert total == pytest.approx(copy_time + 5 * max(copy_time, compute_time) + min(0.0, compute_time - copy_time))
    with pytest.raises(ValueError, match="num_steps"):
        viz.double_buffer_schedule(0)


def test_plot_double_buffering_draws_a_bar_per_copy_and_step_coloured_by_buffer():
    fig = viz.plot_double_buffering(4)
    ax = fig.axes[0]
    bars = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_fill()]
    assert len(bars) == 8  # a copy and a step each
    texts = [t.get_text() for t in ax.texts]
    assert [t for t in texts if t.startswith("copy")] == ["copy 0", "copy 1", "copy 2", "copy 3"]
    assert "idle: waits\nfor copy 0" in texts and "no copy left:\nstep alone" in texts
    buffer_colors = {tuple(p.get_facecolor()[:3]) for p in bars}
    assert len(buffer_colors) == 2
    assert [h.get_text() for h in ax.get_legend().get_texts()] == ["VMEM buffer 0", "VMEM buffer 1"]


def _parts(block_q, block_k, head_dim, dtype):
    item = 2 if dtype == "bfloat16" else 4
    return {"blocks (x2)": 2 * (2 * block_q + 2 * block_k) * head_dim * item, "scores": 3 * block_q * block_k * 4}


def test_vmem_budget_explorer_carries_a_still_picture_and_redraws(shown):
    limits = {"v5e": 16 << 20, "v6e": 32 << 20}
    box = widgets.vmem_budget_explorer(_parts, limits)
    bundle = box._repr_mimebundle_()
    assert list(bundle) == [widgets.WIDGET_VIEW, "image/png", "text/plain"]
    png = base64.b64decode(bundle["image/png"])
    assert png.startswith(b"\x89PNG") and len(png) < 150_000
    width = int.from_bytes(png[16:20], "big")  # the IHDR chunk: saved at the figure's dpi, as inline figures are
    assert width >= 0.9 * 8.0 * matplotlib.rcParams["figure.dpi"]  # plot_vmem_budget's 8 inches, less tight trim
    assert "VMEM budget explorer" in bundle["text/plain"]
    block_q, block_k = box.children[0].children
    head_dim, dtype = box.children[1].children
    assert (block_q.value, block_k.value, head_dim.value, dtype.value) == (512, 512, 128, "bfloat16")
    block_q.value = 2048
    dtype.value = "float32"
    ax = shown[-1].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["2048 x 512\nd=128, float32"]
    total = sum(_parts(2048, 512, 128, "float32").values()) / (1 << 20)
    over = [t for t in ax.texts if t.get_text() == f" {total:.1f} MiB"]
    assert over and over[0].get_color() == viz.PALETTE["masked"]  # 28 MiB: over v5e's 16
