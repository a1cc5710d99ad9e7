"""Make the two tables of notebook 08 (``data/estimates/block_sweep.csv``, ``seq_sweep.csv``): static estimates.

Both are libtpu's static cycle estimates (:func:`flashlib.estimate.estimate_cycles`, compiled ahead of time for
a TPU target on a CPU machine, never timed on a TPU), for the attention forward ``[1, 8, seq, 128]`` bfloat16,
not causal, on v5e and v6e:

* ``block_sweep.csv`` — flashlib's Pallas kernel at ``seq = 2048`` for every ``block_q x block_k`` in 128, 256,
  512, 1024 (the tuning table starts at 256): how the estimate grows as the grid gets finer;
* ``seq_sweep.csv`` — three implementations over ``seq`` = 128 .. 4096: ``xla`` (flashlib's ``impl="xla"``,
  ``jax.nn.dot_product_attention`` fused by XLA), ``pallas`` (flashlib's kernel, blocks from the tuned table
  clamped to the sequence, ``block_k_major`` included, else the default) and ``jax_flash`` (JAX's
  ``flash_attention``, blocks ``q1024/km1024/k512`` clamped). Beside the cycles: the compiler's cost analysis
  of the same compile (FLOPs and HBM bytes accessed), which places each implementation on the roofline.

Needs libtpu >= 0.0.42 (the newest-jax environment); about ten minutes on two CPU cores::

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv/bin/python data/estimates/make_perf_lab_estimates.py
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from flashlib import cost, estimate, hardware, provenance, tuning
from flashlib.kernels.block_sizes import BlockSizes
from flashlib.tpu_compile import compile_for_tpu
from flashlib.xla import xla_attention

TOPOLOGIES = ("v5e:1x1", "v6e:1x1")
SHAPE: dict[str, Any] = dict(batch=1, heads=8, head_dim=128, dtype="bfloat16", causal=False)
SWEEP_SEQ = 2048
SWEEP_BLOCKS = (128, 256, 512, 1024)
SEQS = (128, 256, 512, 1024, 2048, 4096)
JAX_FLASH_BLOCKS = tuning.JAX_FLASH_DEFAULT  # (block_q, block_k_major, block_k), clamped to the sequence
BLOCK_COLUMNS = ["generation", "seq", "block_q", "block_k", "grid_steps", "status", "cycles", "mxu_floor",
                 "floor_ratio", "note"]
SEQ_COLUMNS = ["generation", "impl", "seq", "blocks", "status", "cycles", "mxu_floor", "floor_ratio", "flops",
               "hbm_bytes", "note"]


KERNEL_SOURCES = ("flashlib/kernels", "flashlib/cost.py", "flashlib/geometry.py", "flashlib/tiling.py")


def kernel_state() -> str:
    """The commit the kernels were compiled from, whether they had uncommitted changes, and their sha256."""
    state = provenance.source_state(KERNEL_SOURCES)
    dirty = " + uncommitted changes to the kernel sources" if state.edited else ""
    return f"commit {state.commit or '?'}{dirty}, kernel sha256 {state.sha256}"


def _note(err: Exception) -> str:
    return " ".join(str(err).split())[:200]


def block_row(topology: str, block_q: int, block_k: int) -> dict[str, Any]:
    """One flashlib configuration at ``SWEEP_SEQ``: its estimate, or why there is none."""
    generation = topology.split(":")[0]
    sizes = BlockSizes(block_q, block_k, generation=generation)
    steps = SHAPE["batch"] * SHAPE["heads"] * (SWEEP_SEQ // block_q) * (SWEEP_SEQ // block_k)
    row = dict(generation=generation, seq=SWEEP_SEQ, block_q=block_q, block_k=block_k, grid_steps=steps)
    trial = tuning.estimate_trial("pallas", block_q=sizes.block_q, block_k=sizes.block_k, topology=topology,
                                  seq=SWEEP_SEQ, **SHAPE)
    if not trial.ok:
        return {**row, "status": trial.status, "note": trial.note[:200]}
    flops = cost.attention_flops(SHAPE["batch"], SHAPE["heads"], SWEEP_SEQ, SWEEP_SEQ, SHAPE["head_dim"],
                                 SHAPE["causal"])
    floor = hardware.mxu_floor_cycles(flops, generation)
    return {**row, "status": "ok", "cycles": trial.cycles, "mxu_floor": round(floor),
            "floor_ratio": round(trial.cycles / floor, 3)}


def _blocks(impl: str, seq: int, generation: str) -> dict[str, int]:
    if impl == "pallas":
        sizes = BlockSizes.default(seq, seq, SHAPE["head_dim"], SHAPE["dtype"], generation=generation,
                                   causal=SHAPE["causal"])  # the tuned table's pick where it has one
        if sizes.block_k_major is None:
            return dict(block_q=sizes.block_q, block_k=sizes.block_k)
        return dict(block_q=sizes.block_q, block_k_major=sizes.block_k_major, block_k=sizes.block_k)
    if impl == "jax_flash":
        block_q, block_k_major, block_k = (min(b, seq) for b in JAX_FLASH_BLOCKS)
        return dict(block_q=block_q, block_k_major=block_k_major, block_k=block_k)
    return {}


def _compiled_cost(impl: str, topology: str, seq: int, blocks: dict[str, int]) -> tuple[float | None, float | None]:
    """(FLOPs, HBM bytes accessed) from the compiler's cost analysis of the same compile."""
    shape = (SHAPE["batch"], SHAPE["heads"], seq, SHAPE["head_dim"])
    q = jax.ShapeDtypeStruct(shape, jnp.dtype(SHAPE["dtype"]))
    if impl == "xla":
        def fn(q, k, v):
            return xla_attention(q, k, v, causal=SHAPE["causal"])
    else:
        recipe = estimate.flashlib_forward if impl == "pallas" else estimate.jax_flash_forward
        options = dict(blocks, generation=topology.split(":")[0]) if impl == "pallas" else blocks

        def fn(q, k, v):
            return recipe(q, k, v, causal=SHAPE["causal"], **options)
    check = compile_for_tpu(fn, q, q, q, topology=topology)
    return (check.flops, check.bytes_accessed) if check.ok else (None, None)


