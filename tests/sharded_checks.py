"""The 8-device checks of tests/test_sharded.py, run in a process of their own.

``--xla_force_host_platform_device_count=8`` only works if it is set before jax starts, and the test suite's
process started jax long ago, so ``tests/test_sharded.py`` runs this script once, in a subprocess, and reads
one JSON line per check from its stdout: each case's errors (and the naive same-dtype implementation's)
against the float64 oracle, each bad input's message. The rule itself is applied there, in pytest.

    python tests/sharded_checks.py            # every check, JSON lines
    python tests/sharded_checks.py CASE_ID    # one case
"""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":  # before jax starts; imported by tests/test_sharded.py (for CASES), it changes nothing
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: the peers' rules

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from peers import rules  # noqa: E402

from flashlib.reference import attention_oracle, attention_vjp_oracle  # noqa: E402
from flashlib.ring import from_ring_order, ring_attention, to_ring_order  # noqa: E402
from flashlib.sharded import sharded_attention  # noqa: E402

# id: (function, mesh shape (split axis "x", ring axis "seq"), which q/k/v dimension "x" splits, impl, options,
#      causal, load balance, dtype, batch, heads, kv_heads, seq, head_dim)
PALLAS = {"interpret": True}
CASES = {
    "ring-blockwise-1x8-causal-zigzag-gqa": ("ring", (1, 8), "batch", "blockwise", {"block_q": 8, "block_k": 8},
                                             True, "zigzag", "float32", 1, 4, 2, 64, 16),
    "ring-blockwise-2x4-full-zigzag-uneven-gqa": ("ring", (2, 4), "heads", "blockwise", {}, False, "zigzag",
                                                  "float32", 1, 4, 2, 50, 16),
    "ring-blockwise-4x2-causal-contiguous-uneven": ("ring", (4, 2), "heads", "blockwise", {"block_k": 8}, True, None,
                                                    "float32", 1, 8, 4, 37, 16),
    "ring-blockwise-2x4-causal-zigzag-bf16": ("ring", (2, 4), "batch", "blockwise", {}, True, "zigzag", "bfloat16",
                                              2, 2, 2, 64, 32),
    "ring-reference-4x2-causal-zigzag-uneven-mqa": ("ring", (4, 2), "batch", "reference", {}, True, "zigzag",
                                                    "float32", 4, 4, 1, 30, 16),
    # pallas in interpret mode is the slow worker: contiguous chunks (one pair per step, not four); the zig-zag
    # bookkeeping does not depend on the worker and runs above with blockwise and reference
    "ring-pallas-2x4-causal-contiguous-gqa": ("ring", (2, 4), "heads", "pallas", PALLAS, True, None, "float32",
                                              1, 4, 2, 64, 32),
    "ring-pallas-1x8-full-contiguous-uneven-bf16": ("ring", (1, 8), "batch", "pallas", PALLAS, False, None,
                                                    "bfloat16", 1, 2, 2, 60, 32),
    "ring-in-order-blockwise-2x4-causal-zigzag": ("ring", (2, 4), "heads", "blockwise", {}, True, "zigzag",
                                                  "float32", 1, 4, 4, 64, 16),
    "sharded-blockwise-2x4-causal-gqa": ("sharded", (2, 4), "batch", "blockwise", {}, True, None, "float32",
                                         2, 8, 4, 40, 16),
    "sharded-pallas-4x2-full-bf16": ("sharded", (4, 2), "batch", "pallas", PALLAS, False, None, "bfloat16",
                                     4, 2, 2, 32, 32),
    # issue 24: layout="bshd" (head_axis had split the sequence), and the VJP run eagerly on jax.make_mesh's
    # default mesh outside jax.set_mesh (Explicit axes in the newest jax: JAX's mesh-context error)
    "sharded-reference-2x4-causal-bshd-eager": ("sharded", (2, 4), "batch", "reference", {}, True, None, "float32",
                                                2, 8, 4, 16, 8),
}


def mesh_of(shape: tuple[int, int]) -> Mesh:
    """A ("x", "seq") mesh; for the sharded cases "seq" splits the heads instead."""
    return jax.make_mesh(shape, ("x", "seq"))


