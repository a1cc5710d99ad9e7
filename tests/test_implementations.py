"""Every registered implementation against the float64 oracle: property tests over the whole contract.

Search or smoke (``tests/conftest.py``): the property tests (the default profile's 12 random examples) run in full
in the main environment and as 3 random examples under ``make test-colab``; the fixed cases run in both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_qkv
from hypothesis import given
from hypothesis import strategies as st
from peers import rules

import flashlib
from flashlib import checks

IMPLS = list(flashlib.implementations())
# Interpreted Pallas is slow on the CPU: its property tests run fewer, smaller examples (tests/test_tpu_*.py
# cover it in depth); the others sweep the full range the contract promises.
FAST_IMPLS = [name for name in IMPLS if name != "pallas"]

def attention_cases(*, max_batch: int, max_heads: int, max_len: int, head_dims: list[int]):
    """Random attention calls: :func:`make_qkv`'s arguments (q_len and kv_len drawn apart), plus ``causal``."""
    return st.fixed_dictionaries(
        {
            "batch": st.integers(1, max_batch),
            "heads": st.integers(1, max_heads),
            "q_len": st.integers(1, max_len),
            "kv_len": st.integers(1, max_len),
            "head_dim": st.sampled_from(head_dims),
            "dtype": st.sampled_from([jnp.float32, jnp.bfloat16]),
            "causal": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )


shapes = attention_cases(max_batch=3, max_heads=4, max_len=600, head_dims=[32, 64, 96, 128])


@pytest.mark.parametrize("impl", FAST_IMPLS)
@given(case=shapes)
def test_matches_oracle(impl, case):
    causal = case.pop("causal")
    q, k, v = make_qkv(**case)
    # jitted: one compiled program per example (eagerly, each op compiles on its own for each new shape);
    # the fixed cases below run eagerly
    out = jax.jit(lambda q, k, v: flashlib.attention(q, k, v, causal=causal, impl=impl))(q, k, v)
    checks.check_attention(out, q, k, v, causal=causal, name=impl, quiet=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_custom_scale_and_short_sequences(impl):
    q, k, v = make_qkv(1, 2, 3, 130, 32, seed=3)
    out = flashlib.attention(q, k, v, scale=0.37, causal=True, impl=impl)
    checks.check_attention(out, q, k, v, scale=0.37, causal=True, quiet=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_are_zero(impl):
    q, k, v = make_qkv(1, 1, 20, 5, 32)
    out = np.asarray(flashlib.attention(q, k, v, causal=True, impl=impl))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0, 0, :15], 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_large_logits_do_not_overflow(impl):
    q, k, v = make_qkv(1, 2, 40, 40, 32, seed=7)
    q = q * 1e3  # |scores| up to ~1e4 with the default scale
    out = flashlib.attention(q, k, v, impl=impl)
    checks.check_attention(out, q, k, v, quiet=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_and_dtype_preserved(impl):
    q, k, v = make_qkv(1, 1, 16, 16, 32, dtype=jnp.bfloat16)
    out = jax.jit(lambda q, k, v: flashlib.attention(q, k, v, causal=True, impl=impl))(q, k, v)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape


@pytest.mark.parametrize("impl", ["reference", "blockwise", "xla", "pallas"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_the_reference(impl, causal):
    q, k, v = make_qkv(1, 2, 33, 47, 32, seed=11)  # small: interpreted Pallas compiles slowly

    def loss(impl_name):
        return lambda q, k, v: jnp.sum(jnp.sin(flashlib.attention(q, k, v, causal=causal, impl=impl_name)))

    expected = jax.grad(loss("reference"), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss(impl), argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=2e-5, rtol=2e-5)


def test_reference_gradients_match_finite_differences():
    q, k, v = make_qkv(1, 1, 4, 5, 8, seed=2)
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    from jax.test_util import check_grads

    check_grads(lambda q, k, v: flashlib.attention(q, k, v, causal=True, impl="reference"), (q, k, v),
                order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-3)


grad_shapes = attention_cases(max_batch=2, max_heads=2, max_len=256, head_dims=[32, 64, 128])


@pytest.mark.parametrize("impl", FAST_IMPLS)
@given(case=grad_shapes)
def test_gradients_match_oracle(impl, case):
    """The VJP for a random output cotangent, against float64, by FlashAttention's rule for gradients."""
    causal = case.pop("causal")
    q, k, v = make_qkv(**case)
    do = jax.random.normal(jax.random.key(case["seed"] + 1), q.shape, jnp.float32).astype(q.dtype)
    fn = functools.partial(flashlib.attention, causal=causal, impl=impl)
    _, *grads = jax.jit(rules.output_and_grads, static_argnums=0)(fn, q, k, v, do)  # one program, as above
    checks.check_attention_grads(grads, q, k, v, do, causal=causal, name=impl, quiet=True)
