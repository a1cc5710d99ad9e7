"""Measure flashlib's Pallas forward kernel *as it is now* with libtpu's static cycle estimate; append rows.

Each run compiles the current kernel ahead of time for v5e and/or v6e (no TPU needed; libtpu >= 0.0.42,
i.e. the newest-jax environment ``.venv``) on the target shapes of the optimisation issue, ``[B=1, H=8, T,
D=128]`` bf16, for every block configuration given, and appends one row per (shape, blocks) to
``forward_steps.csv`` under the step name given. Earlier rows are history: they were measured on the kernel
of their step and are never re-measured. A configuration that fails to compile or crashes libtpu's static
profiler gets a row with the status in ``cycles``. Example::

    JAX_PLATFORMS=cpu .venv/bin/python data/optimisation/measure_forward.py --step 0-baseline \\
        --change "kernel at commit d896847" --blocks 1024/512,1024/1024 --seqs 2048 --generations v5e,v6e

``--blocks`` takes ``block_q/block_k`` or ``block_q/block_k_major/block_k`` items.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from flashlib import cost, estimate, hardware, tuning  # noqa: E402

CSV_PATH = Path(__file__).resolve().parent / "forward_steps.csv"
COLUMNS = ("step", "change", "generation", "seq", "causal", "block_q", "block_k", "block_k_major", "cycles",
           "jax_best", "ratio_to_jax", "mxu_floor")
BATCH, HEADS, HEAD_DIM, DTYPE = 1, 8, 128, "bfloat16"


def load_jax_best() -> dict[tuple[str, int, bool], int]:
    """JAX's flash_attention (jax.experimental.pallas.ops.tpu), best over its configurations, keyed by
    (generation, seq, causal): the JAX rows of the tuned table (same libtpu 0.0.50 static estimate and shapes;
    at T = 2048-8192 on v5e and 2048-4096 on v6e they equal data/reference/jax_flash_estimates.csv)."""
    return {(key.generation, key.q_len, key.causal): entry.baseline_best.cycles
            for key, entry in tuning.load_tuned_table().items()
            if entry.baseline_best is not None and key.head_dim == HEAD_DIM and key.dtype == DTYPE}


def parse_blocks(text: str) -> list[tuple[int, int, int | None]]:
    """``"1024/512,1024/2048/512"`` -> ``[(1024, 512, None), (1024, 512, 2048)]`` as (block_q, block_k, major)."""
    configs = []
    for item in text.split(","):
        parts = [int(x) for x in item.split("/")]
        if len(parts) == 2:
            configs.append((parts[0], parts[1], None))
        elif len(parts) == 3:
            configs.append((parts[0], parts[2], parts[1]))
        else:
            raise argparse.ArgumentTypeError(f"blocks item must be q/k or q/km/k, got {item!r}")
    return configs


def measure(generation: str, seq: int, causal: bool, block_q: int, block_k: int,
            block_k_major: int | None, timeout: float) -> str:
    """The total estimated cycles as a string, or the reason there are none."""
    trial = tuning.estimate_trial(
        "pallas", block_q=block_q, block_k=block_k, block_k_major=block_k_major, topology=f"{generation}:1x1",
        timeout=timeout, batch=BATCH, heads=HEADS, seq=seq, head_dim=HEAD_DIM, dtype=DTYPE, causal=causal,
    )
    if trial.ok:
        return str(trial.cycles)
    return trial.status if trial.status == "profiler_crash" else f"{trial.status}: {trial.note[:120]}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", required=True, help="name of the step, e.g. 3-block-k-major")
    parser.add_argument("--change", required=True, help="what the step changed, in a few words")
    parser.add_argument("--blocks", type=parse_blocks, required=True)
    parser.add_argument("--generations", type=lambda s: s.split(","), default=["v5e", "v6e"])
    parser.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096])
    parser.add_argument("--causal", type=lambda s: [x == "1" for x in s.split(",")], default=[False, True],
                        help="0,1 (both), 0 or 1")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=CSV_PATH)
    args = parser.parse_args(argv)
    if not estimate.supports_static_profile():
        sys.exit(f"libtpu {estimate.libtpu_version()} has no static profile: use the newest-jax environment")

    best_of_jax = load_jax_best()
    new_file = not args.out.exists()
    with args.out.open("a", newline="") as f:
        writer = csv.writer(f)
        if new_file:
            writer.writerow(COLUMNS)
        for generation in args.generations:
            chip = hardware.chip_for_topology(f"{generation}:1x1")
            for seq in args.seqs:
                for causal in args.causal:
                    flops = cost.attention_flops(BATCH, HEADS, seq, seq, HEAD_DIM, causal)
                    floor = round(hardware.mxu_floor_cycles(flops, chip))
                    jax_best = best_of_jax.get((generation, seq, causal))
                    for block_q, block_k, major in args.blocks:
                        cycles = measure(generation, seq, causal, block_q, block_k, major, args.timeout)
                        ratio = f"{int(cycles) / jax_best:.3f}" if cycles.isdigit() and jax_best else ""
                        row = (args.step, args.change, generation, seq, int(causal), block_q, block_k,
                               major or "", cycles, jax_best or "", ratio, floor)
                        writer.writerow(row)
                        f.flush()
                        print(",".join(map(str, row)), flush=True)


if __name__ == "__main__":
    main()
