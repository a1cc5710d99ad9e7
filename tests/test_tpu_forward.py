"""The Pallas TPU forward kernel: numerics in interpret mode, TPU semantics, lowering and AOT compiles."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_no_races, make_qkv, tpu_race_state
from jax.experimental.pallas import tpu as pltpu

import flashlib
from flashlib import cost, geometry
from flashlib.checks import check_attention
from flashlib.kernels import BlockSizes, flash_attention_forward
from flashlib.kernels.options import resolve_block_sizes
from flashlib.reference import logsumexp_oracle
from flashlib.tpu_compile import compile_for_tpu, lower_for_tpu

F32, BF16 = jnp.float32, jnp.bfloat16


def pallas(q, k, v, **kwargs):
    return flashlib.attention(q, k, v, impl="pallas", **kwargs)


# ---------------------------------------------------------------------------------------------------
# Numerics (interpret mode on this CPU)
# ---------------------------------------------------------------------------------------------------

CASES = [  # q_len, kv_len, head_dim, dtype, causal, block sizes
    (1, 1, 32, F32, False, None),  # one token: one padded block each way
    (37, 37, 64, F32, True, None),  # odd length, default blocks clamped to the sequence
    (300, 300, 128, BF16, True, BlockSizes(64, 128)),  # several blocks: skipped, straddling, padded
    (37, 300, 64, F32, True, BlockSizes(16, 128)),  # q_len < kv_len: the diagonal is shifted right
    (300, 37, 32, BF16, True, BlockSizes(32, 128)),  # q_len > kv_len: the first 263 rows see nothing
    (256, 384, 256, F32, False, BlockSizes(128, 128)),  # aligned, no mask at all
    (200, 130, 128, F32, False, BlockSizes(8, 128)),  # the smallest f32 query block; padded keys
    (130, 520, 64, BF16, False, BlockSizes(128, 256)),  # padded q and k
    # block_k_major: several key sub-blocks per grid step, each skipped, masked or plain on its own
    (300, 300, 128, BF16, True, BlockSizes(64, 128, block_k_major=256)),  # last sub-block is all padding
    (37, 600, 64, F32, True, BlockSizes(16, 128, block_k_major=384)),  # shifted diagonal inside a copy
    (300, 200, 32, BF16, True, BlockSizes(32, 128, block_k_major=256)),  # rows that see nothing, padded keys
    (130, 520, 64, BF16, False, BlockSizes(128, 128, block_k_major=512)),  # three sub-blocks of padding skipped
    # causal query blocks taller than block_k: diagonal sub-blocks split into square row chunks
    (300, 300, 64, BF16, True, BlockSizes(256, 128, block_k_major=256)),
    (520, 400, 32, F32, True, BlockSizes(256, 128, block_k_major=384)),  # rows that see nothing
    (250, 700, 32, F32, True, BlockSizes(256, 128, block_k_major=512)),  # diagonal shifted right
]


@pytest.mark.parametrize("q_len, kv_len, head_dim, dtype, causal, sizes", CASES)
def test_matches_oracle(q_len, kv_len, head_dim, dtype, causal, sizes):
    q, k, v = make_qkv(q_len=q_len, kv_len=kv_len, head_dim=head_dim, dtype=dtype)
    out = pallas(q, k, v, causal=causal, block_sizes=sizes)
    check_attention(out, q, k, v, causal=causal, quiet=True)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_head_dims(head_dim):
    q, k, v = make_qkv(q_len=40, kv_len=136, head_dim=head_dim, dtype=BF16)
    check_attention(pallas(q, k, v, causal=True), q, k, v, causal=True, quiet=True)


def test_custom_scale_and_batch():
    q, k, v = make_qkv(batch=2, heads=3, q_len=48, head_dim=32)
    out = pallas(q, k, v, scale=0.3, block_sizes=BlockSizes(16, 128))
    check_attention(out, q, k, v, scale=0.3, quiet=True)


def test_lse_and_rows_that_see_no_key():
    """q_len > kv_len, causal: rows 0..q_len-kv_len-1 see no key -> out 0 (not NaN), lse -inf."""
    q_len, kv_len = 300, 37
    q, k, v = make_qkv(q_len=q_len, kv_len=kv_len, head_dim=32)
    out, lse = flash_attention_forward(q, k, v, causal=True, block_sizes=BlockSizes(64, 128), return_lse=True)
    assert lse.shape == (1, 2, q_len) and lse.dtype == jnp.float32
    blind = q_len - kv_len
    assert np.all(np.asarray(out)[:, :, :blind] == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, :blind]))
    expected = logsumexp_oracle(q, k, causal=True)
    np.testing.assert_allclose(np.asarray(lse)[:, :, blind:], expected[:, :, blind:], rtol=1e-5, atol=1e-5)


def test_lse_with_sub_blocks_matches_one_block_per_step():
    """block_k_major walks the same key blocks as block_k alone: the same out and lse (rows that see no key too)."""
    q, k, v = make_qkv(q_len=300, kv_len=200, head_dim=32)
    one = flash_attention_forward(q, k, v, causal=True, block_sizes=BlockSizes(64, 128), return_lse=True)
    major = flash_attention_forward(q, k, v, causal=True, block_sizes=BlockSizes(64, 128, block_k_major=256),
                                    return_lse=True)
    for a, b in zip(one, major, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_matches_blockwise_lse():
    q, k, v = make_qkv(q_len=100, kv_len=260, head_dim=64)
    _, lse = flash_attention_forward(q, k, v, causal=True, block_sizes=BlockSizes(32, 128), return_lse=True)
    _, lse_blockwise = flashlib.blockwise.blockwise_attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_blockwise), rtol=1e-5, atol=1e-5)


def test_matches_jax_flash_attention():
    """Same numbers as JAX's own TPU kernel, both run in TPU interpret mode (top-left == bottom-right
    causal alignment when q_len == kv_len; JAX's kernel needs lengths divisible by its blocks)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as jax_fa

    q, k, v = make_qkv(q_len=256, head_dim=128)
    jax_sizes = jax_fa.BlockSizes(block_q=128, block_k_major=128, block_k=128, block_b=1)
    with pltpu.force_tpu_interpret_mode():
        expected = jax_fa.flash_attention(q, k, v, causal=True, sm_scale=0.125, block_sizes=jax_sizes)
    out = pallas(q, k, v, causal=True, scale=0.125, block_sizes=BlockSizes(128, 128))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_tpu_interpret_mode_detects_no_races(causal):
    """TPU-semantics emulation: DMAs, VMEM and semaphores simulated (and parallel grid axes may run out
    of order, as they may across a chip's cores)."""
    pltpu.reset_tpu_interpret_mode_state()
    q, k, v = make_qkv(q_len=136, kv_len=256, head_dim=32)
    params = pltpu.InterpretParams(detect_races=True)
    out = pallas(q, k, v, causal=causal, block_sizes=BlockSizes(64, 128), interpret=params)
    check_attention(out, q, k, v, causal=causal, quiet=True)
    assert_no_races()


