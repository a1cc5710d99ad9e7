"""The Pallas decode kernels (issue 17) by FlashAttention's rule against the float64 decode oracle: contiguous and
paged caches, f32 and bf16, lengths that are not multiples of the page (or key block) size, empty and full
pages, batch rows of very different lengths (some shorter than ``q_len``: rows that see no key), ``q_len`` 1
and more, GQA groups 1, 2 and 8, several split counts; TPU-semantics interpret mode with race detection; stale
cache contents (NaN) past each length and garbage block-table entries never reach the output; AOT compiles
for v5e and v6e; bad input refused by name; and FlashAttention's KV-cache / split-KV test shapes, cut to CI.

The rule (``tests/peers/rules.py``): ``max|kernel - oracle| <= mult * max|naive same-dtype - oracle| + atol``,
the naive implementation being FlashAttention's ``attention_ref(upcast=False, reorder_ops=True)`` run per
sequence on its ``lengths[b]`` keys (bottom-right causal; an empty sequence gives zeros, as the contract says).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from peers import rules

from flashlib import decode
from flashlib.kernels import decode_attention, tpu_decode
from flashlib.kernels.decoding import default_block_k, default_num_splits, default_pages_per_step
from flashlib.tpu_compile import compile_for_tpu

BF16, F32 = jnp.bfloat16, jnp.float32


def _contiguous(rng, batch, kv_heads, max_len, d, dtype, lengths):
    k = jnp.asarray(rng.normal(size=(batch, kv_heads, max_len, d)), dtype)
    v = jnp.asarray(rng.normal(size=(batch, kv_heads, max_len, d)), dtype)
    return decode.KVCache(k, v, jnp.asarray(lengths, jnp.int32))


def _paged(rng, batch, kv_heads, page_size, pages_per_seq, d, dtype, lengths, spare_pages=3):
    num_pages = batch * pages_per_seq + spare_pages
    table = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    k = jnp.asarray(rng.normal(size=(num_pages, kv_heads, page_size, d)), dtype)
    v = jnp.asarray(rng.normal(size=(num_pages, kv_heads, page_size, d)), dtype)
    return decode.PagedKVCache(k, v, jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32))


def _naive_error(q, cache, oracle) -> float:
    """FlashAttention's naive same-dtype reference, one sequence at a time, against the oracle."""
    flat = decode.contiguous(cache)
    worst = 0.0
    for b, length in enumerate(np.asarray(flat.lengths).tolist()):
        if length == 0:
            continue  # no key at all: zeros by the contract, exactly what the oracle holds
        out = rules.naive_same_dtype(q[b:b + 1], flat.k[b:b + 1, :, :length], flat.v[b:b + 1, :, :length], causal=True)
        worst = max(worst, float(np.max(np.abs(np.asarray(out, np.float64)[0] - oracle[b]))))
    return worst


def _check_rule(got, q, cache, rule: rules.Rule):
    oracle = decode.decode_oracle(q, cache)
    assert got.shape == oracle.shape and got.dtype == q.dtype
    error = float(np.max(np.abs(np.asarray(got, np.float64) - oracle)))
    naive = _naive_error(q, cache, oracle)
    bound = rule.bound("out", naive)
    assert error <= bound, f"kernel error {error:.3g} > bound {bound:.3g} (naive same-dtype error {naive:.3g})"


RULE = rules.Rule(mult_out=2.0, atol_out=1e-5)

CONTIGUOUS_CASES = [  # (batch, kv_heads, group, q_len, max_len, head_dim, dtype, lengths, block_k, num_splits)
    (3, 1, 1, 1, 384, 64, F32, [384, 1, 129], 128, 1),  # MHA, q_len 1: a full cache, one key, one past a block
    (3, 2, 8, 4, 256, 64, BF16, [255, 3, 0], 128, 2),  # GQA 8:1, a row shorter than q_len, an empty row
    (2, 2, 2, 16, 300, 32, F32, [300, 17], 128, 3),  # max_len padded to blocks, a split past the length
    (2, 1, 8, 2, 512, 128, BF16, [512, 130], 128, 4),  # bf16 head_dim 128, four splits
]


@pytest.mark.parametrize("batch, kv_heads, group, q_len, max_len, d, dtype, lengths, block_k, num_splits",
                         CONTIGUOUS_CASES)
def test_contiguous_cache_by_flashattentions_rule(batch, kv_heads, group, q_len, max_len, d, dtype, lengths, block_k,
                                                  num_splits):
    rng = np.random.default_rng(max_len + q_len)
    cache = _contiguous(rng, batch, kv_heads, max_len, d, dtype, lengths)
    q = jnp.asarray(rng.normal(size=(batch, kv_heads * group, q_len, d)), dtype)
    got = decode_attention(q, cache, block_k=block_k, num_splits=num_splits, interpret=True)
    _check_rule(got, q, cache, RULE)


