"""Append rows to ``backward_steps.csv``: libtpu's static cycle estimates of the attention backward kernels.

Shape ``[1, 8, seq, 128]`` bf16, scale ``1/sqrt(128)``. Each configuration compiles ahead of time for one TPU
target in a fresh subprocess (:func:`flashlib.estimate.estimate_cycles`), and the static profile gives the
cycles of every kernel in it; ``dq`` and ``dkv`` are the two backward Pallas kernels (the forward and the
XLA glue around them are left out of ``dq_plus_dkv``). No TPU needed; libtpu >= 0.0.42 is (``.venv``)::

    JAX_PLATFORMS=cpu .venv/bin/python data/optimisation/measure_backward.py --step baseline \\
        --change "the committed kernels" --configs 512/512/512/512 1024/512/1024/512

flashlib configs are ``block_q_dkv/block_k_dkv/block_q_dq/block_k_dq`` (run through
:func:`flashlib.kernels.tpu_backward.backward` directly, so flashlib's conservative VMEM check does not
refuse blocks the compiler takes). ``--jax`` measures JAX's ``jax.experimental.pallas.ops.tpu.flash_attention``
instead, configs ``block_q/block_k_major/block_k`` used for its forward and all its backward fields (as in
``data/reference/jax_flash_estimates.csv``); those rows have step ``jax`` and set ``jax_best``,
the smallest JAX ``dq_plus_dkv`` per (generation, seq, causal) that later rows are compared with.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp

from flashlib import estimate

CSV_PATH = Path(__file__).with_name("backward_steps.csv")
COLUMNS = ["step", "change", "generation", "seq", "causal", "config", "dq", "dkv", "dq_plus_dkv", "jax_best",
           "ratio_to_jax", "xla_glue"]
HEADS, HEAD_DIM, DTYPE = 8, 128, "bfloat16"


def flashlib_backward(q, k, v, out, lse, do, *, causal: bool, blocks: tuple[int, int, int, int],
                      generation: str, fuse_dq: bool | None = None):
    """flashlib's backward kernels (and the XLA ops around them) for the given backward blocks; ``fuse_dq``
    as in :func:`flashlib.kernels.flash_attention_backward` (False: the separate dQ kernel)."""
    from flashlib.kernels import BlockSizes, tpu_backward

    block_q_dkv, block_k_dkv, block_q_dq, block_k_dq = blocks
    sizes = BlockSizes(512, 512, generation=generation, block_q_dkv=block_q_dkv, block_k_dkv=block_k_dkv,
                       block_q_dq=block_q_dq, block_k_dq=block_k_dq)
    scale = 1.0 / math.sqrt(q.shape[-1])
    return tpu_backward.backward(q, k, v, out, lse, do, None, causal=causal, scale=scale, sizes=sizes,
                                 interpret=False, fuse_dq=fuse_dq)


def jax_backward(q, k, v, do, *, causal: bool, blocks: tuple[int, int, int]):
    """JAX's flash attention differentiated (forward, dq and dkv kernels), its backward blocks = its forward's."""
    from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

    block_q, block_k_major, block_k = blocks
    sizes = jax_flash.BlockSizes(
        block_q=block_q, block_k_major=block_k_major, block_k=block_k, block_b=1,
        block_q_major_dkv=block_q, block_k_major_dkv=block_k_major, block_k_dkv=block_k, block_q_dkv=block_q,
        block_k_major_dq=block_k_major, block_k_dq=block_k, block_q_dq=block_q,
    )
    scale = 1.0 / math.sqrt(q.shape[-1])

    def attention(q, k, v):
        return jax_flash.flash_attention(q, k, v, causal=causal, sm_scale=scale, block_sizes=sizes)

    _, vjp = jax.vjp(attention, q, k, v)
    return vjp(do)


def _backward_cycles(kernels: dict[str, int]) -> dict[str, int | str]:
    """``dq``, ``dkv`` and ``xla_glue`` cycles from one compile's per-kernel profile.

    A kernel whose name holds ``dq`` (``dkv``) is that kernel; one holding both is a fused backward kernel,
    credited to ``dkv`` with ``dq`` left empty. A ``jvp``/``forward`` kernel is the forward (left out); every
    other op is ``xla_glue``: the backward's own XLA work (D = rowsum(dO * O), broadcasts, transposes).
    """
    dq = dkv = 0
    dq_found = False
    glue = 0
    for name, cycles in kernels.items():
        words = set(re.split(r"[_.]", name.lower()))
        if "dkv" in words:
            dkv += cycles
        elif "dq" in words:
            dq, dq_found = dq + cycles, True
        elif "jvp" not in words and "forward" not in words:
            glue += cycles
    if not dkv:
        raise RuntimeError(f"no backward kernel among {sorted(kernels)}")
    return {"dq": dq if dq_found else "", "dkv": dkv, "dq_plus_dkv": dq + dkv, "xla_glue": glue}


def measure(generation: str, seq: int, causal: bool, config: str, use_jax: bool,
            fuse_dq: bool | None = None) -> dict[str, int | str] | str:
    """:func:`_backward_cycles` of one configuration, or the reason there is no estimate."""
    blocks = tuple(int(b) for b in config.split("/"))
    q = jax.ShapeDtypeStruct((1, HEADS, seq, HEAD_DIM), DTYPE)
    lse = jax.ShapeDtypeStruct((1, HEADS, seq), jnp.float32)
    module = Path(__file__).stem
    try:
        if use_jax:
            est = estimate.estimate_cycles(f"{module}:jax_backward", q, q, q, q, topology=f"{generation}:1x1",
                                           causal=causal, blocks=blocks)
        else:
            est = estimate.estimate_cycles(f"{module}:flashlib_backward", q, q, q, q, lse, q,
                                           topology=f"{generation}:1x1", causal=causal, blocks=blocks,
                                           generation=generation, fuse_dq=fuse_dq)
    except estimate.EstimateError as err:
        return f"{type(err).__name__}: {str(err)[:160]}"
    return _backward_cycles(est.kernels)


def _read_rows() -> list[dict[str, str]]:
    if not CSV_PATH.exists():
        return []
    with CSV_PATH.open() as f:
        return list(csv.DictReader(f))


def _fill_ratios(rows: list[dict]) -> None:
    """Set every measured row's ``jax_best`` (smallest JAX ``dq_plus_dkv`` of its generation, seq and
    causality) and ``ratio_to_jax``, from the JAX rows measured so far."""
    def key(row: dict) -> tuple[str, str, str]:
        return str(row["generation"]), str(row["seq"]), str(row["causal"])

    best: dict[tuple[str, str, str], int] = {}
    for row in rows:
        if row["step"] == "jax" and str(row.get("dq_plus_dkv", "")):
            best[key(row)] = min(best.get(key(row), 1 << 62), int(row["dq_plus_dkv"]))
    for row in rows:
        if key(row) in best and str(row.get("dq_plus_dkv", "")):
            row["jax_best"] = best[key(row)]
            row["ratio_to_jax"] = round(int(row["dq_plus_dkv"]) / best[key(row)], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", required=True, help="name of the kernel state measured (ignored with --jax)")
    parser.add_argument("--change", default="", help="what this step changed")
    parser.add_argument("--configs", nargs="+", required=True, help="q_dkv/k_dkv/q_dq/k_dq, or q/k_major/k (--jax)")
    parser.add_argument("--generations", nargs="+", default=["v5e", "v6e"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[2048])
    parser.add_argument("--causal", choices=["both", "true", "false"], default="both")
    parser.add_argument("--jax", action="store_true", help="measure JAX's kernel instead of flashlib's")
    parser.add_argument("--fuse-dq", choices=["auto", "true", "false"], default="auto",
                        help="flashlib's fuse_dq (false: the separate dQ kernel, as before the fused kernel)")
    args = parser.parse_args()
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    fuse_dq = {"auto": None, "true": True, "false": False}[args.fuse_dq]

    rows = _read_rows()
    for generation in args.generations:
        for seq in args.seqs:
            for causal in causals:
                for config in args.configs:
                    result = measure(generation, seq, causal, config, args.jax, fuse_dq)
                    row = dict(step="jax" if args.jax else args.step, change=args.change, generation=generation,
                               seq=seq, causal=causal, config=config)
                    if isinstance(result, str):
                        row["change"] = f"{args.change} [no estimate: {result}]".strip()
                    else:
                        row.update(result)
                    rows.append(row)
                    _fill_ratios(rows)
                    print(", ".join(f"{k}={row.get(k, '')}" for k in COLUMNS if k != "change"), flush=True)
                    with CSV_PATH.open("w", newline="") as f:
                        writer = csv.DictWriter(f, COLUMNS)
                        writer.writeheader()
                        writer.writerows({k: r.get(k, "") for k in COLUMNS} for r in rows)


if __name__ == "__main__":
    main()
