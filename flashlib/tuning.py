"""Choosing block sizes by the TPU compiler's static estimate, and the committed table of those choices.

A block size is a trade: bigger blocks mean fewer grid steps (less per-step overhead, fewer re-reads of
k and v) but more VMEM and, for causal attention, more wasted work on the diagonal. Rather than guess, ask
the compiler. For one shape, dtype, causality and TPU target:

1. :func:`candidates` lists the ``BlockSizes`` worth trying: every ``block_q x block_k`` from
   :data:`BLOCK_CHOICES`, clamped to the sequence (:meth:`BlockSizes.fit`), that flashlib's own tiling rule
   and VMEM estimate accept (:meth:`BlockSizes.validate`);
2. :func:`tune` compiles each one for the target with libtpu's static profiler
   (:func:`flashlib.estimate.estimate_attention`) and keeps every outcome — cycles, or why there are none
   (``refused`` by flashlib, ``compile_error`` from the compiler, the final judge, ``profiler_crash`` when
   libtpu's profiler aborts on a kernel that compiles) — and the best: the fewest estimated cycles;
3. ``data/tuning/make_tuned_table.py`` runs :func:`tune` over a grid of shapes and writes
   ``data/tuning/forward_blocks.json`` (:data:`TABLE_PATH`), which :func:`load_tuned_table` reads;
4. :func:`lookup` answers "which blocks for this call?" from that table by the nearest-entry rule below.

The nearest-entry rule of :func:`lookup` (and :func:`nearest_entry`):

* only entries of the same generation, dtype and causality that have a best (an entry whose candidates all
  crashed libtpu's profiler has none: with libtpu 0.0.50, every head_dim=64 entry, and causal ones on v5e);
* ``head_dim``: the same head_dim if tuned, else the smallest tuned head_dim above it (VMEM grows with
  head_dim, so those blocks still fit), else no answer;
* length: with ``n = max(q_len, kv_len)``, the entry with the largest tuned length ``<= n``; a call shorter
  than every tuned length takes the shortest entry;
* its best blocks are clamped to the call (:meth:`BlockSizes.fit`) and checked (:meth:`BlockSizes.validate`);
  a refusal gives no answer. "No answer" is ``None``: the caller keeps :meth:`BlockSizes.default`.

The numbers are static estimates of the kernel as it is today, not timings (see :mod:`flashlib.estimate`);
when the kernel changes, rerun the script: it is the single source of truth for the table.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import jax.numpy as jnp

from flashlib import cost, data, estimate, hardware
from flashlib.kernels.block_sizes import GENERATIONS, BlockSizes

__all__ = [
    "BLOCK_CHOICES",
    "JAX_FLASH_CHOICES",
    "MAJOR_CHOICES",
    "TABLE_PATH",
    "table_path",
    "TableKey",
    "Trial",
    "TuningResult",
    "candidates",
    "estimate_trial",
    "load_tuned_table",
    "lookup",
    "nearest_entry",
    "progress",
    "tune",
]

TABLE_PATH = Path(__file__).resolve().parents[1] / "data" / "tuning" / "forward_blocks.json"
BLOCK_CHOICES: tuple[int, ...] = (256, 512, 1024)  # tried for block_q and for block_k
MAJOR_CHOICES: tuple[int, ...] = (2048, 4096)  # block_k_major (keys per k/v copy) tried on top of one block_k
# JAX's own flash_attention as a yardstick: (block_q, block_k_major, block_k), its best configurations in
# shared/reference/jax-kernel-tpu-estimates.md plus the plain 512 cube.
JAX_FLASH_CHOICES: tuple[tuple[int, int, int], ...] = (
    (512, 512, 512), (1024, 1024, 1024), (512, 2048, 512), (1024, 2048, 512),
)
STATUSES: tuple[str, ...] = ("ok", "refused", "compile_error", "profiler_crash")
_T = TypeVar("_T")


# ---------------------------------------------------------------------------------------------------
# One measured configuration, and one tuned shape
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    """One configuration and what the compiler said about it.

    Attributes:
      impl: ``"pallas"`` (flashlib's kernel) or ``"jax_flash"`` (JAX's, the yardstick).
      block_q, block_k: the blocks, after clamping to the sequence.
      block_k_major: keys per k/v copy when larger than ``block_k`` (JAX's kernel always sets it), else None.
      status: one of :data:`STATUSES`.
      cycles: libtpu's static estimate, all kernels of the compile together (``status == "ok"`` only).
      floor_ratio: ``cycles`` over the MXU floor of the ideal FLOPs (1.0: every MXU busy every cycle).
      compile_seconds: wall time of the compile (``"ok"`` only).
      note: why there is no estimate, in one line.
    """

    impl: str
    block_q: int
    block_k: int
    status: str
    block_k_major: int | None = None
    cycles: int | None = None
    floor_ratio: float | None = None
    compile_seconds: float | None = None
    note: str = ""

    @property
    def ok(self) -> bool:
        """Whether the compiler returned an estimate."""
        return self.status == "ok"

    @property
    def label(self) -> str:
        """``q512/k1024`` (``q512/km2048/k512`` for JAX's kernel)."""
        major = f"/km{self.block_k_major}" if self.block_k_major else ""
        return f"q{self.block_q}{major}/k{self.block_k}"


class TableKey(NamedTuple):
    """What a tuned entry is keyed by; batch and heads only scale the grid, so they are not part of it."""

    generation: str
    dtype: str
    causal: bool
    head_dim: int
    q_len: int
    kv_len: int


@dataclass(frozen=True)
class TuningResult:
    """Every configuration tried for one shape on one target, and the best of them.

    ``trials`` are flashlib's kernel (refusals included); ``baseline`` JAX's own flash attention on the
    same shape, for comparison (empty when not asked for).
    """

    topology: str
    dtype: str
    causal: bool
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    mxu_floor: float
    trials: tuple[Trial, ...]
    baseline: tuple[Trial, ...] = ()

    @property
    def generation(self) -> str:
        """``"v5e"`` for ``"v5e:1x1"``."""
        return self.topology.split(":")[0]

    @property
    def key(self) -> TableKey:
        """This entry's :class:`TableKey`."""
        return TableKey(self.generation, self.dtype, self.causal, self.head_dim, self.q_len, self.kv_len)

    @property
    def best(self) -> Trial | None:
        """flashlib's configuration with the fewest estimated cycles; None when none has an estimate."""
        return _fastest(self.trials)

    @property
    def baseline_best(self) -> Trial | None:
        """JAX's fastest configuration on this shape, if measured."""
        return _fastest(self.baseline)

    @property
    def best_block_sizes(self) -> BlockSizes | None:
        """:attr:`best` as a ``BlockSizes`` for this generation."""
        best = self.best
        if best is None:
            return None
        return BlockSizes(best.block_q, best.block_k, generation=self.generation, block_k_major=best.block_k_major)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (with the best picked out, for readers of the file)."""
        fields = {name: getattr(self, name) for name in ("topology", "dtype", "causal", "batch", "heads", "q_len",
                                                         "kv_len", "head_dim")}
        best, base = self.best, self.baseline_best
        return {
            **fields,
            "mxu_floor": round(self.mxu_floor, 1),
            "best": None if best is None else _best_json(best),
            "jax_flash_best": None if base is None else {"label": base.label, "cycles": base.cycles},
            "vs_jax_flash": round(best.cycles / base.cycles, 3) if best and base else None,
            "trials": [_trial_json(t) for t in self.trials],
            "baseline": [_trial_json(t) for t in self.baseline],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TuningResult:
        """Inverse of :meth:`to_json` (the derived fields are recomputed, not read)."""
        fields = {name: data[name] for name in ("topology", "dtype", "causal", "batch", "heads", "q_len", "kv_len",
                                                "head_dim", "mxu_floor")}
        return cls(**fields, trials=tuple(Trial(**t) for t in data["trials"]),
                   baseline=tuple(Trial(**t) for t in data.get("baseline", ())))


def _fastest(trials: Iterable[Trial]) -> Trial | None:
    return min((t for t in trials if t.ok), key=lambda t: t.cycles, default=None)


def _best_json(trial: Trial) -> dict[str, Any]:
    blocks = {"block_q": trial.block_q, "block_k": trial.block_k}
    if trial.block_k_major is not None:
        blocks["block_k_major"] = trial.block_k_major
    return {**blocks, "cycles": trial.cycles}


def _trial_json(trial: Trial) -> dict[str, Any]:
    return {k: v for k, v in asdict(trial).items() if v is not None and v != ""}


# ---------------------------------------------------------------------------------------------------
# Candidates and measurements
# ---------------------------------------------------------------------------------------------------


def _screen(seq_q: int, seq_k: int, head_dim: int, dtype, generation: str, choices: Iterable[int],
            majors: Iterable[int] = ()) -> tuple[list[BlockSizes], list[tuple[BlockSizes, str]]]:
    """``(accepted, [(refused, why)])``: every pair of ``choices`` (each alone and with every larger copy size
    of ``majors``), clamped to the sequence, deduplicated."""
    if generation not in GENERATIONS:
        raise ValueError(f"generation must be one of {', '.join(GENERATIONS)}, got {generation!r}")
    accepted: list[BlockSizes] = []
    refused: list[tuple[BlockSizes, str]] = []
    seen: set[tuple[int, int, int | None]] = set()
    choices, majors = list(choices), list(majors)
    for block_q, block_k in itertools.product(choices, choices):
        for major in [None, *(m for m in majors if m > block_k and m % block_k == 0)]:
            sizes = BlockSizes(block_q, block_k, generation=generation, block_k_major=major).fit(seq_q, seq_k, dtype)
            if (sizes.block_q, sizes.block_k, sizes.block_k_major) in seen:
                continue
            seen.add((sizes.block_q, sizes.block_k, sizes.block_k_major))
            try:
                sizes.validate(dtype, head_dim)
            except ValueError as err:
                refused.append((sizes, str(err)))
            else:
                accepted.append(sizes)
    return accepted, refused


def candidates(seq_q: int, seq_k: int, head_dim: int, dtype, generation: str,
               choices: Iterable[int] = BLOCK_CHOICES, majors: Iterable[int] = MAJOR_CHOICES) -> list[BlockSizes]:
    """The forward ``BlockSizes`` worth compiling for one shape on ``generation`` (``"v5e"``, ``"v6e"``).

    Every ``block_q x block_k`` of ``choices``, alone and with each ``block_k_major`` of ``majors`` that holds
    whole ``block_k`` sub-blocks, clamped to the tile-rounded sequences and deduplicated, that obeys the
    dtype's tiling rule and fits flashlib's VMEM estimate for the generation's scoped limit.
    """
    return _screen(seq_q, seq_k, head_dim, dtype, generation, choices, majors)[0]


def estimate_trial(impl: str, *, block_q: int, block_k: int, block_k_major: int | None = None,
                   topology: str = "v5e:1x1", timeout: float = 900.0, **shape: Any) -> Trial:
    """One :func:`~flashlib.estimate.estimate_attention` call as a :class:`Trial`: a refusal, a compile error or
    a profiler crash is an outcome, not an exception. A toolchain that cannot estimate at all (no libtpu, too
    old, chip not covered) still raises: no configuration would fare better."""
    blocks = dict(block_q=block_q, block_k=block_k, block_k_major=block_k_major)
    try:
        est = estimate.estimate_attention(impl, **shape, **blocks, topology=topology, timeout=timeout)
    except (estimate.LibtpuMissingError, estimate.LibtpuTooOldError, estimate.UnsupportedChipError):
        raise
    except estimate.ProfilerCrashError as err:
        return Trial(impl, **blocks, status="profiler_crash", note=_one_line(err))
    except estimate.EstimateError as err:
        return Trial(impl, **blocks, status="compile_error", note=_one_line(err))
    except ValueError as err:  # flashlib's tiling rule or VMEM estimate
        return Trial(impl, **blocks, status="refused", note=_one_line(err))
    return Trial(impl, **blocks, status="ok", cycles=est.total_cycles, floor_ratio=round(est.floor_ratio, 3),
                 compile_seconds=round(est.compile_seconds, 1))


def _one_line(message: object, limit: int = 400) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def tune(
    seq_q: int,
    seq_k: int | None = None,
    head_dim: int = 128,
    dtype: str = "bfloat16",
    causal: bool = False,
    topology: str = "v5e:1x1",
    *,
    batch: int = 1,
    heads: int = 8,
    choices: Iterable[int] = BLOCK_CHOICES,
    majors: Iterable[int] = MAJOR_CHOICES,
    baseline: Iterable[tuple[int, int, int]] = (),
    timeout: float = 900.0,
    report: Callable[[str], None] | None = None,
) -> TuningResult:
    """Estimate every candidate (and every ``baseline`` JAX configuration that fits the sequence) for one
    shape on ``topology``; ``report`` (e.g. ``print``) hears one line per configuration."""
    seq_k = seq_q if seq_k is None else seq_k
    dtype = jnp.dtype(dtype).name
    generation = topology.split(":")[0]
    shape = dict(batch=batch, heads=heads, seq=seq_q, kv_seq=seq_k, head_dim=head_dim, dtype=dtype, causal=causal)
    accepted, refused = _screen(seq_q, seq_k, head_dim, dtype, generation, choices, majors)
    trials = [Trial("pallas", s.block_q, s.block_k, "refused", block_k_major=s.block_k_major, note=_one_line(why))
              for s, why in refused]
    jobs = [("pallas", dict(block_q=s.block_q, block_k=s.block_k, block_k_major=s.block_k_major)) for s in accepted]
    jobs += [("jax_flash", dict(block_q=q, block_k_major=km, block_k=k))
             for q, km, k in baseline if max(q, km, k) <= min(seq_q, seq_k)]
    measured: list[Trial] = []
    for impl, blocks in jobs:
        trial = estimate_trial(impl, **blocks, topology=topology, timeout=timeout, **shape)
        measured.append(trial)
        if report is not None:
            outcome = f"{trial.cycles:,} cycles ({trial.floor_ratio}x floor)" if trial.ok else trial.status
            report(f"{topology} T={seq_q}x{seq_k} d={head_dim} {dtype} causal={causal} {impl} {trial.label}: {outcome}")
    flops = cost.attention_flops(batch, heads, seq_q, seq_k, head_dim, causal)
    return TuningResult(
        topology=topology, dtype=dtype, causal=causal, batch=batch, heads=heads, q_len=seq_q, kv_len=seq_k,
        head_dim=head_dim, mxu_floor=hardware.mxu_floor_cycles(flops, hardware.chip_for_topology(topology)),
        trials=tuple(trials + [t for t in measured if t.impl == "pallas"]),
        baseline=tuple(t for t in measured if t.impl == "jax_flash"),
    )


# ---------------------------------------------------------------------------------------------------
# The committed table
# ---------------------------------------------------------------------------------------------------


@functools.cache
def _load(path: Path, mtime: float) -> dict[TableKey, TuningResult]:
    del mtime  # part of the cache key only: a rewritten file is read again
    data = json.loads(path.read_text())
    results = (TuningResult.from_json(entry) for entry in data["entries"])
    return {result.key: result for result in results}


def table_path() -> Path:
    """Where the tuned table is read from: ``tuning/forward_blocks.json`` in the folder
    :func:`flashlib.data.data_dir` finds (``$FLASHLIB_DATA`` first: a pip-installed flashlib on Colab, whose
    setup cell clones the repository and points it there), else :data:`TABLE_PATH` (a clone or an editable
    install), which may be absent."""
    try:
        found = data.data_dir() / "tuning" / TABLE_PATH.name
    except FileNotFoundError:
        return TABLE_PATH
    return found if found.exists() else TABLE_PATH


def load_tuned_table(path: str | Path | None = None) -> dict[TableKey, TuningResult]:
    """``{TableKey: TuningResult}`` from ``path``, by default :func:`table_path`; ``{}`` when the file is absent
    (a pip-installed flashlib without the repository's ``data/``: the defaults fall back to the generation's
    preferred blocks)."""
    path = Path(table_path() if path is None else path)
    return _load(path, path.stat().st_mtime) if path.exists() else {}


def nearest_entry(q_len: int, kv_len: int, head_dim: int, dtype, causal: bool, generation: str,
                  table: Mapping[TableKey, TuningResult] | None = None) -> TuningResult | None:
    """The table entry the nearest-entry rule (module docstring) picks for a call, or None."""
    table = load_tuned_table() if table is None else table
    dtype = jnp.dtype(dtype).name
    usable = [r for r in table.values() if (r.generation, r.dtype, r.causal) == (generation, dtype, bool(causal))
              and r.head_dim >= head_dim and r.best is not None]
    if not usable:
        return None
    dim = min(r.head_dim for r in usable)  # head_dim itself when tuned, else the smallest above it
    usable = [r for r in usable if r.head_dim == dim]
    length = max(q_len, kv_len)
    shorter = [r for r in usable if max(r.q_len, r.kv_len) <= length]
    if shorter:
        return max(shorter, key=lambda r: (max(r.q_len, r.kv_len), r.q_len))
    return min(usable, key=lambda r: (max(r.q_len, r.kv_len), r.q_len))


def lookup(q_len: int, kv_len: int, head_dim: int, dtype, causal: bool, generation: str,
           table: Mapping[TableKey, TuningResult] | None = None) -> BlockSizes | None:
    """The tuned forward ``BlockSizes`` for a call, by the nearest-entry rule (module docstring), clamped to the
    call and validated; None when the table has no answer (then use :meth:`BlockSizes.default`)."""
    entry = nearest_entry(q_len, kv_len, head_dim, dtype, causal, generation, table)
    if entry is None:
        return None
    sizes = entry.best_block_sizes.fit(q_len, kv_len, dtype)
    try:
        sizes.validate(dtype, head_dim)
    except ValueError:
        return None
    return sizes


# ---------------------------------------------------------------------------------------------------
# Progress on long sweeps (shared with flashlib.bench)
# ---------------------------------------------------------------------------------------------------


def progress(items: Iterable[_T], total: int | None = None, describe: Callable[[_T], str] = str,
             file=None) -> Iterator[_T]:
    """Yield ``items``, saying on stderr which one is running: ``[3/8 00:42] pallas T=2048``.

    tqdm's bar when tqdm is installed (not a dependency), else one plain line per item.
    """
    file = sys.stderr if file is None else file
    items = list(items) if total is None else items
    total = len(items) if total is None else total
    try:
        from tqdm import tqdm
    except ImportError:
        start = time.monotonic()
        for i, item in enumerate(items, 1):
            elapsed = int(time.monotonic() - start)
            print(f"[{i}/{total} {elapsed // 60:02d}:{elapsed % 60:02d}] {describe(item)}", file=file, flush=True)
            yield item
        return
    bar = tqdm(items, total=total, file=file, leave=False)
    for item in bar:
        bar.set_description(describe(item))
        yield item
