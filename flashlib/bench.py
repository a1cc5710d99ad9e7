"""``python -m flashlib.bench``: time attention implementations on a TPU — or, without one, ask the compiler.

On a TPU every implementation runs compiled: flashlib's ``xla``, ``pallas`` and ``blockwise``, and JAX's
own kernels, ``jax_flash`` (``jax.experimental.pallas.ops.tpu.flash_attention``) and ``splash``
(``splash_attention``). Each is warmed up (compile + runs), then timed ``--repeats`` times with
``block_until_ready``; the median is reported, with libtpu's static estimate beside it where one exists.

Without a TPU nothing is timed. The first line says so, then the bench runs what needs no TPU: libtpu's
static cycle estimates (:mod:`flashlib.estimate`; ``pallas`` and ``jax_flash``, compiled ahead of time for
``--target``) and the roofline of :mod:`flashlib.hardware` (the time no kernel can beat). With a libtpu too
old for estimates (Colab's), the roofline alone. Either way it writes ``bench.csv`` and ``bench.png``::

    python -m flashlib.bench --seq 1024,2048,4096 --causal --target v6e
    python -m flashlib.bench --quick          # tiny shapes, seconds: what CI runs

flashlib's blocks come from the tuned table when it has an entry (:func:`flashlib.tuning.lookup`), else
:meth:`BlockSizes.default`; JAX's flash attention from the table's yardstick, else ``q1024/km1024/k512``
(each clamped to the sequence).
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import flashlib
from flashlib import cost, env, estimate, hardware, tuning
from flashlib.kernels.block_sizes import GENERATIONS, BlockSizes, current_generation
from flashlib.progress import progress

__all__ = ["ESTIMATED", "IMPLS", "estimates_unavailable", "main", "time_call"]

IMPLS: tuple[str, ...] = ("xla", "pallas", "blockwise", "jax_flash", "splash")
ESTIMATED: tuple[str, ...] = ("pallas", "jax_flash")  # the recipes of flashlib.estimate.estimate_attention
TPU_ONLY: tuple[str, ...] = ("jax_flash", "splash")  # JAX's kernels have no interpret path here
COLUMNS = ["kind", "impl", "seq", "batch", "heads", "head_dim", "dtype", "causal", "device", "blocks", "status",
           "median_us", "min_us", "runs", "cycles", "estimate_us", "floor_ratio", "tflops", "roofline_us", "bound",
           "note"]


# ---------------------------------------------------------------------------------------------------
# Block sizes and callables
# ---------------------------------------------------------------------------------------------------


def _pallas_blocks(seq: int, head_dim: int, dtype: str, causal: bool, generation: str) -> tuple[BlockSizes, str]:
    """What :meth:`BlockSizes.default` picks, and where from: the tuned table (looked up once), or the
    generation's preferred blocks."""
    tuned = tuning.lookup(seq, seq, head_dim, dtype, causal, generation)
    if tuned is not None:
        return tuned, "tuned"
    return BlockSizes.preferred(seq, seq, head_dim, dtype, generation=generation), "default"


def _jax_flash_blocks(seq: int, head_dim: int, dtype: str, causal: bool, generation: str) -> tuple[int, int, int]:
    entry = tuning.nearest_entry(seq, seq, head_dim, dtype, causal, generation)
    best = entry.baseline_best if entry is not None else None
    default = tuning.JAX_FLASH_DEFAULT
    block_q, block_k_major, block_k = (best.block_q, best.block_k_major, best.block_k) if best else default
    return min(block_q, seq), min(block_k_major, seq), min(block_k, seq)


