"""Decoding with the variants of issue 16 that decoding models use (issue 17): a logit soft-cap and a sliding
window, in the decode contract (:mod:`flashlib.decode`) and the Pallas decode kernels.

* the decode oracle with a window and a soft-cap is the float64 attention oracle run per sequence on its
  ``lengths[b]`` keys (bottom-right causal, ``window=(left, 0)``) — two independent writings of one rule;
* the kernels (contiguous and paged, several splits, several pages a step) against the decode oracle, f32
  tight and bf16 by FlashAttention's rule;
* keys before the window are never read: NaN there (whole blocks and the masked block's head) stays out of
  the output, and the index maps clamp a slot's dead steps before the window to one index (no copies);
* the kernels compile for v5e with both variants.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from peers import rules

from flashlib import decode, reference
from flashlib.kernels import decode_attention, tpu_decode
from flashlib.tpu_compile import compile_for_tpu

BF16, F32 = jnp.bfloat16, jnp.float32


def _cache(rng, batch, kv_heads, max_len, d, dtype, lengths, page_size=None):
    k = rng.normal(size=(batch, kv_heads, max_len, d))
    v = rng.normal(size=(batch, kv_heads, max_len, d))
    lengths = jnp.asarray(lengths, jnp.int32)
    if page_size is None:
        return decode.KVCache(jnp.asarray(k, dtype), jnp.asarray(v, dtype), lengths)
    pages_per_seq = max_len // page_size
    table = rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq)
    pool_k = np.zeros((batch * pages_per_seq, kv_heads, page_size, d))
    pool_v = np.zeros_like(pool_k)
    for b in range(batch):
        for p in range(pages_per_seq):
            pool_k[table[b, p]] = k[b, :, p * page_size:(p + 1) * page_size]
            pool_v[table[b, p]] = v[b, :, p * page_size:(p + 1) * page_size]
    return decode.PagedKVCache(jnp.asarray(pool_k, dtype), jnp.asarray(pool_v, dtype), jnp.asarray(table, jnp.int32),
                               lengths)


def test_the_decode_oracle_is_the_attention_oracle_per_sequence():
    rng = np.random.default_rng(0)
    cache = _cache(rng, 3, 2, 40, 8, F32, [40, 5, 17])
    q = rng.normal(size=(3, 4, 3, 8)) * 3
    got = decode.decode_oracle(q, cache, softcap=2.0, window=(6, 4))
    for b, length in enumerate([40, 5, 17]):
        k, v = (np.asarray(x, np.float64)[b:b + 1, :, :length] for x in (cache.k, cache.v))
        want = reference.attention_oracle(q[b:b + 1], k, v, causal=True, window=(6, 4), softcap=2.0)
        np.testing.assert_allclose(got[b:b + 1], want, atol=1e-12)


CASES = [  # (page_size, batch, kv_heads, group, q_len, max_len, lengths, window, softcap, num_splits, step)
    (None, 3, 2, 4, 3, 512, [512, 200, 2], (150, 0), 5.0, 2, 128),  # windows across blocks, a short row
    (None, 2, 1, 8, 1, 384, [384, 129], (0, 0), None, 3, 128),  # a window of one key: the query's own
    (16, 2, 2, 2, 2, 128, [128, 70], (37, 3), 3.0, 2, 2),  # pages of 16, two a step; right side ignored
    (128, 2, 1, 4, 4, 512, [500, 300], (200, 0), 20.0, 1, 2),  # 128-key pages updated together
]


@pytest.mark.parametrize("page_size, batch, kv_heads, group, q_len, max_len, lengths, window, softcap, splits, step",
                         CASES)
def test_decode_kernels_with_window_and_softcap(page_size, batch, kv_heads, group, q_len, max_len, lengths, window,
                                                softcap, splits, step):
    rng = np.random.default_rng(max_len + q_len)
    cache = _cache(rng, batch, kv_heads, max_len, 32, F32, lengths, page_size)
    q = jnp.asarray(rng.normal(size=(batch, kv_heads * group, q_len, 32)) * 2, F32)
    options = {"pages_per_step": step} if page_size else {"block_k": step}
    got = decode_attention(q, cache, num_splits=splits, softcap=softcap, window=window, interpret=True, **options)
    want = decode.decode_oracle(q, cache, softcap=softcap, window=window)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=3e-6)
    split_kv = decode_attention(q, cache, impl="split_kv", num_splits=3, softcap=softcap, window=window)
    np.testing.assert_allclose(np.asarray(split_kv, np.float64), want, atol=3e-6)


def test_bfloat16_by_flashattentions_rule():
    rng = np.random.default_rng(4)
    lengths, window, softcap = [512, 301], (100, 0), 10.0
    cache = _cache(rng, 2, 2, 512, 64, BF16, lengths)
    q = jnp.asarray(rng.normal(size=(2, 8, 2, 64)), BF16)
    got = decode_attention(q, cache, block_k=128, num_splits=2, softcap=softcap, window=window, interpret=True)
    oracle = decode.decode_oracle(q, cache, softcap=softcap, window=window)
    naive = 0.0
    for b, length in enumerate(lengths):
        out = rules.naive_same_dtype(q[b:b + 1], cache.k[b:b + 1, :, :length], cache.v[b:b + 1, :, :length],
                                     causal=True, window=window, softcap=softcap)
        naive = max(naive, float(np.max(np.abs(np.asarray(out, np.float64)[0] - oracle[b]))))
    error = float(np.max(np.abs(np.asarray(got, np.float64) - oracle)))
    assert error <= 2 * naive + 1e-5, (error, naive)


@pytest.mark.parametrize("page_size", [None, 16])
def test_keys_before_the_window_are_never_read(page_size):
    """NaN in every key and value before the first new token's window — whole blocks and the head of the block
    the window starts in: computing on them, or letting 0 * NaN into acc, would poison the output."""
    rng = np.random.default_rng(9)
    q_len, left, lengths = 2, 40, [256, 200]
    cache = _cache(rng, 2, 1, 256, 32, F32, lengths, page_size)
    flat = decode.contiguous(cache)
    k, v = np.asarray(flat.k).copy(), np.asarray(flat.v).copy()
    for b, length in enumerate(lengths):
        k[b, :, :length - q_len - left] = np.nan
        v[b, :, :length - q_len - left] = np.nan
    poisoned = _cache(np.random.default_rng(9), 2, 1, 256, 32, F32, lengths, page_size)
    if page_size is None:
        poisoned = decode.KVCache(jnp.asarray(k), jnp.asarray(v), flat.lengths)
    else:  # the same pages, poisoned through the table
        pool_k, pool_v = np.asarray(poisoned.k_pages).copy(), np.asarray(poisoned.v_pages).copy()
        table = np.asarray(poisoned.block_table)
        for b in range(2):
            for p in range(table.shape[1]):
                pool_k[table[b, p]] = k[b, :, p * page_size:(p + 1) * page_size]
                pool_v[table[b, p]] = v[b, :, p * page_size:(p + 1) * page_size]
        poisoned = decode.PagedKVCache(jnp.asarray(pool_k), jnp.asarray(pool_v), poisoned.block_table, flat.lengths)
    q = jnp.asarray(rng.normal(size=(2, 2, q_len, 32)), F32)
    options = {"pages_per_step": 2} if page_size else {"block_k": 128}
    got = decode_attention(q, poisoned, num_splits=2, window=(left, 0), interpret=True, **options)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got, np.float64), decode.decode_oracle(q, cache, window=(left, 0)),
                               atol=3e-6)


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_slot_before_the_window_repeats_its_first_live_block(slots):
    """With a window, a slot's steps before the first live block fetch its first block from there on (one index:
    no copies), then its live blocks, then its last again — traced and with Python ints alike."""
    for first in range(5):
        for last in range(first, 8):
            for slot in range(slots):
                steps = [step * slots + slot for step in range(10)]
                indices = [int(tpu_decode._slot_block(b, jnp.int32(last), slot, slots, jnp.int32(first)))
                           for b in steps]
                assert indices == [int(tpu_decode._slot_block(b, last, slot, slots, first)) for b in steps]
                live = [b for b in steps if first <= b <= last]
                if live:
                    assert sorted(set(indices)) == live, (first, last, slot, indices)
                    copies = sum(a != b for a, b in zip(indices, indices[1:], strict=False))
                    assert copies == len(live) - 1


def test_bad_variants_name_the_argument():
    rng = np.random.default_rng(1)
    cache = _cache(rng, 1, 1, 128, 8, F32, [100])
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), F32)
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        decode_attention(q, cache, softcap=-1.0, interpret=True)
    with pytest.raises(ValueError, match="window must be a pair"):
        decode_attention(q, cache, window=5, interpret=True)


@pytest.mark.tpu
@pytest.mark.parametrize("page_size", [None, 64])
def test_decode_variants_compile_for_tpu(page_size):
    s = jax.ShapeDtypeStruct
    if page_size:
        def fn(q, k, v, table, lengths):
            return decode_attention(q, decode.PagedKVCache(k, v, table, lengths), num_splits=2, pages_per_step=4,
                                    softcap=30.0, window=(1000, 0), interpret=False)
        pool = s((40, 2, page_size, 128), BF16)
        args = (s((2, 8, 3, 128), BF16), pool, pool, s((2, 16), jnp.int32), s((2,), jnp.int32))
    else:
        def fn(q, k, v, lengths):
            return decode_attention(q, decode.KVCache(k, v, lengths), num_splits=2, block_k=512, softcap=30.0,
                                    window=(1000, 0), interpret=False)
        args = (s((2, 8, 3, 128), BF16), s((2, 2, 2048, 128), BF16), s((2, 2, 2048, 128), BF16), s((2,), jnp.int32))
    check = compile_for_tpu(fn, *args, topology="v5e:1x1")
    assert check.ok, check.compiler_message
