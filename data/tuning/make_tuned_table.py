"""Make ``data/tuning/forward_blocks.json``: the forward kernel's block sizes, tuned by libtpu's static estimate.

For every shape ``[batch=1, heads=8, T, head_dim=128]`` bf16 with T in {1024, 2048, 4096, 8192}, causal and
not, on v5e and v6e: compile every candidate ``block_q x block_k`` (512, 1024 each, clamped to T), alone and
with a larger k/v copy per grid step (``block_k_major`` 2048, 4096; those flashlib's VMEM estimate refuses
recorded as ``refused``) ahead of time for the target with libtpu's static profiler, and JAX's own flash
attention on a few of its configurations as a yardstick (:func:`flashlib.tuning.tune`). The defaults are the
grid of the committed table: blocks of 256 never won in an earlier run that tried them (``--blocks
256,512,1024`` brings them back), and head_dim 64 is left out because libtpu 0.0.50's static profiler crashes
on every head_dim=64 kernel, flashlib's and JAX's (``--head-dims 128,64`` with a libtpu that can).
JAX's rows do not depend on flashlib's kernel: ``--reuse-baseline PATH`` copies them from an earlier table
(same libtpu) instead of compiling them again. ``--keep PATH`` (repeatable) takes whole entries from earlier
tables made with the same libtpu and candidates, so a grid can be grown a piece at a time (say T=8192 on each
chip in two parallel runs, then one run that keeps all three tables); the end-of-run recheck estimates one
entry of every source again, so a kernel changed between the pieces is caught. Every outcome is kept:
cycles, or ``refused`` / ``compile_error`` / ``profiler_crash`` with the reason. No TPU needed; libtpu >= 0.0.42
is (the newest-jax environment)::

    JAX_PLATFORMS=cpu .venv/bin/python data/tuning/make_tuned_table.py     # about 1.5 hours on 2 cores

or in pieces, one process per chip for the long shapes, then one run that keeps the pieces::

    make_tuned_table.py --topologies v5e:1x1 --seq 8192 --out v5e.json &     # ~30 min each, in parallel
    make_tuned_table.py --topologies v6e:1x1 --seq 8192 --out v6e.json &
    make_tuned_table.py --seq 1024,2048,4096 --out short.json               # ~30 min
    make_tuned_table.py --keep short.json --keep v5e.json --keep v6e.json   # the union, rechecked

This script is the single source of truth for the table: when the kernel changes, rerun it. The file is
rewritten after every shape (``"complete": false`` until the end), so an interrupted run keeps its results.
``flashlib.tuning.load_tuned_table`` reads it and ``flashlib.tuning.lookup`` answers from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

from flashlib import estimate, provenance, tuning  # noqa: E402
from flashlib.progress import progress  # noqa: E402

KERNEL_SOURCES = ("flashlib/kernels", "flashlib/cost.py", "flashlib/geometry.py", "flashlib/tiling.py",
                  "flashlib/reference.py")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _shown(arg: str) -> str:
    """A command-line argument as the table records it: a file outside the repository (a scratch table) by its
    name only, so the committed header names no machine's paths."""
    path = Path(arg)
    if path.is_absolute() and path.exists() and not path.resolve().is_relative_to(provenance.REPOSITORY):
        return f"<{path.name}>"
    return arg