def test_a_value_head_dim_of_its_own():
    rng = np.random.default_rng(7)
    k = jnp.asarray(rng.normal(size=(2, 2, 256, 64)), BF16)
    v = jnp.asarray(rng.normal(size=(2, 2, 256, 128)), BF16)
    cache = decode.KVCache(k, v, jnp.asarray([200, 7], jnp.int32))
    q = jnp.asarray(rng.normal(size=(2, 4, 2, 64)), BF16)
    got = decode_attention(q, cache, block_k=128, num_splits=2, interpret=True)
    assert got.shape == (2, 4, 2, 128)
    _check_rule(got, q, cache, RULE)


# (batch, kv_heads, group, q_len, page_size, pages_per_seq, d, dtype, lengths, num_splits, pages_per_step)
PAGED_CASES = [
    (3, 2, 2, 1, 16, 5, 64, F32, [80, 17, 0], 2, 2),  # full pages; one key into a page; an empty sequence
    (3, 1, 8, 3, 8, 6, 64, BF16, [5, 48, 33], 3, 1),  # a row shorter than a page; all pages full; GQA 8:1, bf16
    (2, 2, 1, 5, 16, 4, 32, F32, [3, 64], 1, None),  # length < q_len (blind rows); the default: all 4 pages a step
    (2, 1, 2, 1, 16, 4, 32, BF16, [40, 63], 4, 1),  # one page per split
    (2, 1, 4, 2, 16, 7, 32, F32, [100, 33], 2, 3),  # 3 pages a step over 7: the last step has 2 slots past the table
    (2, 1, 8, 3, 128, 5, 32, BF16, [300, 129], 2, 2),  # 128-key pages, two a step: one update for both
]


@pytest.mark.parametrize("batch, kv_heads, group, q_len, page_size, pages_per_seq, d, dtype, lengths, num_splits, "
                         "pages_per_step", PAGED_CASES)
def test_paged_cache_by_flashattentions_rule(batch, kv_heads, group, q_len, page_size, pages_per_seq, d, dtype,
                                             lengths, num_splits, pages_per_step):
    rng = np.random.default_rng(page_size * pages_per_seq + q_len)
    cache = _paged(rng, batch, kv_heads, page_size, pages_per_seq, d, dtype, lengths)
    q = jnp.asarray(rng.normal(size=(batch, kv_heads * group, q_len, d)), dtype)
    got = decode_attention(q, cache, num_splits=num_splits, pages_per_step=pages_per_step, interpret=True)
    _check_rule(got, q, cache, RULE)


def test_every_impl_of_the_entry_point_agrees():
    """The kernel (default splits and block), the pure-JAX split-KV and the reference, on one paged cache."""
    rng = np.random.default_rng(3)
    cache = _paged(rng, 2, 2, 16, 4, 32, F32, [37, 64])
    q = jnp.asarray(rng.normal(size=(2, 4, 2, 32)), F32)
    want = decode.decode_oracle(q, cache)
    for impl, options in (("pallas", {}), ("split_kv", {"num_splits": 3}), ("reference", {})):
        got = decode_attention(q, cache, impl=impl, interpret=True, **options)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-6, err_msg=impl)
    # under jit, as a serving loop runs it: lengths and the table traced, read by the kernel from SMEM
    jitted = jax.jit(lambda q, cache: decode_attention(q, cache, num_splits=2, pages_per_step=2, interpret=True))
    np.testing.assert_allclose(np.asarray(jitted(q, cache), np.float64), want, atol=2e-6)


@pytest.mark.parametrize("page_size", [16, 128])  # pages updated one by one, and two 128-key pages together
def test_stale_cache_and_bad_table_entries_past_the_length_never_reach_the_output(page_size):
    """Keys and values past each length are NaN (the live last block's tail and the whole pages after it), and
    the block table past a sequence's last page names pages that do not exist: the index maps clamp to the
    last live page (no wild copy) and the body neither computes a dead page nor lets a NaN value in."""
    rng = np.random.default_rng(4)
    batch, pages_per_seq, lengths = 2, 4, [page_size + 4, 0]
    cache = _paged(rng, batch, 1, page_size, pages_per_seq, 32, F32, lengths, spare_pages=0)
    table = np.asarray(cache.block_table)
    bad_table = table.copy()
    clean_k, clean_v = np.asarray(cache.k_pages), np.asarray(cache.v_pages)
    k, v = clean_k.copy(), clean_v.copy()
    for b, length in enumerate(lengths):
        for p in range(pages_per_seq):
            stale = slice(max(length - p * page_size, 0), page_size)  # this page's positions >= length
            k[table[b, p], :, stale], v[table[b, p], :, stale] = np.nan, np.nan
        live_pages = -(-length // page_size)
        bad_table[b, live_pages:] = [-7, 10**6, 99, -1][: pages_per_seq - live_pages]
    poisoned = decode.PagedKVCache(jnp.asarray(k), jnp.asarray(v), jnp.asarray(bad_table), cache.lengths)
    q = jnp.asarray(rng.normal(size=(batch, 2, 3, 32)), F32)
    got = np.asarray(decode_attention(q, poisoned, num_splits=2, pages_per_step=2, interpret=pltpu.InterpretParams()))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, decode.decode_oracle(q, cache), atol=2e-6)


