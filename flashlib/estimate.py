"""How many TPU cycles will a kernel take? Ask the TPU compiler, from a machine without a TPU.

libtpu (``pip install 'jax[tpu]'``) can compile ahead of time for a TPU target on any machine
(:mod:`flashlib.tpu_compile`). Started with ``--xla_jf_dump_static_llo_profile_to=DIR``, it also writes the
*static* cycle estimate of every kernel it compiles: its scheduler's cost of the final VLIW program plus a
model of the DMAs, summed over the grid. :func:`estimate_cycles` compiles any jittable function that way
and returns a :class:`CycleEstimate`: cycles per kernel, the total, the implied time and TFLOP/s at the
chip's (derived) clock, and the ratio to the MXU floor of :mod:`flashlib.hardware`.

What the number is, and is not (probed, never checked against a real TPU): it grows linearly with the
grid; a ``pl.when`` comparing program ids is credited step by step (causal block skipping shows up), but
one on a value read from SMEM counts as never taken; f32 and bf16 price almost the same; v4 is not
covered. Use it to *compare* kernels and block sizes, and :func:`bundle_stats` to see why one costs more.

libtpu reads its flags once, when it starts, so each estimate runs in a fresh Python subprocess: ``fn``
must be importable there — a module-level function (or a ``functools.partial`` of one), or a
``"module:function"`` string; keyword arguments are passed to it as static arguments. For attention,
:func:`estimate_attention` has ready recipes (``impl="pallas"``: flashlib's kernel, ``"jax_flash"``: JAX's).

Longer than 400 lines because the subprocess, the reading of what libtpu wrote or why it died, and the
result are one mechanism that changes together (a new libtpu changes all three); the git provenance of a
table (:mod:`flashlib.provenance`) and the sweep's progress (:mod:`flashlib.progress`) are not here.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashlib import cost, env, hardware, llo_dump
from flashlib.kernels import BlockSizes, tpu_forward
from flashlib.kernels.block_sizes import GENERATIONS
from flashlib.kernels.variants import KernelVariants
from flashlib.llo_dump import BundleStats
from flashlib.tpu_compile import explain_compiler_error

__all__ = [
    "MIN_LIBTPU",
    "BelowFloorError",
    "CycleEstimate",
    "EstimateError",
    "LibtpuMissingError",
    "LibtpuTooOldError",
    "ProfilerCrashError",
    "UnsupportedChipError",
    "bundle_stats",
    "estimate_attention",
    "estimate_cycles",
    "failure_status",
    "libtpu_version",
    "one_line",
    "supports_static_profile",
]

MIN_LIBTPU = (0, 0, 42)  # oldest libtpu credited with the profile flag (0.0.50.1 has it; Colab's 0.0.23 has not)
PROFILE_FLAG = "--xla_jf_dump_static_llo_profile_to"
BUNDLE_FLAGS = ("--xla_jf_dump_to", "--xla_jf_dump_llo_text=true")


class EstimateError(RuntimeError):
    """The TPU compiler gave no estimate; the message says why in plain words."""


class LibtpuMissingError(EstimateError):
    """libtpu is not installed, so nothing can be compiled for a TPU."""


class LibtpuTooOldError(EstimateError):
    """The installed libtpu predates the static-profile flag."""


class UnsupportedChipError(EstimateError):
    """libtpu's static cost model does not cover this TPU generation."""


class ProfilerCrashError(EstimateError):
    """libtpu's static profiler aborted on a kernel the compiler itself accepts (a libtpu bug)."""


class BelowFloorError(EstimateError):
    """The estimate is below a physical floor (the MXUs at peak, or HBM at full bandwidth): the static model
    did not count some of the work, so the number flatters. Work under a ``pl.when`` whose condition reads SMEM
    (scalar-prefetched tables) is the known cause: the model treats it as never run."""


