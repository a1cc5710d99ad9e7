"""The TPU chips flashlib talks about, with a source for every figure, and the roofline built from them.

A kernel's speed has two ceilings. The MXUs (the systolic matrix units) finish at most ``peak`` FLOP/s; HBM
delivers at most ``bandwidth`` bytes/s. A kernel doing ``flops`` of work on ``bytes`` of traffic takes at least
``max(flops / peak, bytes / bandwidth)``: which term wins depends on its *arithmetic intensity*
``flops / bytes`` compared with the chip's *ridge point* ``peak / bandwidth`` (:func:`roofline`).

Cycle counts (:mod:`flashlib.estimate` reads them from the TPU compiler) need one more figure, the clock.
Google does not publish TPU clocks, so :attr:`TpuChip.clock_hz` is *derived*: peak FLOP/s divided by the
FLOPs the MXUs finish per cycle (``MXUs x dim x dim`` multiply-adds, 2 FLOPs each). For v4, v5e and v5p that
gives 1.05, 1.50 and 1.75 GHz; for v6e and TPU7x, with the MXU counts the documentation lists, it gives
3.5 and 4.4 GHz — implausible, so either the MXUs are more or faster than listed. For those two compare
cycle counts between kernels, not against the derived clock (:attr:`TpuChip.clock_note`).

Sources, cited per figure below:

* Cloud TPU docs, one page per generation: https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p,
  .../v6e, .../tpu7x ("[cloud]").
* jax's hardware table ``jax._src.tpu_info`` (jax 0.12), rendered at
  https://docs.jax.dev/en/latest/pallas/tpu/hardware.html ("[tpu_info]"; figures there are per TensorCore).
* Inter-chip interconnect (ICI): the same Cloud TPU pages' "Bidirectional inter-chip interconnect (ICI)
  bandwidth (per chip)" and "ICI ports per chip" rows, read 2026-12 ("[cloud]"); not looked up for v4 and
  TPU7x (None).
* Measured here with libtpu 0.0.50.1 ("[measured]"): the scoped-VMEM limit from the compiler's own
  "Scoped allocation with size 32.00M and limit 16.00M" message, the static estimate by trying it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CHIPS", "Roofline", "TpuChip", "chip_for_topology", "mxu_floor_cycles", "roofline"]

GIB = 1 << 30
MIB = 1 << 20
FLOPS_PER_MAC = 2  # a multiply-add is two floating-point operations


@dataclass(frozen=True)
class TpuChip:
    """One TPU generation, per *chip* (all its TensorCores together) unless a field says otherwise.

    Attributes:
      name: the generation, e.g. ``"v5e"``.
      peak_bf16_flops: peak dense bf16 matmul throughput of the chip, FLOP/s.
      hbm_bandwidth: HBM bandwidth of the chip, bytes/s.
      hbm_bytes: HBM capacity of the chip, bytes.
      tensor_cores: TensorCores per chip.
      cores_per_device: TensorCores behind one JAX device of :attr:`topology`: 2 where two cores act as one
        device ("megacore", v5p: the compiler may split a kernel's parallel grid axes between them), else 1.
      mxus_per_core: matrix units per TensorCore.
      mxu_dim: an MXU is a ``mxu_dim x mxu_dim`` systolic array.
      vmem_bytes: VMEM per TensorCore, bytes.
      scoped_vmem_bytes: the compiler's default scoped-VMEM limit for one kernel, bytes.
      topology: the smallest topology name for an ahead-of-time compile (:func:`flashlib.tpu_compile.tpu_topology`).
      static_estimate: whether libtpu's static cycle estimate (:mod:`flashlib.estimate`) covers this chip.
      clock_note: why the derived clock is not to be trusted, when it is not.
      ici_bandwidth: bidirectional inter-chip interconnect bandwidth of the chip, all ports together, bytes/s
        (None: not recorded).
      ici_ports: ICI links per chip (None: not recorded).
    """

    name: str
    peak_bf16_flops: float
    hbm_bandwidth: float
    hbm_bytes: int
    tensor_cores: int
    cores_per_device: int
    mxus_per_core: int
    mxu_dim: int
    vmem_bytes: int
    scoped_vmem_bytes: int
    topology: str
    static_estimate: bool
    clock_note: str = ""
    ici_bandwidth: float | None = None
    ici_ports: int | None = None

    @property
    def ici_link_bandwidth(self) -> float | None:
        """One ICI link, one direction, bytes/s: ``ici_bandwidth / (2 x ici_ports)`` (derived; what one hop of a
        ring, device i -> i + 1, can use)."""
        if self.ici_bandwidth is None or self.ici_ports is None:
            return None
        return self.ici_bandwidth / (2 * self.ici_ports)

    @property
    def mxus(self) -> int:
        """Matrix units on the whole chip."""
        return self.tensor_cores * self.mxus_per_core

    @property
    def mxus_per_device(self) -> int:
        """Matrix units one JAX device (so one compiled kernel) can use."""
        return self.cores_per_device * self.mxus_per_core

    @property
    def flops_per_cycle(self) -> int:
        """FLOPs the MXUs of one device finish per clock cycle: ``MXUs x dim^2`` multiply-adds, 2 FLOPs each."""
        return self.mxus_per_device * self.mxu_dim * self.mxu_dim * FLOPS_PER_MAC

    @property
    def clock_hz(self) -> float:
        """Derived: peak / (MXUs x dim^2 x 2) over the whole chip. Not a published figure; see :attr:`clock_note`."""
        return self.peak_bf16_flops / (self.mxus * self.mxu_dim * self.mxu_dim * FLOPS_PER_MAC)

    @property
    def device_peak_flops(self) -> float:
        """Peak bf16 FLOP/s of one JAX device: the chip's share for :attr:`cores_per_device` cores."""
        return self.peak_bf16_flops * self.cores_per_device / self.tensor_cores

    @property
    def ridge_point(self) -> float:
        """FLOPs per HBM byte above which a kernel is compute bound: peak / bandwidth."""
        return self.peak_bf16_flops / self.hbm_bandwidth


_FAST_CLOCK = (
    "the derived clock ({:.1f} GHz) is implausibly high: the listed MXUs cannot reach the listed peak at a "
    "realistic clock, so compare cycle counts between kernels rather than converting them to seconds"
)

CHIPS: dict[str, TpuChip] = {
    "v4": TpuChip(
        name="v4",
        peak_bf16_flops=275e12,  # [cloud v4] "Peak compute per chip 275 teraflops (bf16 or int8)"
        hbm_bandwidth=1200e9,  # [cloud v4] "HBM2 capacity and bandwidth 32 GiB, 1200 GBps"
        hbm_bytes=32 * GIB,  # [cloud v4] 32 GiB
        tensor_cores=2,  # [cloud v4] "Each TPU v4 chip contains two TensorCores"
        cores_per_device=1,  # [measured] topology v4:2x2x1 has 8 devices (4 chips), each with num_cores=1
        mxus_per_core=4,  # [cloud v4] "Each TensorCore has four matrix-multiply units (MXUs)"
        mxu_dim=128,  # [tpu_info] mxu_column_size=128 for generations < 6
        vmem_bytes=16 * MIB,  # [tpu_info] vmem_capacity_bytes = 16 MiB per core
        # [measured] no separate scoped limit: a 32 MiB kernel "Used 32.00M of 16.00M vmem", all of VMEM
        scoped_vmem_bytes=16 * MIB,
        topology="v4:2x2x1",  # the smallest v4 topology jax's get_topology_desc accepts here
        # [measured] libtpu aborts: "Dma latency model is currently only supported on VF/VL/GF/GL"
        static_estimate=False,
    ),  # derived clock: 275e12 / (8 x 128^2 x 2) = 1.05 GHz
    "v5e": TpuChip(
        name="v5e",
        peak_bf16_flops=197e12,  # [cloud v5e] "Peak compute per chip (bf16) 197 TFLOPs"
        hbm_bandwidth=819e9,  # [cloud v5e] "HBM2 capacity and bandwidth 16 GB, 819 GBps"
        hbm_bytes=16 * 10**9,  # [cloud v5e] 16 GB
        tensor_cores=1,  # [cloud v5e] "Each v5e chip contains one TensorCore"
        cores_per_device=1,
        mxus_per_core=4,  # [cloud v5e] "Each TensorCore has four matrix-multiply units (MXUs)"
        mxu_dim=128,  # [tpu_info] mxu_column_size=128 for generations < 6
        vmem_bytes=128 * MIB,  # [tpu_info] vmem_capacity_bytes = 128 MiB per core
        scoped_vmem_bytes=16 * MIB,  # [measured] "Scoped allocation with size 32.00M and limit 16.00M"
        topology="v5e:1x1",
        static_estimate=True,  # [measured] libtpu 0.0.50.1
        ici_bandwidth=400e9,  # [cloud v5e] "Bidirectional inter-chip interconnect (ICI) bandwidth (per chip) 400 GBps"
        ici_ports=4,  # [cloud v5e] "ICI ports per chip 4" (a 2D torus)
    ),  # derived clock: 197e12 / (4 x 128^2 x 2) = 1.50 GHz
    "v5p": TpuChip(
        name="v5p",
        peak_bf16_flops=459e12,  # [cloud v5p] "Peak compute per chip (bf16) 459 TFLOPs"
        hbm_bandwidth=2765e9,  # [cloud v5p] "HBM2e capacity and bandwidth 95GB, 2765 GBps"
        hbm_bytes=95 * GIB,  # [cloud v5p] "HBM capacity per chip (GiB) 95"
        tensor_cores=2,  # [cloud v5p] "Number of TensorCores per chip 2"
        cores_per_device=2,  # [measured] topology v5p:1x1x1 has 1 device with num_cores=2 (megacore)
        mxus_per_core=4,  # [cloud v5p] "Each TensorCore has four Matrix Multiply Units (MXU)"
        mxu_dim=128,  # [tpu_info] mxu_column_size=128 for generations < 6
        vmem_bytes=64 * MIB,  # [tpu_info] vmem_capacity_bytes = 64 MiB per core
        scoped_vmem_bytes=16 * MIB,  # [measured] "Scoped allocation with size 32.00M and limit 16.00M"
        topology="v5p:1x1x1",
        static_estimate=True,  # [measured] libtpu 0.0.50.1
        # [cloud v5p] "Bidirectional inter-chip interconnect (ICI) bandwidth per chip (GBps) 1200"
        ici_bandwidth=1200e9,
        ici_ports=6,  # derived: the page lists no port count; "Interconnect topology 3D torus": 6 neighbours
    ),  # derived clock: 459e12 / (8 x 128^2 x 2) = 1.75 GHz
    "v6e": TpuChip(
        name="v6e",
        peak_bf16_flops=918e12,  # [cloud v6e] "Peak compute per chip (bf16) 918 TFLOPs"
        hbm_bandwidth=1638e9,  # [cloud v6e] "HBM bandwidth per chip 1638 GBps"
        hbm_bytes=32 * 10**9,  # [cloud v6e] "HBM capacity per chip 32 GB"
        tensor_cores=1,  # [cloud v6e] "Each v6e chip contains one TensorCore"
        cores_per_device=1,
        # [cloud v6e] "Each TensorCore contains two 256x256 matrix-multiply units (MXU)"; [tpu_info] num_mxus=2,
        # and the compiler's bundle listings for v6e use exactly mxu0 and mxu1 ([measured])
        mxus_per_core=2,
        mxu_dim=256,
        vmem_bytes=128 * MIB,  # [tpu_info] vmem_capacity_bytes = 128 MiB per core
        scoped_vmem_bytes=32 * MIB,  # [measured] "Scoped allocation with size 37.50M and limit 32.00M"
        topology="v6e:1x1",
        static_estimate=True,  # [measured] libtpu 0.0.50.1
        ici_bandwidth=800e9,  # [cloud v6e] "Bidirectional inter-chip interconnect (ICI) bandwidth (per chip) 800 GBps"
        ici_ports=4,  # [cloud v6e] "ICI ports per chip 4" (a 2D torus)
        clock_note=_FAST_CLOCK.format(918e12 / (2 * 256 * 256 * 2) / 1e9),
    ),  # derived clock: 918e12 / (2 x 256^2 x 2) = 3.50 GHz (implausible, see clock_note)
    "tpu7x": TpuChip(
        name="tpu7x",
        peak_bf16_flops=2307e12,  # [cloud tpu7x] "Peak compute per chip (BF16) (TFLOPs) 2307"
        hbm_bandwidth=7.40e12,  # [tpu_info] mem_bw_bytes_per_second = 7.40e12 per chip (3.7e12 per core)
        hbm_bytes=192 * GIB,  # [cloud tpu7x] "HBM capacity per chip (GiB) 192"
        tensor_cores=2,  # [cloud tpu7x] "Each TPU7x chip contains two TensorCores and four SparseCores"
        cores_per_device=1,  # [measured] topology tpu7x:1x1x1 has 2 devices with num_cores=1 (no megacore)
        mxus_per_core=2,  # [tpu_info] num_mxus=2
        mxu_dim=256,  # [tpu_info] mxu_column_size=256
        vmem_bytes=64 * MIB,  # [tpu_info] vmem_capacity_bytes = 64 MiB per core
        scoped_vmem_bytes=32 * MIB,  # [measured] "Scoped allocation with size 37.50M and limit 32.00M"
        topology="tpu7x:1x1x1",
        static_estimate=True,  # [measured] libtpu 0.0.50.1 writes a profile for tpu7x too
        clock_note=_FAST_CLOCK.format(2307e12 / (4 * 256 * 256 * 2) / 1e9),
    ),  # derived clock: 2307e12 / (4 x 256^2 x 2) = 4.40 GHz (implausible, see clock_note)
}


def chip_for_topology(topology: str) -> TpuChip:
    """The chip of a topology name such as ``"v5e:1x1"`` or ``"tpu7x:1x1x1"``."""
    generation = topology.split(":")[0]
    if generation not in CHIPS:
        raise ValueError(f"unknown TPU generation {generation!r} in topology {topology!r}; known: {', '.join(CHIPS)}")
    return CHIPS[generation]


@dataclass(frozen=True)
class Roofline:
    """Where a kernel sits under the roofline of one chip.

    Attributes:
      flops: the work, FLOPs.
      hbm_bytes: the HBM traffic, bytes.
      intensity: ``flops / hbm_bytes``, FLOPs per byte.
      ridge_point: the chip's ``peak / bandwidth``, FLOPs per byte.
      compute_seconds: ``flops / peak``.
      memory_seconds: ``hbm_bytes / bandwidth``.
      seconds: the predicted time, the larger of the two.
      bound: ``"compute"`` or ``"memory"``, whichever term is larger.
    """

    flops: float
    hbm_bytes: float
    intensity: float
    ridge_point: float
    compute_seconds: float
    memory_seconds: float
    seconds: float
    bound: str

    def __str__(self) -> str:
        return (
            f"{self.flops / 1e9:.2f} GFLOP, {self.hbm_bytes / 1e6:.2f} MB: intensity {self.intensity:.0f} FLOP/B vs "
            f"ridge {self.ridge_point:.0f} -> {self.bound} bound, >= {self.seconds * 1e6:.1f} us"
        )


def roofline(flops: float, hbm_bytes: float, chip: TpuChip | str) -> Roofline:
    """The roofline time of ``flops`` FLOPs moving ``hbm_bytes`` bytes on ``chip`` (a :class:`TpuChip` or its name).

    A lower bound: the MXUs at peak and HBM at full bandwidth, perfectly overlapped.
    """
    chip = CHIPS[chip] if isinstance(chip, str) else chip
    if flops < 0 or hbm_bytes <= 0:
        raise ValueError(f"need flops >= 0 and hbm_bytes > 0, got flops={flops}, hbm_bytes={hbm_bytes}")
    compute = flops / chip.peak_bf16_flops  # s
    memory = hbm_bytes / chip.hbm_bandwidth  # s
    return Roofline(
        flops=flops,
        hbm_bytes=hbm_bytes,
        intensity=flops / hbm_bytes,
        ridge_point=chip.ridge_point,
        compute_seconds=compute,
        memory_seconds=memory,
        seconds=max(compute, memory),
        bound="compute" if compute >= memory else "memory",
    )


def mxu_floor_cycles(flops: float, chip: TpuChip | str) -> float:
    """Cycles one device's MXUs need for ``flops`` at one multiply-add per MXU cell per cycle:
    ``flops / (MXUs x dim x dim x 2)`` — no kernel beats it (it would need every MXU busy every cycle)."""
    chip = CHIPS[chip] if isinstance(chip, str) else chip
    return flops / chip.flops_per_cycle
