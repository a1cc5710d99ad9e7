"""flashlib.blockwise: the online update, block sizes that do not divide, the log-sum-exp, O(N) memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_qkv

from flashlib import blockwise, reference


@pytest.mark.parametrize(("block_q", "block_k"), [(1, 1), (7, 13), (64, 128), (1000, 1000)])
@pytest.mark.parametrize("causal", [False, True])
def test_any_block_size_gives_the_same_answer(block_q, block_k, causal):
    q, k, v = make_qkv(1, 2, 45, 70, 32, seed=1)
    out = blockwise.blockwise_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    np.testing.assert_allclose(out, reference.attention_oracle(q, k, v, causal=causal), atol=3e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_lse_matches_the_oracle(causal):
    q, k, v = make_qkv(2, 1, 30, 19, 32, seed=4)
    _, lse = blockwise.blockwise_attention(q, k, v, causal=causal, block_q=8, block_k=8, return_lse=True)
    expected = reference.logsumexp_oracle(q, k, causal=causal)
    assert lse.shape == (2, 1, 30) and lse.dtype == jnp.float32
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_online_update_is_the_state_merge():
    rng = np.random.default_rng(0)
    s = jnp.asarray(rng.normal(size=(4, 6)) * 5, jnp.float32)
    v = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)
    state = reference.state_from_scores(s[:, :2], v[:2])
    everything = jnp.ones((4, 4), bool)
    updated = blockwise.online_update(state, s[:, 2:], v[2:], everything)
    merged = reference.merge_states(state, reference.state_from_scores(s[:, 2:], v[2:]))
    for a, b in zip(updated, merged, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_pad_to_multiple():
    x = jnp.ones((1, 1, 5, 2))
    assert blockwise.pad_to_multiple(x, 2, 4).shape == (1, 1, 8, 2)
    assert blockwise.pad_to_multiple(x, 2, 5) is x


def _peak_temp_bytes(fn, *args) -> int:
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_memory_grows_linearly_not_quadratically():
    """The compiled scratch of blockwise grows ~linearly in N; the naive version's grows ~N^2."""
    lengths = (1024, 4096)
    naive, tiled = [], []
    for n in lengths:
        q = jax.ShapeDtypeStruct((1, 1, n, 64), jnp.float32)
        naive.append(_peak_temp_bytes(lambda q: reference.attention_naive(q, q, q), q))
        tiled.append(_peak_temp_bytes(lambda q: blockwise.blockwise_attention(q, q, q, block_k=128), q))
    growth = lengths[1] / lengths[0]  # 4x longer
    assert naive[1] / naive[0] > 0.8 * growth**2  # ~16x
    assert tiled[1] / tiled[0] < 1.5 * growth  # ~4x
    assert tiled[1] < naive[1] / 8