# ---------------------------------------------------------------------------------------------------
# Result
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CycleEstimate:
    """libtpu's static estimate of one compiled function on one TPU target.

    Attributes:
      topology: the compile target, e.g. ``"v5e:1x1"``.
      chip: its :class:`~flashlib.hardware.TpuChip`.
      kernels: ``{op name: estimated cycles}`` for every op libtpu profiled: the Pallas kernels, plus XLA
        ops around them (e.g. the ``pad`` and ``slice`` of a sequence that is not a whole number of blocks).
      flops: the work the ratios are taken against (the caller's count, else the compiler's cost analysis).
      libtpu_version: the libtpu that made the estimate.
      compile_seconds: wall time of the ahead-of-time compile.
      bundles: per-op :class:`~flashlib.llo_dump.BundleStats` when asked for (``bundles=True``), else None.
      hbm_bytes: the fewest HBM bytes the function must move (the caller's count), for :attr:`hbm_floor`.
    """

    topology: str
    chip: hardware.TpuChip
    kernels: Mapping[str, int]
    flops: float | None
    libtpu_version: str
    compile_seconds: float
    bundles: Mapping[str, BundleStats] | None = None
    hbm_bytes: float | None = None

    @property
    def total_cycles(self) -> int:
        """Cycles of all profiled ops together."""
        return sum(self.kernels.values())

    @property
    def seconds(self) -> float:
        """The total at the chip's derived clock (see :attr:`TpuChip.clock_note` for v6e and TPU7x)."""
        return self.total_cycles / self.chip.clock_hz

    @property
    def tflops_per_second(self) -> float:
        """``flops`` over :attr:`seconds`, in TFLOP/s (nan without a FLOP count)."""
        return self.flops / self.seconds / 1e12 if self.flops and self.total_cycles else math.nan

    @property
    def mxu_floor(self) -> float:
        """Cycles the device's MXUs need for ``flops`` at full rate (:func:`hardware.mxu_floor_cycles`)."""
        return hardware.mxu_floor_cycles(self.flops, self.chip) if self.flops else math.nan

    @property
    def hbm_floor(self) -> float:
        """Cycles HBM needs to move ``hbm_bytes`` at full bandwidth (nan without a byte count)."""
        return self.hbm_bytes / self.chip.hbm_bandwidth * self.chip.clock_hz if self.hbm_bytes else math.nan

    @property
    def floor(self) -> float:
        """The higher of :attr:`mxu_floor` and :attr:`hbm_floor` that is known (nan if neither): no real
        kernel can take fewer cycles."""
        known = [f for f in (self.mxu_floor, self.hbm_floor) if not math.isnan(f)]
        return max(known) if known else math.nan

    @property
    def below_floor(self) -> bool:
        """True when :attr:`total_cycles` is under :attr:`floor`: the model missed work (see BelowFloorError)."""
        return not math.isnan(self.floor) and self.total_cycles < self.floor

    @property
    def floor_ratio(self) -> float:
        """``total_cycles / mxu_floor``: 1.0 would be every MXU busy on every cycle."""
        return self.total_cycles / self.mxu_floor if self.flops else math.nan

    def __str__(self) -> str:
        ops = ", ".join(f"{name} {cycles:,}" for name, cycles in self.kernels.items())
        text = f"{self.topology}: {self.total_cycles:,} cycles ({ops})"
        if self.flops:
            text += (
                f"; {self.seconds * 1e6:.1f} us at {self.chip.clock_hz / 1e9:.2f} GHz, "
                f"{self.tflops_per_second:.0f} TFLOP/s; {self.floor_ratio:.2f}x the MXU floor of {self.mxu_floor:,.0f}"
            )
        return text


# ---------------------------------------------------------------------------------------------------
# libtpu
# ---------------------------------------------------------------------------------------------------


