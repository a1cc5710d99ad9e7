"""The ground truth: oracle, naive attention, softmax three ways, and the state merge identity."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_qkv

from flashlib import reference as ref


def test_oracle_matches_a_hand_computed_example():
    q = np.array([[[[1.0, 0.0]]]])  # [1, 1, 1, 2]
    k = np.array([[[[1.0, 0.0], [0.0, 1.0]]]])  # [1, 1, 2, 2]
    v = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    w = np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()  # scale 1
    np.testing.assert_allclose(ref.attention_oracle(q, k, v, scale=1.0), [[[w @ v[0, 0]]]])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("q_len", "kv_len"), [(1, 1), (5, 5), (3, 9), (9, 3)])
def test_naive_matches_oracle_in_f32(causal, q_len, kv_len):
    q, k, v = make_qkv(2, 2, q_len, kv_len, 16)
    out = ref.attention_naive(q, k, v, causal=causal)
    np.testing.assert_allclose(out, ref.attention_oracle(q, k, v, causal=causal), atol=2e-6)


def test_causal_mask_is_bottom_right_aligned():
    mask = np.asarray(ref.causal_mask(2, 4))
    # query 0 sees keys 0..2 (0 + 4 - 2), query 1 sees all four
    np.testing.assert_array_equal(mask, [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(np.asarray(ref.causal_mask(3, 3)), np.tril(np.ones((3, 3))))


def test_rows_that_see_no_key_are_zero_not_nan():
    q, k, v = make_qkv(1, 1, 6, 2, 8)  # causal, q_len > kv_len: queries 0..3 see nothing
    out = np.asarray(ref.attention_naive(q, k, v, causal=True))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0, 0, :4], 0.0)
    np.testing.assert_array_equal(ref.attention_oracle(q, k, v, causal=True)[0, 0, :4], 0.0)
    assert np.isneginf(ref.logsumexp_oracle(q, k, causal=True)[0, 0, :4]).all()


def test_huge_logits_do_not_overflow():
    q, k, v = make_qkv(1, 1, 8, 8, 4)
    q = q * 3e3  # scores of order 1e4
    out = np.asarray(ref.attention_naive(q, k, v, scale=1.0))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref.attention_oracle(q, k, v, scale=1.0), atol=1e-4)


def test_softmax_three_ways_agree_and_naive_overflows():
    x = jnp.array([[1.0, 2.0, 3.0], [-5.0, 0.0, 5.0]])
    for fn in (ref.softmax_stable, ref.softmax_online):
        np.testing.assert_allclose(fn(x), ref.softmax_naive(x), rtol=1e-6)
    big = jnp.array([1000.0, 1001.0])
    assert np.isnan(np.asarray(ref.softmax_naive(big))).all()
    np.testing.assert_allclose(ref.softmax_online(big), ref.softmax_stable(big), rtol=1e-6)
    np.testing.assert_allclose(ref.softmax_stable(big), [1 / (1 + np.e), np.e / (1 + np.e)], rtol=1e-6)


@pytest.mark.parametrize("split", [1, 4, 7])
def test_merging_two_partial_states_equals_the_whole(split):
    rng = np.random.default_rng(0)
    s = jnp.asarray(rng.normal(size=(3, 8)) * 10, jnp.float32)  # [q, k]
    v = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)  # [k, d]
    whole = ref.state_from_scores(s, v)
    left = ref.state_from_scores(s[:, :split], v[:split])
    right = ref.state_from_scores(s[:, split:], v[split:])
    merged = ref.merge_states(left, right)
    for a, b in zip(merged, whole, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ref.state_output(merged), ref.softmax_stable(s) @ v, rtol=1e-5, atol=1e-6)


def test_merge_with_an_empty_state_is_the_identity():
    s = jnp.array([[0.5, 2.0]])
    v = jnp.eye(2)
    full = ref.state_from_scores(s, v)
    empty = ref.state_from_scores(s, v, mask=jnp.zeros((1, 2), bool))
    assert float(empty.l[0]) == 0.0 and np.isneginf(empty.m[0])
    for a, b in zip(ref.merge_states(empty, full), full, strict=True):
        np.testing.assert_allclose(a, b)
    assert np.asarray(ref.state_output(empty)).tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("q_len", "kv_len"), [(1, 1), (5, 9), (9, 3)])
def test_vjp_oracle_matches_autodiff_of_naive(causal, q_len, kv_len):
    """The hand-written backward (dV = P^T dO, dS = P (dP - D), ...) is autodiff's answer, rows that see
    no key (q_len > kv_len, causal) included: their gradient is zero."""
    import jax

    q, k, v = make_qkv(2, 2, q_len, kv_len, 16, seed=3)
    do = jax.random.normal(jax.random.key(1), q.shape)
    _, vjp = jax.vjp(lambda q, k, v: ref.attention_naive(q, k, v, causal=causal, scale=0.3), q, k, v)
    expected = vjp(do)
    got = ref.attention_vjp_oracle(q, k, v, do, causal=causal, scale=0.3)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == np.float64 and g.shape == e.shape
        np.testing.assert_allclose(g, e, atol=3e-6)
