"""Make ``data/estimates/causal_compaction_v5e.csv``: libtpu's static cycle estimates of the causal Pallas forward
with and without grid compaction, ``[1, 8, T, 128]`` bf16 on ``v5e:1x1``, at the issue's and the tuned shapes.

* ``today``: the full grid ``(b, h, num_q_blocks, num_kv_steps)``, the steps above the diagonal skipped by
  program-id guards (no compute, no copy, but a grid step each) — guards the static model evaluates;
* ``compacted``: the compacted grid ``(b, h, num_live)`` with each step's (query block, key step, first, last)
  computed from its program id and the schedule's constants (``tpu_forward.forward(estimate_as="program_ids")``,
  :func:`flashlib.geometry.scheduled_pair`) instead of read from the SMEM tables: the same computation, guards and
  index maps the model evaluates, plus ``num_q_blocks`` scalar compares per step that the real kernel replaces
  by four SMEM loads (so if anything a little pessimistic). This is the number compared with ``today``;
* ``compacted_as_estimated``: the real compacted kernel as the model sees it — its guards and index maps read
  scalar-prefetched (SMEM) tables, and the model takes code under a guard on SMEM data as never run: **not** a
  measurement, shown to say how far off it is;
* ``plain_unguarded`` / ``masked_unguarded``: estimate-only variants computing every sub-block of every live step
  without guards, plain or masked (``init``/``finalize`` as often as the real kernel, on program ids), and
  ``interpolated = plain + masked_share * (masked - plain)`` (``masked_share``: live steps holding a sub-block that
  needs a mask): a cross-check. Where ``block_q == block_k`` (one sub-block, no row chunks) the real kernel lies
  between the two; with row chunks or sub-blocks it skips parts of a masked step and can be below both.

Shapes whose tuned blocks copy every key in one step (one key step per query block) have nothing to drop: the
default rule (``compact=None``) does not compact them, so there ``compacted`` is ``today`` (not re-estimated).

Each estimate compiles ahead of time in a fresh subprocess (:func:`flashlib.estimate.estimate_cycles`); no TPU
needed, libtpu >= 0.0.42 is (the newest-jax environment)::

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv/bin/python data/estimates/make_compaction_estimates.py
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
import numpy as np

from flashlib import estimate, geometry
from flashlib.tiling import round_up

HEAD_DIM, HEADS = 128, 8
# (T, block_q, block_k, block_k_major): the shapes, then the v5e tuned table's causal entries
# (data/tuning/forward_blocks.json; T = 1024, 2048 and 4096 copy every key in one step: nothing to compact)
SHAPES = [(2048, 512, 512, None), (4096, 512, 512, None), (8192, 512, 512, None), (4096, 1024, 512, None),
          (8192, 1024, 512, 2048), (1024, 1024, 512, 1024), (2048, 1024, 512, 2048), (4096, 512, 512, 4096)]
COLUMNS = ["T", "block_q", "block_k", "block_k_major", "grid_steps_today", "live_steps", "today", "compacted",
           "compacted_over_today", "compacted_as_estimated", "plain_unguarded", "masked_unguarded", "masked_share",
           "interpolated"]


def _cycles(length: int, block_q: int, block_k: int, block_k_major, topology: str, **kernel) -> int:
    q = jax.ShapeDtypeStruct((1, HEADS, length, HEAD_DIM), jnp.bfloat16)
    result = estimate.estimate_cycles(estimate.flashlib_forward, q, q, q, topology=topology, causal=True,
                                      block_q=block_q, block_k=block_k, block_k_major=block_k_major, **kernel)
    return int(result.total_cycles)


def steps(length: int, block_q: int, kv_step: int) -> tuple[int, int, float]:
    """``(full grid steps, live steps, masked share of the live ones)`` of one (batch, head)."""
    num_q, num_kv = round_up(length, block_q) // block_q, round_up(length, kv_step) // kv_step
    geo = dict(q_len=length, kv_len=length, causal=True)
    q_block, kv_block, _, _ = geometry.live_schedule(num_q, num_kv, block_q=block_q, kv_step=kv_step, **geo)
    masked = np.asarray(geometry.block_needs_mask(q_block, kv_block, block_q=block_q, block_k=kv_step, **geo))
    return num_q * num_kv, q_block.size, float(masked.mean())


def rows(topology: str, shapes):
    for length, block_q, block_k, block_k_major in shapes:
        full, live, share = steps(length, block_q, block_k_major or block_k)
        blocks = (length, block_q, block_k, block_k_major, topology)
        row = dict(T=length, block_q=block_q, block_k=block_k, block_k_major=block_k_major or "",
                   grid_steps_today=full, live_steps=live, today=_cycles(*blocks, compact=False))
        if live == full:  # nothing to drop: the rule keeps the full grid
            yield dict(row, compacted=row["today"], compacted_over_today=1.0)
            continue
        row["compacted"] = _cycles(*blocks, compact=True, estimate_as="program_ids")
        row["compacted_over_today"] = round(row["compacted"] / row["today"], 3)
        row["compacted_as_estimated"] = _cycles(*blocks, compact=True, estimate_as="as_shipped")
        plain = row["plain_unguarded"] = _cycles(*blocks, compact=True, estimate_as="plain")
        masked = row["masked_unguarded"] = _cycles(*blocks, compact=True, estimate_as="masked")
        yield dict(row, masked_share=round(share, 4), interpolated=round(plain + share * (masked - plain)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--shapes", default=None, help="indices into SHAPES, comma-separated (default: all)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: causal_compaction_<generation>.csv beside this script")
    args = parser.parse_args()
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    out = args.out or Path(__file__).with_name(f"causal_compaction_{args.topology.split(':')[0]}.csv")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with out.open("w", newline="") as f:
        f.write(f"# static cycle estimates (libtpu --xla_jf_dump_static_llo_profile_to), target {args.topology}\n")
        f.write(f"# flashlib's causal Pallas forward, [1, {HEADS}, T, {HEAD_DIM}] bf16, full grid (today) vs compacted "
                "(estimated with the schedule from program ids, estimate_as='program_ids'; compacted_as_estimated, "
                "the SMEM-table kernel as is, is blind to the work under its guards); made by "
                f"make_compaction_estimates.py at commit {commit}\n")
        f.write(f"# libtpu {estimate.libtpu_version()}, jax {jax.__version__}, {datetime.date.today()}, "
                f"{platform.system()} {platform.machine()} CPU (no TPU): a static model, never checked against a "
                "real TPU\n")
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for row in rows(args.topology, shapes):
            writer.writerow(row)
            f.flush()
            print(row, flush=True)


if __name__ == "__main__":
    main()