def attention_fn(case_id: str):
    case = CASES[case_id]
    kind, mesh_shape, x_splits, impl, options, causal, load_balance = case[:7]
    mesh = mesh_of(mesh_shape)
    axes = {"batch_axis": "x"} if x_splits == "batch" else {"head_axis": "x"}
    if kind == "ring" and "in-order" in case_id:  # the caller keeps q, k, v and out in ring order
        n = mesh.shape["seq"]

        def in_order(q, k, v):
            q, k, v = (to_ring_order(x, n=n, load_balance=load_balance) for x in (q, k, v))
            out = ring_attention(q, k, v, mesh=mesh, seq_axis="seq", causal=causal, impl=impl,
                                 load_balance=load_balance, in_ring_order=True, **axes, **options)
            return from_ring_order(out, n=n, load_balance=load_balance)

        return in_order
    if kind == "ring":
        return lambda q, k, v: ring_attention(q, k, v, mesh=mesh, seq_axis="seq", causal=causal, impl=impl,
                                              load_balance=load_balance, **axes, **options)
    if "bshd" in case_id:  # the caller's arrays are [batch, seq, heads, d]: the heads are still what "seq" splits
        def bshd(q, k, v):
            out = sharded_attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), mesh=mesh, batch_axis="x",
                                    head_axis="seq", causal=causal, impl=impl, layout="bshd", **options)
            return out.transpose(0, 2, 1, 3)

        return bshd
    return lambda q, k, v: sharded_attention(q, k, v, mesh=mesh, batch_axis="x", head_axis="seq", causal=causal,
                                             impl=impl, **options)


def run_case(case_id: str) -> dict:
    case = CASES[case_id]
    causal, dtype, (batch, heads, kv_heads, seq, head_dim) = case[5], jnp.dtype(case[7]), case[8:]
    q, k, v, do = rules.random_inputs(jax.random.key(len(case_id)), batch=batch, heads=heads, q_len=seq,
                                      kv_len=seq, head_dim=head_dim, dtype=dtype)
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    start = time.perf_counter()
    run = rules.output_and_grads if "eager" in case_id else jax.jit(rules.output_and_grads, static_argnums=0)
    values = run(attention_fn(case_id), q, k, v, do)
    seconds = time.perf_counter() - start
    oracle = [attention_oracle(q, k, v, causal=causal), *attention_vjp_oracle(q, k, v, do, causal=causal)]

    def naive(q, k, v):
        return rules.naive_same_dtype(q, k, v, causal=causal)

    naive_values = jax.jit(rules.output_and_grads, static_argnums=0)(naive, q, k, v, do)
    return {"case": case_id, "dtype": dtype.name, "errors": rules.max_errors(values, oracle),
            "naive_errors": rules.max_errors(naive_values, oracle), "seconds": round(seconds, 2),
            "out_sharding": _spec(values[0])}


def _spec(x) -> list:
    """The array's PartitionSpec as a list, trailing Nones dropped (jax versions print specs differently)."""
    spec = list(getattr(x.sharding, "spec", ["not a NamedSharding"]))
    while spec and spec[-1] is None:
        spec.pop()
    return spec


def bad_inputs() -> dict:
    """The message of each refused call (or "accepted")."""
    q = jnp.zeros((2, 4, 16, 8))
    kv2 = jnp.zeros((2, 2, 16, 8))
    mesh24 = mesh_of((2, 4))
    calls = {
        "ring-q-k-lengths": lambda: ring_attention(q, jnp.zeros((2, 4, 8, 8)), jnp.zeros((2, 4, 8, 8)), mesh=mesh24,
                                                   seq_axis="seq"),
        "ring-unknown-axis": lambda: ring_attention(q, q, q, mesh=mesh24, seq_axis="sequence"),
        "ring-seq-axis-twice": lambda: ring_attention(q, q, q, mesh=mesh24, seq_axis="seq", head_axis="seq"),
        "ring-load-balance": lambda: ring_attention(q, q, q, mesh=mesh24, seq_axis="seq", load_balance="striped"),
        "ring-impl": lambda: ring_attention(q, q, q, mesh=mesh24, seq_axis="seq", impl="xla"),
        "ring-option": lambda: ring_attention(q, q, q, mesh=mesh24, seq_axis="seq", impl="blockwise", interpret=True),
        "ring-in-order-uneven": lambda: ring_attention(jnp.zeros((2, 4, 15, 8)), jnp.zeros((2, 4, 15, 8)),
                                                       jnp.zeros((2, 4, 15, 8)), mesh=mesh24, seq_axis="seq",
                                                       in_ring_order=True),
        "ring-not-a-mesh": lambda: ring_attention(q, q, q, mesh="2x4", seq_axis="seq"),
        "sharded-kv-heads": lambda: sharded_attention(q, kv2, kv2, mesh=mesh24, head_axis="seq"),
        "sharded-batch": lambda: sharded_attention(jnp.zeros((3, 4, 16, 8)), jnp.zeros((3, 4, 16, 8)),
                                                   jnp.zeros((3, 4, 16, 8)), mesh=mesh24, batch_axis="x",
                                                   head_axis="seq"),
        "sharded-same-axis": lambda: sharded_attention(q, q, q, mesh=mesh24, batch_axis="x", head_axis="x"),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = "accepted"
        except ValueError as err:
            messages[name] = f"ValueError: {err}"
    return messages


def main(argv: list[str]) -> None:
    """The cases named (every case where none is), then the bad-input messages."""
    for case_id in argv or CASES:
        print(json.dumps(run_case(case_id)), flush=True)
    print(json.dumps({"bad_inputs": bad_inputs()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