def libtpu_version() -> str | None:
    """The installed libtpu's version string (``"0.0.50.1"``), or None without libtpu."""
    for dist in ("libtpu", "libtpu-nightly"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def supports_static_profile() -> bool:
    """Whether the installed libtpu is new enough for static estimates (>= :data:`MIN_LIBTPU`)."""
    version = libtpu_version()
    return env.has_libtpu() and version is not None and _version_tuple(version)[:3] >= MIN_LIBTPU


def _too_old(version: str | None) -> LibtpuTooOldError:
    need = ".".join(map(str, MIN_LIBTPU))
    return LibtpuTooOldError(
        f"static cycle estimates need libtpu >= {need} (the newest-jax environment, e.g. .venv); this is libtpu "
        f"{version}, which does not know the {PROFILE_FLAG} flag: pip install -U 'jax[tpu]'"
    )


def _check_can_estimate(topology: str) -> hardware.TpuChip:
    chip = hardware.chip_for_topology(topology)
    if not env.has_libtpu():
        raise LibtpuMissingError(
            "libtpu is not installed, so nothing can be compiled for a TPU target: pip install 'jax[tpu]'"
        )
    if not chip.static_estimate:
        raise UnsupportedChipError(
            f"the static cost model does not cover TPU {chip.name} (libtpu aborts: its DMA latency model knows "
            "only v5e, v5p, v6e and later); estimate for v5e:1x1 or v6e:1x1 instead"
        )
    if not supports_static_profile():
        raise _too_old(libtpu_version())
    return chip


# ---------------------------------------------------------------------------------------------------
# What became of an estimate that has no cycles: one classifier for the tuner, the benchmark, the data scripts
# ---------------------------------------------------------------------------------------------------

_TOOLCHAIN_ERRORS = (LibtpuMissingError, LibtpuTooOldError, UnsupportedChipError)


def failure_status(error: Exception) -> str | None:
    """The status (:data:`flashlib.kernels.tuned_table.STATUSES`) of one configuration whose estimate raised
    ``error``: ``"refused"`` (a ``ValueError``: flashlib's own tiling rule or VMEM budget, before any compile),
    ``"profiler_crash"`` (libtpu's static profiler aborted on a kernel that compiles), ``"compile_error"``
    (the compiler's refusal, the final judge). None for a toolchain that cannot estimate at all (no libtpu,
    too old, a chip its cost model does not cover): no configuration would fare better, so the caller
    re-raises; None too for :class:`BelowFloorError`, a bug in what is estimated, never a configuration's cost."""
    if isinstance(error, (*_TOOLCHAIN_ERRORS, BelowFloorError)):
        return None
    if isinstance(error, ProfilerCrashError):
        return "profiler_crash"
    if isinstance(error, EstimateError):
        return "compile_error"
    if isinstance(error, ValueError):
        return "refused"
    return None


def one_line(message: object, limit: int = 400) -> str:
    """``message`` on one line, at most ``limit`` characters: the note beside a status."""
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------
# The subprocess
# ---------------------------------------------------------------------------------------------------


def _child() -> None:
    """Subprocess entry: compile the pickled call for its topology; libtpu writes the dumps as it goes."""
    payload_path, result_path = sys.argv[1], sys.argv[2]
    with open(payload_path, "rb") as f:
        outer = pickle.load(f)
    sys.path[:0] = [p for p in outer["sys_path"] if p not in sys.path]  # so the caller's modules import here
    result: dict[str, Any] = {"ok": False}
    try:
        import jax
        from jax.experimental import topologies

        from flashlib._compat import cost_analysis_dict

        fn, static_kwargs, shapes = pickle.loads(outer["call"])
        if isinstance(fn, str):
            module, _, name = fn.partition(":")
            fn = getattr(importlib.import_module(module), name)
        # Not tpu_compile.tpu_topology: it silences native stderr, where libtpu says why it refuses to start.
        target = outer["topology"]
        bounds = (tuple(int(x) for x in target.split(":")[1].split("x")) + (1, 1, 1))[:3]
        device = topologies.get_topology_desc(target, "tpu", chips_per_host_bounds=bounds).devices[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]

        def call(*args):
            return fn(*args, **static_kwargs)

        start = time.perf_counter()
        compiled = jax.jit(call).lower(*structs).compile()
        analysis = cost_analysis_dict(compiled)
        result = {"ok": True, "seconds": time.perf_counter() - start, "flops": analysis.get("flops")}
    except Exception as err:  # a compile error (VMEM, tiling) is an answer, reported to the parent
        result = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    with open(result_path, "w") as f:
        json.dump(result, f)


def _shapes(args: tuple[Any, ...]) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(int(d) for d in a.shape), str(getattr(a.dtype, "name", a.dtype))) for a in args]


