"""Compile a sharded program for a multi-chip TPU slice from a CPU machine, and read its collectives.

libtpu describes a slice (``"v5e:2x2"``: four v5e chips) without the chips being here; a ``Mesh`` over
those devices lets ``jax.jit(...).lower(...).compile()`` run the whole SPMD pipeline (shard_map, the
collectives, the Pallas kernels through Mosaic) exactly as it would for the real slice. What comes back is
the compiled HLO text, which says what the compiler decided:

* which collectives it emitted (``collective-permute``, ``all-gather``, ...), and whether as *asynchronous*
  pairs, ``collective-permute-start`` ... ``collective-permute-done``;
* what it scheduled between a start and its done: the work that runs while the transfer is in flight
  (:func:`overlaps`); for ring attention, the kernels of the current chunk;
* its own cost figures (``cost_analysis()``: flops, bytes, and on TPU an ``optimal_seconds`` estimate).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flashlib import env
from flashlib._compat import cost_analysis_dict
from flashlib.tpu_compile import tpu_topology

__all__ = ["Overlap", "SliceCompile", "collective_counts", "compile_for_slice", "overlaps", "slice_mesh"]

COLLECTIVES = ("collective-permute", "all-gather", "all-reduce", "reduce-scatter", "all-to-all")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*.*?\s(?P<op>[a-z][\w\-]*)\((?P<args>[^)]*)\)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")


@dataclass(frozen=True)
class Overlap:
    """One asynchronous collective: its start, and the operations scheduled before its done."""

    computation: str
    start: str
    between: tuple[str, ...]  # the op names between start and done, in schedule order

    @property
    def kernels_between(self) -> int:
        """Pallas kernels (``custom-call``) and conditionals (that hold them) running during the transfer."""
        return sum(op in ("custom-call", "conditional") for op in self.between)


def _instructions(hlo_text: str):
    """``(computation, name, op, args)`` for every instruction, in the text's (= the schedule's) order."""
    computation = ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group("name")
            continue
        found = _INSTRUCTION.match(line)
        if found:
            yield computation, found.group("name"), found.group("op"), found.group("args")


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many of each collective the compiled program holds (an async pair counts once, by its start)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for _, _, op, _ in _instructions(hlo_text):
        base = op.removesuffix("-start")
        if base in counts and not op.endswith("-done"):
            counts[base] += 1
    return counts


def overlaps(hlo_text: str, collective: str = "collective-permute") -> list[Overlap]:
    """Every ``collective``-start in the compiled program and the ops scheduled before its done (a
    scheduled module lists each computation's instructions in execution order)."""
    open_starts: dict[tuple[str, str], list[str]] = {}
    found: list[Overlap] = []
    for computation, name, op, args in _instructions(hlo_text):
        if op == f"{collective}-start":
            open_starts[(computation, name)] = []
            continue
        if op == f"{collective}-done":
            started = args.strip().lstrip("%").split(",")[0].strip().lstrip("%")
            between = open_starts.pop((computation, started), None)
            if between is not None:
                found.append(Overlap(computation, started, tuple(between)))
            continue
        for key, ops in open_starts.items():
            if key[0] == computation:
                ops.append(op)
    return found


def slice_mesh(topology: str, axis_names: Sequence[str], shape: Sequence[int] | None = None) -> Mesh:
    """A ``Mesh`` over the chips of the TPU slice ``topology`` (no TPU needed; libtpu is), e.g.
    ``slice_mesh("v5e:2x2", ("seq",))`` for a ring of four."""
    devices = np.array(tpu_topology(topology).devices)
    return Mesh(devices.reshape(tuple(shape) if shape is not None else (devices.size,)), tuple(axis_names))


@dataclass(frozen=True)
class SliceCompile:
    """What compiling one program for a slice gave."""

    topology: str
    chips: int
    seconds: float
    hlo_text: str = field(repr=False)
    cost: dict[str, float] = field(default_factory=dict)

    @property
    def collectives(self) -> dict[str, int]:
        return collective_counts(self.hlo_text)

    def overlaps(self, collective: str = "collective-permute") -> list[Overlap]:
        return overlaps(self.hlo_text, collective)


def compile_for_slice(fn: Callable[..., Any], mesh: Mesh, *args: jax.ShapeDtypeStruct,
                      spec: PartitionSpec | None = None) -> SliceCompile:
    """Compile ``fn(*args)`` for the slice of ``mesh`` (:func:`slice_mesh`), the arguments laid out as
    ``spec``; raises what the compiler raises. Needs libtpu (``pip install 'jax[tpu]'``)."""
    if not env.has_libtpu():
        raise RuntimeError("compile_for_slice needs libtpu (pip install 'jax[tpu]') to compile for a TPU slice")
    sharding = NamedSharding(mesh, PartitionSpec() if spec is None else spec)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*structs).compile()
    seconds = time.perf_counter() - start
    topology = str(mesh.devices.flat[0].device_kind)
    return SliceCompile(topology, int(mesh.devices.size), seconds, compiled.as_text(), cost_analysis_dict(compiled))
