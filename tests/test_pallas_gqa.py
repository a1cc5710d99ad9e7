"""Grouped-query and multi-query attention in the Pallas kernels (issue 16, first Pallas variant): outputs and
gradients by FlashAttention's rule in TPU-semantics interpret mode (races detected), both backward paths
(fused dQ and the separate dQ kernel), K and V never repeated in HBM, and the gradient compiled for v5e and
v6e by libtpu."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import flashlib
from flashlib import checks
from flashlib.kernels import BlockSizes, backward_kernels, tpu_forward
from flashlib.kernels.block_sizes import vmem_limit_bytes
from flashlib.kernels.tpu_backward import flash_attention_backward
from flashlib.kernels.tpu_forward import flash_attention_forward, heads_per_step
from flashlib.tpu_compile import compile_for_tpu

BF16 = jnp.bfloat16


def _inputs(heads, kv_heads, q_len, kv_len, head_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(1, heads, q_len, head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=(1, kv_heads, kv_len, head_dim)), dtype)
    v = jnp.asarray(rng.normal(size=(1, kv_heads, kv_len, head_dim)), dtype)
    do = jnp.asarray(rng.normal(size=q.shape), dtype)
    return q, k, v, do


@pytest.mark.parametrize("heads, kv_heads, q_len, kv_len, dtype, causal, fuse_dq", [
    (4, 2, 136, 200, jnp.float32, True, True),  # GQA, q shorter, padding on both
    (4, 1, 200, 136, BF16, True, False),  # MQA, q longer (rows that see no key), the separate dQ kernel
    (6, 2, 128, 256, BF16, False, True),  # GQA 3:1, not causal
])
def test_gqa_by_flashattentions_rule_in_tpu_interpret_mode(heads, kv_heads, q_len, kv_len, dtype, causal, fuse_dq):
    pltpu.reset_tpu_interpret_mode_state()
    q, k, v, do = _inputs(heads, kv_heads, q_len, kv_len, 64, dtype)
    sizes, params = BlockSizes(block_q=64, block_k_major=128, block_k=128), pltpu.InterpretParams(detect_races=True)
    out, lse = flash_attention_forward(q, k, v, causal=causal, block_sizes=sizes, interpret=params, return_lse=True)
    grads = flash_attention_backward(q, k, v, out, lse, do, causal=causal, block_sizes=sizes, interpret=params,
                                     fuse_dq=fuse_dq)
    checks.check_attention_and_grads(out, grads, q, k, v, do, causal=causal, quiet=True)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_the_entry_point_differentiates_gqa():
    q, k, v, do = _inputs(4, 2, 40, 72, 32, jnp.float32, seed=1)
    out, vjp = jax.vjp(lambda q, k, v: flashlib.attention(q, k, v, causal=True, impl="pallas"), q, k, v)
    checks.check_attention_and_grads(out, vjp(do), q, k, v, do, causal=True, quiet=True)


def _pallas_operand_shapes(fn, *args, outputs: list | None = None) -> list[list[tuple[int, ...]]]:
    """The operand shapes of every pallas_call in ``fn``'s program (forward and backward); with ``outputs`` (a
    list), their outputs' (shape, dtype) appended to it."""
    found, outputs = [], ([] if outputs is None else outputs)

    def subjaxprs(value):
        if hasattr(value, "eqns"):  # a Jaxpr
            yield value
        elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):  # a ClosedJaxpr
            yield value.jaxpr
        elif isinstance(value, (tuple, list)):
            for item in value:
                yield from subjaxprs(item)

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append([tuple(var.aval.shape) for var in eqn.invars])
                outputs.append([(tuple(var.aval.shape), var.aval.dtype) for var in eqn.outvars])
                continue
            for param in eqn.params.values():
                for sub in subjaxprs(param):
                    walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_k_and_v_are_never_repeated_in_hbm():
    """Every kernel reads k and v with their own kv_heads: no [b, heads, kv_len, d] copy is made for them."""
    q, k, v, _ = _inputs(8, 2, 64, 96, 32, jnp.float32)

    def grad(q, k, v):
        return jax.grad(lambda q, k, v: flashlib.attention(q, k, v, impl="pallas").sum(), argnums=(0, 1, 2))(q, k, v)

    outputs = []
    calls = _pallas_operand_shapes(grad, q, k, v, outputs=outputs)
    assert len(calls) >= 2  # the forward and at least one backward kernel
    for shapes in calls:  # every kernel takes (q, k, v, ...); the fused one k^T last
        kv_operands = shapes[1:3] + (shapes[6:7] if len(shapes) == 7 else [])
        assert all(s[1] == 2 for s in kv_operands) and shapes[0][1] == 8, shapes
    # the dK/dV (here fused) kernel sums the group itself: dK, dV per kv head, in k's dtype — no f32 per query head
    dk, dv = outputs[1][:2]
    assert dk[0][1] == dv[0][1] == 2 and dk[1] == dv[1] == k.dtype, outputs[1]


