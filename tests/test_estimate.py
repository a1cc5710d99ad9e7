"""flashlib.estimate and flashlib.llo_dump: parsing libtpu's dumps, the arithmetic, the errors, real estimates.

The parsing and arithmetic tests run anywhere. Tests that compile (``@pytest.mark.tpu``) need libtpu, and the
estimates themselves a libtpu new enough to know the profile flag (the newest-jax environment, not Colab's
0.0.23); each compile runs in a subprocess and takes a few seconds.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from flashlib import cost, env, estimate, hardware, llo_dump, provenance
from flashlib.estimate import CycleEstimate

DATA = Path(__file__).parent / "data"
needs_profile = pytest.mark.skipif(
    not estimate.supports_static_profile(),
    reason=f"libtpu {estimate.libtpu_version()} predates the static profile flag (needs >= "
    f"{'.'.join(map(str, estimate.MIN_LIBTPU))}, the newest-jax environment)",
)

# ---------------------------------------------------------------------------------------------------
# Parsing (real files written by libtpu 0.0.50.1)
# ---------------------------------------------------------------------------------------------------


def test_profile_of_jax_flash_attention_sample():
    text = (DATA / "sample_static_llo_profile.textproto").read_text()
    assert llo_dump.profile_cycles(text) == {"flash_attention.1": 178_098}
    fields = llo_dump.parse_textproto(text)["hlo_op_estimate"][0]
    assert fields["dma_instruction_type"] == ["DMA_INSTRUCTION_TYPE_LOCAL"] and fields["scalar_inputs"] == [0]


def test_profile_with_a_nested_instruction_sample():
    text = (DATA / "sample_pad_static_llo_profile.textproto").read_text()
    assert llo_dump.profile_cycles(text) == {"pad.4.q_ref": 0}
    instruction = llo_dump.parse_textproto(text)["hlo_op_estimate"][0]["hlo_instruction"][0]
    assert instruction["opcode"] == ["pad"] and instruction["shape"][0]["dimensions"] == [1, 8, 1024, 128]


def test_read_profile_dir_collects_every_profile():
    assert llo_dump.read_profile_dir(DATA) == {"flash_attention.1": 178_098, "pad.4.q_ref": 0}


def test_textproto_syntax():
    text = '''# a comment
    a: 1  b: -2.5e3 flag: true name: "x \\"y\\"" kind: ENUM_VALUE
    m { k: 1 } m < k: 2 >; list: [1, 2]
    '''
    tree = llo_dump.parse_textproto(text.replace("list: [1, 2]", ""))
    assert tree["a"] == [1] and tree["b"] == [-2500.0] and tree["flag"] == [True]
    assert tree["name"] == ['x "y"'] and tree["kind"] == ["ENUM_VALUE"]
    assert tree["m"] == [{"k": [1]}, {"k": [2]}]
    assert llo_dump.profile_cycles('x { hlo_op_name: "k" estimated_cycles: 5 } y { hlo_op_name: "k" '
                                   "estimated_cycles: 7 }") == {"k": 12}  # the same op twice is summed
    with pytest.raises(ValueError, match="not closed"):
        llo_dump.parse_textproto("m { k: 1")


BUNDLES = """\
= control target key start
LB: loop body
= control target key end

     0   :  { %s1_s0 = inlined_call_operand.hbm [shape: bf16[1,8,2048,128], index: 0] /* a = b */ }
  0x25   : > { %7713 = dma.hbm_to_vmem [thread:$0]  (!%p8969_p8), /*hbm=*/%s227_s7, /*size_in_granules=*/4096 }
 0x140   : > { %1046 = vmatmul.bf16.vlgmr.msra.gmra.mxu0 %v7410_v38 }
 0x141   : > { %4466 = vmatpush.bf16.msrb.mxu0 %v7481_v36  ;;  %1215 = vmatmul.bf16.vlgmr.msra.gmra.mxu1 %v7410 }
 0x152   : > { %1558 = vmatmul.bf16.gmra.mxu3 %v7411_v39  ;;  %v7494_v39 = vld [vmem:[%s9098_s2 + $0xa0] sm:$0xff] }
 0x160 LB: > { %v1 = vpop.f32.mrf.mxu3  ;;  %v2 = vmax.xlane.f32.xlu0 %v1  ;;  %v3 = vpop.eup %v2 }
 0x161   : > { %9 = vst [vmem:[#allocation3] sm:$0xff] %v3  ;;  %10 = dma.done.wait [#allocation7], 4096 }
"""


def test_bundle_stats_counts_instruction_kinds():
    stats = llo_dump.bundle_stats(BUNDLES, "k")
    assert stats.bundles == 7
    assert (stats.vmatmul, stats.vmatpush, stats.mxu_pop, stats.xlu, stats.eup) == (3, 1, 1, 1, 1)
    assert (stats.vld, stats.vst, stats.dma) == (1, 1, 1)  # dma.done.wait waits, it does not copy
    assert stats.mxus == ("mxu0", "mxu1", "mxu3")
    assert "3 bundles" not in str(stats) and "MXUs mxu0/mxu1/mxu3" in str(stats)


def test_read_bundle_dir_skips_helper_programs(tmp_path):
    (tmp_path / "17-flash.1-72-final_bundles.txt").write_text(BUNDLES)
    (tmp_path / "17-flash.1-71-schedule-analysis_final_bundles.txt").write_text("Schedule analysis:")
    (tmp_path / "17-<late-finalization>-68-final_bundles.txt").write_text(BUNDLES)
    (tmp_path / "17-TLP-73-final_bundles.txt").write_text(BUNDLES)
    assert list(llo_dump.read_bundle_dir(tmp_path)) == ["flash.1"]
    assert llo_dump.read_bundle_dir(tmp_path, ops={"other"}) == {}


# ---------------------------------------------------------------------------------------------------
# Arithmetic and errors (no compile)
# ---------------------------------------------------------------------------------------------------


def test_cycle_estimate_arithmetic():
    chip = hardware.CHIPS["v5e"]
    est = CycleEstimate("v5e:1x1", chip, {"kernel": 150_000, "pad": 50_000}, flops=131_072 * 100_000.0,
                        libtpu_version="0.0.50.1", compile_seconds=1.0)
    assert est.total_cycles == 200_000 and est.mxu_floor == 100_000 and est.floor_ratio == 2.0
    assert est.seconds == pytest.approx(200_000 / chip.clock_hz)
    assert est.tflops_per_second == pytest.approx(chip.peak_bf16_flops / 2 / 1e12)  # half the MXU peak
    assert "200,000 cycles" in str(est) and "2.00x the MXU floor" in str(est)


def test_v4_is_refused_in_plain_words():
    with pytest.raises(estimate.UnsupportedChipError, match="does not cover TPU v4"):
        estimate.estimate_attention("pallas", seq=256, block_q=128, block_k=128, topology="v4:2x2x1")


def test_missing_libtpu_says_how_to_install(monkeypatch):
    monkeypatch.setattr(env, "has_libtpu", lambda: False)
    with pytest.raises(estimate.LibtpuMissingError, match=r"pip install 'jax\[tpu\]'"):
        estimate.estimate_attention("pallas", seq=256, block_q=128, block_k=128)


def test_old_libtpu_is_refused_by_version(monkeypatch):
    monkeypatch.setattr(env, "has_libtpu", lambda: True)
    monkeypatch.setattr(estimate, "libtpu_version", lambda: "0.0.23")
    assert not estimate.supports_static_profile()
    with pytest.raises(estimate.LibtpuTooOldError, match=r"need libtpu >= 0\.0\.42.*this is libtpu 0\.0\.23"):
        estimate.estimate_attention("pallas", seq=256, block_q=128, block_k=128)


@pytest.mark.parametrize(
    ("stderr", "error", "words"),
    [
        ("ERROR: Unknown command line flag 'xla_jf_dump_static_llo_profile_to'", estimate.LibtpuTooOldError,
         "libtpu >= 0.0.42"),
        ("F1130 ...] Static LLO profiling of k failed: INVALID_ARGUMENT: Dma latency model is currently only "
         "supported on VF/VL/GF/GL.", estimate.UnsupportedChipError, "does not cover"),
        ("noise\nF1130 00:36:42.5 25004 llo_module.cc:75] Check failed: TakeStatus() is OK (INTERNAL: Expected "
         "vector-f32, got vector-bf16packed", estimate.ProfilerCrashError, "Expected vector-f32"),
        ("F1130 01:20:43.0 19571 llo_dumper.cc:1697] Static LLO profiling of flash_attention.1 failed: "
         "FAILED_PRECONDITION: Cannot schedule FIFO pop instruction when the FIFO is empty",
         estimate.ProfilerCrashError, "Cannot schedule FIFO pop"),
        ("Segmentation fault", estimate.EstimateError, "Segmentation fault"),
    ],
)
def test_a_dead_subprocess_is_explained(stderr, error, words):
    err = estimate._diagnose(stderr, "0.0.50.1")
    assert type(err) is error and words in str(err)


def test_a_lambda_cannot_travel_to_the_subprocess():
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    with pytest.raises(estimate.EstimateError, match="module-level function"):
        estimate._pickled_call(lambda a: a, {}, (x,))
    assert estimate._shapes((x, jnp.zeros((2, 3), jnp.bfloat16))) == [((8, 128), "float32"), ((2, 3), "bfloat16")]


def test_flashlib_blocks_are_checked_before_any_compile():
    with pytest.raises(ValueError, match="over the 16 MiB scoped limit of v5e"):
        estimate.estimate_attention("pallas", seq=2048, block_q=2048, block_k=2048)


# ---------------------------------------------------------------------------------------------------
# Real estimates: compiled for a TPU target in a subprocess
# ---------------------------------------------------------------------------------------------------


def _scale_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


def scaled_copy(x, *, block_rows: int):
    """A module-level Pallas kernel (so the subprocess can import it): ``2 * x`` in ``[block_rows, 512]`` tiles."""
    spec = pl.BlockSpec((block_rows, 512), lambda i, j: (i, j))
    grid = (x.shape[0] // block_rows, x.shape[1] // 512)
    return pl.pallas_call(_scale_kernel, grid=grid, in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name="scaled_copy")(x)


@pytest.mark.tpu
@needs_profile
def test_estimates_grow_linearly_with_the_grid():
    small, big = (estimate.estimate_cycles(scaled_copy, jax.ShapeDtypeStruct((rows, 2048), jnp.float32),
                                           block_rows=128) for rows in (512, 1024))
    assert list(small.kernels) == ["scaled_copy.1"]
    assert big.total_cycles / small.total_cycles == pytest.approx(2.0, rel=0.1)  # twice the grid steps


@pytest.mark.tpu
@needs_profile
def test_attention_estimate_grows_with_the_grid_and_respects_the_floor():
    small, big = (estimate.estimate_attention("pallas", heads=1, seq=seq, block_q=128, block_k=128)
                  for seq in (512, 1024))
    assert big.total_cycles / small.total_cycles == pytest.approx(4.0, rel=0.15)  # 16 -> 64 grid steps
    assert big.floor_ratio > 1.0 and big.flops == 4 * 1024 * 1024 * 128


@pytest.mark.tpu
@needs_profile
def test_reproduces_the_reference_estimate_of_jax_flash_attention():
    # data/reference/jax_flash_estimates.csv: T=2048, q512/km2048/k512, v5e -> 178,098 cycles
    est = estimate.estimate_attention("jax_flash", seq=2048, block_q=512, block_k_major=2048, block_k=512)
    assert est.kernels == {"flash_attention.1": 178_098}
    assert est.floor_ratio == pytest.approx(1.36, abs=0.005)


@pytest.mark.tpu
@needs_profile
def test_bundle_stats_show_the_mxus_the_compiler_uses():
    x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    for topology, mxus in (("v5e:1x1", 4), ("v6e:1x1", 2)):
        stats = estimate.bundle_stats("jax.numpy:matmul", x, x, topology=topology)  # an XLA op, by name
        assert stats and all(s.bundles > 0 for s in stats.values())
        used = {m for s in stats.values() for m in s.mxus}
        assert len(used) == mxus == hardware.CHIPS[topology.split(":")[0]].mxus_per_core


@pytest.mark.tpu
@pytest.mark.skipif(estimate.supports_static_profile(), reason="this libtpu knows the flag; the too-old path "
                    "is for Colab's libtpu 0.0.23")
def test_old_libtpu_is_refused_by_what_it_says(monkeypatch):
    monkeypatch.setattr(estimate, "supports_static_profile", lambda: True)  # skip the version check: ask libtpu
    with pytest.raises(estimate.LibtpuTooOldError, match="does not know the"):
        estimate.estimate_cycles(scaled_copy, jax.ShapeDtypeStruct((512, 512), jnp.float32), block_rows=128)


def test_source_state_fingerprints_the_sources_a_table_was_made_from():
    import hashlib

    state = provenance.source_state(["flashlib/cost.py"])
    assert state.sha256 == hashlib.sha256((provenance.REPOSITORY / "flashlib/cost.py").read_bytes()).hexdigest()[:16]
    assert state.sha256 != provenance.source_state(["flashlib/cost.py", "flashlib/kernels"]).sha256
    assert state.commit == "" or all(c in "0123456789abcdef" for c in state.commit)  # "" outside a git checkout
    assert isinstance(state.edited, bool)


# ---------------------------------------------------------------------------------------------------
# Estimates that never flatter: below the MXU or HBM floor is refused
# ---------------------------------------------------------------------------------------------------


def _made_up(cycles: int, flops: float | None, hbm_bytes: float | None) -> CycleEstimate:
    return CycleEstimate("v5e:1x1", hardware.CHIPS["v5e"], {"kernel": cycles}, flops, "test", 0.0, hbm_bytes=hbm_bytes)


def test_the_floor_is_the_higher_of_mxu_and_hbm():
    chip = hardware.CHIPS["v5e"]
    flops, hbm_bytes = 2.0**30, 2.0**24
    est = _made_up(10**6, flops, hbm_bytes)
    assert est.mxu_floor == pytest.approx(flops / chip.flops_per_cycle)
    assert est.hbm_floor == pytest.approx(hbm_bytes / chip.hbm_bandwidth * chip.clock_hz)
    assert est.floor == max(est.mxu_floor, est.hbm_floor)
    assert _made_up(int(est.floor) - 1, flops, hbm_bytes).below_floor
    assert not _made_up(int(est.floor) + 1, flops, hbm_bytes).below_floor
    only_bytes = _made_up(10, None, hbm_bytes)  # a copy: no FLOPs, still a floor
    assert only_bytes.floor == only_bytes.hbm_floor and only_bytes.below_floor
    assert not _made_up(10, None, None).below_floor  # nothing to judge against
    assert estimate.failure_status(estimate.BelowFloorError("x")) is None  # a tool bug: tuning re-raises


def test_flashlib_forward_refuses_an_unknown_form():
    q = jax.ShapeDtypeStruct((1, 1, 256, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="estimate_as must be"):
        estimate.flashlib_forward(q, q, q, causal=True, block_q=128, block_k=128, estimate_as="smem")


def test_auto_estimates_a_compacted_grid_in_its_program_id_form():
    """By construction, not by the caller's care: compacted (what attention runs causal), "auto" traces the
    program-id form; not compacted, the kernel as shipped (traced here, nothing compiled)."""
    q = jax.ShapeDtypeStruct((1, 2, 1024, 128), jnp.bfloat16)

    def traced(causal, compact, form):
        return str(jax.make_jaxpr(lambda q, k, v: estimate.flashlib_forward(
            q, k, v, causal=causal, block_q=256, block_k=256, compact=compact, estimate_as=form))(q, q, q))

    auto = traced(True, None, "auto")
    assert auto == traced(True, None, "program_ids") != traced(True, None, "as_shipped")
    assert traced(True, False, "auto") == traced(True, False, "as_shipped")  # the full grid: program-id guards
    assert traced(False, None, "auto") == traced(False, None, "as_shipped")  # nothing to compact


def test_an_estimate_below_the_floor_is_refused(monkeypatch):
    """estimate_cycles judges the result against the caller's FLOPs and bytes (not the compiler's count, which
    may include padding): below either floor it raises, unless asked to show what the model counted."""
    monkeypatch.setattr(estimate, "_check_can_estimate", lambda topology: hardware.CHIPS["v5e"])
    monkeypatch.setattr(estimate, "_run", lambda *a, **k: ({"seconds": 0.0, "flops": 1e15}, {"kernel": 1000}, None))
    flops = 1000.0 * hardware.CHIPS["v5e"].flops_per_cycle  # exactly 1000 cycles of MXU work
    assert estimate.estimate_cycles("m:f", flops=flops).total_cycles == 1000  # at the floor: fine
    assert estimate.estimate_cycles("m:f").flops == 1e15  # the compiler's count is reported, never judged
    with pytest.raises(estimate.BelowFloorError, match="1,000 cycles for v5e:1x1 is below the floor of 1,001"):
        estimate.estimate_cycles("m:f", flops=flops * 1.001)
    bytes_for_2000 = 2000 / hardware.CHIPS["v5e"].clock_hz * hardware.CHIPS["v5e"].hbm_bandwidth
    with pytest.raises(estimate.BelowFloorError, match="HBM 2,000"):
        estimate.estimate_cycles("m:f", flops=flops, hbm_bytes=bytes_for_2000)
    shown = estimate.estimate_cycles("m:f", hbm_bytes=bytes_for_2000, allow_below_floor=True)
    assert shown.below_floor and shown.hbm_floor == pytest.approx(2000)


@pytest.mark.tpu
@needs_profile
def test_the_shipped_causal_kernel_is_estimated_at_or_above_its_floor():
    """What flashlib.attention runs causal (compact=None: the compacted grid, 10 of 16 steps here) is estimated in
    its program-id form, at or above the causal floor. Where the kernel as shipped (its steps' guards read SMEM)
    falls below the floor, estimate_cycles refuses it: measured at [1, 8, 4096, 128] bf16 with 1024 x 512 copies
    of 2048 keys on v5e (libtpu 0.0.50.1), program-id form 403,462 cycles, floor 262,208, as shipped 204,393; and
    data/estimates/causal_compaction_v5e.csv at T = 8192: 667,289 against 1,048,576. (That shape costs 24 s to
    estimate here; this one ~8 s.)"""
    shipped = estimate.estimate_attention("pallas", seq=2048, causal=True, compact=None, block_q=512, block_k=512)
    assert shipped.total_cycles >= shipped.floor == shipped.mxu_floor > 0


ESTIMATES = Path(__file__).parents[1] / "data" / "estimates"


def _table(name: str) -> list[dict]:
    import csv

    with (ESTIMATES / name).open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def test_no_committed_estimate_of_a_kernel_we_ship_is_below_its_floor():
    """The committed tables, read as the notebooks and the tuner read them: every cost is at or above its floor.
    Exceptions are named: the compacted kernel as the model sees it (``compacted_as_estimated``, kept to show
    the flattery) and JAX's paged kernel copying several pages a step (the table's own caveat: a lower bound)."""
    swept = [(name, row) for name in ("forward_v5e.csv", "forward_v6e.csv", "block_sweep.csv", "seq_sweep.csv")
             for row in _table(name) if row["status"] == "ok"]
    assert len(swept) > 50
    assert [(name, row) for name, row in swept if int(row["cycles"]) < float(row["mxu_floor"])] == []
    decode = [row for row in _table("decode_v5e.csv") if row["status"] == "ok"]
    below = {(row["kind"], row["block_k"], row["pages_per_step"]) for row in decode
             if int(row["cycles"]) < int(row["floor_cycles"])}
    assert below <= {("jax_paged", "128", "16"), ("jax_paged", "512", "4")}, below
    chip = hardware.CHIPS["v5e"]
    for row in _table("causal_compaction_v5e.csv"):
        t = int(row["T"])
        floor = cost.attention_flops(1, 8, t, t, 128, True) / chip.flops_per_cycle
        assert int(row["today"]) >= floor and int(row["compacted"]) >= floor, row