def _pickled_call(fn: Callable[..., Any] | str, kwargs: Mapping[str, Any], args: tuple[Any, ...]) -> bytes:
    try:
        return pickle.dumps((fn, dict(kwargs), _shapes(args)))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise EstimateError(
            f"cannot send {fn!r} to the compiler subprocess ({err}): pass a module-level function, a "
            "functools.partial of one, or a 'module:function' string, with static options as keyword arguments"
        ) from err


def _diagnose(stderr: str, version: str | None) -> EstimateError:
    """Turn a subprocess that died inside libtpu into the error a reader can act on."""
    if "Unknown command line flag" in stderr and "xla_jf_dump" in stderr:
        return _too_old(version)
    if "Dma latency model is currently only supported" in stderr:
        return UnsupportedChipError("the static cost model does not cover this TPU generation (libtpu: "
                                    "'Dma latency model is currently only supported on VF/VL/GF/GL')")
    # The profiler's own failures: a failed check, or a "Static LLO profiling of <op> failed: ..." (seen for
    # head_dim=64 on v5e and v6e: "Cannot schedule FIFO pop instruction when the FIFO is empty").
    fatal = next((ln for ln in stderr.splitlines() if ln.startswith("F")
                  and ("Check failed" in ln or "Static LLO profiling of" in ln)), "")
    if fatal:
        hint = ""
        if "vmatmul.msk" in fatal:  # seen with jnp.where(mask, p, 0.0) feeding a bf16 p @ v; p * mask compiles
            hint = "; here a select feeds a masked bf16 matmul: multiplying by the mask instead avoids the crash"
        return ProfilerCrashError(
            "libtpu's static profiler crashed on this kernel (a libtpu bug: the compile itself succeeds "
            f"without the profile flag){hint}: {fatal.split('] ', 1)[-1][:400]}"
        )
    tail = "\n".join(stderr.strip().splitlines()[-5:])
    return EstimateError(f"the compiler subprocess died without an answer:\n{tail}")


