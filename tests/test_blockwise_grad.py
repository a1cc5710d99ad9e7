"""flashlib.blockwise's custom VJP: gradients against the float64 oracle, the lse's cotangent, higher order
through the plain-JAX backward, and the memory it saves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_qkv
from jax.test_util import check_grads

from flashlib import blockwise, reference
from flashlib.checks import check_attention_grads

F32, BF16 = jnp.float32, jnp.bfloat16


def blockwise_grads(q, k, v, do, **kwargs):
    """``(dq, dk, dv)`` by ``jax.vjp``, jitted (one compiled program builds faster than eager dispatch)."""

    def grads(q, k, v, do):
        _, vjp = jax.vjp(lambda q, k, v: blockwise.blockwise_attention(q, k, v, **kwargs), q, k, v)
        return vjp(do)

    return jax.jit(grads)(q, k, v, do)


def cotangent(q, seed: int = 9):
    return jax.random.normal(jax.random.key(seed), q.shape, jnp.float32).astype(q.dtype)


CASES = [  # q_len, kv_len, dtype, causal, block_q, block_k
    (45, 70, F32, False, 7, 13),  # blocks that divide nothing
    (45, 70, F32, True, 64, 128),  # q_len < kv_len: one block each way
    (70, 45, F32, True, 16, 16),  # q_len > kv_len: 25 rows see no key
    (1, 1, F32, True, 128, 128),  # one token
    (130, 300, BF16, True, 64, 128),
    (300, 130, BF16, False, 128, 64),
]


@pytest.mark.parametrize("q_len, kv_len, dtype, causal, block_q, block_k", CASES)
def test_gradients_match_oracle(q_len, kv_len, dtype, causal, block_q, block_k):
    q, k, v = make_qkv(1, 2, q_len, kv_len, 32, dtype=dtype, seed=1)
    do = cotangent(q)
    grads = blockwise_grads(q, k, v, do, causal=causal, block_q=block_q, block_k=block_k)
    check_attention_grads(grads, q, k, v, do, causal=causal, quiet=True)


def test_custom_scale_and_rows_that_see_no_key_get_zero_gradient():
    q, k, v = make_qkv(2, 1, 20, 5, 16, seed=3)
    do = cotangent(q)
    dq, dk, dv = blockwise_grads(q, k, v, do, causal=True, scale=0.4, block_k=2)
    check_attention_grads((dq, dk, dv), q, k, v, do, causal=True, scale=0.4, quiet=True)
    np.testing.assert_array_equal(np.asarray(dq)[:, :, :15], 0.0)  # queries 0..14 see no key


def test_lse_is_differentiable():
    """A cotangent on lse adds P * dlse to dS: compare with autodiff through jax.nn.logsumexp."""
    q, k, v = make_qkv(1, 2, 30, 19, 32, seed=4)
    weights = jnp.linspace(-1.0, 1.0, 30)

    def loss_blockwise(q, k, v):
        out, lse = blockwise.blockwise_attention(q, k, v, block_q=8, block_k=8, return_lse=True)
        return jnp.sum(out**2) + jnp.sum(lse * weights)

    def loss_reference(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * reference.default_scale(32)
        return jnp.sum(reference.attention_naive(q, k, v) ** 2) + jnp.sum(jax.nn.logsumexp(s, axis=-1) * weights)

    got = jax.jit(jax.grad(loss_blockwise, argnums=(0, 1, 2)))(q, k, v)
    expected = jax.jit(jax.grad(loss_reference, argnums=(0, 1, 2)))(q, k, v)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-5)


def test_finite_differences_first_and_second_order():
    """The backward is plain JAX, so reverse-over-reverse differentiates it (no second custom rule needed)."""
    q, k, v = make_qkv(1, 1, 4, 6, 8, seed=2)

    @jax.jit
    def fn(q, k, v):
        return blockwise.blockwise_attention(q, k, v, causal=True, block_q=2, block_k=4)

    check_grads(fn, (q, k, v), order=2, modes=("rev",), atol=5e-2, rtol=5e-2, eps=1e-2)


def test_return_lse_still_returns_the_forward_values():
    q, k, v = make_qkv(1, 2, 33, 47, 32, seed=6)
    out, lse = blockwise.blockwise_attention(q, k, v, causal=True, block_q=8, block_k=16, return_lse=True)
    np.testing.assert_allclose(out, reference.attention_oracle(q, k, v, causal=True), atol=3e-6)
    np.testing.assert_allclose(lse, reference.logsumexp_oracle(q, k, causal=True), rtol=1e-5, atol=1e-5)


def _grad_temp_bytes(fn, n: int) -> int:
    q = jax.ShapeDtypeStruct((1, 1, n, 64), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_grad_memory_grows_linearly_not_quadratically():
    """Compiled scratch of jax.grad: ~linear in N through blockwise's custom VJP, ~N^2 through the naive
    version (autodiff keeps its [N, N] probabilities), and far below autodiff through the scan, which keeps
    every block's probabilities — the whole matrix again, in pieces."""
    lengths = (1024, 4096)
    naive = [_grad_temp_bytes(reference.attention_naive, n) for n in lengths]
    tiled = [_grad_temp_bytes(lambda q, k, v: blockwise.blockwise_attention(q, k, v, block_k=128), n) for n in lengths]
    growth = lengths[1] / lengths[0]  # 4x longer
    assert naive[1] / naive[0] > 0.8 * growth**2  # ~16x
    assert tiled[1] / tiled[0] < 1.5 * growth  # ~4x
    assert tiled[1] < naive[1] / 8

    def scan_autodiff(q, k, v):  # the same forward, without the custom VJP
        static = blockwise._Static(causal=False, scale=0.125, block_q=128, block_k=128, return_lse=False,
                                   window=None, softcap=None)
        return blockwise._forward(q, k, v, None, None, static)[0]

    assert tiled[1] < _grad_temp_bytes(scan_autodiff, lengths[1]) / 4