def _splash(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, block: int) -> jax.Array:
    """JAX's splash attention on ``[batch, heads, seq, head_dim]`` (it takes one batch row, q pre-scaled)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    heads, seq = q.shape[1], q.shape[2]
    one = masks.CausalMask((seq, seq)) if causal else masks.FullMask((seq, seq))
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block)
    kernel = splash.make_splash_mha(masks.MultiHeadMask([one] * heads), head_shards=1, q_seq_shards=1,
                                    block_sizes=sizes)
    return jax.vmap(kernel)(q * (1.0 / math.sqrt(q.shape[-1])), k, v)


def _callable(impl: str, seq: int, args: argparse.Namespace, generation: str) -> tuple[Callable[..., Any], str]:
    """``(jitted fn(q, k, v), blocks label)`` for one implementation at one length."""
    shape = (seq, args.head_dim, args.dtype, args.causal, generation)
    if impl == "pallas":
        sizes, source = _pallas_blocks(*shape)
        fn = functools.partial(flashlib.attention, impl="pallas", causal=args.causal, block_sizes=sizes)
        return jax.jit(fn), f"q{sizes.block_q}/k{sizes.block_k} ({source})"
    if impl == "jax_flash":
        q, km, k = _jax_flash_blocks(*shape)
        fn = functools.partial(estimate.jax_flash_forward, causal=args.causal, block_q=q, block_k_major=km, block_k=k)
        return jax.jit(fn), f"q{q}/km{km}/k{k}"
    if impl == "splash":
        block = min(512, seq)
        return jax.jit(functools.partial(_splash, causal=args.causal, block=block)), f"q{block}/kv{block}"
    return jax.jit(functools.partial(flashlib.attention, impl=impl, causal=args.causal)), ""


# ---------------------------------------------------------------------------------------------------
# The three kinds of row: measured, estimated, roofline
# ---------------------------------------------------------------------------------------------------


def time_call(fn: Callable[..., Any], *args: Any, warmup: int = 2, repeats: int = 10) -> list[float]:
    """Seconds per call of ``fn(*args)``: ``warmup`` untimed calls (the first compiles), then ``repeats`` timed
    ones, each waiting for the device (``block_until_ready``: JAX dispatches asynchronously)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def _base(kind: str, impl: str, seq: int, args: argparse.Namespace, device: str) -> dict[str, Any]:
    return dict(kind=kind, impl=impl, seq=seq, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                dtype=args.dtype, causal=args.causal, device=device)


def _flops(seq: int, args: argparse.Namespace) -> int:
    return cost.attention_flops(args.batch, args.heads, seq, seq, args.head_dim, args.causal)


def measure(impl: str, seq: int, args: argparse.Namespace, generation: str) -> dict[str, Any]:
    """One timed row; a failure (e.g. blocks the chip refuses) is a row with its reason, not a crash."""
    row = _base("measured", impl, seq, args, env.device_kind())
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (args.batch, args.heads, seq, args.head_dim)
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(args.dtype) for key in keys)
    try:
        fn, row["blocks"] = _callable(impl, seq, args, generation)
        times = time_call(fn, q, k, v, repeats=args.repeats)
    except Exception as err:  # a benchmark reports every implementation it could not run, and goes on
        return {**row, "status": "error", "note": " ".join(str(err).split())[:200]}
    median = statistics.median(times)
    return {**row, "status": "ok", "median_us": round(median * 1e6, 1), "min_us": round(min(times) * 1e6, 1),
            "runs": len(times), "tflops": round(_flops(seq, args) / median / 1e12, 2)}


def estimate_row(impl: str, seq: int, args: argparse.Namespace, topology: str) -> dict[str, Any]:
    """One static-estimate row (compiled for ``topology`` in a subprocess by :func:`tuning.estimate_trial`)."""
    generation = topology.split(":")[0]
    if impl == "pallas":
        sizes, source = _pallas_blocks(seq, args.head_dim, args.dtype, args.causal, generation)
        blocks = dict(block_q=sizes.block_q, block_k=sizes.block_k, block_k_major=sizes.block_k_major)
        label = f" ({source})"
    else:
        q, km, k = _jax_flash_blocks(seq, args.head_dim, args.dtype, args.causal, generation)
        blocks, label = dict(block_q=q, block_k_major=km, block_k=k), ""
    shape = dict(batch=args.batch, heads=args.heads, seq=seq, head_dim=args.head_dim, dtype=args.dtype,
                 causal=args.causal)
    trial = tuning.estimate_trial(impl, **blocks, topology=topology, **shape)
    row = {**_base("estimate", impl, seq, args, topology), "blocks": trial.label + label, "status": trial.status}
    if not trial.ok:
        return {**row, "note": trial.note[:200]}
    seconds = trial.cycles / hardware.chip_for_topology(topology).clock_hz
    return {**row, "cycles": trial.cycles, "estimate_us": round(seconds * 1e6, 1), "floor_ratio": trial.floor_ratio,
            "tflops": round(_flops(seq, args) / seconds / 1e12, 2)}