def _run(fn, args, kwargs, *, topology: str, bundles: bool, timeout: float):
    """Compile in a subprocess with the dump flags; return (result dict, profile cycles, bundle stats)."""
    version = libtpu_version()
    with tempfile.TemporaryDirectory(prefix="flashlib-estimate-") as tmp:
        work = Path(tmp)
        profile_dir, bundle_dir = work / "profile", work / "bundles"
        flags = [f"{PROFILE_FLAG}={profile_dir}"]
        if bundles:
            flags += [f"{BUNDLE_FLAGS[0]}={bundle_dir}", BUNDLE_FLAGS[1]]
        payload = {"sys_path": list(sys.path), "topology": topology, "call": _pickled_call(fn, kwargs, args)}
        (work / "payload.pkl").write_bytes(pickle.dumps(payload))
        child_env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        child_env["LIBTPU_INIT_ARGS"] = " ".join([os.environ.get("LIBTPU_INIT_ARGS", ""), *flags]).strip()
        command = [sys.executable, "-c", "from flashlib.estimate import _child; _child()",
                   str(work / "payload.pkl"), str(work / "result.json")]
        try:
            proc = subprocess.run(command, env=child_env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise EstimateError(f"the compile for {topology} took longer than timeout={timeout:.0f} s") from err
        result_file = work / "result.json"
        if not result_file.exists():
            raise _diagnose(proc.stderr, version)
        result = json.loads(result_file.read_text())
        if not result["ok"]:
            if "Unknown command line flag" in proc.stderr:
                raise _too_old(version)
            raise EstimateError(f"does not compile for {topology}: {explain_compiler_error(result['error'])}")
        cycles = llo_dump.read_profile_dir(profile_dir) if profile_dir.exists() else {}
        if not cycles:
            raise EstimateError(f"libtpu {version} compiled for {topology} but wrote no static profile")
        stats = llo_dump.read_bundle_dir(bundle_dir, set(cycles)) if bundles and bundle_dir.exists() else None
    return result, cycles, stats


def estimate_cycles(
    fn: Callable[..., Any] | str,
    *args: Any,
    topology: str = "v5e:1x1",
    flops: float | None = None,
    bundles: bool = False,
    timeout: float = 600.0,
    hbm_bytes: float | None = None,
    allow_below_floor: bool = False,
    **static_kwargs: Any,
) -> CycleEstimate:
    """libtpu's static cycle estimate of ``fn(*args, **static_kwargs)`` compiled for ``topology``.

    Args:
      fn: a module-level function (or ``functools.partial`` of one), or a ``"module:function"`` string; it
        is imported again in a fresh subprocess, where libtpu starts with the profile flag.
      args: arrays or ``jax.ShapeDtypeStruct``; only their shapes and dtypes travel.
      topology: a TPU target with a static cost model: ``"v5e:1x1"``, ``"v6e:1x1"``, ``"v5p:1x1x1"``,
        ``"tpu7x:1x1x1"`` (not v4).
      flops: the work to compare against; None takes the compiler's cost analysis (a Pallas kernel reports
        its ``pl.CostEstimate``).
      bundles: also dump the VLIW bundle listings and count their instructions (:attr:`CycleEstimate.bundles`).
      timeout: seconds before the compile is abandoned.
      hbm_bytes: the fewest HBM bytes ``fn`` must move, for the HBM floor (:attr:`CycleEstimate.hbm_floor`).
      allow_below_floor: return an estimate below the floor of the caller's ``flops`` or ``hbm_bytes`` instead
        of raising :class:`BelowFloorError`: only to show what the model does not count, never as a cost.
      static_kwargs: passed to ``fn`` as Python values (not traced), e.g. ``causal=True``.

    Raises:
      LibtpuMissingError, LibtpuTooOldError, UnsupportedChipError, ProfilerCrashError, BelowFloorError, or
      EstimateError (does not compile, e.g. VMEM overflow), each with a sentence saying what to do.
    """
    chip = _check_can_estimate(topology)
    result, cycles, stats = _run(fn, args, static_kwargs, topology=topology, bundles=bundles, timeout=timeout)
    found = CycleEstimate(
        topology=topology,
        chip=chip,
        kernels=cycles,
        flops=flops if flops is not None else result.get("flops"),
        libtpu_version=libtpu_version() or "?",
        compile_seconds=result["seconds"],
        bundles=stats,
        hbm_bytes=hbm_bytes,
    )
    # Only against the caller's counts: the compiler's cost analysis of a kernel may count padded work.
    judged = dataclasses.replace(found, flops=flops)
    if judged.below_floor and not allow_below_floor:
        raise BelowFloorError(
            f"{found.total_cycles:,} cycles for {topology} is below the floor of {judged.floor:,.0f} (MXU "
            f"{judged.mxu_floor:,.0f}, HBM {judged.hbm_floor:,.0f}): the static model did not count some of the "
            "work (code under a pl.when whose condition reads SMEM counts as never run). Estimate a form whose "
            "guards read program ids (flashlib_forward's estimate_as), or pass allow_below_floor=True to see "
            "only what the model counted")
    return found


def bundle_stats(fn: Callable[..., Any] | str, *args: Any, topology: str = "v5e:1x1", **static_kwargs: Any):
    """``{kernel: BundleStats}``: the static instruction counts behind :func:`estimate_cycles`'s number."""
    return estimate_cycles(fn, *args, topology=topology, bundles=True, **static_kwargs).bundles


# ---------------------------------------------------------------------------------------------------
# Attention recipes: module-level, so the subprocess can import them
# ---------------------------------------------------------------------------------------------------


def flashlib_forward(q, k, v, *, causal: bool, block_q: int, block_k: int, generation: str | None = None,
                     block_k_major: int | None = None, window: tuple[int | None, int | None] | None = None,
                     compact: bool | None = False, estimate_as: str = "auto"):
    """flashlib's Pallas forward kernel, compiled (not interpreted), with the given blocks (and window).

    ``compact`` (:func:`flashlib.kernels.tpu_forward.forward`): False (default) the full causal grid, skipping by
    program-id guards, which a static estimate sees; True the compacted causal grid; None what
    ``flashlib.attention`` picks (compacted where that drops a step). The compacted kernel as shipped reads its
    schedule from scalar-prefetched tables, and the static model counts the work under guards on SMEM data as
    never run, so ``estimate_as`` says which form of it is compiled:

    * ``"auto"`` (default): a compacted grid as ``"program_ids"``, anything else as shipped. An estimate of
      what ``flashlib.attention`` runs is honest by construction.
    * ``"program_ids"`` (compacted only) computes each step's pair from its program id and the schedule's
      constants (:func:`flashlib.geometry.scheduled_pair`: the same results, guards and index maps the model
      evaluates, plus ``num_q_blocks`` scalar compares per step where the real kernel loads four SMEM words).
    * ``"plain"`` / ``"masked"`` (compacted only) compute every sub-block of every live step without guards,
      with ``init``/``finalize`` as often as the real kernel but on program ids (wrong outputs; cycle counts to
      bracket the real kernel's).
    * ``"as_shipped"``: the kernel exactly as it ships, SMEM guards and all: what the model misses (its estimate
      of a compacted grid falls below the MXU floor; :func:`estimate_cycles` refuses it unless
      ``allow_below_floor``).

    With GQA the query heads a step computes travel as separate 2-D operands (``separate_heads``: the static
    profiler reads no kernel whose blocks have three dimensions); the stack of their outputs afterwards is its
    own op in the estimate (:attr:`CycleEstimate.kernels`), which the kernel as shipped does not run."""
    if estimate_as not in ("auto", "program_ids", "plain", "masked", "as_shipped"):
        raise ValueError(f"estimate_as must be 'auto', 'program_ids', 'plain', 'masked' or 'as_shipped', got "
                         f"{estimate_as!r}")
    sizes = BlockSizes(block_q=block_q, block_k=block_k, generation=generation, block_k_major=block_k_major)
    from flashlib.kernels.options import resolve_call
    from flashlib.masks import check_window

    call = resolve_call(q, k, v, causal=causal, scale=None, block_sizes=sizes, interpret=False)
    variants = KernelVariants.of(window=None if window is None else check_window(window))
    return tpu_forward.forward(q, k, v, causal=bool(causal), scale=call.scale, sizes=call.sizes,
                               interpret=call.interpret, return_lse=False, variants=variants, compact=compact,
                               estimate_as=None if estimate_as == "as_shipped" else estimate_as,
                               separate_heads=True)


def flashlib_segments_forward(q, k, v, q_segments, kv_segments, *, causal: bool, block_q: int, block_k: int,
                              block_tables: bool = True):
    """flashlib's Pallas forward with segment ids, compiled: with the scalar-prefetched block tables that skip
    pairs of blocks whose segments cannot meet (``block_tables``; a static estimate counts the work under
    their SMEM guard as free), or without them (every block in the band visited and masked)."""
    sizes = BlockSizes(block_q=block_q, block_k=block_k).fit(q.shape[2], k.shape[2], q.dtype)
    variants = KernelVariants(segments=True, block_tables=block_tables)
    return tpu_forward.forward(q, k, v, (q_segments, kv_segments), causal=causal, scale=q.shape[-1] ** -0.5,
                               sizes=sizes, interpret=False, return_lse=False, variants=variants)


def jax_flash_forward(q, k, v, *, causal: bool, block_q: int, block_k: int, block_k_major: int):
    """JAX's own ``jax.experimental.pallas.ops.tpu.flash_attention``, scaled by ``1/sqrt(head_dim)`` like flashlib."""
    from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

    sizes = jax_flash.BlockSizes(block_q=block_q, block_k_major=block_k_major, block_k=block_k, block_b=1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    return jax_flash.flash_attention(q, k, v, causal=causal, sm_scale=scale, block_sizes=sizes)


_RECIPES: dict[str, Callable[..., Any]] = {"pallas": flashlib_forward, "jax_flash": jax_flash_forward}


def estimate_attention(
    impl: str = "pallas",
    *,
    batch: int = 1,
    heads: int = 8,
    seq: int = 2048,
    kv_seq: int | None = None,
    head_dim: int = 128,
    dtype: str = "bfloat16",
    causal: bool = False,
    block_q: int = 512,
    block_k: int = 512,
    block_k_major: int | None = None,
    topology: str = "v5e:1x1",
    generation: str | None = None,
    bundles: bool = False,
    timeout: float = 600.0,
    compact: bool | None = False,
) -> CycleEstimate:
    """The static estimate of one attention forward ``[batch, heads, seq, head_dim]``, against the ideal FLOPs
    (:func:`flashlib.cost.attention_flops`: ``4 * seq * kv_seq * head_dim`` per head, about half when causal).

    ``impl="pallas"`` is flashlib's kernel, blocks ``block_q`` x ``block_k`` checked here (``ValueError``) against
    the VMEM budget of ``generation`` (default: the topology's; ``"v6e"`` lets the compiler, rather than
    flashlib's conservative estimate, judge v5e blocks). For both kernels ``block_k_major`` (default
    ``block_k``) is the key block copied per grid step, ``block_k`` the sub-block computed on at a time.
    ``compact`` (pallas, causal): False the full grid, True the compacted one, None what ``flashlib.attention``
    runs; a compacted grid is estimated in its program-id form (:func:`flashlib_forward`'s ``"auto"``).

    Never flatters: below the MXU floor of those FLOPs, or the HBM floor of q, k, v and out crossing once, it
    raises :class:`BelowFloorError` (the static model missed work) instead of returning a number.
    """
    if impl not in _RECIPES:
        raise ValueError(f"impl must be one of {', '.join(_RECIPES)}, got {impl!r}")
    import jax

    kv_seq = seq if kv_seq is None else kv_seq
    q = jax.ShapeDtypeStruct((batch, heads, seq, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, heads, kv_seq, head_dim), dtype)
    options: dict[str, Any] = dict(causal=causal, block_q=block_q, block_k=block_k)
    if impl == "pallas":
        if generation is None and topology.split(":")[0] in GENERATIONS:
            generation = topology.split(":")[0]
        sizes = BlockSizes(block_q=block_q, block_k=block_k, generation=generation, block_k_major=block_k_major)
        sizes.fit(seq, kv_seq, dtype).validate(dtype, head_dim)  # refuse here, before a subprocess starts
        options.update(generation=generation, compact=compact)
        if block_k_major is not None:
            options["block_k_major"] = block_k_major
    else:
        options["block_k_major"] = block_k if block_k_major is None else block_k_major
    flops = float(cost.attention_flops(batch, heads, seq, kv_seq, head_dim, causal))
    hbm_bytes = float(cost.attention_bytes(batch, heads, seq, kv_seq, head_dim, causal, dtype))  # each once
    return estimate_cycles(_RECIPES[impl], q, kv, kv, topology=topology, flops=flops, hbm_bytes=hbm_bytes,
                           bundles=bundles, timeout=timeout, **options)
