"""The performance pictures build from the committed tables, and the numbers drawn on them are the tables'."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported anywhere: no display needed

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import PICTURE_TEST_MARKS  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from flashlib import hardware, perf_plots, tuning, widgets  # noqa: E402
from flashlib.hardware import MIB  # noqa: E402
from flashlib.kernels.block_sizes import BlockSizes  # noqa: E402

pytestmark = PICTURE_TEST_MARKS

ESTIMATES = tuning.TABLE_PATH.parents[1] / "estimates"
BLOCK_SWEEP = perf_plots.read_table(ESTIMATES / "block_sweep.csv")
SEQ_SWEEP = perf_plots.read_table(ESTIMATES / "seq_sweep.csv")
TABLE = tuning.load_tuned_table()


def _texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts + [ax.title, ax.xaxis.label])


def _entry(generation: str, seq: int, causal: bool = False, head_dim: int = 128) -> tuning.TuningResult:
    return TABLE[tuning.TableKey(generation, "bfloat16", causal, head_dim, seq, seq)]


# -- reading ---------------------------------------------------------------------------------------


def test_read_table_skips_provenance_and_converts_cells(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("# made by hand\nname,n,x,flag,empty\na,3,0.5,True,\n")
    assert perf_plots.read_table(path) == [{"name": "a", "n": 3, "x": 0.5, "flag": True, "empty": None}]
    assert perf_plots.read_table(tmp_path / "absent.csv") == []
    assert perf_plots.select([{"a": 1, "b": 2}, {"a": 1, "b": 3}], a=1, b=3) == [{"a": 1, "b": 3}]


def test_committed_tables_are_complete():
    assert {(r["generation"], r["block_q"], r["block_k"]) for r in BLOCK_SWEEP} == {
        (g, bq, bk) for g in ("v5e", "v6e") for bq in (128, 256, 512, 1024) for bk in (128, 256, 512, 1024)}
    assert {(r["generation"], r["impl"], r["seq"]) for r in SEQ_SWEEP} == {
        (g, i, s) for g in ("v5e", "v6e") for i in ("xla", "pallas", "jax_flash") for s in (128, 256, 512, 1024, 2048,
                                                                                            4096)}
    ok = [r for r in SEQ_SWEEP if r["status"] == "ok"]
    assert ok and all(r["cycles"] >= r["mxu_floor"] > 0 and r["hbm_bytes"] > 0 for r in ok)


# -- block grids -----------------------------------------------------------------------------------


def _best_per_cell(entry: tuning.TuningResult) -> dict[tuple[int, int], tuning.Trial]:
    """Per (block_q, block_k): the trial with the fewest cycles (over block_k_major), else the first one."""
    cells: dict[tuple[int, int], tuning.Trial] = {}
    for trial in entry.trials:
        held = cells.get((trial.block_q, trial.block_k))
        if held is None or (trial.ok and (not held.ok or trial.cycles < held.cycles)):
            cells[trial.block_q, trial.block_k] = trial
    return cells


def test_block_grid_of_a_tuned_entry_holds_its_best_trial_per_cell():
    entry = _entry("v5e", 2048)
    grid = perf_plots.block_grid(entry)
    cells = _best_per_cell(entry)
    assert len(cells) == grid.cycles.size
    for (block_q, block_k), trial in cells.items():
        i, j = grid.block_qs.index(block_q), grid.block_ks.index(block_k)
        assert grid.status[i, j] == trial.status
        assert (np.isnan(grid.cycles[i, j]) if trial.cycles is None else grid.cycles[i, j] == trial.cycles)
    assert grid.best == (entry.best.block_q, entry.best.block_k) and grid.mxu_floor == entry.mxu_floor


def test_block_grid_needs_a_generation_for_rows():
    with pytest.raises(ValueError, match="generation="):
        perf_plots.block_grid(BLOCK_SWEEP)


def test_plot_block_cycles_labels_every_cell_from_the_table():
    entry = _entry("v5e", 2048)
    texts = _texts(perf_plots.plot_block_cycles(perf_plots.block_grid(entry)))
    for trial in _best_per_cell(entry).values():
        if trial.ok:
            assert f"{trial.cycles / 1e3:,.0f}k\n×{trial.cycles / entry.best.cycles:.2f}" in texts
    assert "refused\n(VMEM)" in texts and "×1.00" in texts
    crashed = perf_plots.BlockGrid((512,), (512, 1024), np.array([[np.nan, 2e5]]),
                                   np.array([["profiler_crash", "ok"]], dtype=object), 65_536.0, "synthetic")
    assert "profiler\ncrash" in _texts(perf_plots.plot_block_cycles(crashed))


def test_fit_step_cost_recovers_a_known_line_and_fits_the_sweep():
    rows = [dict(status="ok", grid_steps=s, cycles=900 * s + 100_000, mxu_floor=65_536) for s in (8, 64, 512)]
    rows.append(dict(status="refused", grid_steps=4, cycles=None, mxu_floor=None))
    fit = perf_plots.fit_step_cost(rows)
    assert fit.per_step == pytest.approx(900) and fit.rest == pytest.approx(100_000)
    assert fit.mxu_per_step[64] == 1024
    with pytest.raises(ValueError, match="at least two"):
        perf_plots.fit_step_cost(rows[:1])
    for generation in ("v5e", "v6e"):
        sweep = perf_plots.select(BLOCK_SWEEP, generation=generation, status="ok")
        fit = perf_plots.fit_step_cost(sweep)
        assert fit.per_step > 0 and fit.rest > 0
        smallest = perf_plots.select(sweep, block_q=128, block_k=128)[0]  # the most steps: the fit must hold there
        assert fit.per_step * smallest["grid_steps"] + fit.rest == pytest.approx(smallest["cycles"], rel=0.15)
        fig = perf_plots.plot_step_cost(sweep, fit)
        assert f"{fit.per_step:,.0f} cycles per step" in fig.axes[0].get_legend().texts[0].get_text()
        (points,) = fig.axes[0].collections
        assert sorted(map(tuple, points.get_offsets())) == sorted((r["grid_steps"], r["cycles"]) for r in sweep)


def test_plot_vmem_by_blocks_draws_the_block_sizes_estimate():
    fig = perf_plots.plot_vmem_by_blocks(128, jnp.bfloat16, block_qs=(256, 1024), block_ks=(256, 512, 1024))
    lines = [line for line in fig.axes[0].lines if line.get_label().startswith("block_q=")]
    assert [line.get_label() for line in lines] == ["block_q=256", "block_q=1024"]
    expected = [BlockSizes(1024, bk).vmem_bytes(128, jnp.bfloat16) / MIB for bk in (256, 512, 1024)]
    np.testing.assert_allclose(lines[1].get_ydata(), expected)
    limits = [line.get_label() for line in fig.axes[0].lines if "scoped limit" in line.get_label()]
    assert limits == ["v5e scoped limit 16 MiB", "v6e scoped limit 32 MiB"]  # legend entries: no text collides


# -- implementations -------------------------------------------------------------------------------


def test_roofline_points_and_plot_match_the_sweep():
    chip = hardware.CHIPS["v5e"]
    points = perf_plots.roofline_points(SEQ_SWEEP, "v5e")
    rows = perf_plots.select(SEQ_SWEEP, generation="v5e", status="ok")
    assert len(points) == len(rows)
    for point, row in zip(points, rows, strict=True):
        flops = 4 * 8 * row["seq"] ** 2 * 128
        assert point.intensity == pytest.approx(flops / row["hbm_bytes"])
        assert point.tflops == pytest.approx(flops / (row["cycles"] / chip.clock_hz) / 1e12)
    fig = perf_plots.plot_roofline(points, "v5e")
    drawn = {line.get_label(): line for line in fig.axes[0].lines}
    pallas = sorted((p for p in points if p.impl == "pallas"), key=lambda p: p.seq)
    np.testing.assert_allclose(drawn["flashlib (Pallas)"].get_ydata(), [p.tflops for p in pallas])
    assert f"ridge {chip.ridge_point:.0f} FLOP/B" in _texts(fig)
    no_bytes = [dict(rows[0], hbm_bytes=None)]  # a compile without cost analysis has no place on the roofline
    assert perf_plots.roofline_points(no_bytes, "v5e") == []


def test_plot_seq_sweep_labels_flashlib_over_xla():
    fig = perf_plots.plot_seq_sweep(SEQ_SWEEP, "v6e")
    texts = _texts(fig)
    for seq in (128, 4096):
        (ours,) = perf_plots.select(SEQ_SWEEP, generation="v6e", impl="pallas", seq=seq)
        (xla,) = perf_plots.select(SEQ_SWEEP, generation="v6e", impl="xla", seq=seq)
        assert f"×{ours['cycles'] / xla['cycles']:.2f}" in texts
    assert {line.get_label() for line in fig.axes[0].lines} >= {"XLA (fused)", "flashlib (Pallas)", "MXU floor"}


# -- the optimisation story ------------------------------------------------------------------------

STEPS = [
    dict(step=0, change="baseline kernel", cycles=200_000, jax_best=180_000, mxu_floor=131_072),
    dict(step=1, change="bigger blocks", cycles=150_000, jax_best=180_000, mxu_floor=131_072),
]


def test_plot_optimisation_steps_bars_are_the_rows():
    fig = perf_plots.plot_optimisation_steps(STEPS)
    heights = [patch.get_height() for patch in fig.axes[0].patches]
    assert heights == [200_000, 150_000]
    assert "150k\n×0.75" in _texts(fig) and "JAX's best 180k" in fig.axes[0].get_legend().texts[0].get_text()
    with pytest.raises(ValueError, match="at least one row"):
        perf_plots.plot_optimisation_steps([])


def test_group_steps_keeps_the_best_row_per_step_and_shape():
    rows = [dict(step=0, generation="v5e", seq=2048, causal=False, cycles=300),
            dict(step=0, generation="v6e", seq=2048, causal=False, cycles=200),
            dict(step=1, generation="v5e", seq=2048, causal=False, cycles=250),
            dict(step=1, generation="v5e", seq=2048, causal=False, cycles=240),
            dict(step=2, generation="v5e", seq=2048, causal=False, cycles=None),
            dict(step=3, generation="v5e", seq=2048, causal=False, cycles="profiler_crash"),
            dict(step="jax", generation="v5e", seq=2048, causal=False, cycles=100)]
    story = perf_plots.group_steps(rows, "cycles", skip_steps=("jax",))
    assert list(story) == [("v5e", 2048, False), ("v6e", 2048, False)]
    assert [r["cycles"] for r in story[("v5e", 2048, False)]] == [300, 240]


def test_plot_block_cycles_colours_the_multiple_of_the_best_on_one_scale():
    """Two panels whose ranges differ: a cell 1% off the best gets the same colour in both."""
    narrow = perf_plots.BlockGrid((256, 512), (256,), np.array([[100.0], [101.0]]), np.array([["ok"], ["ok"]]),
                                  1.0, "narrow")
    wide = perf_plots.BlockGrid((256, 512), (256,), np.array([[100.0], [300.0]]), np.array([["ok"], ["ok"]]),
                                1.0, "wide")
    colours = []
    for grid in (narrow, wide):
        image = perf_plots.plot_block_cycles(grid).axes[0].images[0]
        colours.append(image.cmap(image.norm(image.get_array()))[..., :3])
    np.testing.assert_allclose(colours[0][0, 0], colours[1][0, 0])  # the best: the same, lightest colour
    assert np.abs(colours[0][1, 0] - colours[0][0, 0]).max() < 0.05  # 1% off looks like the best
    assert np.abs(colours[1][1, 0] - colours[1][0, 0]).max() > 0.3  # 3x off is dark


def test_the_step_chart_never_repeats_a_series_style():
    shapes = [(g, n, c) for g in ("v5e", "v6e") for n in (2048, 4096, 8192) for c in (False, True)]
    fig = perf_plots.plot_steps_vs_baseline({shape: STEPS for shape in shapes})
    styles = [(line.get_color(), line.get_linestyle(), line.get_marker()) for line in fig.axes[0].lines
              if line.get_label() != "JAX's best"]
    assert len(styles) == 12 and len(set(styles)) == 12


def test_plot_steps_vs_baseline_draws_each_shape_over_jax():
    story = {("v5e", 2048, False): STEPS, ("v6e", 2048, True): [dict(STEPS[1], step=2, jax_best=100_000)]}
    fig = perf_plots.plot_steps_vs_baseline(story)
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    np.testing.assert_allclose(lines["v5e 2048"].get_ydata(), [200 / 180, 150 / 180])
    assert list(lines["v6e 2048 causal"].get_xdata()) == [2] and lines["v6e 2048 causal"].get_ydata()[0] == 1.5
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["0", "1", "2"]


def test_steps_table_ratios():
    lines = perf_plots.steps_table(STEPS, width=20).splitlines()
    assert lines[2].split()[-3:] == ["150,000", "0.75", "0.83"] and "bigger blocks" in lines[2]
    later = [dict(STEPS[0], jax_best=None), dict(STEPS[1], step="1-fold", jax_best=None)]
    later[0]["jax_best"] = 300_000  # only the first row names JAX's best: the others are compared with it
    lines = perf_plots.steps_table(later, width=20).splitlines()
    assert lines[2].startswith("1-fold") and lines[2].split()[-1] == "0.50"


# -- the widget ------------------------------------------------------------------------------------


def test_block_size_explorer_redraws_from_the_table(shown):
    box = widgets.block_size_explorer(TABLE)
    generation, seq = box.children[0].children
    head_dim, causal = box.children[1].children
    assert set(generation.options) == {key.generation for key in TABLE}
    assert list(seq.options) == sorted({key.q_len for key in TABLE}) and 4096 in seq.options
    entry = _entry(generation.value, seq.value, causal.value, head_dim.value)
    assert f"best q{entry.best.block_q}/k{entry.best.block_k}: {entry.best.cycles:,} cycles" in _texts(shown[0])
    seq.value = 4096
    generation.value = "v6e"
    entry = _entry("v6e", 4096, causal.value, head_dim.value)
    assert len(shown) == 3 and f"{entry.best.cycles:,} cycles" in _texts(shown[-1])
    with pytest.raises(ValueError, match="table is empty"):
        widgets.block_size_explorer({})


def test_step_names_wrap_between_words_not_inside_them():
    assert perf_plots._step_label("fused_dq_defaults") == "fused_dq_\ndefaults"
    assert perf_plots._step_label("bigger blocks") == "bigger\nblocks" and perf_plots._step_label("0") == "0"


def test_decode_roofline_points_and_plot():
    chip = hardware.CHIPS["v5e"]
    table = perf_plots.select(perf_plots.read_table(ESTIMATES / "decode_v5e.csv"), batch=1, num_splits=1, block_k=2048)
    assert perf_plots.decode_roofline_points([r for r in table if r["kind"] == "guarded"], "v5e") == []  # not kept
    rows = [r for r in table if r["kind"] in ("contiguous", "forward")]
    points = perf_plots.decode_roofline_points(table, "v5e")
    assert len(points) == len(rows) == 6
    for row, point in zip(rows, points, strict=True):
        assert point.intensity == pytest.approx(8.0)  # 32 query heads on 4 kv heads, bf16: heads / (kv_heads * 2)
        flops = 4 * 32 * row["kv_len"] * 128
        assert point.tflops == pytest.approx(flops / (row["cycles"] / chip.clock_hz) / 1e12)
        assert point.tflops < chip.hbm_bandwidth * point.intensity / 1e12  # under the roof
    mha = perf_plots.decode_roofline_points(rows[:1], "v5e", kv_heads=32)
    assert mha[0].intensity == pytest.approx(1.0)
    prefill = [p._replace(impl="prefill") for p in perf_plots.roofline_points(SEQ_SWEEP, "v5e") if p.impl == "pallas"]
    fig = perf_plots.plot_decode_roofline(points + prefill, "v5e")
    labels = {line.get_label() for line in fig.axes[0].lines}
    assert {"decode kernel, 1 new token", "training kernel, 1 new token",
            "prefill (flashlib forward, q_len = T, non-causal)"} <= labels
    texts = _texts(fig)
    assert "T=4k, 16k, 64k" in texts and "T=128" in texts and "T=512" in texts and "T=4096" in texts
    assert "memory bound" in texts and "compute bound" in texts and f"ridge {chip.ridge_point:.0f} FLOP/B" in texts
