"""Make ``data/estimates/decode_<generation>.csv``: libtpu's static cycle estimates of one decode step against the
HBM floor (:mod:`flashlib.decode_estimate`; issue 17).

One new token per sequence, bf16, head_dim 128, GQA 8:1 (32 query heads on 4 kv heads), caches of 4k, 16k
and 64k keys, batch 1 and 8: the contiguous-cache decode kernel at 1, 2, 4 and 8 splits (2048-key blocks),
flashlib's attention forward on the same cache (at ``q_len = 16``, the block ``q_len = 1`` pads to), and at
4k / batch 1 the key-block sweep, the paged kernel (pages of 128 and 512 keys, one page per grid step and
2048 keys per step), JAX's ``paged_attention`` and the kernel as served (guards reading ``lengths``).
Each compiled ahead of time for one TPU target in a fresh subprocess. No TPU needed; libtpu >= 0.0.42 is
(the newest-jax environment)::

    JAX_PLATFORMS=cpu .venv/bin/python data/estimates/make_decode_estimates.py --topology v5e:1x1
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
from pathlib import Path

import jax

from flashlib import decode_estimate, estimate, hardware, provenance

COLUMNS = ["kind", "batch", "kv_len", "num_splits", "block_k", "pages_per_step", "cycles", "kernel_cycles",
           "floor_cycles", "vs_floor", "status", "note"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", default=None, help="re-make only these kinds (comma-separated) in the existing "
                        "table, keeping its other rows, and say so in its header")
    args = parser.parse_args()
    chip = hardware.chip_for_topology(args.topology)
    out = args.out or Path(__file__).with_name(f"decode_{chip.name}.csv")
    state = provenance.source_state(["flashlib/kernels/tpu_decode.py", "flashlib/decode_estimate.py"])

    def progress(done, total, row):
        print(f"[{done}/{total}] {row['kind']} b={row['batch']} kv={row['kv_len']} splits={row.get('num_splits')} "
              f"block={row.get('block_k')}: {row.get('cycles')} cycles, {row.get('vs_floor')}x floor", flush=True)

    if args.only:
        _remake(out, tuple(args.only.split(",")), args.topology, state, progress)
        return
    rows = decode_estimate.decode_table(topology=args.topology, progress=progress)
    header = [
        f"# static cycle estimates (libtpu --xla_jf_dump_static_llo_profile_to), target {args.topology}",
        "# one decode step: q [batch, 32, 1, 128] bf16 against a [batch, 4, kv_len, 128] K and V cache (GQA 8:1), "
        f"every sequence full; made by make_decode_estimates.py at commit {state.commit}"
        + (" (sources edited)" if state.edited else "") + f", sources sha256 {state.sha256}",
        f"# libtpu {estimate.libtpu_version()}, jax {jax.__version__}, {datetime.date.today()}, {platform.system()} "
        f"{platform.machine()} CPU (no TPU): a static model, never checked against a real TPU",
        f"# floor_cycles = cache bytes / HBM bandwidth ({chip.hbm_bandwidth / 1e9:.0f} GB/s) x derived clock "
        f"({chip.clock_hz / 1e9:.2f} GHz); vs_floor = cycles / floor_cycles; cycles = every op (split merge "
        "included), kernel_cycles = the Pallas kernel's",
        "# kinds: contiguous / paged = the decode kernels with static_length = max_len (guards on program ids, "
        "credited per step); guarded = as served (guards read lengths from SMEM); forward = flashlib's attention "
        "forward at q_len 16 (q_len 1 pads to it; block_k = keys per copy, sub-blocks of 512); jax_paged = JAX's "
        "paged_attention (its copies and compute sit under SMEM-reading guards, which the profiler counts as never "
        "run: below the floor, meaningless)",
        "# caveat: the static model does not cap concurrent copies at the HBM bandwidth; paged rows with "
        "pages_per_step > 1 (several copies in flight) are lower bounds: real time >= max(cycles, floor_cycles)",
    ]
    with out.open("w", newline="") as f:
        f.write("\n".join(header) + "\n")
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: row.get(key, "") for key in COLUMNS})
    print(f"wrote {out}")


def _remake(out: Path, kinds: tuple[str, ...], topology: str, state, progress) -> None:
    """Re-estimate the rows of ``kinds`` in ``out`` (same order), keep the others, and add a header line."""
    lines = out.read_text().splitlines()
    header = [line for line in lines if line.startswith("#")]
    old = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    new = iter(decode_estimate.decode_table(topology=topology, progress=progress, kinds=kinds))
    rows = [({key: row.get(key, "") for key in COLUMNS} if old_row["kind"] in kinds else old_row)
            for old_row in old for row in [next(new) if old_row["kind"] in kinds else {}]]
    header.append(f"# {', '.join(kinds)} rows re-made by make_decode_estimates.py --only {','.join(kinds)} at commit "
                  f"{state.commit}" + (" (sources edited)" if state.edited else "") + f", libtpu "
                  f"{estimate.libtpu_version()}, {datetime.date.today()}")
    with out.open("w", newline="") as f:
        f.write("\n".join(header) + "\n")
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"re-made the {', '.join(kinds)} rows of {out}")


if __name__ == "__main__":
    main()