def test_causal_skips_copies_of_blocks_above_the_diagonal():
    """The clamped k/v index maps: a causal run copies far fewer k blocks than a full one (counted from
    TPU interpret mode's HBM read log; it may walk parallel grid axes out of order, so bound, don't equate)."""
    q, k, v = make_qkv(heads=1, q_len=512, head_dim=32)
    reads, params = {}, pltpu.InterpretParams(detect_races=True)
    for causal in (False, True):
        pltpu.reset_tpu_interpret_mode_state()
        pallas(q, k, v, causal=causal, block_sizes=BlockSizes(64, 128), interpret=params)
        races = tpu_race_state()
        if races is None or not hasattr(races, "reads"):
            pytest.skip("this jax's race detector does not log reads")
        # keys are (memory space, buffer, device, core); inputs live in "hbm" ("any" in jax 0.7)
        reads[causal] = [len(log) for (space, *_), log in races.reads.items() if space in ("hbm", "any")]
    num_q_blocks, num_kv_blocks = 512 // 64, 512 // 128
    assert max(reads[False]) == num_q_blocks * num_kv_blocks  # k (and v): a new block every grid step
    in_order = cost.kv_block_fetches(512, 512, 64, 128, causal=True)  # 19 of 32, were the grid walked in order
    assert max(reads[True]) <= in_order + num_q_blocks  # reordering q blocks costs at most one copy each


