"""Make ``data/estimates/forward_<generation>.csv``: libtpu's static cycle estimates of the attention forward.

One shape, the one of ``data/reference/jax_flash_estimates.csv`` at T=2048: ``[1, 8, 2048, 128]`` bf16.
Two kernels: JAX's own ``jax.experimental.pallas.ops.tpu.flash_attention`` (blocks q / k_major / k) and
flashlib's Pallas forward (blocks q / k), causal and not, each compiled ahead of time for one TPU target in a
fresh subprocess (:func:`flashlib.estimate.estimate_attention`). No TPU needed; libtpu >= 0.0.42 is (the
newest-jax environment)::

    JAX_PLATFORMS=cpu .venv/bin/python data/estimates/make_forward_estimates.py --topology v5e:1x1

A configuration the toolchain refuses is a row too, with its reason in ``status``: ``refused`` (flashlib's
VMEM check), ``compile_error`` (the compiler's), ``profiler_crash`` (libtpu's static profiler aborts on a
kernel that compiles). ``flashlib_budget`` rows ask flashlib for its v6e budget (32 MiB) so that the
compiler, not flashlib's conservative estimate, decides whether the blocks fit the v5e's 16 MiB.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
from pathlib import Path

import jax

from flashlib import estimate

SHAPE = dict(batch=1, heads=8, seq=2048, head_dim=128, dtype="bfloat16")
JAX_BLOCKS = [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (512, 2048, 512), (1024, 2048, 512)]
FLASHLIB_BLOCKS = [(256, 256), (512, 512), (1024, 512), (512, 1024), (1024, 1024)]
COLUMNS = [
    "impl", "causal", "block_q", "block_k_major", "block_k", "status", "cycles", "mxu_floor", "floor_ratio",
    "vs_jax_best", "us_at_clock", "tflops_at_clock", "bundles", "vmatmul", "vld", "vst", "xlu", "eup", "note",
]


def _row(impl: str, causal: bool, blocks: tuple[int, int, int], topology: str, **options) -> dict:
    block_q, block_k_major, block_k = blocks
    row = dict(impl=impl, causal=causal, block_q=block_q, block_k_major=block_k_major, block_k=block_k)
    try:
        est = estimate.estimate_attention(
            "jax_flash" if impl == "jax_flash" else "pallas", **SHAPE, causal=causal, block_q=block_q,
            block_k=block_k, block_k_major=block_k_major, topology=topology, bundles=True, **options,
        )
    except (ValueError, estimate.EstimateError) as err:
        status = estimate.failure_status(err)
        if status is None:
            raise
        return {**row, "status": status, "note": str(err).split("LLO_CHECK failure")[-1][:200]}
    (stats,) = [s for name, s in est.bundles.items() if "attention" in name] or [None]
    counts = {k: getattr(stats, k) for k in ("bundles", "vmatmul", "vld", "vst", "xlu", "eup")} if stats else {}
    return {
        **row, "status": "ok", "cycles": est.total_cycles, "mxu_floor": round(est.mxu_floor),
        "floor_ratio": round(est.floor_ratio, 3), "us_at_clock": round(est.seconds * 1e6, 1),
        "tflops_at_clock": round(est.tflops_per_second, 1), **counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    generation = args.topology.split(":")[0]
    out = args.out or Path(__file__).with_name(f"forward_{generation}.csv")

    rows: list[dict] = []
    for causal in (False, True):
        first = len(rows)
        for blocks in JAX_BLOCKS:
            rows.append(_row("jax_flash", causal, blocks, args.topology))
        for block_q, block_k in FLASHLIB_BLOCKS:
            rows.append(_row("flashlib", causal, (block_q, block_k, block_k), args.topology))
        if generation == "v5e":  # the compiler decides, not flashlib's conservative VMEM estimate
            for block_q, block_k in [(1024, 1024)]:
                row = _row("flashlib", causal, (block_q, block_k, block_k), args.topology, generation="v6e")
                rows.append({**row, "impl": "flashlib_budget"})
        print(*(f"{r['impl']:>15} causal={r['causal']!s:5} {r['block_q']}/{r['block_k_major']}/{r['block_k']}: "
                f"{r['status']} {r.get('cycles', '')}" for r in rows[first:]), sep="\n")
    for causal in (False, True):
        best = min((r["cycles"] for r in rows if r["impl"] == "jax_flash" and r["causal"] == causal
                    and r["status"] == "ok"), default=None)
        for r in rows:
            if r["causal"] == causal and r["status"] == "ok" and best:
                r["vs_jax_best"] = round(r["cycles"] / best, 3)

    chip = estimate.hardware.chip_for_topology(args.topology)
    header = [
        f"static cycle estimates (libtpu --xla_jf_dump_static_llo_profile_to), target {args.topology}",
        f"shape [batch, heads, seq, head_dim] = [{SHAPE['batch']}, {SHAPE['heads']}, {SHAPE['seq']}, "
        f"{SHAPE['head_dim']}] {SHAPE['dtype']}, scale 1/sqrt(head_dim); made by {Path(__file__).name}",
        f"libtpu {estimate.libtpu_version()}, jax {jax.__version__}, {datetime.date.today().isoformat()}, "
        f"{platform.system()} {platform.machine()} CPU (no TPU): a static model, never checked against a real TPU",
        f"mxu_floor = ideal FLOPs / (MXUs x dim^2 x 2) = FLOPs / {chip.flops_per_cycle}; us/tflops at the derived "
        f"clock {chip.clock_hz / 1e9:.2f} GHz; vs_jax_best = cycles / best jax_flash row of the same causality",
        "bundles..eup: static instruction counts of the kernel's final VLIW listing (loop bodies once)",
    ] + ([f"caveat: {chip.clock_note}"] if chip.clock_note else [])
    with out.open("w", newline="") as f:
        f.writelines(f"# {line}\n" for line in header)
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