def roofline_row(seq: int, args: argparse.Namespace, chip: hardware.TpuChip) -> dict[str, Any]:
    """The roofline time of the ideal attention (:mod:`flashlib.cost`'s FLOPs and HBM bytes) on ``chip``."""
    dims = (args.batch, args.heads, seq, seq, args.head_dim, args.causal)
    line = hardware.roofline(cost.attention_flops(*dims), cost.attention_bytes(*dims, args.dtype), chip)
    return {**_base("roofline", "roofline", seq, args, chip.topology), "status": "ok",
            "roofline_us": round(line.seconds * 1e6, 2), "bound": line.bound,
            "tflops": round(line.flops / line.seconds / 1e12, 1)}


def estimates_unavailable(topology: str) -> str | None:
    """Why static estimates cannot be made here for ``topology``, in one sentence; None when they can."""
    chip = hardware.chip_for_topology(topology)
    if not env.has_libtpu():
        return "libtpu is not installed (pip install 'jax[tpu]')"
    if not chip.static_estimate:
        return f"libtpu's static cost model does not cover TPU {chip.name}"
    if not estimate.supports_static_profile():
        need = ".".join(map(str, estimate.MIN_LIBTPU))
        return f"libtpu {estimate.libtpu_version()} predates the static profile flag (needs >= {need})"
    return None


# ---------------------------------------------------------------------------------------------------
# Output: CSV, plot, summary
# ---------------------------------------------------------------------------------------------------


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str, note: str = "") -> bool:
    """Microseconds against sequence length, log-log: timings solid, estimates dashed, the roofline dotted.
    False (and no file) without matplotlib, which is a notebook extra, not a dependency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"measured": ("-", "o", "median_us", ""), "estimate": ("--", "s", "estimate_us", " (static estimate)"),
              "roofline": (":", None, "roofline_us", "")}
    for kind, impl in dict.fromkeys((r["kind"], r["impl"]) for r in rows):
        line, marker, column, suffix = styles[kind]
        points = [(r["seq"], r[column]) for r in rows if (r["kind"], r["impl"]) == (kind, impl) and r.get(column)]
        if points:
            xs, ys = zip(*sorted(points), strict=True)
            device = next(r["device"] for r in rows if r["kind"] == kind)
            color, label = ("black", f"roofline, {device}") if kind == "roofline" else (None, impl + suffix)
            ax.plot(xs, ys, linestyle=line, marker=marker, color=color, label=label)
    seqs = sorted({r["seq"] for r in rows})
    ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="microseconds (lower is better)", title=title)
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    plain = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_formatter(plain)
    low, high = ax.get_ylim()
    if high < 10 * low:  # less than a decade: label the minor ticks too, else there may be no label at all
        ax.yaxis.set_minor_formatter(plain)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.05 if note else 0, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per (length, implementation): the measured time with the static estimate beside it."""
    lines = []
    for seq in sorted({r["seq"] for r in rows}):
        for impl in dict.fromkeys(r["impl"] for r in rows if r["seq"] == seq):
            parts = []
            for r in (r for r in rows if (r["seq"], r["impl"]) == (seq, impl)):
                if r["status"] != "ok":
                    parts.append(f"{r['kind']}: {r['status']} ({r.get('note', '')[:80]})")
                elif r["kind"] == "measured":
                    parts.append(f"measured {r['median_us']:,.1f} us ({r['tflops']} TFLOP/s) {r.get('blocks', '')}")
                elif r["kind"] == "estimate":
                    parts.append(f"estimate {r['estimate_us']:,.1f} us ({r['cycles']:,} cycles, {r['floor_ratio']}x "
                                 f"MXU floor) {r['blocks']}")
                else:
                    parts.append(f">= {r['roofline_us']:,.2f} us ({r['bound']} bound)")
            lines.append(f"T={seq:>6} {impl:>10}: " + " | ".join(p.strip() for p in parts))
    return lines