# ---------------------------------------------------------------------------------------------------
# Block geometry and cost accounting
# ---------------------------------------------------------------------------------------------------


GEOMETRIES = [(37, 300, 16, 128), (300, 37, 32, 128), (512, 512, 64, 128), (1000, 700, 128, 256), (5, 1024, 8, 512)]


@pytest.mark.parametrize("q_len, kv_len, block_q, block_k", GEOMETRIES)
def test_block_geometry_matches_the_element_mask(q_len, kv_len, block_q, block_k):
    """Block skipping and mask building agree with the element-wise rule of reference.causal_visible."""
    q_pad, kv_pad = -(-q_len // block_q) * block_q, -(-kv_len // block_k) * block_k
    rows, cols = np.arange(q_pad)[:, None], np.arange(kv_pad)[None, :]
    seen = (cols < kv_len) & flashlib.reference.causal_visible(rows, cols, q_len=q_len, kv_len=kv_len)
    real_rows = rows < q_len
    block_geometry = dict(block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=True)
    for i in range(q_pad // block_q):
        for j in range(kv_pad // block_k):
            tile = seen[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k]
            real = real_rows[i * block_q:(i + 1) * block_q]
            assert bool(geometry.block_is_visible(i, j, **block_geometry)) == bool((tile & real).any()), (i, j)
            if tile.any():
                assert bool(geometry.block_needs_mask(i, j, **block_geometry)) == (not tile.all()), (i, j)


def test_ideal_counts():
    b, h, n, d = 2, 3, 64, 32
    assert cost.attention_flops(b, h, n, n, d, False) == 4 * b * h * n * n * d
    assert cost.attention_flops(b, h, n, n, d, True) == 4 * b * h * d * n * (n + 1) // 2
    assert cost.attention_transcendentals(b, h, n, 2 * n, d, False) == b * h * 2 * n * n
    assert cost.attention_bytes(b, h, n, n, d, False, "bfloat16") == b * h * 4 * n * d * 2


@pytest.mark.parametrize("q_len, kv_len, block_q, block_k", [(1024, 1024, 512, 128), (300, 700, 256, 128),
                                                           (700, 300, 512, 256), (1024, 1024, 128, 256)])
def test_forward_tiles_are_the_row_chunks_the_kernel_runs(q_len, kv_len, block_q, block_k):
    """Counted element by element: a sub-block runs whole unless it needs a mask and is split into row chunks,
    and then only the chunks whose rows see one of its keys run."""
    rows = np.arange(-(-q_len // block_q) * block_q)  # padded query rows: they count as the kernel counts them
    whole = chunks = 0
    split = block_q > block_k and block_q % block_k == 0
    for kv_block in range(-(-kv_len // block_k)):
        keys = np.arange(kv_block * block_k, (kv_block + 1) * block_k)
        seen = keys[None, :] <= rows[:, None] + kv_len - q_len  # [rows, keys]
        for q_block in range(len(rows) // block_q):
            tile = seen[q_block * block_q:(q_block + 1) * block_q]
            if not tile.any():
                continue
            needs_mask = not tile.all() or keys[-1] >= kv_len
            if split and needs_mask:
                chunks += sum(tile[c:c + block_k].any() for c in range(0, block_q, block_k))
            else:
                whole += 1
    assert geometry.forward_tiles(q_len, kv_len, block_q, block_k, causal=True) == (whole, chunks)
    sizes = BlockSizes(block_q, block_k)
    assert cost.attention_flops(1, 1, q_len, kv_len, 64, True, sizes) == (
        (whole * block_q * block_k + chunks * block_k * block_k) * 2 * 2 * 64)


def test_causal_counts_only_visited_blocks():
    sizes = BlockSizes(128, 128)
    full = cost.attention_flops(1, 1, 1024, 1024, 128, False, sizes)
    causal = cost.attention_flops(1, 1, 1024, 1024, 128, True, sizes)
    assert causal * 64 == full * 36  # 8 x 8 blocks, 36 on or below the diagonal
    # query block i walks key blocks 0..i: i changes, plus a copy of block 0 when the previous one ended elsewhere
    assert cost.kv_block_fetches(1024, 1024, 128, 128, True) == 1 + sum(range(8)) + 6
    # copies of 512 keys walked in 128-key sub-blocks: the same work, copies of the larger block
    major = BlockSizes(128, 128, block_k_major=512)
    assert cost.attention_flops(1, 1, 1024, 1024, 128, True, major) == causal
    fetches = cost.kv_block_fetches(1024, 1024, 128, 512, True)  # q blocks 0-3 hold block 0; 4-7 walk 0, 1
    assert fetches == 1 + 4 + 3 and cost.attention_bytes(1, 1, 1024, 1024, 128, True, "bfloat16", major) == (
        (2 * 1024 + 2 * fetches * 512) * 128 * 2)


# ---------------------------------------------------------------------------------------------------
# The compiled path: lowering to Mosaic and AOT compiles for real TPU targets, from this CPU machine
# ---------------------------------------------------------------------------------------------------

SHAPES = [  # batch, heads, q_len, kv_len, head_dim, dtype, causal: the default block sizes for each
    (1, 2, 1, 1, 32, F32, False),
    (1, 2, 37, 300, 64, F32, True),
    (1, 2, 300, 37, 64, BF16, True),
    (2, 8, 1024, 1024, 128, BF16, True),
    (1, 4, 4096, 4096, 128, BF16, False),
    (1, 2, 512, 512, 256, F32, True),
]
NOTEBOOK_CONFIGS = [  # what the notebooks show: bf16, 2k tokens, 8 heads of 128, a block-size ladder
    (1, 8, 2048, 2048, 128, BF16, True, BlockSizes(128, 128)),
    (1, 8, 2048, 2048, 128, BF16, True, BlockSizes(256, 512)),
    (1, 8, 2048, 2048, 128, BF16, False, BlockSizes(512, 512)),
]
MAJOR_CONFIGS = [  # a 2048-key copy per grid step, walked in 512-key sub-blocks
    (1, 8, 2048, 2048, 128, BF16, False, BlockSizes(1024, 512, block_k_major=2048)),
    (1, 8, 4096, 4096, 128, BF16, True, BlockSizes(1024, 512, block_k_major=2048)),
]
TOPOLOGIES = ["v5e:1x1", "v6e:1x1"]


def _config_id(config) -> str:
    *sizes, dtype, causal, blocks = config
    blocks = "default" if blocks is None else f"{blocks.block_q}x{blocks.block_k}"
    if blocks != "default" and config[-1].block_k_major:
        blocks += f"-major{config[-1].block_k_major}"
    return "x".join(map(str, sizes)) + f"-{jnp.dtype(dtype).name}-{'causal' if causal else 'full'}-{blocks}"


def _compiled_fn(causal, sizes):
    return jax.jit(lambda q, k, v: pallas(q, k, v, causal=causal, block_sizes=sizes, interpret=False))


def _structs(batch, heads, q_len, kv_len, head_dim, dtype):
    q = jax.ShapeDtypeStruct((batch, heads, q_len, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, heads, kv_len, head_dim), dtype)
    return q, kv, kv


@pytest.mark.parametrize("config", [(*shape, None) for shape in SHAPES] + NOTEBOOK_CONFIGS + MAJOR_CONFIGS,
                         ids=_config_id)
def test_lowers_for_tpu(config):
    *shape, causal, sizes = config
    check = lower_for_tpu(_compiled_fn(causal, sizes), *_structs(*shape))
    assert check.ok, check.compiler_message


@pytest.mark.tpu
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("config", [(*shape, None) for shape in SHAPES] + NOTEBOOK_CONFIGS + MAJOR_CONFIGS,
                         ids=_config_id)
def test_compiles_for_tpu(config, topology):
    *shape, causal, sizes = config
    generation = topology.split(":")[0]
    if sizes is None:  # the defaults for that chip
        sizes = BlockSizes.default(shape[2], shape[3], shape[4], shape[5], generation=generation)
    check = compile_for_tpu(_compiled_fn(causal, sizes), *_structs(*shape), topology=topology)
    assert check.ok, check.compiler_message


@pytest.mark.tpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("major", [None, 1024])
def test_cost_estimate_reaches_the_compiler(causal, major):
    """XLA reports the kernel's pl.CostEstimate, which flashlib.cost computes (aligned shapes: no pad ops)."""
    batch, heads, n, head_dim, sizes = 1, 4, 1024, 128, BlockSizes(256, 512, block_k_major=major)
    check = compile_for_tpu(_compiled_fn(causal, sizes), *_structs(batch, heads, n, n, head_dim, BF16))
    assert check.ok, check.compiler_message
    dims = (batch, heads, n, n, head_dim, causal)
    assert check.flops == cost.attention_flops(*dims, block_sizes=sizes)
    # causal compacts (flashlib.geometry.live_schedule): XLA may add a copy of a constant schedule table (<= KiBs)
    slack = 16 * 1024 if causal and major is None else 0
    assert 0 <= check.bytes_accessed - cost.attention_bytes(*dims, BF16, block_sizes=sizes) <= slack
    if causal:  # 4 x 2 blocks, 6 visited: 5/8 of the dense work (the ideal causal count is ~1/2)
        assert check.flops == cost.attention_flops(batch, heads, n, n, head_dim, False) * 6 // 8


# ---------------------------------------------------------------------------------------------------
# Options and registration
# ---------------------------------------------------------------------------------------------------


def test_registered():
    impl = flashlib.get_implementation("pallas")
    assert impl.options == ("block_sizes", "interpret") and impl.native_on == ("tpu",)
    assert "pallas" in flashlib.implementations()


def test_rejects_block_sizes_of_the_wrong_type():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="block_sizes must be a flashlib.kernels.BlockSizes"):
        pallas(q, k, v, block_sizes=(128, 128))


def test_rejects_bad_interpret():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="interpret must be None"):
        pallas(q, k, v, interpret="yes")


def test_rejects_bf16_query_block_of_8():
    q, k, v = make_qkv(dtype=BF16)
    with pytest.raises(ValueError, match="block_q must be a multiple of 16"):
        pallas(q, k, v, block_sizes=BlockSizes(8, 128))


def test_rejects_blocks_that_overflow_vmem():
    q, k, v = make_qkv(q_len=4096, head_dim=256)
    with pytest.raises(ValueError, match="MiB of VMEM"):
        pallas(q, k, v, block_sizes=BlockSizes(4096, 4096))


def test_direct_call_validates_too():
    q, k, v = make_qkv(dtype=BF16)
    with pytest.raises(ValueError, match="block_q must be a multiple of 16"):
        flash_attention_forward(q, k, v, block_sizes=BlockSizes(24, 128))


def test_resolve_clamps_to_short_sequences():
    shape = flashlib.validate_inputs(*make_qkv(q_len=37, kv_len=300, dtype=BF16))
    assert resolve_block_sizes(shape, BlockSizes(512, 512)) == BlockSizes(48, 384)
    assert resolve_block_sizes(shape, None).block_q == 48


def test_jit_of_attention_lowers_with_interpret_false():
    fn = functools.partial(pallas, interpret=False)
    assert lower_for_tpu(jax.jit(fn), *make_qkv(q_len=128)).ok
