"""Notebook 09's pictures and their data: the visibility matrix is the oracle's mask, a block plan agrees with
the elements it covers and with the cost model's copy count, the mask designer redraws, and the variant
estimates table is complete and drawn as it reads."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported anywhere: no display needed

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import PICTURE_TEST_MARKS  # noqa: E402

from flashlib import cost, perf_plots, tuning, viz, widgets  # noqa: E402
from flashlib.reference import variant_mask  # noqa: E402

pytestmark = PICTURE_TEST_MARKS

VARIANTS = perf_plots.read_table(tuning.TABLE_PATH.parents[1] / "estimates" / "variants_v5e.csv")
DESIGNS = [  # q_len, kv_len, block_q, block_k, causal, window, segments pattern
    (32, 32, 8, 8, True, None, "none"),
    (24, 40, 8, 8, True, (10, 0), "none"),
    (40, 24, 8, 8, True, (6, 2), "2 equal"),
    (30, 37, 8, 16, False, (5, 5), "3 uneven"),
    (48, 48, 16, 8, False, (None, 4), "4 short"),
    (20, 20, 8, 8, False, None, "3 uneven"),
]


def _design(q_len, kv_len, block_q, block_k, causal, window, segments):
    return dict(causal=causal, window=window, **widgets.design_segments(segments, q_len, kv_len))


@pytest.mark.parametrize("design", DESIGNS)
def test_visibility_is_the_oracles_mask(design):
    q_len, kv_len = design[:2]
    rule = _design(*design)
    ids = None if rule["q_segments"] is None else tuple(np.asarray(rule[k])[None] for k in ("q_segments",
                                                                                            "kv_segments"))
    mask = variant_mask(q_len, kv_len, causal=rule["causal"], window=rule["window"], segment_ids=ids)
    want = np.ones((q_len, kv_len), bool) if mask is None else np.broadcast_to(np.asarray(mask),
                                                                               (1, 1, q_len, kv_len))[0, 0]
    assert np.array_equal(viz.visibility(q_len, kv_len, **rule), want)


@pytest.mark.parametrize("design", DESIGNS)
def test_a_block_plan_agrees_with_the_elements_and_visits_each_live_block_once(design):
    q_len, kv_len, block_q, block_k = design[:4]
    rule = _design(*design)
    plan = viz.block_plan(q_len, kv_len, block_q, block_k, **rule)
    nq, nk = plan.kinds.shape
    padded = np.zeros((nq * block_q, nk * block_k), bool)
    padded[:q_len, :kv_len] = viz.visibility(q_len, kv_len, **rule)
    blocks = padded.reshape(nq, block_q, nk, block_k)
    seen = blocks.any(axis=(1, 3))
    assert not (seen & (plan.kinds == 0)).any(), "a skipped block holds a visible element"
    plain = plan.kinds == 2
    padded[q_len:, :kv_len] = True  # padded query rows are dropped: they hide nothing; padded keys do
    full = padded.reshape(nq, block_q, nk, block_k).all(axis=(1, 3))
    assert (full | ~plain).all(), "a plain block hides an element"
    assert np.array_equal(plan.empty, (plan.kinds > 0) & ~seen)
    visited = {(i, int(plan.fetched[i, s])) for i, s in zip(*np.nonzero(plan.computes), strict=True)}
    assert visited == {(int(i), int(j)) for i, j in zip(*np.nonzero(plan.kinds > 0), strict=True)}
    assert plan.computes.sum() == (plan.kinds > 0).sum()  # each computed once


@pytest.mark.parametrize(("q_len", "kv_len", "block_q", "block_k"), [(64, 64, 8, 8), (48, 80, 16, 8), (80, 48, 8, 16)])
def test_a_causal_plan_copies_what_the_cost_model_counts(q_len, kv_len, block_q, block_k):
    plan = viz.block_plan(q_len, kv_len, block_q, block_k, causal=True)
    assert not plan.compacted
    assert plan.copies == cost.kv_block_fetches(q_len, kv_len, block_q, block_k, causal=True)


def test_a_window_compacts_the_grid_to_its_reach():
    lengths = (64, 128, 256, 512)
    steps = {n: viz.block_plan(n, n, 8, 8, causal=True, window=(12, 0)).fetched.shape[1] for n in lengths}
    assert set(steps.values()) == {3}  # rows 8i..8i+7 reach back to 8i - 12: blocks i - 2 .. i
    assert viz.block_plan(64, 64, 8, 8, causal=True, window=(12, 0)).compacted


def test_the_pictures_draw_and_count():
    plan = viz.block_plan(32, 32, 8, 8, causal=True)
    fig = viz.plot_block_plan(plan)
    assert "6 plain, 4 masked, 6 skipped" in fig.axes[0].get_title()
    fig = viz.plot_fetch_schedule(plan)
    assert f"{plan.copies} k/v block copies, 16 grid steps" in fig.axes[0].get_title()
    assert viz.plot_visibility(viz.visibility(8, 8, causal=True), block_q=4, block_k=4).axes
    assert len(viz.plot_softcap((5.0, 10.0)).axes[0].lines) == 3
    assert "group 4" in viz.plot_head_groups(8, 2).axes[0].get_title()


def test_segment_patterns_cover_the_length():
    for name in widgets.SEGMENT_PATTERNS[1:]:
        for length in (8, 13, 64):
            ids = widgets.segment_pattern(name, length)
            assert len(ids) == length and ids == sorted(ids) and ids[0] == 0
    assert widgets.segment_pattern("none", 8) is None
    ids = widgets.design_segments("2 equal", 4, 8)  # the queries are the packed row's last 4 tokens
    assert ids == dict(q_segments=[1, 1, 1, 1], kv_segments=[0, 0, 0, 0, 1, 1, 1, 1])
    assert widgets.design_segments("2 equal", 6, 2) == dict(q_segments=[0, 0, 0, 1, 1, 1], kv_segments=[1, 1])


def test_mask_designer_redraws_and_carries_a_still_picture(shown):
    box = widgets.mask_designer(q_len=32, kv_len=48, block_q=8, block_k=8, causal=True, window=(8, 0))
    bundle = box._repr_mimebundle_()
    assert list(bundle) == [widgets.WIDGET_VIEW, "image/png", "text/plain"]
    assert "mask designer" in bundle["text/plain"]
    segments = box.children[2].children[1]
    assert segments.description == "segments"
    segments.value = "2 equal"
    titles = [ax.get_title() for ax in shown[-1].axes]
    assert any("masked" in title for title in titles) and any("compacted" in ax.get_xlabel() for ax in shown[-1].axes)


def test_mask_designer_offers_an_unbounded_side_that_a_dropdown_can_hold(shown):
    """ipywidgets reads a ``None`` value as no selection (a blank dropdown): "none" stands for it."""
    box = widgets.mask_designer(q_len=32, kv_len=48, block_q=8, block_k=8, causal=True, window=(None, 4))
    left, right = box.children[3].children
    assert (left.description, right.description) == ("left", "right")
    assert (left.value, left.label, left.index) == (widgets.NO_BOUND, "none", 0)
    assert (right.value, right.label) == (4, "4")
    right.value = widgets.NO_BOUND
    assert (right.label, right.index) == ("none", 0)
    assert shown[-1].axes[0].get_title() == "q_len 32, kv_len 48, window None"
    left.value = 8
    assert shown[-1].axes[0].get_title() == "q_len 32, kv_len 48, window (8, None)"


def test_the_segment_tables_in_numpy_are_the_kernels_tables():
    """The pictures compute :func:`flashlib.masks.segment_block_table` in NumPy (no JAX dispatch, no compile per
    shape, so the mask designer redraws at once): the same tables as the kernels' JAX ones."""
    from flashlib import masks  # noqa: PLC0415

    for q_len, kv_len, block_q, block_k, causal, window, segments in DESIGNS:
        ids = widgets.design_segments("4 short" if segments == "none" else segments, q_len, kv_len)
        num_q, num_kv = -(-q_len // block_q), -(-kv_len // block_k)
        q_ids = np.pad(np.asarray(ids["q_segments"]), (0, num_q * block_q - q_len))[None]
        kv_ids = np.pad(np.asarray(ids["kv_segments"]), (0, num_kv * block_k - kv_len))[None]
        band = viz.block_plan(q_len, kv_len, block_q, block_k, causal=causal, window=window).kinds > 0
        blocks = dict(outer_len=q_len, inner_len=kv_len, outer_block=block_q, inner_block=block_k, band_visible=band)
        in_jax = masks.segment_block_table(q_ids, kv_ids, **blocks)
        in_numpy = masks.segment_block_table(q_ids, kv_ids, **blocks, xp=np)
        assert all(isinstance(table, np.ndarray) for table in in_numpy)
        for want, got in zip(in_jax, in_numpy, strict=True):
            np.testing.assert_array_equal(np.asarray(want), got)


def test_a_big_fetch_schedule_is_a_few_artists_and_drops_unreadable_numbers():
    """A 24 x 24 grid: collections, not a patch (and a text) per cell, which took seconds to draw."""
    plan = viz.block_plan(96, 96, 4, 4, causal=True)
    fig = widgets.draw_mask_design(96, 96, 4, 4, True, None, None, "none")
    plan_ax, fetch_ax = fig.axes[1], fig.axes[2]
    assert not plan_ax.patches and not fetch_ax.patches and len(fetch_ax.collections) <= 6
    assert not fetch_ax.texts  # cells of a few points: the outlines and the title count the copies
    assert f"{plan.copies} k/v block copies" in fetch_ax.get_title()
    small = viz.plot_fetch_schedule(viz.block_plan(32, 32, 8, 8, causal=True))
    assert [t.get_text() for t in small.axes[0].texts] == [str(int(b)) for b in viz.block_plan(32, 32, 8, 8,
                                                                                              causal=True).fetched.ravel()]


def test_variant_estimates_table_is_complete_and_drawn():
    window = perf_plots.select(VARIANTS, kind="window")
    assert [r["T"] for r in window] == [2048, 4096, 8192, 16384, 32768]
    per_token = [r["cycles"] / r["T"] for r in window]
    assert max(per_token) / min(per_token) < 1.2  # the bar: linear in T within 1.2x
    gqa = perf_plots.select(VARIANTS, kind="gqa")
    assert {(r["causal"], r["kv_heads"]) for r in gqa} == {(c, h) for c in (False, True) for h in (8, 2, 1)}
    assert all(r["kv_bytes"] == 2 * r["kv_heads"] * 2048 * 128 * 2 for r in gqa)
    for row in gqa:  # the bar: a step shares its k/v copy among its heads, at no more cycles than MHA
        mha = perf_plots.select(gqa, causal=row["causal"], kv_heads=8)[0]
        assert row["kv_bytes_read"] * row["heads_per_step"] == mha["kv_bytes_read"]
        assert row["cycles"] <= mha["cycles"]
    fig = perf_plots.plot_gqa_estimates(gqa)
    bars = [patch.get_height() for patch in fig.axes[0].patches]
    assert bars == [1 / r["heads_per_step"] for r in sorted(gqa, key=lambda r: (r["causal"], -r["kv_heads"]))]
    assert list(fig.axes[0].lines[0].get_ydata()) == [1.0, 0.25, 0.125, 1.0, 0.25, 0.125]  # bytes held
    fig = perf_plots.plot_window_scaling(window)
    assert list(fig.axes[0].lines[0].get_ydata()) == [r["cycles"] for r in window]