# ---------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flashlib.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=_ints, default=None, help="lengths, e.g. 1024,2048 (default 1024,2048,4096)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=None, help="default 8 (1 with --quick)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS),
                        help=f"comma-separated, from {','.join(IMPLS)}")
    parser.add_argument("--target", default=None, choices=[*GENERATIONS, *(f"{g}:1x1" for g in GENERATIONS)],
                        help="TPU generation for blocks, estimates and roofline; default: the TPU here, else v5e")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per implementation (default 10)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for bench.csv and bench.png")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (T=256,512, one head): seconds, for CI")
    parser.add_argument("--no-estimates", dest="estimates", action="store_false",
                        help="skip libtpu's static estimates (each is a compile in a subprocess: seconds to minutes)")
    parser.add_argument("--measure", action="store_true", help="time even without a TPU (CPU timings, Pallas "
                        "interpreted: to test this harness, not to compare kernels)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.impls) - set(IMPLS))
    if unknown:
        parser.error(f"unknown --impls {','.join(unknown)}; choose from {','.join(IMPLS)}")
    args.seq = args.seq or ([256, 512] if args.quick else [1024, 2048, 4096])
    args.heads = args.heads or (1 if args.quick else 8)
    args.repeats = args.repeats or (3 if args.quick else 10)
    return args


def _first_line(args: argparse.Namespace, on_tpu: bool, generation: str, why_not: str | None) -> str:
    """What this run will do instead of what one might expect: the line a reader must see first."""
    here = f"no TPU here (backend {env.backend()})"
    if on_tpu:
        return f"TPU here ({env.device_kind()}): timing {', '.join(args.impls)}; median of {args.repeats} runs"
    if args.measure:
        return (f"{here}: timing on the {env.backend()} as asked (--measure); Pallas runs interpreted and JAX's TPU "
                "kernels are skipped, so these times say nothing about a TPU")
    if why_not is None:
        return f"{here}: running the TPU compiler's static estimates and the roofline for {generation} instead of " \
               "timings"
    return f"{here}: static estimates {why_not}; running the roofline for {generation} only, instead of timings"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    on_tpu = env.backend() == "tpu"
    generation = (args.target or current_generation()).split(":")[0]
    chip = hardware.CHIPS[generation]
    reason = estimates_unavailable(chip.topology)
    why_not = "skipped (--no-estimates)" if not args.estimates else reason and f"unavailable ({reason})"
    measuring = on_tpu or args.measure
    print(_first_line(args, on_tpu, generation, why_not))
    if on_tpu and why_not:
        print(f"static estimates: {why_not}; timings only")
    impls = args.impls if on_tpu else [i for i in args.impls if i not in TPU_ONLY]
    estimated = [] if why_not else [i for i in args.impls if i in ESTIMATED]
    if not measuring and not why_not:
        skipped = [i for i in args.impls if i not in ESTIMATED]
        if skipped:
            print(f"{', '.join(skipped)}: no static-estimate recipe; timed on a TPU only")
    jobs = [("measured", i, s) for s in args.seq for i in impls] if measuring else []
    jobs += [("estimate", i, s) for s in args.seq for i in estimated]
    rows = [roofline_row(seq, args, chip) for seq in args.seq]
    for kind, impl, seq in progress(jobs, describe=lambda j: f"{j[0]} {j[1]} T={j[2]}"):
        if kind == "measured":
            rows.append(measure(impl, seq, args, generation))
        else:
            rows.append(estimate_row(impl, seq, args, chip.topology))
    print(*_summary(rows), sep="\n")

    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "bench.csv")
    shape = f"[{args.batch}, {args.heads}, T, {args.head_dim}] {args.dtype}{' causal' if args.causal else ''}"
    where = f"measured on {env.device_kind()}" if measuring else f"{chip.topology}, no TPU: static estimates + roofline"
    note = "estimates: libtpu's static cycles at the derived clock" + (f"; {chip.clock_note}" * bool(chip.clock_note))
    drew = plot(rows, args.out / "bench.png", f"attention forward {shape}\n{where}", note if estimated else "")
    plotted = f" and {args.out / 'bench.png'}" if drew else " (matplotlib is not installed: no plot)"
    print(f"wrote {args.out / 'bench.csv'}{plotted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
