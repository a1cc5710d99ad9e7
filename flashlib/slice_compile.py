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

__all__ = ["Overlap", "SliceCompile", "collective_counts", "compile_for_slice", "overlaps", "ring_order", "slice_mesh"]

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
    def conditionals_between(self) -> int:
        """``conditional`` ops scheduled between start and done: for the ring, its chunk-pair switches (each
        runs a Pallas kernel, or nothing) that execute while the transfer is in flight."""
        return self.between.count("conditional")


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


def _entry(hlo_text: str) -> str:
    """The name of the entry computation (``main...``): the program around its loops."""
    found = re.search(r"^ENTRY\s+%(?P<name>[\w.\-]+)", hlo_text, re.MULTILINE)
    return found.group("name") if found else ""


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


def _snake(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every coordinate of a ``sizes`` grid once, each a neighbour of the one before (a boustrophedon)."""
    if not sizes:
        return [()]
    rest = _snake(sizes[1:])
    path = []
    for x in range(sizes[0]):
        path += [(x, *r) for r in (rest if x % 2 == 0 else rest[::-1])]
    return path


def _grid_cycle(a: int, b: int) -> list[tuple[int, int]]:
    """A closed tour of an ``a x b`` grid (``b`` even) through neighbours only: along row 0, a snake over
    columns 1.. of rows 1..b-1, and back up column 0 (0, 1, 3, 2 on a 2 x 2)."""
    tour = [(x, 0) for x in range(a)]
    for y in range(1, b):
        xs = range(a - 1, 0, -1) if y % 2 else range(1, a)
        tour += [(x, y) for x in xs]
    return tour + [(0, y) for y in range(b - 1, 0, -1)]


def ring_order(devices: Sequence[Any]) -> list[Any]:
    """``devices`` (TPU chips, with ``coords``) in the order of a ring along their links: each chip followed by
    a neighbour on the ICI mesh (coordinates one apart in one dimension), the last one by the first where the
    grid allows it (an even number of chips). Ordered by id, a 2 x 2 slice would be (0,0), (1,0), (0,1), (1,1):
    two of the ring's four hops diagonal, between chips with no link. A 1-D slice keeps its natural order."""
    coords = {tuple(d.coords): d for d in devices}
    if len(coords) != len(devices):  # several cores on a chip: no ring of chips to follow
        return list(devices)
    dims = [i for i in range(len(next(iter(coords)))) if len({c[i] for c in coords}) > 1]
    lows = [min(c[i] for c in coords) for i in range(len(next(iter(coords))))]
    sizes = [len({c[i] for c in coords}) for i in dims]
    if len(dims) <= 1 or len(coords) != int(np.prod(sizes)):  # a line, or not a full grid: by coordinate
        return sorted(devices, key=lambda d: tuple(reversed(tuple(d.coords))))
    rest = _snake(sizes[1:])  # the other dimensions walked as one line of neighbours
    a, b = sizes[0], len(rest)
    if b % 2 and a % 2 == 0:
        tour = [(x, y) for y, x in _grid_cycle(b, a)]
    elif b % 2 == 0:
        tour = _grid_cycle(a, b)
    else:  # an odd number of chips has no closed tour of neighbours: a snake, open at its end
        tour = [(x, y) for y in range(b) for x in (range(a) if y % 2 == 0 else range(a - 1, -1, -1))]

    def device(x: int, y: int) -> Any:
        at = list(lows)
        for i, offset in zip(dims, (x, *rest[y]), strict=True):
            at[i] += offset
        return coords[tuple(at)]

    return [device(x, y) for x, y in tour]


def slice_mesh(topology: str, axis_names: Sequence[str], shape: Sequence[int] | None = None) -> Mesh:
    """A ``Mesh`` over the chips of the TPU slice ``topology`` (no TPU needed; libtpu is), e.g.
    ``slice_mesh("v5e:2x2", ("seq",))`` for a ring of four. A one-axis mesh is a ring: its chips follow
    :func:`ring_order` (on a 2 x 2, ids 0, 1, 3, 2), so each ring hop is one ICI link; a mesh of ``shape`` keeps
    the chips in id order."""
    devices = tpu_topology(topology).devices
    if shape is None or len(shape) == 1:
        return Mesh(np.array(ring_order(devices)), tuple(axis_names))
    return Mesh(np.array(devices).reshape(tuple(shape)), tuple(axis_names))


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

    def loop_overlaps(self, collective: str = "collective-permute") -> list[Overlap]:
        """The async ``collective``s inside loop bodies (for the ring: its steps), not in the entry computation."""
        entry = _entry(self.hlo_text)
        return [o for o in self.overlaps(collective) if o.computation != entry]

    def permute_report(self) -> str:
        """One line: the collective-permutes inside the loop, with the conditionals in flight during each, and
        those of the entry computation before and after its first loop (for the ring: the reordering of the
        inputs into ring order, and of the output back)."""
        entry, before, after, seen_loop = _entry(self.hlo_text), 0, 0, False
        for computation, _, op, _ in _instructions(self.hlo_text):
            if computation != entry:
                continue
            seen_loop = seen_loop or op == "while"
            if op in ("collective-permute", "collective-permute-start"):
                after, before = after + seen_loop, before + (not seen_loop)
        loop = self.loop_overlaps()
        during = " and ".join(str(o.conditionals_between) for o in loop) or "no"
        return (f"collective-permutes: {len(loop)} in the loop ({during} conditionals between start and done), "
                f"{before} before it, {after} after it")


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
