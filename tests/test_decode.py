"""Decoding's ground (issue 17): the float64 decode oracle, the one-piece JAX reference and split-KV, over
contiguous and paged caches, against plain attention per sequence (``reference.attention_oracle``: a cache of
``lengths[b]`` keys with ``q_len`` new queries is bottom-right causal attention at ``kv_len = lengths[b]``).

The property test searches (``derandomize=False``); its ranges reach sequences shorter than ``q_len`` (queries
that see no key), empty sequences, lengths that are not multiples of the page size, empty and full pages,
GQA groups 1-8, and split counts from one to one key per split.

Search or smoke (``tests/conftest.py``): both searches run in full in the main environment and as a random quarter
under ``make test-colab`` — the oracle is float64 NumPy, and the reference and split-KV paths are plain jnp whose
jax-version dependence the quarter shows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import search_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlib import decode, reference


@st.composite
def paged_cases(draw):
    batch, kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3, 8]))
    q_len, page_size, pages_per_seq = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    d, dv = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    max_len = page_size * pages_per_seq
    lengths = np.array([draw(st.integers(0, max_len)) for _ in range(batch)])
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    num_pages = batch * pages_per_seq + draw(st.integers(0, 3))  # a pool with spare pages
    table = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    magnitude = draw(st.sampled_from([1.0, 6.0]))
    cache = decode.PagedKVCache(
        k_pages=jnp.asarray(rng.normal(size=(num_pages, kv_heads, page_size, d)) * magnitude, jnp.float32),
        v_pages=jnp.asarray(rng.normal(size=(num_pages, kv_heads, page_size, dv)), jnp.float32),
        block_table=jnp.asarray(table, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32))
    q = jnp.asarray(rng.normal(size=(batch, kv_heads * group, q_len, d)) * magnitude, jnp.float32)
    num_splits = draw(st.integers(1, max_len))
    return q, cache, num_splits


def _per_sequence_oracle(q, cache):
    flat = _contiguous(cache)  # the library's gather (the oracle gathers in NumPy)
    q, k, v = (np.asarray(x, np.float64) for x in (q, flat.k, flat.v))
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for b, length in enumerate(np.asarray(flat.lengths).tolist()):
        if length:
            out[b] = reference.attention_oracle(q[b:b + 1], k[b:b + 1, :, :length], v[b:b + 1, :, :length],
                                                causal=True)[0]
    return out


@settings(max_examples=search_examples(60), derandomize=False, deadline=None)
@given(paged_cases())
def test_decode_oracle_is_attention_per_sequence(case):
    q, cache, _ = case
    np.testing.assert_allclose(decode.decode_oracle(q, cache), _per_sequence_oracle(q, cache), rtol=1e-9, atol=1e-12)


@functools.partial(jax.jit, static_argnames="num_splits")
def _three_decodes(q, cache, num_splits):
    """The reference, split-KV over the pages and split-KV over the contiguous copy: one compiled program
    per drawn shape, as a model runs them (op by op, each new shape compiled each op: ~3x the time)."""
    return (decode.decode_reference(q, cache), decode.decode_split_kv(q, cache, num_splits=num_splits),
            decode.decode_split_kv(q, decode.contiguous(cache), num_splits=num_splits))


_contiguous = jax.jit(decode.contiguous)


@settings(max_examples=search_examples(30), derandomize=False, deadline=None)
@given(paged_cases())
def test_reference_and_split_kv_match_the_oracle(case):
    q, cache, num_splits = case
    want = decode.decode_oracle(q, cache)
    for got in _three_decodes(q, cache, num_splits):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5 * max(1.0, np.abs(want).max()))


def test_a_sequence_shorter_than_the_new_tokens_gives_zeros_for_the_rows_that_see_nothing():
    rng = np.random.default_rng(0)
    cache = decode.KVCache(jnp.asarray(rng.normal(size=(2, 1, 6, 4)), jnp.float32),
                           jnp.asarray(rng.normal(size=(2, 1, 6, 4)), jnp.float32), jnp.asarray([1, 0], jnp.int32))
    q = jnp.asarray(rng.normal(size=(2, 2, 3, 4)), jnp.float32)
    out = np.asarray(decode.decode_split_kv(q, cache, num_splits=3))
    assert np.all(out[0, :, :2] == 0) and np.all(out[0, :, 2] != 0) and np.all(out[1] == 0)


def test_split_states_merge_in_any_order():
    """The splits are independent: merging their states in reverse gives the same output (notebook 03)."""
    rng = np.random.default_rng(1)
    cache = decode.KVCache(jnp.asarray(rng.normal(size=(1, 2, 40, 8)), jnp.float32),
                           jnp.asarray(rng.normal(size=(1, 2, 40, 8)), jnp.float32), jnp.asarray([37], jnp.int32))
    q = jnp.asarray(rng.normal(size=(1, 4, 2, 8)), jnp.float32)
    out, states = decode.decode_split_kv(q, cache, num_splits=5, return_states=True)
    merged = states[-1]
    for state in states[-2::-1]:
        merged = reference.merge_states(merged, state)
    np.testing.assert_allclose(np.asarray(reference.state_output(merged)).reshape(out.shape), out, atol=1e-6)


def test_split_bounds_cover_the_cache():
    assert decode.split_bounds(10, 3) == [(0, 3), (3, 7), (7, 10)]
    assert decode.split_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="num_splits must be an int from 1 to the cache length 4"):
        decode.split_bounds(4, 5)


@pytest.mark.parametrize("change, message", [
    (lambda q, c: (q[0], c), r"q must be \[batch, heads, q_len, head_dim\]"),
    (lambda q, c: (q, c._replace(lengths=c.lengths.astype(jnp.float32))), r"lengths must be \[batch\] = \(2,\) ints"),
    (lambda q, c: (q[:, :3], c), r"kv_heads \(2\) must divide q's heads \(3\)"),
    (lambda q, c: (q, c._replace(k=c.k[..., :2])), r"does not fit q"),
    (lambda q, c: (q, c._replace(v=c.v[:, :, :3])), r"the cache's v .* must match k"),
    (lambda q, c: (q, "cache"), r"cache must be a KVCache or a PagedKVCache"),
])
def test_bad_input_names_the_argument(change, message):
    q = jnp.zeros((2, 4, 1, 8))
    cache = decode.KVCache(jnp.zeros((2, 2, 6, 8)), jnp.zeros((2, 2, 6, 8)), jnp.asarray([3, 6], jnp.int32))
    with pytest.raises(ValueError, match=message):
        decode.decode_reference(*change(q, cache))