@pytest.mark.parametrize("paged", [False, True])
def test_tpu_semantics_interpret_mode_with_race_detection(paged):
    """NaN-filled scratch, out-of-bounds and race checks (``pltpu.InterpretParams``) on a multi-split call."""
    pltpu.reset_tpu_interpret_mode_state()
    rng = np.random.default_rng(5)
    if paged:
        cache = _paged(rng, 2, 2, 16, 4, 32, BF16, [50, 7])
    else:
        cache = _contiguous(rng, 2, 2, 384, 32, BF16, [300, 2])
    q = jnp.asarray(rng.normal(size=(2, 4, 3, 32)), BF16)
    options = {"pages_per_step": 2} if paged else {"block_k": 128}
    got = decode_attention(q, cache, num_splits=2, interpret=pltpu.InterpretParams(detect_races=True), **options)
    _check_rule(got, q, cache, RULE)


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_each_slot_stops_at_its_own_last_live_block(slots):
    """The index a slot copies, step after step: its blocks while they are live, then its last live block again
    (the same index as the step before: no copy), never a block past the last live one — traced as the index
    maps run it (lengths from SMEM) and with a Python ``last`` (static_length) alike."""
    for last in range(7):
        for slot in range(slots):
            indices = [int(tpu_decode._slot_block(step * slots + slot, jnp.int32(last), slot, slots))
                       for step in range(9)]
            assert indices == [int(tpu_decode._slot_block(step * slots + slot, last, slot, slots)) for step in range(9)]
            live = [step * slots + slot for step in range(9) if step * slots + slot <= last]
            assert indices[:len(live)] == live and max(indices) <= last
            copies = sum(a != b for a, b in zip(indices, indices[1:], strict=False))
            assert copies == max(len(live) - 1, 0), (last, slot, indices)  # one copy per live block, none after


def test_defaults_follow_the_shapes():
    assert default_block_k(65536) == 2048 and default_block_k(640) == 640 and default_block_k(300) == 384
    assert default_block_k(1920) == 1920 and default_block_k(2176) == 128  # 17 x 128: only 128 divides it
    assert default_num_splits(1, 1, 32, cores=2) == 2  # one sequence, one kv head: a split per megacore core
    assert default_num_splits(8, 4, 32, cores=2) == 1  # the batch already fills the cores
    assert default_num_splits(1, 1, 1, cores=2) == 1  # a short cache: one split
    assert default_num_splits(1, 1, 32) == 1  # off a TPU: one core
    assert default_pages_per_step(128, 64) == 16 and default_pages_per_step(512, 64) == 4
    assert default_pages_per_step(16, 5) == 5 and default_pages_per_step(4096, 8) == 1


@pytest.mark.parametrize("change, message", [
    (dict(impl="flash"), r"impl must be one of 'pallas', 'split_kv', 'reference'"),
    (dict(block_k=100), r"block_k must be a positive multiple of 128"),
    (dict(num_splits=0), r"num_splits must be an int from 1 to 3 \(at most one per grid step: the cache has 3 key"),
    (dict(num_splits=4), r"num_splits must be an int from 1 to 3"),
    (dict(paged=True, block_k=128), r"block_k must be None for a paged cache"),
    (dict(paged=True, num_splits=2), r"num_splits must be an int from 1 to 1 \(.*1 grid steps of 4 page"),
    (dict(paged=True, pages_per_step=1, num_splits=5), r"num_splits must be an int from 1 to 4"),
    (dict(paged=True, pages_per_step=5), r"pages_per_step must be an int from 1 to 4"),
    (dict(pages_per_step=2), r"pages_per_step is for a paged cache"),
    (dict(dtype=jnp.float16), r"q must be float32 or bfloat16"),
    (dict(cache_dtype=BF16), r"the cache's k and v must have q's dtype float32"),
    (dict(lengths=[3.0, 1.0]), r"lengths must be \[batch\] = \(2,\) ints"),
    (dict(lengths=[3, 385]), r"lengths must be from 0 to the cache's capacity 384, got \[3, 385\]"),
    (dict(paged=True, lengths=[-1, 9]), r"lengths must be from 0 to the cache's capacity 64"),
    (dict(paged=True, table_entry=11), r"block_table\[1\] names pages \[.*11\] for its 9 keys, but the pool has pages "
                                       r"0 to 10"),
])
def test_bad_input_names_the_argument(change, message):
    rng = np.random.default_rng(6)
    dtype = change.pop("dtype", F32)
    cache_dtype = change.pop("cache_dtype", dtype)
    if change.pop("paged", False):
        cache, options = _paged(rng, 2, 1, 16, 4, 32, cache_dtype, [3, 9]), change
    else:
        cache, options = _contiguous(rng, 2, 1, 384, 32, cache_dtype, [3, 9]), {"block_k": 128, **change}
    if "lengths" in options:
        cache = cache._replace(lengths=jnp.asarray(options.pop("lengths")))
    if "table_entry" in options:  # sequence 1's first page: live (9 keys)
        cache = cache._replace(block_table=cache.block_table.at[1, 0].set(options.pop("table_entry")))
    q = jnp.zeros((2, 2, 1, 32), dtype)
    with pytest.raises(ValueError, match=message):
        decode_attention(q, cache, interpret=True, **options)


