"""The committed table of tuned block sizes, read: its records, where the file is, the nearest-entry rule.

``data/tuning/forward_blocks.json`` holds, per shape, dtype, causality and TPU generation, every forward
configuration :mod:`flashlib.tuning` compiled and what libtpu's static estimate said about it. This module
only *reads* it, so the kernels' defaults (:meth:`flashlib.kernels.BlockSizes.default`) can consult it
without depending on the sweep that writes it (which sits above the kernels, in :mod:`flashlib.tuning`).

The nearest-entry rule (:func:`nearest_entry`):

* only entries of the same generation, dtype and causality that have a best (an entry whose candidates all
  crashed libtpu's profiler has none: with libtpu 0.0.50, every head_dim=64 entry, and causal ones on v5e);
* ``head_dim``: the same head_dim if tuned, else the smallest tuned head_dim above it (VMEM grows with
  head_dim, so those blocks still fit), else no answer;
* length: with ``n = max(q_len, kv_len)``, the entry with the largest tuned length ``<= n``; a call shorter
  than every tuned length takes the shortest entry.

The blocks of an entry are plain numbers here (:attr:`TuningResult.best_blocks`); clamping them to a call
and checking them against the VMEM budget is :func:`flashlib.kernels.block_sizes.lookup`'s job.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp

__all__ = [
    "STATUSES",
    "PACKAGED_TABLE",
    "TABLE_PATH",
    "TableKey",
    "Trial",
    "TuningResult",
    "load_tuned_table",
    "nearest_entry",
    "table_path",
]

TABLE_NAME = "tuning/forward_blocks.json"  # the repository's data/ names it there (a link to the packaged file)
# The table ships inside the package (package data in pyproject.toml): BlockSizes.default reads the same table in a
# clone, an editable install and a pip-installed wheel, whatever FLASHLIB_DATA says (or that it is unset).
PACKAGED_TABLE = Path(__file__).resolve().with_name("forward_blocks.json")
TABLE_PATH = Path(__file__).resolve().parents[2] / "data" / TABLE_NAME  # a clone's path to it, for its readers
# What became of one configuration: an estimate, flashlib's own refusal (tiling rule or VMEM budget), the
# compiler's error, or libtpu's static profiler aborting on a kernel that compiles.
STATUSES: tuple[str, ...] = ("ok", "refused", "compile_error", "profiler_crash")


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

    @property
    def blocks(self) -> dict[str, int | None]:
        """``{"block_q": ..., "block_k": ..., "block_k_major": ...}``: the fields of a ``BlockSizes``."""
        return {"block_q": self.block_q, "block_k": self.block_k, "block_k_major": self.block_k_major}


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


@functools.cache
def _load(path: Path, mtime: float) -> dict[TableKey, TuningResult]:
    del mtime  # part of the cache key only: a rewritten file is read again
    content = json.loads(path.read_text())
    results = (TuningResult.from_json(entry) for entry in content["entries"])
    return {result.key: result for result in results}


def table_path() -> Path:
    """Where the tuned table is read from: :data:`PACKAGED_TABLE`, inside the installed package, so the defaults
    never change with the environment (a Colab runtime restarted without its setup cell, which set
    ``$FLASHLIB_DATA``, read a different table before the table shipped in the wheel). The repository's
    ``data/tuning/forward_blocks.json`` is a link to it."""
    return PACKAGED_TABLE


def load_tuned_table(path: str | Path | None = None) -> dict[TableKey, TuningResult]:
    """``{TableKey: TuningResult}`` from ``path``, by default :func:`table_path`; ``{}`` when a ``path`` given
    is absent. The packaged table missing is an install error, said as one (never a silent change of defaults)."""
    if path is None and not PACKAGED_TABLE.exists():
        raise FileNotFoundError(f"flashlib's tuned block table is missing from the installed package "
                                f"({PACKAGED_TABLE}); reinstall flashlib (the wheel ships it as package data)")
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