def header(args: argparse.Namespace) -> dict:
    """What made the table, and how to read it."""
    state = provenance.source_state(KERNEL_SOURCES)
    return {
        "about": "flashlib Pallas forward kernel: block sizes tuned by libtpu's static cycle estimate "
                 "(--xla_jf_dump_static_llo_profile_to), compiled ahead of time on a CPU machine, never timed on "
                 "a TPU. best = the candidate with the fewest estimated cycles; vs_jax_flash = its cycles over "
                 "the best of JAX's own flash_attention (baseline) on the same shape. Status: ok, refused "
                 "(flashlib's VMEM/tiling check), compile_error (the compiler's), profiler_crash (libtpu's "
                 "static profiler aborts on a kernel that compiles: no estimate).",
        "lookup_rule": "flashlib.tuning.lookup: same generation, dtype and causality among entries with a best; "
                       "the same head_dim, else the smallest tuned head_dim above it; the largest tuned "
                       "max(q_len, kv_len) <= the call's (else the shortest entry); the best blocks clamped by "
                       "BlockSizes.fit and validated, else None.",
        "made_by": " ".join(["data/tuning/make_tuned_table.py", *map(_shown, sys.argv[1:])]),
        "kernel_source": (state.commit or "unknown commit")
                         + (" + uncommitted changes to the kernel sources" if state.edited else ""),
        "kernel_sha256": state.sha256,
        "libtpu": estimate.libtpu_version(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, no TPU",
        "candidates": {"block_q": args.blocks, "block_k": args.blocks, "block_k_major": args.majors,
                       "jax_flash": [list(c) for c in tuning.JAX_FLASH_CHOICES] if args.baseline else []},
        "grid": {"topologies": args.topologies, "seq": args.seq, "head_dim": args.head_dims, "dtype": args.dtype,
                 "causal": [False, True], "batch": args.batch, "heads": args.heads},
    }


THIS_RUN = "this run"


def check_kernel_unchanged(head: dict, entries: list[tuning.TuningResult], sources: list[str],
                           timeout: float) -> None:
    """Did the kernel change while the sweep ran (another hand editing it), or since a kept table was made?
    Compare the sources' digest, and estimate again the best of the first and the last entry this run made and
    of the first entry kept from each earlier table (``sources[i]``: where ``entries[i]`` came from): if those
    cycles moved, the table mixes two kernels and gets a ``warning``; a source edit that changed no cycles (a
    docstring) only a note."""
    head["kernel_sha256_at_end"] = provenance.source_state(KERNEL_SOURCES).sha256
    with_best = [(e, src) for e, src in zip(entries, sources, strict=True) if e.best is not None]
    made_here = [e for e, src in with_best if src == THIS_RUN]
    first_kept: dict[str, tuning.TuningResult] = {}
    for entry, src in with_best:
        if src != THIS_RUN:
            first_kept.setdefault(src, entry)
    to_check = made_here[:1] + made_here[-1:] + list(first_kept.values())
    head["recheck"] = []
    for entry in {id(e): e for e in to_check}.values():
        again = tuning.estimate_trial(
            "pallas", block_q=entry.best.block_q, block_k=entry.best.block_k,
            block_k_major=entry.best.block_k_major, topology=entry.topology,
            timeout=timeout, batch=entry.batch, heads=entry.heads, seq=entry.q_len, kv_seq=entry.kv_len,
            head_dim=entry.head_dim, dtype=entry.dtype, causal=entry.causal,
        )
        head["recheck"].append({"entry": f"{entry.topology} T={entry.q_len} d={entry.head_dim} causal={entry.causal} "
                                f"{entry.best.label}", "cycles_in_table": entry.best.cycles,
                                "cycles_at_end": again.cycles})
    if any(r["cycles_in_table"] != r["cycles_at_end"] for r in head["recheck"]):
        head["warning"] = "the kernel changed while this table was made (see recheck): rerun the script"
        print(f"warning: {head['warning']}", file=sys.stderr)
    elif head["kernel_sha256_at_end"] != head["kernel_sha256"]:
        head["note"] = ("the kernel sources were edited while this table was made, but the rechecked entries "
                        "estimate the same cycles at the end")


def load_kept(paths: list[Path], head: dict) -> dict[tuning.TableKey, tuple[str, tuning.TuningResult]]:
    """``{key: (table name, entry)}`` from earlier tables, kept as they are: same libtpu, candidates, batch and
    heads as this run, else an error (their cycles would not compare). A later table wins on a shared key;
    ``head["kept_from"]`` says what came from where."""
    kept: dict[tuning.TableKey, tuple[str, tuning.TuningResult]] = {}
    head["kept_from"] = []
    for path in paths:
        earlier = json.loads(path.read_text())
        if not earlier.get("complete"):
            sys.exit(f"--keep {path}: that run did not finish (\"complete\": false); finish or rerun it")
        theirs, ours = earlier.get("grid", {}), head["grid"]
        for field, their, our in (("libtpu", earlier.get("libtpu"), head["libtpu"]),
                                  ("candidates", earlier.get("candidates"), head["candidates"]),
                                  ("batch", theirs.get("batch"), ours["batch"]),
                                  ("heads", theirs.get("heads"), ours["heads"])):
            if their != our:
                sys.exit(f"--keep {path}: its {field} {their!r} is not this run's {our!r}; "
                         f"rerun those shapes instead of keeping them")
        table = tuning.load_tuned_table(path)
        kept.update({key: (path.name, result) for key, result in table.items()})
        made_by = " ".join(map(_shown, earlier.get("made_by", "").split()))
        head["kept_from"].append({"table": path.name, "made_by": made_by, "date": earlier.get("date"),
                                  "entries": len(table),
                                  "kernel_source": earlier.get("kernel_source"),
                                  "kernel_sha256": earlier.get("kernel_sha256")})
    return kept


def write(path: Path, head: dict, entries: list[tuning.TuningResult], complete: bool) -> None:
    """Rewrite the table atomically."""
    data = {**head, "complete": complete, "entries": [e.to_json() for e in entries]}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", type=lambda s: s.split(","), default=["v5e:1x1", "v6e:1x1"])
    parser.add_argument("--seq", type=_ints, default=[1024, 2048, 4096, 8192])
    parser.add_argument("--head-dims", type=_ints, default=[128])
    parser.add_argument("--blocks", type=_ints, default=[512, 1024])
    parser.add_argument("--majors", type=_ints, default=list(tuning.MAJOR_CHOICES),
                        help="block_k_major values tried on top of each block_k (empty: none)")
    parser.add_argument("--reuse-baseline", type=Path, default=None, metavar="PATH",
                        help="copy JAX's flash_attention rows from this earlier table instead of compiling them")
    parser.add_argument("--keep", type=Path, action="append", default=[], metavar="PATH",
                        help="keep the entries of this earlier table (same libtpu and candidates) instead of "
                             "tuning those shapes again; repeatable")
    parser.add_argument("--note", default="", help="a sentence added to the table's 'about'")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip JAX's flash_attention")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per compile")
    parser.add_argument("--out", type=Path, default=tuning.TABLE_PATH)
    args = parser.parse_args(argv)
    if max(args.blocks) >= 8192:
        parser.error("blocks of 8192 or more take the compiler minutes and never fit VMEM: leave them out")
    if not estimate.supports_static_profile():
        sys.exit(f"libtpu {estimate.libtpu_version()} cannot make static estimates (needs >= "
                 f"{'.'.join(map(str, estimate.MIN_LIBTPU))}): run this in the newest-jax environment (.venv)")

    head = header(args)
    if 64 not in args.head_dims:
        head["about"] += (" head_dim=64 is not in this table: libtpu 0.0.50's static profiler crashes on every "
                          "head_dim=64 kernel (flashlib's and JAX's), so it has no estimate; a head_dim=64 call "
                          "takes the head_dim=128 entry by the lookup rule.")
    if args.note:
        head["about"] += " " + args.note
    reused: dict[tuning.TableKey, tuning.TuningResult] = {}
    if args.reuse_baseline is not None:
        reused = tuning.load_tuned_table(args.reuse_baseline)
        earlier = json.loads(args.reuse_baseline.read_text())
        head["baseline_from"] = (f"JAX flash_attention rows copied, not recompiled, from the table of "
                                 f"{earlier.get('date')} (libtpu {earlier.get('libtpu')}, jax {earlier.get('jax')})")
    kept = load_kept(args.keep, head)
    grid = list(itertools.product(args.topologies, args.head_dims, (False, True), args.seq))
    entries: list[tuning.TuningResult] = []
    sources: list[str] = []
    for topology, head_dim, causal, seq in progress(
        grid, describe=lambda g: f"{g[0]} d={g[1]} causal={g[2]} T={g[3]}"
    ):
        key = tuning.TableKey(topology.split(":")[0], args.dtype, causal, head_dim, seq, seq)
        if key in kept:
            source, result = kept[key]
            entries.append(result)
            sources.append(source)
            print(f"  kept from {source}", flush=True)
            continue
        old = reused.get(key)
        compile_baseline = args.baseline and old is None
        result = tuning.tune(seq, seq, head_dim, args.dtype, causal, topology, batch=args.batch, heads=args.heads,
                             choices=args.blocks, majors=args.majors,
                             baseline=tuning.JAX_FLASH_CHOICES if compile_baseline else (),
                             timeout=args.timeout, report=lambda line: print(line, flush=True))
        if args.baseline and old is not None:
            result = dataclasses.replace(result, baseline=old.baseline)
        entries.append(result)
        sources.append(THIS_RUN)
        best, base = result.best, result.baseline_best
        print(f"  best: {best.label + f' {best.cycles:,}' if best else 'none'}; "
              f"jax_flash: {base.label + f' {base.cycles:,}' if base else 'none'}", flush=True)
        write(args.out, head, entries, complete=False)
    check_kernel_unchanged(head, entries, sources, args.timeout)
    write(args.out, head, entries, complete=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
