"""Ask the TPU toolchain about a function from any machine, no TPU needed.

Two levels, both usable from tests and notebooks:

* :func:`lower_for_tpu` — ``jax.export`` for platform ``"tpu"`` runs the Pallas→Mosaic lowering. It
  catches block shapes that break the (8, 128) tiling rule and ops Mosaic cannot lower. No libtpu needed.
* :func:`compile_for_tpu` — ahead-of-time compile for a real TPU target (``"v5e:1x1"``, ``"v6e:1x1"``, …)
  through libtpu (``pip install 'jax[tpu]'``). Also catches what only the compiler knows: VMEM overflow
  (v5e's default scoped limit is 16 MiB), unsupported layouts. Skips, saying so, when libtpu is absent.

Each returns a :class:`TpuCheck` whose ``summary`` says in plain words what the toolchain answered.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax import export as jax_export

from flashlib import env
from flashlib._compat import cost_analysis_dict

__all__ = ["TpuCheck", "compile_for_tpu", "explain_compiler_error", "lower_for_tpu", "tpu_topology"]


@dataclass(frozen=True)
class TpuCheck:
    """What the TPU toolchain said about one function."""

    ok: bool
    target: str
    summary: str
    compiler_message: str = ""
    seconds: float = 0.0
    skipped: bool = False
    flops: float | None = None
    bytes_accessed: float | None = None

    def __str__(self) -> str:
        verdict = "skipped" if self.skipped else ("accepted" if self.ok else "rejected")
        return f"{self.target}: {verdict} — {self.summary}"


def explain_compiler_error(message: str) -> str:
    """Turn a Pallas/Mosaic/XLA error into one sentence a reader can act on."""
    vmem = re.search(r"Scoped allocation with size ([\d.]+[KMG]?) and limit ([\d.]+[KMG]?)", message)
    if vmem or "vmem" in message.lower() and "memory" in message.lower():
        need, limit = (vmem.group(1), vmem.group(2)) if vmem else ("more", "the scoped limit")
        return (
            f"does not fit in VMEM: the kernel needs {need}B of scoped VMEM but the limit is {limit}B; "
            "use smaller blocks (or raise vmem_limit_bytes in the compiler params)"
        )
    if "divisible by 8 and 128" in message:
        shape = re.search(r"has block shape \(([^)]*(?:\)[^)]*)*?)\), array shape \(([\d, ]+)\)", message)
        sizes = re.findall(r"block_size=(\d+)", message)
        where = f" (block {tuple(int(s) for s in sizes)} for array ({shape.group(2)}))" if shape and sizes else ""
        return (
            "block shape breaks the TPU tiling rule: its last two dimensions must be divisible by 8 and 128 "
            f"(or equal the array's){where}"
        )
    if "not implemented" in message.lower() or "unsupported" in message.lower():
        first = next((ln.strip() for ln in message.splitlines() if ln.strip()), message)
        return f"the TPU compiler cannot lower an operation in this kernel: {first[:300]}"
    first = next((ln.strip() for ln in message.splitlines() if ln.strip()), "unknown error")
    return first[:300]


def _abstract(args: tuple[Any, ...], sharding: Any = None) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]


def lower_for_tpu(fn: Callable[..., Any], *args: Any) -> TpuCheck:
    """Lower ``fn(*args)`` for TPU with ``jax.export`` (Mosaic lowering; no libtpu). Args may be arrays or
    ``jax.ShapeDtypeStruct``; only shapes and dtypes are used."""
    start = time.perf_counter()
    try:
        jax_export.export(jax.jit(fn), platforms=["tpu"])(*_abstract(args))
    except Exception as err:  # the lowering raises ValueError, NotImplementedError, MosaicError, ...
        return TpuCheck(False, "tpu lowering", explain_compiler_error(str(err)), str(err)[:4000],
                        time.perf_counter() - start)
    return TpuCheck(True, "tpu lowering", "lowers to Mosaic for TPU", seconds=time.perf_counter() - start)


@functools.cache
def tpu_topology(name: str = "v5e:1x1") -> Any:
    """A TPU topology description (no TPU needed; requires libtpu), e.g. ``"v5e:1x1"``, ``"v6e:1x1"``,
    ``"v5p:1x1x1"``, ``"v4:2x2x1"``."""
    from jax.experimental import topologies

    dims = tuple(int(x) for x in name.split(":")[1].split("x"))
    bounds = (dims + (1, 1, 1))[:3]
    with _quiet_native_stderr():  # libtpu logs, at C++ level, that it found no TPU here — which we know
        return topologies.get_topology_desc(topology_name=name, platform="tpu", chips_per_host_bounds=bounds)


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence file descriptor 2 (native code's stderr) for the block; Python exceptions still propagate."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def compile_for_tpu(fn: Callable[..., Any], *args: Any, topology: str = "v5e:1x1") -> TpuCheck:
    """Compile ``fn(*args)`` ahead of time for the TPU ``topology`` with libtpu; skips without libtpu."""
    if not env.has_libtpu():
        return TpuCheck(False, topology, "libtpu is not installed (pip install 'jax[tpu]'), so nothing was "
                        "compiled", skipped=True)
    start = time.perf_counter()
    try:
        device = tpu_topology(topology).devices[0]
        structs = _abstract(args, jax.sharding.SingleDeviceSharding(device))
        compiled = jax.jit(fn).lower(*structs).compile()
    except Exception as err:
        return TpuCheck(False, topology, explain_compiler_error(str(err)), str(err)[:4000],
                        time.perf_counter() - start)
    cost = cost_analysis_dict(compiled)
    return TpuCheck(True, topology, "compiles for this TPU", seconds=time.perf_counter() - start,
                    flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"))
