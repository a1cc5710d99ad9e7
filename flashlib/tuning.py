"""Choosing block sizes by the TPU compiler's static estimate, and the committed table of those choices.

A block size is a trade: bigger blocks mean fewer grid steps (less per-step overhead, fewer re-reads of
k and v) but more VMEM and, for causal attention, more wasted work on the diagonal. Rather than guess, ask
the compiler. For one shape, dtype, causality and TPU target:

1. the kernel lists the ``BlockSizes`` worth trying (:func:`flashlib.kernels.candidates.candidates`: the
   backend owns its search space, the tuner asks it): every ``block_q x block_k`` from :data:`BLOCK_CHOICES`,
   clamped to the sequence (:meth:`BlockSizes.fit`), that its own tiling rule and VMEM estimate accept
   (:meth:`BlockSizes.validate`);
2. :func:`tune` compiles each one for the target with libtpu's static profiler
   (:func:`flashlib.estimate.estimate_attention`) and keeps every outcome — cycles, or why there are none
   (``refused`` by flashlib, ``compile_error`` from the compiler, the final judge, ``profiler_crash`` when
   libtpu's profiler aborts on a kernel that compiles) — and the best: the fewest estimated cycles;
3. ``data/tuning/make_tuned_table.py`` runs :func:`tune` over a grid of shapes and writes
   ``data/tuning/forward_blocks.json`` (:data:`TABLE_PATH`).

Reading that table is not this module's job: its records (:class:`Trial`, :class:`TuningResult`), the file's
location and the nearest-entry rule live with the kernels that consult it
(:mod:`flashlib.kernels.tuned_table`, and :func:`flashlib.kernels.block_sizes.lookup` for a call's blocks),
so the kernels never import the sweep. They are re-exported here for the sweep's users.

The numbers are static estimates of the kernel as it is today, not timings (see :mod:`flashlib.estimate`);
when the kernel changes, rerun the script: it is the single source of truth for the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax.numpy as jnp

from flashlib import cost, estimate, hardware
from flashlib.kernels.block_sizes import entry_block_sizes, lookup
from flashlib.kernels.candidates import BLOCK_CHOICES, MAJOR_CHOICES, candidates, screen
from flashlib.kernels.tuned_table import (
    PACKAGED_TABLE,
    STATUSES,
    TABLE_PATH,
    TableKey,
    Trial,
    TuningResult,
    load_tuned_table,
    nearest_entry,
    table_path,
)

__all__ = [  # the table's records and reader live with the kernels that read it; re-exported for the sweep
    "BLOCK_CHOICES",
    "JAX_FLASH_CHOICES",
    "JAX_FLASH_DEFAULT",
    "MAJOR_CHOICES",
    "PACKAGED_TABLE",
    "STATUSES",
    "TABLE_PATH",
    "table_path",
    "TableKey",
    "Trial",
    "TuningResult",
    "candidates",
    "entry_block_sizes",
    "estimate_trial",
    "load_tuned_table",
    "lookup",
    "nearest_entry",
    "tune",
]

# JAX's own flash_attention as a yardstick: (block_q, block_k_major, block_k), its best configurations in
# data/reference/jax_flash_estimates.csv (the rows with forward_best) plus the plain 512 cube.
JAX_FLASH_CHOICES: tuple[tuple[int, int, int], ...] = (
    (512, 512, 512), (1024, 1024, 1024), (512, 2048, 512), (1024, 2048, 512),
)
# The configuration JAX's kernel runs at where the table has no baseline for a shape (near its best there).
JAX_FLASH_DEFAULT: tuple[int, int, int] = (1024, 1024, 512)


# ---------------------------------------------------------------------------------------------------
# Candidates and measurements
# ---------------------------------------------------------------------------------------------------


def estimate_trial(impl: str, *, block_q: int, block_k: int, block_k_major: int | None = None,
                   topology: str = "v5e:1x1", timeout: float = 900.0, **shape: Any) -> Trial:
    """One :func:`~flashlib.estimate.estimate_attention` call as a :class:`Trial`: a refusal, a compile error or
    a profiler crash is an outcome, not an exception. A toolchain that cannot estimate at all (no libtpu, too
    old, chip not covered) still raises: no configuration would fare better."""
    blocks = dict(block_q=block_q, block_k=block_k, block_k_major=block_k_major)
    try:
        est = estimate.estimate_attention(impl, **shape, **blocks, topology=topology, timeout=timeout)
    except (ValueError, estimate.EstimateError) as err:
        status = estimate.failure_status(err)
        if status is None:
            raise
        return Trial(impl, **blocks, status=status, note=estimate.one_line(err))
    return Trial(impl, **blocks, status="ok", cycles=est.total_cycles, floor_ratio=round(est.floor_ratio, 3),
                 compile_seconds=round(est.compile_seconds, 1))


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
    accepted, refused = screen(seq_q, seq_k, head_dim, dtype, generation, choices, majors)
    trials = [Trial("pallas", s.block_q, s.block_k, "refused", block_k_major=s.block_k_major,
                    note=estimate.one_line(why)) for s, why in refused]
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