# FlashAttention's tests/test_flash_attn.py::test_flash_attn_kvcache (cache_seqlens drawn per sequence, paged_kv_block
# None or 256, seqlen_q 1 .. 128, mqa/gqa with 6 query heads) and ::test_flash_attn_splitkv (num_splits > 1 over
# seqlen_k 339 .. 2048), forward only. Cut for CI: seqlen_q 1 and 3, seqlen_k 339 and 799 (cache 128 keys larger,
# lengths drawn below it), page 256 -> 16 x 64 keys, head_dim 64, batch 2. Rules: kvcache out 3x + 1e-5, splitkv
# out 2x + 1e-5.
PEER_CASES = [  # (q_len, kv_len, kv_heads, paged, dtype, num_splits, mult)
    (1, 339, 1, False, BF16, 3, 2.0),  # splitkv
    (3, 799, 3, True, BF16, 2, 3.0),  # kvcache, paged, gqa
    (1, 339, 3, True, F32, 1, 3.0),  # kvcache, mqa-free gqa 2:1, f32
]


@pytest.mark.parametrize("q_len, kv_len, kv_heads, paged, dtype, num_splits, mult", PEER_CASES)
def test_flashattention_kvcache_and_splitkv_cases(q_len, kv_len, kv_heads, paged, dtype, num_splits, mult):
    rng = np.random.default_rng(kv_len)
    lengths = [kv_len, int(rng.integers(q_len, kv_len))]  # FA: cache_seqlens = randint(0, seqlen_cache - seqlen_new)
    if paged:
        pages = -(-(kv_len + 128) // 64)
        cache = _paged(rng, 2, kv_heads, 64, pages, 64, dtype, lengths)
        options = {"pages_per_step": 4}
    else:
        cache = _contiguous(rng, 2, kv_heads, kv_len + 128, 64, dtype, lengths)
        options = {"block_k": 128}
    q = jnp.asarray(rng.normal(size=(2, 6, q_len, 64)), dtype)
    got = decode_attention(q, cache, num_splits=num_splits, interpret=True, **options)
    _check_rule(got, q, cache, rules.Rule(mult_out=mult, atol_out=1e-5))


@pytest.mark.tpu
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
@pytest.mark.parametrize("page_size", [None, 64, 128])
def test_decode_kernels_compile_for_tpu(topology, page_size):
    """bf16, GQA 4:1, three new tokens (the masked block and its row pattern), two splits (partials and merge);
    the paged cache four pages a step: pages of 64 keys one update each, of 128 keys one update together."""
    s = jax.ShapeDtypeStruct
    if page_size:
        def fn(q, k, v, table, lengths):
            return decode_attention(q, decode.PagedKVCache(k, v, table, lengths), num_splits=2, pages_per_step=4,
                                    interpret=False)
        pool = s((40, 2, page_size, 128), BF16)
        args = (s((2, 8, 3, 128), BF16), pool, pool, s((2, 16), jnp.int32), s((2,), jnp.int32))
    else:
        def fn(q, k, v, lengths):
            return decode_attention(q, decode.KVCache(k, v, lengths), num_splits=2, block_k=512, interpret=False)
        args = (s((2, 8, 3, 128), BF16), s((2, 2, 2048, 128), BF16), s((2, 2, 2048, 128), BF16), s((2,), jnp.int32))
    check = compile_for_tpu(fn, *args, topology=topology)
    assert check.ok, check.compiler_message
