"""The Pallas TPU backward kernels and the custom VJP: gradients in interpret mode, TPU semantics, the
geometry and cost of the dK/dV and dQ grids, lowering and AOT compiles of ``jax.grad``."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_no_races, make_qkv, tpu_race_state
from jax.experimental.pallas import tpu as pltpu
from jax.test_util import check_grads

import flashlib
from flashlib import cost, geometry
from flashlib.checks import check_attention_grads
from flashlib.kernels import (
    HIGHER_ORDER_MESSAGE,
    BlockSizes,
    backward_kernels,
    flash_attention,
    flash_attention_backward,
    tpu_backward,
)
from flashlib.reference import causal_mask, default_scale
from flashlib.tpu_compile import compile_for_tpu, lower_for_tpu

F32, BF16 = jnp.float32, jnp.bfloat16
TOPOLOGIES = ["v5e:1x1", "v6e:1x1"]


def backward_sizes(block_q, block_k, dkv=(128, 128), dq=(128, 128)) -> BlockSizes:
    """Small forward and backward blocks, so short sequences still span several blocks of each kernel."""
    return BlockSizes(block_q, block_k, block_q_dkv=dkv[0], block_k_dkv=dkv[1], block_q_dq=dq[0], block_k_dq=dq[1])


def pallas_grads(q, k, v, do, **kwargs):
    _, vjp = jax.vjp(lambda q, k, v: flashlib.attention(q, k, v, impl="pallas", **kwargs), q, k, v)
    return vjp(do)


def cotangent(q, seed: int = 9):
    return jax.random.normal(jax.random.key(seed), q.shape, jnp.float32).astype(q.dtype)


# ---------------------------------------------------------------------------------------------------
# Gradients against the float64 oracle (interpret mode on this CPU)
# ---------------------------------------------------------------------------------------------------

CASES = [  # q_len, kv_len, head_dim, dtype, causal, block sizes
    (1, 1, 32, F32, False, None),  # one token: one padded block in each kernel
    (37, 37, 64, F32, True, None),  # odd length, default blocks clamped to the sequence
    (300, 300, 64, BF16, True, backward_sizes(64, 128)),  # skipped, straddling, padded blocks; fused dQ
    (300, 300, 64, BF16, True, backward_sizes(64, 128, dkv=(128, 64))),  # the same in the separate dQ kernel
    (37, 300, 64, F32, True, backward_sizes(16, 128, dkv=(128, 32))),  # q_len < kv_len: diagonal shifted right
    (300, 37, 32, BF16, True, backward_sizes(32, 128, dkv=(128, 16))),  # q_len > kv_len: 263 rows see no key
    (300, 37, 32, BF16, True, backward_sizes(32, 128)),  # the same fused: one key block of 48, dQ^T rows of 0
    (130, 520, 64, BF16, False, backward_sizes(128, 256, dkv=(256, 128), dq=(128, 256))),  # padding, lcm of blocks
    (200, 130, 128, F32, False, backward_sizes(8, 128, dkv=(256, 8))),  # the smallest f32 key rows of dK/dV
]


@pytest.mark.parametrize("q_len, kv_len, head_dim, dtype, causal, sizes", CASES)
def test_gradients_match_oracle(q_len, kv_len, head_dim, dtype, causal, sizes):
    q, k, v = make_qkv(q_len=q_len, kv_len=kv_len, head_dim=head_dim, dtype=dtype)
    do = cotangent(q)
    grads = pallas_grads(q, k, v, do, causal=causal, block_sizes=sizes)
    check_attention_grads(grads, q, k, v, do, causal=causal, quiet=True)


def test_custom_scale_batch_and_the_direct_backward():
    """flash_attention_backward from the forward's residuals gives what jax.vjp gives."""
    q, k, v = make_qkv(batch=2, heads=3, q_len=40, kv_len=70, head_dim=32)
    do, sizes = cotangent(q), backward_sizes(16, 128)
    grads = pallas_grads(q, k, v, do, causal=True, scale=0.3, block_sizes=sizes)
    check_attention_grads(grads, q, k, v, do, causal=True, scale=0.3, quiet=True)
    out, lse = flashlib.kernels.flash_attention_forward(q, k, v, causal=True, scale=0.3, return_lse=True)
    direct = flash_attention_backward(q, k, v, out, lse, do, causal=True, scale=0.3, block_sizes=sizes)
    for a, b in zip(direct, grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_and_separate_dq_kernels_agree(causal):
    """The fused kernel (dQ^T accumulated beside dK, dV) and the separate dQ kernel: both within the oracle's
    rule, and the same dK, dV (one kernel computes them both ways); padded queries and keys on both sides."""
    q, k, v = make_qkv(q_len=200, kv_len=300, head_dim=64, dtype=BF16)
    do, sizes = cotangent(q), backward_sizes(64, 128, dkv=(128, 128))
    out, lse = flashlib.kernels.flash_attention_forward(q, k, v, causal=causal, return_lse=True)
    grads = {fuse: flash_attention_backward(q, k, v, out, lse, do, causal=causal, block_sizes=sizes, fuse_dq=fuse)
             for fuse in (True, False)}
    for fused_or_not in grads.values():
        check_attention_grads(fused_or_not, q, k, v, do, causal=causal, quiet=True)
    for a, b in zip(grads[True][1:], grads[False][1:], strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(grads[True][0].astype(F32), grads[False][0].astype(F32), rtol=2e-2, atol=2e-2)


def test_fused_dq_is_chosen_by_size_and_checked():
    sizes = backward_sizes(64, 128, dkv=(128, 128)).for_backward(256, 256, 64, BF16)
    assert tpu_backward._fuses_dq(sizes, 256, 256, 64, None)
    assert not tpu_backward._fuses_dq(sizes, 256, 256, 64, False)
    long_q = tpu_backward.FUSED_DQ_MAX_BYTES // (4 * 64) + 1  # one query more than the dQ^T budget holds
    assert not tpu_backward._fuses_dq(sizes, long_q, 256, 64, None)
    narrow = backward_sizes(64, 128, dkv=(128, 64)).for_backward(256, 256, 64, BF16)
    assert not tpu_backward._fuses_dq(narrow, 256, 256, 64, None)  # k^T blocks of 64 keys are not whole lanes
    q, k, v = make_qkv(q_len=256, head_dim=64)
    with pytest.raises(ValueError, match="fuse_dq=True needs block_k_dkv to be a multiple of 128"):
        flash_attention_backward(q, k, v, q, q[..., 0], q, block_sizes=narrow, fuse_dq=True)


def test_finite_differences():
    q, k, v = make_qkv(1, 1, 5, 7, 8, seed=2)
    check_grads(lambda q, k, v: flashlib.attention(q, k, v, causal=True, impl="pallas"), (q, k, v),
                order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-3)


def test_value_and_grad_and_vjp_agree():
    q, k, v = make_qkv(1, 2, 24, 40, 32, seed=4)

    def loss(q, k, v):
        return jnp.sum(jnp.sin(flashlib.attention(q, k, v, causal=True, impl="pallas")))

    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    out, vjp = jax.vjp(lambda q, k, v: flashlib.attention(q, k, v, causal=True, impl="pallas"), q, k, v)
    assert value == pytest.approx(float(jnp.sum(jnp.sin(out))))
    for a, b in zip(grads, vjp(jnp.cos(out)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_lse_is_differentiable_too():
    """With return_lse, a cotangent on lse flows back (folded into D): compare with autodiff of jnp."""
    q, k, v = make_qkv(1, 2, 20, 30, 32, seed=5)
    weights = jnp.linspace(-1.0, 1.0, 20)

    def loss_pallas(q, k, v):
        out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
        return jnp.sum(out**2) + jnp.sum(lse * weights)

    def loss_reference(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * default_scale(32)
        s = jnp.where(causal_mask(20, 30), s, -jnp.inf)
        out = flashlib.attention(q, k, v, causal=True, impl="reference")
        return jnp.sum(out**2) + jnp.sum(jax.nn.logsumexp(s, axis=-1) * weights)

    got = jax.grad(loss_pallas, argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(loss_reference, argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_higher_order_is_refused_clearly():
    q, k, v = make_qkv(1, 1, 8, 8, 8)

    def loss(q):
        return jnp.sum(flashlib.attention(q, k, v, impl="pallas"))

    with pytest.raises(NotImplementedError, match="first-order gradients only; use impl='reference'"):
        jax.grad(lambda q: jnp.sum(jax.grad(loss)(q)))(q)
    with pytest.raises(NotImplementedError, match="first-order gradients only"):
        jax.hessian(loss)(q)
    assert "higher-order" in HIGHER_ORDER_MESSAGE


def test_backward_block_sizes_are_checked_before_tracing():
    q, k, v = make_qkv(q_len=64, dtype=BF16)
    with pytest.raises(ValueError, match="block_k_dkv must be a multiple of 16"):
        flashlib.attention(q, k, v, impl="pallas", block_sizes=BlockSizes(64, 128, block_k_dkv=8))


# ---------------------------------------------------------------------------------------------------
# TPU semantics: races, and the copies causal skipping saves
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_tpu_interpret_mode_detects_no_races(causal):
    """Both backward kernels under TPU-semantics emulation (DMAs, VMEM, uninitialised scratch as NaN)."""
    pltpu.reset_tpu_interpret_mode_state()
    q, k, v = make_qkv(q_len=136, kv_len=200, head_dim=32)
    do, params = cotangent(q), pltpu.InterpretParams(detect_races=True)
    grads = pallas_grads(q, k, v, do, causal=causal, block_sizes=backward_sizes(64, 128), interpret=params)
    check_attention_grads(grads, q, k, v, do, causal=causal, quiet=True)
    assert_no_races()


def test_dkv_causal_skips_copies_of_query_blocks_it_does_not_need():
    """The dK/dV kernel's clamped q index map: a causal run copies far fewer q blocks than a full one."""
    q_len = kv_len = 512
    q, k, v = make_qkv(heads=1, q_len=q_len, head_dim=32)
    sizes = backward_sizes(128, 128, dkv=(128, 64)).for_backward(q_len, kv_len, 32, F32)
    rows = jnp.zeros((1, 1, 8, q_len), jnp.float32)
    params, reads = pltpu.InterpretParams(detect_races=True), {}
    for causal in (False, True):
        pltpu.reset_tpu_interpret_mode_state()
        settings = dict(causal=causal, scale=0.1, q_len=q_len, kv_len=kv_len, sizes=sizes, interpret=params)
        jax.block_until_ready(backward_kernels._dkv(q, k, v, q, rows, rows, **settings))
        races = tpu_race_state()
        if races is None or not hasattr(races, "reads"):
            pytest.skip("this jax's race detector does not log reads")
        reads[causal] = [len(log) for (space, *_), log in races.reads.items() if space in ("hbm", "any")]
    num_q_blocks, num_kv_blocks = q_len // 128, kv_len // 64
    assert max(reads[False]) == num_q_blocks * num_kv_blocks  # q, dO, lse, D: a new block every grid step
    in_order = cost.q_block_fetches(q_len, kv_len, 128, 64, causal=True)  # 18 of 32, were the grid walked in order
    assert max(reads[True]) <= in_order + num_kv_blocks  # reordering kv blocks costs at most one copy each


# ---------------------------------------------------------------------------------------------------
# Geometry and cost accounting of the backward grids
# ---------------------------------------------------------------------------------------------------

GEOMETRIES = [(37, 300, 128, 16), (300, 37, 128, 32), (512, 512, 128, 64), (1000, 700, 256, 128), (5, 1024, 128, 512)]


@pytest.mark.parametrize("q_len, kv_len, block_q, block_k", GEOMETRIES)
def test_first_query_block_is_where_visibility_starts(q_len, kv_len, block_q, block_k):
    """The dK/dV q index map clamps to max(first_query_seeing, 0) // block_q: exactly the first visible block."""
    block_geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=True)
    for j in range(-(-kv_len // block_k)):
        first = max(geometry.first_query_seeing(j, block_k=block_k, q_len=q_len, kv_len=kv_len), 0) // block_q
        visible = [bool(geometry.block_is_visible(i, j, **block_geometry)) for i in range(-(-q_len // block_q))]
        assert visible == [i >= first for i in range(len(visible))], j


def _walk_copies(index_of, outer: int, inner: int) -> int:
    """Copies of one input over a grid walked in order: a copy whenever the block index changes."""
    indices = [index_of(o, i) for o, i in itertools.product(range(outer), range(inner))]
    return 1 + sum(a != b for a, b in itertools.pairwise(indices))


@pytest.mark.parametrize("q_len, kv_len, block_q, block_k", GEOMETRIES)
@pytest.mark.parametrize("causal", [False, True])
def test_fetch_counts_match_a_simulated_grid_walk(q_len, kv_len, block_q, block_k, causal):
    nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
    last = geometry.last_kv_blocks(q_len, kv_len, block_q, block_k, causal)
    first = geometry.first_query_blocks(q_len, kv_len, block_q, block_k, causal)
    assert cost.kv_block_fetches(q_len, kv_len, block_q, block_k, causal) == _walk_copies(
        lambda i, j: min(j, last[i]), nq, nk)
    assert cost.q_block_fetches(q_len, kv_len, block_q, block_k, causal) == _walk_copies(
        lambda j, i: max(i, first[j]), nk, nq)


def test_ideal_backward_is_two_and_a_half_forwards():
    for causal in (False, True):
        dims = (2, 3, 64, 96, 32, causal)
        assert 2 * cost.attention_backward_flops(*dims) == 5 * cost.attention_flops(*dims)
        assert cost.attention_backward_transcendentals(*dims) == cost.attention_transcendentals(*dims)
    assert cost.attention_backward_bytes(1, 1, 64, 64, 32, False, "bfloat16") == 8 * 64 * 32 * 2 + 64 * 4


def test_kernels_do_seven_matmuls_over_visited_blocks_or_five_fused():
    """dK/dV recomputes s and dP and does dV, dK (4 matmuls); dQ recomputes s, dP and does dQ (3); the fused
    kernel does dK/dV's four and dQ^T's one over dK/dV's blocks (5), with one exp per score like dK/dV."""
    sizes = BlockSizes(128, 128, block_q_dkv=128, block_k_dkv=128, block_q_dq=128, block_k_dq=128)
    dims = (1, 1, 1024, 1024, 128)
    forward = cost.attention_flops(*dims, True, sizes)
    assert 2 * cost.attention_backward_flops(*dims, True, sizes, kernel="dkv") == 4 * forward
    assert 2 * cost.attention_backward_flops(*dims, True, sizes, kernel="dq") == 3 * forward
    assert 2 * cost.attention_backward_flops(*dims, True, sizes) == 7 * forward
    assert 2 * cost.attention_backward_flops(*dims, True, sizes, kernel="fused") == 5 * forward
    assert (cost.attention_backward_transcendentals(*dims, True, sizes, kernel="fused")
            == cost.attention_backward_transcendentals(*dims, True, sizes, kernel="dkv"))
    k_t_and_dq_t = 2 * 1024 * 128 * 2  # bf16, read once and written once
    assert (cost.attention_backward_bytes(*dims, True, "bfloat16", sizes, kernel="fused")
            == cost.attention_backward_bytes(*dims, True, "bfloat16", sizes, kernel="dkv") + k_t_and_dq_t)
    full = cost.attention_backward_flops(*dims, False, sizes)
    assert cost.attention_backward_flops(*dims, True, sizes) * 64 == full * 36  # 36 of 8 x 8 blocks visited
    assert cost.attention_backward_transcendentals(*dims, True, sizes) == 2 * 36 * 128 * 128


def test_kernel_counts_need_resolved_sizes():
    with pytest.raises(ValueError, match="call sizes.for_backward"):
        cost.attention_backward_flops(1, 1, 64, 64, 32, False, BlockSizes(64, 128))
    with pytest.raises(ValueError, match="kernel must be one of dkv, dq"):
        cost.attention_backward_flops(1, 1, 64, 64, 32, False, BlockSizes(64, 128), kernel="dv")
    with pytest.raises(ValueError, match="pass its block_sizes too"):
        cost.attention_backward_flops(1, 1, 64, 64, 32, False, kernel="dq")


# ---------------------------------------------------------------------------------------------------
# The compiled path: jax.grad lowered to Mosaic and compiled for real TPU targets, from this CPU machine
# ---------------------------------------------------------------------------------------------------

GRAD_CONFIGS = [  # batch, heads, q_len, kv_len, head_dim, dtype, causal, block sizes (None: chip defaults)
    (1, 2, 37, 300, 64, F32, True, None),
    (1, 2, 300, 37, 64, BF16, True, None),
    (2, 8, 1024, 1024, 128, BF16, True, None),
    (1, 2, 512, 512, 256, F32, False, None),
    (1, 8, 2048, 2048, 128, BF16, True, BlockSizes(256, 512, block_q_dkv=512, block_k_dkv=256)),
]


def _config_id(config) -> str:
    *sizes, dtype, causal, blocks = config
    blocks = "default" if blocks is None else "custom"
    return "x".join(map(str, sizes)) + f"-{jnp.dtype(dtype).name}-{'causal' if causal else 'full'}-{blocks}"


def _structs(batch, heads, q_len, kv_len, head_dim, dtype):
    q = jax.ShapeDtypeStruct((batch, heads, q_len, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, heads, kv_len, head_dim), dtype)
    return q, kv, kv


def _grad_fn(causal, sizes):
    def loss(q, k, v):
        out = flashlib.attention(q, k, v, causal=causal, impl="pallas", block_sizes=sizes, interpret=False)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@pytest.mark.parametrize("config", GRAD_CONFIGS[:3], ids=_config_id)
def test_grad_lowers_for_tpu(config):
    *shape, causal, sizes = config
    check = lower_for_tpu(_grad_fn(causal, sizes), *_structs(*shape))
    assert check.ok, check.compiler_message


@pytest.mark.tpu
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("config", GRAD_CONFIGS, ids=_config_id)
def test_grad_compiles_for_tpu(config, topology):
    *shape, causal, sizes = config
    generation = topology.split(":")[0]
    if sizes is None:  # the defaults for that chip
        sizes = BlockSizes.default(shape[2], shape[3], shape[4], shape[5], generation=generation)
    check = compile_for_tpu(_grad_fn(causal, sizes), *_structs(*shape), topology=topology)
    assert check.ok, check.compiler_message


@pytest.mark.tpu
@pytest.mark.parametrize("kernel", cost.BACKWARD_KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_cost_estimate_reaches_the_compiler(kernel, causal):
    """XLA reports each backward kernel's pl.CostEstimate, which flashlib.cost computes."""
    batch, heads, n, head_dim = 1, 4, 1024, 128
    sizes = BlockSizes(256, 512, block_q_dkv=512, block_k_dkv=256, block_q_dq=256, block_k_dq=512)
    q, kv, _ = _structs(batch, heads, n, n, head_dim, BF16)
    rows = jax.ShapeDtypeStruct((batch, heads, 8, n), jnp.float32)
    call = {"fused": backward_kernels._fused, "dkv": backward_kernels._dkv, "dq": backward_kernels._dq}[kernel]

    def run(q, k, v, do, lse_rows, d_rows):
        return call(q, k, v, do, lse_rows, d_rows, causal=causal, scale=0.1, q_len=n, kv_len=n, sizes=sizes,
                    interpret=False)

    check = compile_for_tpu(run, q, kv, kv, q, rows, rows)
    assert check.ok, check.compiler_message
    dims = (batch, heads, n, n, head_dim, causal)
    assert check.flops == cost.attention_backward_flops(*dims, block_sizes=sizes, kernel=kernel)
    kernel_bytes = cost.attention_backward_bytes(*dims, BF16, block_sizes=sizes, kernel=kernel)
    if kernel == "fused":  # the program also holds the XLA transpose making k^T, whose bytes XLA counts too
        assert check.bytes_accessed > kernel_bytes
    else:
        assert check.bytes_accessed == kernel_bytes