@pytest.mark.parametrize("dq_bytes", [None, 4 * 32 * 128 * 2])  # the whole group; 2 heads' dQ^T per step
@pytest.mark.parametrize("fuse_dq", [True, False])
def test_the_backward_sums_a_group_in_its_kernels(fuse_dq, dq_bytes, monkeypatch):
    """dK/dV (and fused) walk a group's query heads in turn and sum them in VMEM; with the fused kernel's dQ^T
    room for only part of a group, the rest is summed outside: every way gives the gradients of MHA over
    repeated k, v heads, summed over each group."""
    if dq_bytes is not None:
        monkeypatch.setattr(backward_kernels, "FUSED_DQ_MAX_BYTES", dq_bytes)
        assert backward_kernels.fused_heads_inner(4, 32, 128) == 2
    q, k, v, do = _inputs(8, 2, 96 + (dq_bytes or 0) % 7, 136, 32, jnp.float32, seed=4)
    sizes = BlockSizes(block_q=32, block_k=128)
    out, lse = flash_attention_forward(q, k, v, causal=True, block_sizes=sizes, interpret=True, return_lse=True)
    got = flash_attention_backward(q, k, v, out, lse, do, causal=True, block_sizes=sizes, interpret=True,
                                   fuse_dq=fuse_dq)
    k4, v4 = (jnp.repeat(x, 4, axis=1) for x in (k, v))
    dq, dk4, dv4 = flash_attention_backward(q, k4, v4, out, lse, do, causal=True, block_sizes=sizes, interpret=True,
                                            fuse_dq=fuse_dq)
    want = (dq, *(x.reshape(1, 2, 4, *x.shape[2:]).sum(axis=2) for x in (dk4, dv4)))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_a_grid_step_takes_the_whole_group_when_it_fits():
    """heads_per_step: all of a group's query heads share one k/v copy when their q, out, lse and state fit
    VMEM; else the largest divisor of the group that fits (never a non-divisor, never over the budget)."""
    bf16 = jnp.dtype(BF16)
    assert heads_per_step(1, BlockSizes(512, 512, generation="v5e"), 128, bf16) == 1  # MHA
    assert heads_per_step(4, BlockSizes(512, 512, generation="v5e"), 128, bf16) == 4
    for group in (2, 3, 4, 6, 8, 16):
        for sizes in (BlockSizes(1024, 512, generation="v5e"), BlockSizes(512, 512, generation="v5e"),
                      BlockSizes(1024, 1024, generation="v6e")):
            pack = heads_per_step(group, sizes, 128, bf16)
            limit = vmem_limit_bytes(sizes.generation)
            assert group % pack == 0 and sizes.vmem_bytes(128, bf16, heads_per_step=pack) <= limit
            larger = [p for p in range(pack + 1, group + 1) if group % p == 0]
            assert all(sizes.vmem_bytes(128, bf16, heads_per_step=p) > limit for p in larger), (group, sizes)
    assert heads_per_step(16, BlockSizes(1024, 512, generation="v5e"), 128, bf16) < 16  # 16 heads do not fit


@pytest.mark.parametrize("pack", [None, 2])
def test_packed_heads_compute_what_one_head_per_step_computes(pack, monkeypatch):
    """A step computing 4 (or, forced, 2) heads of a group against one k/v copy — as [heads, ...] blocks or as
    separate 2-D operands — gives the one-head-per-step kernel's out and lse bit for bit (same tiles, same order),
    with sinks and a value head_dim of its own."""
    if pack is not None:
        monkeypatch.setattr(tpu_forward, "heads_per_step", lambda group, *args: math.gcd(group, pack))
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(1, 8, 72 + (pack or 0), 32)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, 2, 136, d)), jnp.float32) for d in (32, 16))
    sinks = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    settings = dict(causal=True, scale=0.2, sizes=BlockSizes(block_q=32, block_k=128), interpret=True,
                    return_lse=True, variants=tpu_forward.KernelVariants(sinks=True))
    one_per_step = tpu_forward.forward(q, jnp.repeat(k, 4, 1), jnp.repeat(v, 4, 1), None, sinks, **settings)
    for separate_heads in (False, True):
        packed = tpu_forward.forward(q, k, v, None, sinks, separate_heads=separate_heads, **settings)
        for got, want in zip(packed, one_per_step, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.tpu
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
def test_gqa_gradient_compiles_for_tpu(topology):
    q = jax.ShapeDtypeStruct((1, 8, 1024, 128), BF16)
    kv = jax.ShapeDtypeStruct((1, 2, 1024, 128), BF16)

    def loss(q, k, v):
        return flashlib.attention(q, k, v, causal=True, impl="pallas", interpret=False).astype(jnp.float32).sum()

    check = compile_for_tpu(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, topology=topology)
    assert check.ok, check.compiler_message
