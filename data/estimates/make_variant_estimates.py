"""Make ``data/estimates/variants_v5e.csv``: libtpu's static cycle estimates of the Pallas forward with the
variants (issue 16), for ``[1, heads, T, 128]`` bf16 on ``v5e:1x1``, blocks 512 x 512:

* ``window``: local causal attention over the last 1024 keys (``window=(1023, 0)``), T = 2048-32768 — with
  grid compaction the cycles per query token should stay flat (linear cost in T);
* ``causal``: plain causal at the same T, for comparison (quadratic);
* ``gqa``: 8 query heads over 8 (MHA), 2 (GQA 4:1) and 1 (MQA) kv heads at T = 2048, causal and not —
  the kernel reads K/V per group (``kv_bytes`` is what the kernel's k/v operands hold in HBM).

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

from flashlib import estimate

HEAD_DIM, BLOCK = 128, 512
COLUMNS = ["kind", "T", "heads", "kv_heads", "causal", "window", "cycles", "cycles_per_query_token", "kv_bytes"]


def _cycles(q_len: int, heads: int, kv_heads: int, causal: bool, window, topology: str) -> int:
    q = jax.ShapeDtypeStruct((1, heads, q_len, HEAD_DIM), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, kv_heads, q_len, HEAD_DIM), jnp.bfloat16)
    result = estimate.estimate_cycles(estimate.flashlib_forward, q, kv, kv, topology=topology, causal=causal,
                                      block_q=BLOCK, block_k=BLOCK, window=window)
    return int(result.total_cycles)


def rows(topology: str, lengths: list[int]):
    for kind, window in (("window", (1023, 0)), ("causal", None)):
        for length in lengths:
            cycles = _cycles(length, 8, 8, True, window, topology)
            yield dict(kind=kind, T=length, heads=8, kv_heads=8, causal=True, window=window or "", cycles=cycles,
                       cycles_per_query_token=round(cycles / length, 1), kv_bytes=2 * 8 * length * HEAD_DIM * 2)
    for causal in (False, True):
        for kv_heads in (8, 2, 1):
            cycles = _cycles(2048, 8, kv_heads, causal, None, topology)
            yield dict(kind="gqa", T=2048, heads=8, kv_heads=kv_heads, causal=causal, window="", cycles=cycles,
                       cycles_per_query_token=round(cycles / 2048, 1), kv_bytes=2 * kv_heads * 2048 * HEAD_DIM * 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    parser.add_argument("--out", type=Path, default=None, help="default: variants_<generation>.csv beside this script")
    args = parser.parse_args()
    out = args.out or Path(__file__).with_name(f"variants_{args.topology.split(':')[0]}.csv")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with out.open("w", newline="") as f:
        f.write(f"# static cycle estimates (libtpu --xla_jf_dump_static_llo_profile_to), target {args.topology}\n")
        f.write(f"# flashlib's Pallas forward, [1, heads, T, {HEAD_DIM}] bf16, blocks {BLOCK} x {BLOCK}; made by "
                f"make_variant_estimates.py at commit {commit}\n")
        f.write(f"# libtpu {estimate.libtpu_version()}, jax {jax.__version__}, {datetime.date.today()}, "
                f"{platform.system()} {platform.machine()} CPU (no TPU): a static model, never checked against a "
                "real TPU\n")
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for row in rows(args.topology, [int(x) for x in args.lengths.split(",")]):
            writer.writerow(row)
            f.flush()
            print(row, flush=True)


if __name__ == "__main__":
    main()