def seq_row(topology: str, impl: str, seq: int) -> dict[str, Any]:
    """One implementation at one length: estimate, floor and the compiler's cost analysis."""
    generation = topology.split(":")[0]
    blocks = _blocks(impl, seq, generation)
    label = "/".join(f"{k.removeprefix('block_').replace('_major', 'm')}{v}" for k, v in blocks.items()) or "-"
    row: dict[str, Any] = dict(generation=generation, impl=impl, seq=seq, blocks=label)
    flops = cost.attention_flops(SHAPE["batch"], SHAPE["heads"], seq, seq, SHAPE["head_dim"], SHAPE["causal"])
    floor = hardware.mxu_floor_cycles(flops, generation)
    try:
        if impl == "xla":
            q = jax.ShapeDtypeStruct((SHAPE["batch"], SHAPE["heads"], seq, SHAPE["head_dim"]), SHAPE["dtype"])
            est = estimate.estimate_cycles("flashlib.xla:xla_attention", q, q, q, topology=topology, flops=flops,
                                           causal=SHAPE["causal"])
        else:
            est = estimate.estimate_attention(impl, seq=seq, topology=topology, **SHAPE, **blocks)
    except (estimate.EstimateError, ValueError) as err:
        status = estimate.failure_status(err)
        if status is None:
            raise
        return {**row, "status": status, "note": _note(err)}
    compiled_flops, hbm_bytes = _compiled_cost(impl, topology, seq, blocks)
    return {**row, "status": "ok", "cycles": est.total_cycles, "mxu_floor": round(floor),
            "floor_ratio": round(est.total_cycles / floor, 3), "flops": compiled_flops, "hbm_bytes": hbm_bytes}


def _write(path: Path, columns: list[str], rows: list[dict[str, Any]], what: str, started: str) -> None:
    ended = kernel_state()
    same = "unchanged while it ran" if ended == started else f"EDITED while it ran: at the end {ended}"
    header = [
        f"static cycle estimates (libtpu --xla_jf_dump_static_llo_profile_to): {what}",
        f"shape [batch, heads, seq, head_dim] = [{SHAPE['batch']}, {SHAPE['heads']}, seq, {SHAPE['head_dim']}] "
        f"{SHAPE['dtype']}, causal={SHAPE['causal']}; made by {Path(__file__).name}",
        f"kernel: {started} ({same})",
        f"libtpu {estimate.libtpu_version()}, jax {jax.__version__}, {datetime.date.today().isoformat()}, "
        f"{platform.system()} {platform.machine()} CPU (no TPU): a static model, never checked against a real TPU; "
        "it prices float32 and bfloat16 almost the same",
        "mxu_floor = ideal FLOPs / (MXUs x dim^2 x 2); floor_ratio = cycles / mxu_floor",
    ]
    with path.open("w", newline="") as f:
        f.writelines(f"# {line}\n" for line in header)
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent)
    parser.add_argument("--only", choices=("blocks", "seq"), default=None, help="make one of the two tables")
    args = parser.parse_args()
    started = kernel_state()
    if args.only in (None, "blocks"):
        rows = []
        for topology in TOPOLOGIES:
            for block_q in SWEEP_BLOCKS:
                for block_k in SWEEP_BLOCKS:
                    rows.append(block_row(topology, block_q, block_k))
                    print(f"{topology} q{block_q}/k{block_k}: {rows[-1]['status']} {rows[-1].get('cycles', '')}",
                          flush=True)
        _write(args.out_dir / "block_sweep.csv", BLOCK_COLUMNS, rows,
               f"flashlib's Pallas forward at seq={SWEEP_SEQ}, every block_q x block_k", started)
    if args.only in (None, "seq"):
        rows = []
        for topology in TOPOLOGIES:
            for seq in SEQS:
                for impl in ("xla", "pallas", "jax_flash"):
                    rows.append(seq_row(topology, impl, seq))
                    r = rows[-1]
                    print(f"{topology} T={seq} {impl} {r['blocks']}: {r['status']} {r.get('cycles', '')} "
                          f"{r.get('hbm_bytes', '')}", flush=True)
        _write(args.out_dir / "seq_sweep.csv", SEQ_COLUMNS, rows,
               "XLA's fused attention, flashlib's Pallas kernel and JAX's flash_attention across sequence lengths",
               started)


if __name__ == "__main__":
    main()
