"""Make ``data/estimates/variants_v5e.csv``: libtpu's static cycle estimates of the Pallas forward with the
variants (issue 16), for ``[1, heads, T, 128]`` bf16 on ``v5e:1x1``, blocks 512 x 512:

* ``window``: local causal attention over the last 1024 keys (``window=(1023, 0)``), T = 2048-32768 — with
  grid compaction the cycles per query token should stay flat (linear cost in T);
* ``causal``: plain causal at the same T, for comparison (quadratic);
* ``gqa``: 8 query heads over 8 (MHA), 2 (GQA 4:1) and 1 (MQA) kv heads at T = 2048, causal and not — a grid
  step computes a group's query heads against one k/v copy (``heads_per_step``); ``kv_bytes`` is what the
  kernel's k/v operands hold in HBM, ``kv_bytes_read`` what its k/v copies move
  (:func:`flashlib.cost.kv_block_fetches`).

``cycles`` are the attention kernel's own (``flash_attention_forward*`` ops): for GQA the estimate compiles the
kernel with each packed head as its own 2-D operand (``separate_heads``; the profiler reads no kernel with
three-dimensional blocks) and the stack of their outputs it then needs is left out, as the kernel as shipped
does not run it.

Each estimate compiles ahead of time in a fresh subprocess (:func:`flashlib.estimate.estimate_cycles`); no TPU
needed, libtpu >= 0.0.42 is (the newest-jax environment)::

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv/bin/python data/estimates/make_variant_estimates.py
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp

from flashlib import cost, estimate
from flashlib.kernels import BlockSizes
from flashlib.kernels.tpu_forward import heads_per_step

HEAD_DIM, BLOCK = 128, 512
COLUMNS = ["kind", "T", "heads", "kv_heads", "causal", "window", "cycles", "cycles_per_query_token", "kv_bytes",
           "heads_per_step", "kv_bytes_read"]


def _cycles(q_len: int, heads: int, kv_heads: int, causal: bool, window, topology: str) -> int:
    q = jax.ShapeDtypeStruct((1, heads, q_len, HEAD_DIM), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, kv_heads, q_len, HEAD_DIM), jnp.bfloat16)
    result = estimate.estimate_cycles(estimate.flashlib_forward, q, kv, kv, topology=topology, causal=causal,
                                      block_q=BLOCK, block_k=BLOCK, window=window)
    return sum(cycles for op, cycles in result.kernels.items() if op.startswith("flash_attention_forward"))


def _row(kind: str, length: int, heads: int, kv_heads: int, causal: bool, window, topology: str) -> dict:
    cycles = _cycles(length, heads, kv_heads, causal, window, topology)
    sizes = BlockSizes(BLOCK, BLOCK, generation=topology.split(":")[0])
    pack = heads_per_step(heads // kv_heads, sizes, HEAD_DIM, jnp.bfloat16)
    fetches = cost.kv_block_fetches(length, length, BLOCK, BLOCK, causal, window)  # per (batch, grid head)
    return dict(kind=kind, T=length, heads=heads, kv_heads=kv_heads, causal=causal, window=window or "",
                cycles=cycles, cycles_per_query_token=round(cycles / length, 1),
                kv_bytes=2 * kv_heads * length * HEAD_DIM * 2, heads_per_step=pack,
                kv_bytes_read=2 * heads // pack * fetches * BLOCK * HEAD_DIM * 2)


def rows(topology: str, lengths: list[int], kinds: set[str]):
    for kind, window in (("window", (1023, 0)), ("causal", None)):
        if kind in kinds:
            for length in lengths:
                yield _row(kind, length, 8, 8, True, window, topology)
    if "gqa" in kinds:
        for causal in (False, True):
            for kv_heads in (8, 2, 1):
                yield _row("gqa", 2048, 8, kv_heads, causal, None, topology)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    parser.add_argument("--kinds", default="window,causal,gqa", help="which rows (comma-separated)")
    parser.add_argument("--out", type=Path, default=None, help="default: variants_<generation>.csv beside this script")
    args = parser.parse_args()
    out = args.out or Path(__file__).with_name(f"variants_{args.topology.split(':')[0]}.csv")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with out.open("w", newline="") as f:
        f.write(f"# static cycle estimates (libtpu --xla_jf_dump_static_llo_profile_to), target {args.topology}\n")
        f.write(f"# flashlib's Pallas forward, [1, heads, T, {HEAD_DIM}] bf16, blocks {BLOCK} x {BLOCK}; made by "
                f"make_variant_estimates.py at commit {commit}\n")
        f.write("# window: local causal window=(1023, 0); gqa: 8 query heads over 8, 2, 1 kv heads at T = 2048; "
                "cycles: the attention kernel's own (GQA: heads as separate operands, their output stack left out)\n")
        f.write(f"# libtpu {estimate.libtpu_version()}, jax {jax.__version__}, {datetime.date.today()}, "
                f"{platform.system()} {platform.machine()} CPU (no TPU): a static model, never checked against a "
                "real TPU\n")
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for row in rows(args.topology, [int(x) for x in args.lengths.split(",")], set(args.kinds.split(","))):
            writer.writerow(row)
            f.flush()
            print(row, flush=True)


if __name__ == "__main__":
    main()
