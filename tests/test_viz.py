"""The pictures draw headless, the data behind them matches the definitions, and the widgets redraw."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported anywhere: no display needed

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import PICTURE_TEST_MARKS  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from flashlib import viz, widgets  # noqa: E402

pytestmark = PICTURE_TEST_MARKS


def _scores(n: int = 20, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=n) * 2.0


# -- tiling_steps ----------------------------------------------------------------------------------


def _kinds(steps) -> dict[str, int]:
    return {kind: sum(s.kind == kind for s in steps) for kind in ("compute", "masked", "skipped")}


@pytest.mark.parametrize(("q_len", "kv_len", "bq", "bk"), [(256, 256, 64, 64), (100, 70, 32, 16), (8, 8, 8, 8)])
def test_tiling_steps_non_causal_computes_every_tile_row_major(q_len, kv_len, bq, bk):
    steps = viz.tiling_steps(q_len, kv_len, bq, bk)
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    assert _kinds(steps) == {"compute": nq * nk, "masked": 0, "skipped": 0}
    assert [(s.q_block, s.kv_block) for s in steps] == [(i, j) for i in range(nq) for j in range(nk)]  # kv fastest


@pytest.mark.parametrize("nq", [1, 2, 4, 7])
def test_tiling_steps_causal_square(nq):
    steps = viz.tiling_steps(nq * 32, nq * 32, 32, 32, causal=True)
    assert _kinds(steps) == {"compute": nq * (nq - 1) // 2, "masked": nq, "skipped": nq * (nq - 1) // 2}
    assert all(s.kind == "masked" for s in steps if s.q_block == s.kv_block)
    assert all(s.kind == "skipped" for s in steps if s.kv_block > s.q_block)


def test_tiling_steps_causal_is_bottom_right_aligned():
    # 4 queries, 8 keys: query i sees keys <= i + 4, so the second key block is cut by the diagonal, not skipped.
    assert viz.tiling_steps(4, 8, 4, 4, causal=True) == [(0, 0, "compute"), (0, 1, "masked")]
    # 8 queries, 4 keys: the first 4 queries see no key at all, the last 4 see a triangle.
    assert viz.tiling_steps(8, 4, 4, 4, causal=True) == [(0, 0, "skipped"), (1, 0, "masked")]


def test_tiling_steps_kinds_agree_with_the_elementwise_mask():
    q_len, kv_len, bq, bk = 45, 70, 16, 8
    visible = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + (kv_len - q_len)
    for i, j, kind in viz.tiling_steps(q_len, kv_len, bq, bk, causal=True):
        tile = visible[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
        assert kind == ("compute" if tile.all() else "skipped" if not tile.any() else "masked")


# -- online_softmax_trace --------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "block", "d"), [(20, 6, 3), (16, 4, None), (5, 8, 2)])
def test_online_softmax_trace_matches_direct_softmax(n, block, d):
    s = _scores(n)
    v = np.random.default_rng(1).normal(size=(n,) if d is None else (n, d))
    trace = viz.online_softmax_trace(s, v, block)
    assert len(trace) == -(-n // block)
    final = trace[-1]
    m = s.max()
    l = np.exp(s - m).sum()  # noqa: E741
    np.testing.assert_allclose(final["m"], m)
    np.testing.assert_allclose(final["l"], l)
    np.testing.assert_allclose(final["acc"], np.exp(s - m) @ v)
    l_final = final["l"] if d is None else final["l"][..., None]
    np.testing.assert_allclose(final["acc"] / l_final, np.exp(s - m) @ v / l)


def test_online_softmax_trace_alpha_and_running_state():
    s = np.array([0.0, 1.0, -2.0, 3.0, 5.0, 4.0, -1.0])
    trace = viz.online_softmax_trace(s, np.ones_like(s), 2)
    assert trace[0]["alpha"] == 0.0  # nothing to rescale before the first block (m_old = -inf)
    for prev, cur in zip(trace, trace[1:], strict=False):
        np.testing.assert_array_equal(cur["m_old"], prev["m"])
        np.testing.assert_allclose(cur["alpha"], np.exp(cur["m_old"] - cur["m"]))
    for t in trace:  # after each block: the state of the prefix, by definition
        seen = s[: t["hi"]]
        np.testing.assert_allclose(t["m"], seen.max())
        np.testing.assert_allclose(t["l"], np.exp(seen - seen.max()).sum())
    # blocks [0, 1] [-2, 3] [5, 4] [-1]: the max goes 1 -> 3 -> 5 -> 5
    assert [float(t["alpha"]) for t in trace[1:]] == pytest.approx([np.exp(1.0 - 3.0), np.exp(3.0 - 5.0), 1.0])


def test_online_softmax_trace_rows_and_masked_keys():
    s = np.array([[1.0, 2.0, -np.inf, 0.5], [-np.inf, -np.inf, 3.0, 1.0]])
    final = viz.online_softmax_trace(s, np.eye(4), 2)[-1]
    p = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(final["acc"] / final["l"][:, None], p / p.sum(axis=1, keepdims=True))
    first = viz.online_softmax_trace(s, np.eye(4), 2)[0]  # row 1 has seen no visible key yet: empty, not NaN
    assert first["m"][1] == -np.inf and first["l"][1] == 0.0 and not np.isnan(first["acc"]).any()


# -- pictures --------------------------------------------------------------------------------------


def _texts(fig: Figure) -> str:
    return " ".join(_text_list(fig))


def _text_list(fig: Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in [ax.title, *ax.texts]]


def test_plot_tiling_step_draws_every_step():
    steps = viz.tiling_steps(96, 128, 32, 32, causal=True)
    for step in (0, len(steps) // 2, len(steps) - 1):
        fig = viz.plot_tiling_step(96, 128, 32, 32, step, causal=True)
        assert isinstance(fig, Figure)
        assert f"grid step {step}/" in _texts(fig)
    with pytest.raises(ValueError, match="step"):
        viz.plot_tiling_step(64, 64, 32, 32, 4)


def test_plot_online_softmax_step():
    s = _scores(20)
    fig = viz.plot_online_softmax_step(s, 6, 1, values=np.arange(20.0))
    assert isinstance(fig, Figure)
    assert f"{viz.online_softmax_trace(s, np.ones(20), 6)[1]['l']:.4g}" in _texts(fig)


def test_the_online_softmax_picture_shows_weights_shrinking_by_alpha():
    s = np.array([0.0, 1.0, -1.0, 3.0, 0.5, 2.0])
    fig = viz.plot_online_softmax_step(s, 3, 1)  # block 1 raises the max from 1 to 3: alpha = e^-2
    ax = fig.axes[0]
    now, before = ax.containers[0], ax.containers[1]  # the weights, and the earlier block's outlines
    heights = np.array([bar.get_height() for bar in now])
    np.testing.assert_allclose(heights, np.exp(s - 3.0))  # every seen key against the running max
    outline = np.array([bar.get_height() for bar in before])
    np.testing.assert_allclose(heights[:3] / outline, np.exp(1.0 - 3.0))  # shrunk by alpha, all alike
    assert heights.max() == 1.0 and ax.get_ylabel().startswith("weight")
    scores = viz.plot_online_softmax_step(s, 3, 1, show="scores").axes[0]
    np.testing.assert_allclose([bar.get_height() for bar in scores.containers[0]], s)
    with pytest.raises(ValueError, match="show"):
        viz.plot_online_softmax_step(s, 3, 1, show="logits")


def test_plot_attention_map_and_given_axes():
    tokens = ["the", "cat", "sat", "down"]
    probs = np.full((4, 4), 0.25)
    fig = viz.plot_attention_map(probs, tokens, title="uniform")
    assert isinstance(fig, Figure) and [t.get_text() for t in fig.axes[0].get_yticklabels()] == tokens
    host = viz.new_figure((4, 4))
    assert viz.plot_attention_map(probs[:2], tokens[:2], tokens, ax=host.add_subplot()) is host
    with pytest.raises(ValueError, match="shape"):
        viz.plot_attention_map(probs, tokens[:3])


def test_plot_memory_scaling_and_hbm_traffic():
    lengths = [256, 512, 1024, 2048]
    series = {"naive": [4.0 * n * n for n in lengths], "tiled": [512.0 * n for n in lengths]}
    fig = viz.plot_memory_scaling(lengths, series)
    assert isinstance(fig, Figure) and len(fig.axes[0].lines) == 4  # two series, two guides
    guide_starts = [line.get_ydata()[0] for line in fig.axes[0].lines[2:]]
    assert guide_starts == [512.0 * 256] * 2  # the lowest first point
    at_naive = viz.plot_memory_scaling(lengths, series, guides_at="naive")
    assert [line.get_ydata()[0] for line in at_naive.axes[0].lines[2:]] == [0.5 * 4.0 * 256 * 256] * 2
    assert fig.axes[0].get_xlim()[1] > lengths[-1]  # room right of the last length for the guides' labels
    traffic = {"naive": {n: 12.0 * n * n for n in lengths}, "tiled": {n: 2048.0 * n for n in lengths}}
    fig = viz.plot_hbm_traffic(traffic)
    assert isinstance(fig, Figure)
    assert "×6" in _texts(fig)  # 12 * 512**2 / (2048 * 512)


def test_plot_kv_schedule_counts_copies():
    steps = viz.tiling_steps(256, 256, 64, 128, causal=True)  # 4 query blocks x 2 kv steps
    clamped = [min(s.kv_block, ((s.q_block + 1) * 64 - 1) // 128) for s in steps]  # [0, 0, 0, 0, 0, 1, 0, 1]
    fig = viz.plot_kv_schedule(steps, clamped, title="clamped")
    assert "clamped\n4 k/v block copies for 8 grid steps" in _text_list(fig)
    fig = viz.plot_kv_schedule(steps, [s.kv_block for s in steps])
    assert "8 k/v block copies for 8 grid steps" in _text_list(fig)
    with pytest.raises(ValueError, match="one fetched block per step"):
        viz.plot_kv_schedule(steps, clamped[:-1])



def test_plot_q_schedule_draws_key_blocks_as_rows_and_counts_copies():
    # The dK/dV grid of 256 causal tokens in 64 x 128 blocks: key block j first meets query block 2 * j.
    steps = sorted(viz.tiling_steps(256, 256, 64, 128, causal=True), key=lambda s: (s.kv_block, s.q_block))
    clamped = [max(s.q_block, s.kv_block * 128 // 64) for s in steps]  # [0, 1, 2, 3, 2, 2, 2, 3]
    fig = viz.plot_q_schedule(steps, clamped, title="clamped")
    ax = fig.axes[0]
    assert "clamped\n6 q/dO block copies for 8 grid steps" in _text_list(fig)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("query grid step i", "key block j")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1"]  # two key blocks, as rows
    assert len(ax.get_xticklabels()) == 4  # four query steps, as columns
    assert "8 q/dO block copies" in _texts(viz.plot_q_schedule(steps, [s.q_block for s in steps]))
    with pytest.raises(ValueError, match="one fetched block per step"):
        viz.plot_q_schedule(steps, clamped[:-1])

def test_plot_vmem_budget_totals_and_limits():
    mib = 2**20
    configs = {"small": {"blocks": 2 * mib, "scratch": 1 * mib}, "big": {"blocks": 12 * mib, "scratch": 8 * mib}}
    fig = viz.plot_vmem_budget(configs, {"v5e": 16 * mib, "v6e": 32 * mib}, title="budget")
    texts = _text_list(fig)
    assert " 3.0 MiB" in texts and " 20.0 MiB" in texts
    limits = [line.get_label() for line in fig.axes[0].lines]
    assert limits == ["v5e: 16 MiB", "v6e: 32 MiB"]  # in the legend, where two close limits cannot collide
    over = [t for t in fig.axes[0].texts if t.get_text() == " 20.0 MiB"][0]
    assert over.get_color() == viz.PALETTE["masked"]  # over the smallest limit: red
    assert len(fig.axes[0].patches) == 4  # two bars of two parts


def test_plot_tpu_anatomy_names_every_memory_and_unit():
    fig = viz.plot_tpu_anatomy(hbm="32 GB · 1640 GB/s", chip="TPU v6e")
    texts = _text_list(fig)
    for name in ("HBM", "VMEM", "scalar unit + SMEM", "VPU", "EUP", "XLU", "MXU", "8 sublanes", "128 lanes →"):
        assert name in texts, name
    assert any("32 GB · 1640 GB/s" in t for t in texts) and "one TensorCore (TPU v6e)" in texts


def test_plot_matmul_step_phases_and_finish_order():
    grid = (2, 2, 3)
    visits = [(i, j, k) for i in (1, 0) for j in (0, 1) for k in range(3)]  # row 1 first, as a shuffle may do
    titles = [_text_list(viz.plot_matmul_step(grid, visits, step)) for step in range(len(visits))]
    assert any("init acc, acc += X·Y" in t for t in titles[0])
    assert any(t.endswith("acc += X·Y, write O") for t in titles[2])
    assert not any("init" in t or "write O" in t for t in titles[1])
    last = titles[-1]
    assert {"#1", "#2", "#3"} <= set(last) and "#4" not in last  # three output blocks finished before the last step
    with pytest.raises(ValueError, match="step must be in"):
        viz.plot_matmul_step(grid, visits, len(visits))


def test_format_bytes():
    assert [viz.format_bytes(b) for b in (512, 1000, 1536, 3 * 2**30)] == ["512 B", "1000 B", "1.5 KiB", "3 GiB"]


def test_filmstrip_animation_and_jshtml():
    def draw(step, ax):
        viz.plot_tiling_step(64, 64, 32, 32, step, causal=True, ax=ax, legend=False)

    fig = viz.filmstrip(draw, range(4), ncols=3)
    assert isinstance(fig, Figure)
    assert sum(ax.get_visible() for ax in fig.axes) == 4  # 2x3 grid, the two spare panels hidden
    html = viz.to_jshtml(viz.animate(draw, range(2), figsize=(3, 3)))
    assert isinstance(html, str) and "<script" in html


# -- widgets ---------------------------------------------------------------------------------------


def _slider(box):
    controls = box.children[0]
    return controls.children[1]


def test_step_through_redraws_on_slider_change(shown):
    import ipywidgets

    calls = []
    box = widgets.step_through(lambda step, ax: calls.append(step), 5, description="k")
    assert isinstance(box, ipywidgets.VBox) and isinstance(box.children[1], ipywidgets.Output)
    play, slider = box.children[0].children
    assert (play.max, slider.max, slider.description) == (4, 4, "k")
    slider.value = 3
    assert calls == [0, 0, 3] and len(shown) == 2  # step 0 shown, step 0 again as the still picture, step 3


def test_an_explorer_carries_a_still_picture_for_frontends_without_a_kernel(monkeypatch):
    """A static render (GitHub, nbconvert's HTML) picks the PNG, not the ``VBox(children=...)`` repr; a live
    frontend picks the widget view, listed first."""
    import base64

    import IPython.display

    box = widgets.tiling_explorer(128, 128, 64, 32, causal=True)
    bundle = box._repr_mimebundle_()
    assert list(bundle) == [widgets.WIDGET_VIEW, "image/png", "text/plain"]
    assert bundle[widgets.WIDGET_VIEW]["model_id"] == box.model_id
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    assert "interactive widget" in bundle["text/plain"] and "VBox" not in bundle["text/plain"]
    displayed = []
    monkeypatch.setattr(IPython.display, "display", lambda data, raw=False: displayed.append((data, raw)))
    box._ipython_display_()  # what IPython calls with ipywidgets 7 (Colab's)
    assert displayed == [(bundle, True)]


def test_tiling_explorer_redraws(shown):
    box = widgets.tiling_explorer(128, 128, 64, 32, causal=True)
    assert _slider(box).max == 7
    _slider(box).value = 5
    assert len(shown) == 2
    assert "grid step 0/7" in _texts(shown[0]) and "grid step 5/7" in _texts(shown[1])


def test_online_softmax_explorer_redraws(shown):
    s = _scores(12)
    box = widgets.online_softmax_explorer(s, np.arange(12.0), 4)
    assert _slider(box).max == 2
    _slider(box).value = 2
    assert "after block 0/2" in _texts(shown[0]) and "after block 2/2" in _texts(shown[1])


# -- decoding: the block table and split-KV's merge --------------------------------------------------------------


def test_plot_block_table_draws_an_arrow_per_live_page_and_marks_the_rest():
    from matplotlib.patches import FancyArrowPatch  # noqa: PLC0415

    table = np.array([[7, 2, 9, 0], [5, 11, 3, 8]])
    fig = viz.plot_block_table(table, [13, 6], page_size=4, num_pages=12)
    texts = _text_list(fig)
    arrows = [p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == 4 + 2  # ceil(13 / 4) and ceil(6 / 4) live pages
    assert "[0,3] = 0" in texts and "[1,1] = 11" in texts
    assert "not yet read\n(table says 3)" in texts and "not yet read\n(table says 8)" in texts
    assert {"3  named, not yet read", "8  named, not yet read"} <= set(texts)  # named by sequence 1's row, unread
    assert {"1  free", "4  free", "6  free", "10  free"} <= set(texts) and "7" in texts  # no entry names them
    with pytest.raises(ValueError, match="one length per row"):
        viz.plot_block_table(table, [13], page_size=4, num_pages=12)
    with pytest.raises(ValueError, match="lengths must be from 0 to 16"):
        viz.plot_block_table(table, [17, 6], page_size=4, num_pages=12)
    big = viz.plot_block_table(np.array([[1, 0]]), [300], page_size=256, num_pages=2)  # one bar a page, not 256
    assert len(big.axes[0].patches) < 30


def test_plot_paged_grid_copies_each_live_page_once_and_skips_the_rest():
    table = np.array([[7, 2, 9, 0], [5, 11, 3, 8]])
    fig = viz.plot_paged_grid(table, [13, 6], page_size=4)
    texts = _text_list(fig)
    copies = [t for t in texts if t.startswith("copy page")]
    assert copies == ["copy page 7", "copy page 2", "copy page 9", "copy page 0", "copy page 5", "copy page 11"]
    assert texts.count("page 11 again:\nno copy") == 2 and texts.count("compute skipped") == 2  # table's 3, 8 unread
    assert "key 12\n3 slots masked" in texts and "keys 4–5\n2 slots masked" in texts and "keys 8–11" in texts
    assert "step j = 0 (init)" in texts and "step j = 3 (finalize)" in texts
    with pytest.raises(ValueError, match="one length per row"):
        viz.plot_paged_grid(table, [13], page_size=4)
    with pytest.raises(ValueError, match="lengths must be from 1 to 16"):
        viz.plot_paged_grid(table, [0, 6], page_size=4)
    big = viz.plot_paged_grid(np.array([[1, 0, 2]]), [300], page_size=256)  # one bar a page, not 256 slots
    assert len(big.axes[0].patches) < 30 and "keys 256–299\n212 slots masked" in _text_list(big)

def test_plot_pages_per_step_groups_the_pages_and_copies_no_dead_page():
    row = [7, 2, 9, 0, 11, 5, 3, 8, 10, 1, 6, 4]
    fig = viz.plot_pages_per_step(row, 38, page_size=4)  # 10 live pages, the last holding 2 tokens
    texts = _text_list(fig)
    one = texts[1]  # after the title
    assert one.startswith("pages_per_step = 1: 12 grid steps") and one.endswith("10 page copies, one copy a step")
    four = next(t for t in texts if t.startswith("pages_per_step = 4"))
    assert "3 grid steps" in four and "10 page copies, up to 4 copies in flight a step" in four
    assert texts.count("step 11") == 1 and texts.count("step 2") == 2 and "step 12" not in texts
    assert texts.count("= 1") == 2  # one page a step: steps 10 and 11 repeat page 9 (pool page 1)
    assert "= 3" in texts and "= 8" in texts  # four a step: copies 2 and 3 repeat their own pages 6 and 7
    assert all(texts.count(str(page)) == 2 for page in row[:10])  # each live page copied once in each row
    assert "6" not in texts and "4" not in texts  # the table's dead pages are never copied
    with pytest.raises(ValueError, match="length must be from 1 to 48"):
        viz.plot_pages_per_step(row, 49, page_size=4)
    with pytest.raises(ValueError, match="each pages_per_step must be from 1 to 12"):
        viz.plot_pages_per_step(row, 38, page_size=4, options=(1, 13))
    big = viz.plot_pages_per_step([3, 0, 2, 1], 700, page_size=256, options=(2,))  # one bar a page
    assert len(big.axes[0].patches) < 30 and "= 0" in _text_list(big)  # copy 1 repeats page 1 (pool page 0)


def test_split_weights_and_plot_split_kv():
    m, l = [1.0, 3.0, -np.inf], [2.0, 1.0, 0.0]  # noqa: E741
    top, total, weights = viz.split_weights(m, l)
    assert top == 3.0 and total == pytest.approx(2.0 * np.exp(-2.0) + 1.0)
    np.testing.assert_allclose(weights, [2.0 * np.exp(-2.0) / total, 1.0 / total, 0.0])
    assert viz.split_weights([-np.inf], [0.0])[1:] == (0.0, pytest.approx([0.0]))  # no split saw a key
    fig = viz.plot_split_kv([(0, 8), (8, 16), (16, 24)], m, l, length=14)
    texts = " ".join(_text_list(fig))
    assert "m_2 = −∞" in texts and "(no key)" in texts and "length 14" in texts
    assert f"{100 * weights[0]:.0f}%" in texts and "0%" in texts and f"l = {total:.4g}" in texts and "Σ" not in texts
    with pytest.raises(ValueError, match="one \\(m, l\\) per split"):
        viz.plot_split_kv([(0, 8)], m, l, length=8)


def test_plot_chunk_pairs_draws_a_square_per_pair_and_a_legend():
    pairs = [[{(d, s): "diagonal" if s == d else "full" if s < d else "skip"} for d in range(3)] for s in range(2)]
    fig = viz.plot_chunk_pairs(pairs)
    ax = fig.axes[0]
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted(f"{d},{s}" for d in range(3) for s in range(2))  # one square per (step, device) pair
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["full", "diagonal", "skip"]
    assert len([p for p in ax.patches if p.__class__.__name__ == "Polygon"]) == 4  # 2 diagonals, two halves each
    squares = [p for p in ax.patches if p.__class__.__name__ == "Rectangle"]
    for text in ax.texts:  # a diagonal's label sits in its masked upper-right half, clear of the triangle
        a, b = map(int, text.get_text().split(","))
        x, y = text.get_position()
        (square,) = [p for p in squares if 0 < x - p.get_x() < 1 and 0 < y - p.get_y() < 1]
        dx, dy = x - square.get_x(), y - square.get_y()
        assert (dx + dy > 1.2 if a == b else (dx, dy) == (0.5, 0.5)), (a, b, dx, dy)
    assert "query chunks down, key/value chunks across" in ax.get_xlabel()


def test_plot_ring_work_outlines_every_busiest_device_and_none_where_all_tie():
    work = np.array([[2, 2, 2, 2], [0, 4, 4, 1], [0, 0, 3, 4]])  # a tie of all, a tie of two, one busiest
    ax = viz.plot_ring_work(work).axes[0]
    outlined = sorted((round(p.get_y() + 0.5), round(p.get_x() + 0.5)) for p in ax.patches)
    assert outlined == [(1, 1), (1, 2), (2, 3)]  # (step, device)
