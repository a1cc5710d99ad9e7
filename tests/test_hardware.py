"""flashlib.hardware: the chip table, the derived clocks, the roofline and the MXU floor."""

from __future__ import annotations

import math

import pytest

from flashlib import hardware
from flashlib.hardware import CHIPS, chip_for_topology, mxu_floor_cycles, roofline
from flashlib.kernels import block_sizes

# The reference shape of data/reference/jax_flash_estimates.csv: [1, 8, 2048, 128]
REFERENCE_FLOPS = 4 * 1 * 8 * 2048 * 2048 * 128  # two matmuls x 2 FLOPs per multiply-add


def test_table_has_the_five_generations_with_their_compile_targets():
    assert {name: chip.topology for name, chip in CHIPS.items()} == {
        "v4": "v4:2x2x1", "v5e": "v5e:1x1", "v5p": "v5p:1x1x1", "v6e": "v6e:1x1", "tpu7x": "tpu7x:1x1x1",
    }
    assert [name for name, chip in CHIPS.items() if not chip.static_estimate] == ["v4"]
    for name, chip in CHIPS.items():
        assert chip.name == name
        assert chip.peak_bf16_flops > 0 and chip.hbm_bandwidth > 0 and chip.hbm_bytes > 0
        assert chip.scoped_vmem_bytes <= chip.vmem_bytes
        assert chip.mxu_dim in (128, 256) and chip.cores_per_device <= chip.tensor_cores


def test_the_known_v5e_and_v6e_figures():
    v5e, v6e = CHIPS["v5e"], CHIPS["v6e"]
    assert (v5e.peak_bf16_flops, v5e.hbm_bandwidth, v5e.hbm_bytes) == (197e12, 819e9, 16 * 10**9)
    assert (v5e.tensor_cores, v5e.mxus_per_core, v5e.mxu_dim, v5e.scoped_vmem_bytes) == (1, 4, 128, 16 << 20)
    assert (v6e.peak_bf16_flops, v6e.hbm_bandwidth, v6e.hbm_bytes) == (918e12, 1638e9, 32 * 10**9)
    assert (v6e.tensor_cores, v6e.mxus_per_core, v6e.mxu_dim, v6e.scoped_vmem_bytes) == (1, 2, 256, 32 << 20)


@pytest.mark.parametrize("generation", block_sizes.GENERATIONS)
def test_scoped_vmem_agrees_with_the_kernel_budget(generation):
    assert CHIPS[generation].scoped_vmem_bytes == block_sizes.vmem_limit_bytes(generation)


@pytest.mark.parametrize(("name", "ghz"), [("v4", 1.049), ("v5e", 1.503), ("v5p", 1.751)])
def test_derived_clock_is_peak_over_mxu_throughput(name, ghz):
    chip = CHIPS[name]
    assert chip.clock_hz == pytest.approx(chip.peak_bf16_flops / (chip.mxus * chip.mxu_dim**2 * 2))
    assert chip.clock_hz / 1e9 == pytest.approx(ghz, abs=1e-3)
    assert chip.clock_note == ""


@pytest.mark.parametrize(("name", "ghz"), [("v6e", 3.50), ("tpu7x", 4.40)])
def test_an_implausible_derived_clock_says_so(name, ghz):
    chip = CHIPS[name]
    assert chip.clock_hz / 1e9 == pytest.approx(ghz, abs=0.01)
    assert "implausibly high" in chip.clock_note and f"{ghz:.1f} GHz" in chip.clock_note


def test_mxu_floor_reproduces_the_reference_floors():
    assert mxu_floor_cycles(REFERENCE_FLOPS, "v5e") == 131_072  # 4 MXUs of 128x128
    assert mxu_floor_cycles(REFERENCE_FLOPS, CHIPS["v6e"]) == 65_536  # 2 MXUs of 256x256
    assert mxu_floor_cycles(REFERENCE_FLOPS / 2, "v5e") == 65_536  # causal: half the work
    assert mxu_floor_cycles(REFERENCE_FLOPS, "v5p") == 131_072 / 2  # megacore: both cores' MXUs


def test_device_peak_is_the_chips_share():
    assert CHIPS["v5e"].device_peak_flops == CHIPS["v5e"].peak_bf16_flops
    assert CHIPS["tpu7x"].device_peak_flops == CHIPS["tpu7x"].peak_bf16_flops / 2  # one core per device


def test_roofline_memory_and_compute_bound():
    v5e = CHIPS["v5e"]
    assert v5e.ridge_point == pytest.approx(197e12 / 819e9)  # ~240 FLOP per byte
    low = roofline(flops=1e9, hbm_bytes=1e8, chip=v5e)  # 10 FLOP/B: memory bound
    assert low.bound == "memory" and low.intensity == pytest.approx(10.0)
    assert low.seconds == low.memory_seconds == pytest.approx(1e8 / 819e9)
    high = roofline(flops=REFERENCE_FLOPS, hbm_bytes=4 * 8 * 2048 * 128 * 2, chip="v5e")  # q, k, v, out in bf16
    assert high.bound == "compute" and high.intensity == pytest.approx(1024.0)
    assert high.seconds == high.compute_seconds == pytest.approx(REFERENCE_FLOPS / 197e12)
    assert "compute bound" in str(high)


def test_roofline_rejects_nonsense():
    with pytest.raises(ValueError, match="hbm_bytes > 0"):
        roofline(1.0, 0.0, "v5e")


def test_chip_for_topology():
    assert chip_for_topology("v5e:1x1") is CHIPS["v5e"]
    assert chip_for_topology("tpu7x:1x1x1") is CHIPS["tpu7x"]
    with pytest.raises(ValueError, match="unknown TPU generation 'v9'"):
        chip_for_topology("v9:1x1")


def _jax_tpu_info():
    try:
        from jax._src import tpu_info
    except ImportError:
        return None
    return tpu_info if hasattr(tpu_info, "get_tpu_info_for_chip") else None


@pytest.mark.skipif(_jax_tpu_info() is None, reason="this jax has no jax._src.tpu_info hardware table (jax 0.7.2)")
@pytest.mark.parametrize(("name", "version"), [("v4", "TPU_V4"), ("v5e", "TPU_V5E"), ("v5p", "TPU_V5P"),
                                               ("v6e", "TPU_V6E"), ("tpu7x", "TPU_7X")])
def test_agrees_with_jax_tpu_info(name, version):
    tpu_info = _jax_tpu_info()
    info = tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion[version], 1)  # per TensorCore
    chip = CHIPS[name]
    assert (info.num_mxus, info.mxu_column_size, info.vmem_capacity_bytes) == (
        chip.mxus_per_core, chip.mxu_dim, chip.vmem_bytes)
    assert info.chip_version.num_physical_tensor_cores_per_chip == chip.tensor_cores
    per_chip_peak = info.bf16_ops_per_second * chip.tensor_cores
    assert math.isclose(per_chip_peak, chip.peak_bf16_flops, rel_tol=0.01)
    assert hardware.FLOPS_PER_MAC == 2
