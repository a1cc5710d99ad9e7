"""The entry point and the contract: registry, auto selection, and one test per validation error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_qkv

import flashlib
from flashlib import api


def test_registry_lists_the_stages_with_descriptions():
    impls = flashlib.implementations()
    assert {"reference", "blockwise", "xla"} <= set(impls)
    assert all(isinstance(d, str) and len(d) > 10 for d in impls.values())


def test_auto_picks_a_native_implementation_for_this_backend():
    chosen = api.get_implementation("auto")
    assert flashlib.env.backend() in chosen.native_on
    if flashlib.env.backend() == "cpu":
        assert chosen.name == "xla"
    q, k, v = make_qkv(1, 1, 8, 8, 32)
    np.testing.assert_allclose(flashlib.attention(q, k, v), flashlib.attention(q, k, v, impl=chosen.name))


def test_unknown_implementation_lists_the_valid_ones():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match=r"impl='fast'.*choose one of 'auto', 'reference', 'blockwise'"):
        flashlib.attention(q, k, v, impl="fast")


def test_unknown_option_names_what_is_accepted():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match=r"does not accept option\(s\) block_z; it accepts: block_q, block_k"):
        flashlib.attention(q, k, v, impl="blockwise", block_z=64)
    with pytest.raises(ValueError, match="accepts: none"):
        flashlib.attention(q, k, v, impl="reference", block_q=64)


@pytest.mark.parametrize("bad", [0, -8, 12.5, True, "128"])
def test_bad_block_size_is_named(bad):
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match=r"block_q must be a positive int"):
        flashlib.attention(q, k, v, impl="blockwise", block_q=bad)


def test_wrong_rank():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match=r"q must have rank 4 \[batch, heads, seq, head_dim\], got shape \(64, 32\)"):
        flashlib.attention(q[0, 0], k, v)


def test_not_an_array():
    _, k, v = make_qkv()
    with pytest.raises(ValueError, match="q must be an array, got list"):
        flashlib.attention([[1.0]], k, v)


@pytest.mark.parametrize(("dtype", "fix"), [(jnp.float16, "cast to bfloat16"), (jnp.int32, "cast to float32")])
def test_unsupported_dtype(dtype, fix):
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match=f"q has dtype .*supported dtypes are float32, bfloat16: {fix}"):
        flashlib.attention(q.astype(dtype), k.astype(dtype), v.astype(dtype))


def test_mixed_dtypes():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="must share one dtype, got q bfloat16, k float32"):
        flashlib.attention(q.astype(jnp.bfloat16), k, v)


def test_mismatched_batch():
    q, k, v = make_qkv(batch=2)
    with pytest.raises(ValueError, match=r"same number of batch \(axis 0\), got q 2, k 1, v 1"):
        flashlib.attention(q, k[:1], v[:1])


def test_kv_heads_must_divide_q_heads():
    q, k, v = make_qkv(heads=4)
    with pytest.raises(ValueError, match=r"k and v's heads \(axis 1\) must divide q's for grouped-query attention, "
                                         r"got q 4, k and v 3"):
        flashlib.attention(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match=r"k and v must have the same number of heads \(axis 1\), got k 2, v 4"):
        flashlib.attention(q, k[:, :2], v)


def test_mismatched_kv_lengths():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="k and v must have the same sequence length"):
        flashlib.attention(q, k, v[:, :, :10])


def test_mismatched_head_dim():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match=r"q and k must have the same head_dim \(axis 3\), got q 32, k 16"):
        flashlib.attention(q, k[..., :16], v)


def test_empty_sequence():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="empty input"):
        flashlib.attention(q[:, :, :0], k, v)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), "0.1"])
def test_bad_scale(scale):
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        flashlib.attention(q, k, v, scale=scale)


def test_validate_inputs_returns_the_sizes():
    q, k, v = make_qkv(2, 3, 5, 7, 32, dtype=jnp.bfloat16)
    assert flashlib.validate_inputs(q, k, v) == api.AttentionShape(2, 3, 5, 7, 32, "bfloat16")


def test_register_adds_and_replaces_a_stage():
    @api.register("tmp_test_impl", description="reference under another name, for this test")
    def _impl(q, k, v, *, causal, scale):
        return flashlib.reference.attention_naive(q, k, v, causal=causal, scale=scale)

    try:
        q, k, v = make_qkv()
        np.testing.assert_array_equal(flashlib.attention(q, k, v, impl="tmp_test_impl"),
                                      flashlib.attention(q, k, v, impl="reference"))
    finally:
        api._REGISTRY.pop("tmp_test_impl")


# ---------------------------------------------------------------------------------------------------
# layout=: FlashAttention's and jax.nn.dot_product_attention's [batch, seq, heads, head_dim], handled once
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", list(flashlib.implementations()))
def test_bshd_layout_is_the_bhsd_result_transposed(impl):
    q, k, v = make_qkv(2, 3, 10, 12, 32, seed=4)  # [b, h, s, d]
    to_bshd = (0, 2, 1, 3)
    expected = flashlib.attention(q, k, v, causal=True, impl=impl)
    got = flashlib.attention(*(x.transpose(to_bshd) for x in (q, k, v)), causal=True, layout="bshd", impl=impl)
    assert got.shape == (2, 10, 3, 32)
    np.testing.assert_allclose(got.transpose(to_bshd), expected, atol=1e-6, rtol=1e-6)


def test_bshd_layout_matches_jax_nn_and_its_gradients():
    q, k, v = make_qkv(2, 12, 4, 4, 16, seed=5)  # read as [b, s=12, h=4, d=16]: jax.nn's own layout
    expected, expected_vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), q, k, v)
    got, got_vjp = jax.vjp(lambda q, k, v: flashlib.attention(q, k, v, layout="bshd", impl="blockwise"), q, k, v)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    for g, e in zip(got_vjp(q), expected_vjp(q), strict=True):
        np.testing.assert_allclose(g, e, atol=1e-5)


def test_bshd_arrays_passed_as_bhsd_are_caught_when_the_heads_disagree():
    q, k, v = (x.transpose(0, 2, 1, 3) for x in make_qkv(1, 8, 16, 24, 32))  # bshd: [1, 16 | 24 tokens, 8, 32]
    with pytest.raises(ValueError, match="pass layout='bshd'"):
        flashlib.attention(q, k, v)
    assert flashlib.attention(q, k, v, layout="bshd", impl="reference").shape == q.shape


@pytest.mark.parametrize("layout", ["BSHD", "bsd", None, 0])
def test_unknown_layout_lists_the_known_ones(layout):
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match=r"layout=.*'bhsd' \[batch, heads, seq, head_dim\], 'bshd'"):
        flashlib.attention(q, k, v, layout=layout)


def test_bshd_errors_name_the_axes_of_that_layout():
    q, k, v = make_qkv(1, 2, 16, 16, 32)
    with pytest.raises(ValueError, match=r"rank 4 \[batch, seq, heads, head_dim\] \(layout='bshd'\)"):
        flashlib.attention(q[0], k, v, layout="bshd")
    with pytest.raises(ValueError, match=r"same sequence length \(axis 1\)"):
        flashlib.attention(q, k, v[:, :1], layout="bshd")
