"""The variants' contract (issue 16): GQA/MQA, a value head_dim of its own, sliding windows, soft-capping,
segment ids and sinks, alone and combined, as :mod:`flashlib.masks` defines them.

Three independent views are held against each other:

* a brute-force float64 loop written here from the contract's words (one query at a time, its visible keys
  listed by the rule, the sink added to the denominator) — it shares no code with the library;
* the library's float64 oracle (``reference.attention_oracle``, ``attention_vjp_oracle``), whose hand-written
  gradients are also checked against central finite differences of the oracle itself;
* the JAX implementations that support the variants (``impl="reference"`` and its autodiff gradients,
  ``impl="blockwise"`` with small random blocks and its custom VJP), drawn per example.

The property tests search (``derandomize=False``: fresh examples each run; a failure prints the seed to replay
with ``pytest --hypothesis-seed=N`` and is then kept as an explicit ``@example``). Score scales reach large
logits, lengths reach 1, windows and segments reach rows that see no key.

Search or smoke (``tests/conftest.py``): every search here runs in full in the main environment and as a random
quarter under ``make test-colab`` (the float64 views are NumPy; the impls' searches are the same property with the
same strategy); every fixed case runs in both.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import search_examples
from hypothesis import given, settings
from hypothesis import strategies as st
from peers import rules

import flashlib
from flashlib import masks, reference

SEARCH = settings(max_examples=search_examples(100), derandomize=False, deadline=None)  # the float64 views: cheap
# Forward and VJP as one compiled program: an eager VJP compiles each of its ~40 ops on its own for every new
# shape, which was most of a search's time (jit is also how models call attention; the fixed cases run eagerly).
_compiled_out_and_grads = jax.jit(rules.output_and_grads, static_argnums=0)
COMPILED = settings(max_examples=search_examples(40), derandomize=False, deadline=None)  # each compiles a program


# ---------------------------------------------------------------------------------------------------
# The contract in words, as a loop
# ---------------------------------------------------------------------------------------------------


def _sees(i, j, *, q_len, kv_len, causal, window, q_seg, kv_seg) -> bool:
    offset = kv_len - q_len
    if causal and j > i + offset:
        return False
    if window is not None:
        left, right = window
        if left is not None and j < i + offset - left:
            return False
        if right is not None and j > i + offset + right:
            return False
    return q_seg is None or q_seg[i] == kv_seg[j]


def brute_force(q, k, v, *, causal=False, scale=None, window=None, softcap=None, segment_ids=None, sinks=None):
    """Attention one query at a time, from the contract's sentences, in float64 Python."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((batch, heads, q_len, v.shape[-1]))
    for b in range(batch):
        q_seg = None if segment_ids is None else np.asarray(segment_ids[0])[b]
        kv_seg = None if segment_ids is None else np.asarray(segment_ids[1])[b]
        for h in range(heads):
            kvh = h // (heads // kv_heads)  # query head h reads kv head h // group
            for i in range(q_len):
                logits = {}
                for j in range(kv_len):
                    if _sees(i, j, q_len=q_len, kv_len=kv_len, causal=causal, window=window, q_seg=q_seg,
                             kv_seg=kv_seg):
                        s = scale * float(q[b, h, i] @ k[b, kvh, j])
                        logits[j] = softcap * math.tanh(s / softcap) if softcap is not None else s
                sink = None if sinks is None else float(sinks[h])
                if not logits:
                    continue  # no visible key: zeros (a sink carries no value)
                top = max([*logits.values(), *([sink] if sink is not None else [])])
                denominator = sum(math.exp(s - top) for s in logits.values())
                if sink is not None:
                    denominator += math.exp(sink - top)
                for j, s in logits.items():
                    out[b, h, i] += math.exp(s - top) / denominator * v[b, kvh, j]
    return out


# ---------------------------------------------------------------------------------------------------
# Random cases over every combination
# ---------------------------------------------------------------------------------------------------


@st.composite
def cases(draw, max_len: int = 9):
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    batch = draw(st.integers(1, 2))
    q_len, kv_len = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    d, dv = draw(st.integers(1, 4)), draw(st.sampled_from([None, 1, 3, 5]))
    magnitude = draw(st.sampled_from([0.5, 1.0, 4.0, 12.0]))  # 12: logits in the hundreds
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    q = rng.normal(size=(batch, heads, q_len, d)) * magnitude
    k = rng.normal(size=(batch, kv_heads, kv_len, d)) * magnitude
    v = rng.normal(size=(batch, kv_heads, kv_len, dv or d))
    side = st.one_of(st.none(), st.integers(0, max_len))
    variants = {
        "causal": draw(st.booleans()),
        "window": draw(st.one_of(st.none(), st.tuples(side, side))),
        "softcap": draw(st.one_of(st.none(), st.sampled_from([1.0, 5.0, 30.0]))),
        "segment_ids": None,
        "sinks": None,
    }
    if draw(st.booleans()):  # packed: non-decreasing ids, as packing writes them, so some rows see nothing
        segments = draw(st.integers(1, 3))
        variants["segment_ids"] = (np.sort(rng.integers(0, segments, size=(batch, q_len)), axis=-1),
                                   np.sort(rng.integers(0, segments, size=(batch, kv_len)), axis=-1))
    if draw(st.booleans()):
        variants["sinks"] = rng.normal(size=heads) * magnitude
    return q, k, v, variants


def _given(variants):
    return {key: value for key, value in variants.items() if value is not None and key != "causal"}


@SEARCH
@given(cases())
def test_oracle_is_the_contract(case):
    q, k, v, variants = case
    want = brute_force(q, k, v, **variants)
    got = reference.attention_oracle(q, k, v, causal=variants["causal"], **_given(variants))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


VARIANT_IMPLS = ("reference", "blockwise", "xla")
XLA_FEATURES = {"window", "segment_ids"}  # and GQA; not softcap, sinks, a value head_dim of its own


def _impl_options(impl, data):
    if impl in ("reference", "xla"):
        return {}
    return {"block_q": data.draw(st.integers(1, 5), label="block_q"), "block_k": data.draw(st.integers(1, 5),
                                                                                            label="block_k")}


def _supported(impl, q, k, v, given_) -> bool:
    return impl != "xla" or (set(given_) <= XLA_FEATURES and v.shape[-1] == q.shape[-1])


@COMPILED
@given(cases(), st.sampled_from(VARIANT_IMPLS), st.data())
def test_impls_in_float32_match_the_oracle(case, impl, data):
    q, k, v, variants = case
    given_ = _given(variants)
    if not _supported(impl, q, k, v, given_):
        impl = "reference"
    jax_variants = dict(given_)
    if "segment_ids" in given_:
        jax_variants["segment_ids"] = tuple(jnp.asarray(ids, jnp.int32) for ids in given_["segment_ids"])
    if "sinks" in given_:
        jax_variants["sinks"] = jnp.asarray(given_["sinks"], jnp.float32)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    options = _impl_options(impl, data)
    out = jax.jit(lambda q, k, v: flashlib.attention(q, k, v, causal=variants["causal"], impl=impl, **jax_variants,
                                                     **options))(*f32)
    want = reference.attention_oracle(*(np.asarray(x, np.float64) for x in f32), causal=variants["causal"],
                                      **{**given_, **({"sinks": np.asarray(jax_variants["sinks"], np.float64)}
                                                      if "sinks" in given_ else {})})
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5 * max(1.0, np.abs(v).max()), rtol=1e-4)


def _finite_differences(fn, x, eps=1e-6):
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[index] += eps
        down[index] -= eps
        grad[index] = (fn(up) - fn(down)) / (2 * eps)
    return grad


@settings(max_examples=search_examples(25), derandomize=False, deadline=None)
@given(cases(max_len=5))
def test_oracle_gradients_are_the_derivative(case):
    """``attention_vjp_oracle`` (the backward written by hand) against central differences of the oracle."""
    q, k, v, variants = case
    given_ = _given(variants)
    do = np.random.default_rng(0).normal(size=q.shape[:-1] + (v.shape[-1],))
    grads = reference.attention_vjp_oracle(q, k, v, do, causal=variants["causal"], **given_)

    def loss(**changed):
        args = {"q": q, "k": k, "v": v, **changed}
        extra = {**given_, **({"sinks": changed["sinks"]} if "sinks" in changed else {})}
        return float((reference.attention_oracle(args["q"], args["k"], args["v"], causal=variants["causal"],
                                                 **extra) * do).sum())

    primals = {"q": q, "k": k, "v": v, **({"sinks": given_["sinks"]} if "sinks" in given_ else {})}
    assert len(grads) == len(primals)
    for (name, x), grad in zip(primals.items(), grads, strict=True):
        numeric = _finite_differences(lambda x_, name=name: loss(**{name: x_}), np.asarray(x, np.float64))
        np.testing.assert_allclose(grad, numeric, atol=1e-5 * max(1.0, np.abs(numeric).max()), rtol=1e-4,
                                   err_msg=f"d{name}")


@COMPILED
@given(cases(max_len=7), st.sampled_from(VARIANT_IMPLS), st.data())
def test_impl_gradients_match_the_oracle(case, impl, data):
    """Gradients of the JAX implementations (f32; the reference by autodiff, blockwise by its custom VJP),
    sinks included, against the float64 oracle's."""
    q, k, v, variants = case
    given_ = _given(variants)
    if not _supported(impl, q, k, v, given_):
        impl = "reference"
    options = _impl_options(impl, data)
    jax_variants = dict(given_)
    if "segment_ids" in given_:
        jax_variants["segment_ids"] = tuple(jnp.asarray(ids, jnp.int32) for ids in given_["segment_ids"])
    sinks = None if "sinks" not in given_ else jnp.asarray(given_["sinks"], jnp.float32)
    jax_variants.pop("sinks", None)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    do = jnp.asarray(np.random.default_rng(1).normal(size=q.shape[:-1] + (v.shape[-1],)), jnp.float32)

    def fn(q, k, v, *maybe_sinks):
        extra = {"sinks": maybe_sinks[0]} if maybe_sinks else {}
        return flashlib.attention(q, k, v, causal=variants["causal"], impl=impl, **jax_variants, **extra, **options)

    primals = (q, k, v) if sinks is None else (q, k, v, sinks)
    _, *grads = _compiled_out_and_grads(fn, *primals, do)
    oracle_variants = {**given_, **({} if sinks is None else {"sinks": np.asarray(sinks, np.float64)})}
    want = reference.attention_vjp_oracle(*(np.asarray(x, np.float64) for x in (q, k, v, do)),
                                          causal=variants["causal"], **oracle_variants)
    magnitude = max(1.0, *(float(np.abs(w).max(initial=0.0)) for w in want))
    for name, got, expected in zip(("dq", "dk", "dv", "dsinks"), grads, want, strict=False):
        np.testing.assert_allclose(np.asarray(got, np.float64), expected, atol=5e-4 * magnitude, rtol=1e-3,
                                   err_msg=name)


def test_check_attention_grads_takes_the_variants():
    """The library's checker, with a fourth gradient for the sinks; a wrong dsinks is caught by name."""
    q, k, v = _qkv(heads=4, kv_heads=2, dv=3)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    ids = (jnp.asarray([[0, 0, 1, 1, 1]] * 2), jnp.asarray([[0, 0, 0, 1, 1, 1, 1]] * 2))
    variants = dict(causal=True, window=(3, 0), softcap=4.0, segment_ids=ids)
    do = jnp.ones(q.shape[:-1] + (3,), jnp.float32)
    grads = jax.vjp(lambda q, k, v, s: reference.attention_naive(q, k, v, sinks=s, **variants), q, k, v, sinks)[1](do)
    flashlib.checks.check_attention_grads(grads, q, k, v, do, sinks=sinks, quiet=True, **variants)
    with pytest.raises(flashlib.checks.CheckFailed, match=r"dsinks max error .* at \[h\]"):
        flashlib.checks.check_attention_grads((*grads[:3], grads[3] + 0.1), q, k, v, do, sinks=sinks, quiet=True,
                                              **variants)


# ---------------------------------------------------------------------------------------------------
# Worked examples, so a reader sees each rule once
# ---------------------------------------------------------------------------------------------------


def test_local_causal_window_sees_the_last_keys():
    rows, cols = np.arange(5)[:, None], np.arange(5)[None, :]
    visible = masks.element_visible(rows, cols, q_len=5, kv_len=5, causal=True, window=(2, 0))
    assert visible[4].tolist() == [False, False, True, True, True]
    assert visible[0].tolist() == [True, False, False, False, False]


def test_window_is_bottom_right_aligned():
    """Two queries against six keys: query 0 lines up with key 4, query 1 with key 5."""
    rows, cols = np.arange(2)[:, None], np.arange(6)[None, :]
    visible = masks.window_visible(rows, cols, q_len=2, kv_len=6, window=(1, 1))
    assert np.argwhere(visible).tolist() == [[0, 3], [0, 4], [0, 5], [1, 4], [1, 5]]


def test_mqa_equals_repeating_the_single_kv_head():
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(1, 4, 6, 8)), rng.normal(size=(1, 1, 6, 8)), rng.normal(size=(1, 1, 6, 8))
    repeated = reference.attention_oracle(q, np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1), causal=True)
    np.testing.assert_allclose(reference.attention_oracle(q, k, v, causal=True), repeated)


def test_a_sink_with_no_visible_key_gives_zeros_and_takes_no_gradient_from_keys():
    q, k, v = (np.ones((1, 1, 2, 4)) for _ in range(3))
    ids = (np.array([[0, 1]]), np.array([[0, 0]]))  # query 1's segment has no key
    out = reference.attention_oracle(q, k, v, segment_ids=ids, sinks=np.array([0.5]))
    assert np.all(out[0, 0, 1] == 0.0) and np.all(out[0, 0, 0] != 0.0)


def test_huge_sink_takes_all_the_weight():
    q, k, v = (np.ones((1, 1, 3, 4)) for _ in range(3))
    out = reference.attention_oracle(q, k, v, sinks=np.array([1e4]))
    np.testing.assert_allclose(out, 0.0, atol=1e-300)


# ---------------------------------------------------------------------------------------------------
# The contract's refusals
# ---------------------------------------------------------------------------------------------------


def _qkv(heads=4, kv_heads=2, q_len=5, kv_len=7, d=8, dv=8):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.normal(size=(2, heads, q_len, d)), jnp.float32),
            jnp.asarray(rng.normal(size=(2, kv_heads, kv_len, d)), jnp.float32),
            jnp.asarray(rng.normal(size=(2, kv_heads, kv_len, dv)), jnp.float32))


@pytest.mark.parametrize("kwargs, message", [
    ({"window": 3}, r"window must be a pair \(left, right\)"),
    ({"window": (-1, 0)}, r"window's left side must be an int >= 0 or None"),
    ({"window": (0, 1.5)}, r"window's right side must be an int >= 0 or None"),
    ({"softcap": 0.0}, r"softcap must be a positive finite number"),
    ({"softcap": float("inf")}, r"softcap must be a positive finite number"),
    ({"segment_ids": np.zeros((2, 5))}, r"segment_ids must be a pair"),
    ({"segment_ids": (np.zeros((2, 7), int), np.zeros((2, 7), int))},
     r"q_segments must have shape \[batch, q_len\] = \(2, 5\), got \(2, 7\)"),
    ({"segment_ids": (np.zeros((2, 5), int), np.zeros((2, 7)))}, r"kv_segments must hold integers"),
    ({"sinks": np.zeros(2)}, r"sinks must be an array of one logit per query head, shape \(4,\), got \(2,\)"),
    ({"sinks": np.zeros(4, int)}, r"sinks must be floating point"),
])
def test_bad_variants_name_the_argument(kwargs, message):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=message):
        flashlib.attention(q, k, v, impl="reference", **kwargs)


@pytest.mark.parametrize("impl, kwargs, feature", [  # (impl="pallas" runs every variant: test_pallas_variants.py)
    ("xla", {"softcap": 5.0}, "logit soft-capping"),
    ("xla", {"sinks": np.zeros(4, np.float32)}, "attention sinks"),
    ("xla", {"dv": 3}, "a value head_dim different"),
])
def test_an_impl_without_a_variant_says_which_impl_has_it(impl, kwargs, feature):
    dv = kwargs.pop("dv", 8)
    q, k, v = _qkv(kv_heads=4 if kwargs or impl == "xla" else 2, dv=dv)
    with pytest.raises(ValueError, match=rf"impl='{impl}' does not support {feature}.*\(yet\); use impl='reference' or "
                                         "'blockwise' or 'pallas'"):
        flashlib.attention(q, k, v, impl=impl, **kwargs)


def test_auto_picks_an_impl_that_supports_the_variant():
    q, k, v = _qkv(kv_heads=1, dv=3)
    out = flashlib.attention(q, k, v, causal=True, window=(3, 0), impl="auto")
    np.testing.assert_allclose(out, reference.attention_oracle(q, k, v, causal=True, window=(3, 0)), atol=1e-5)


def test_bshd_layout_with_gqa_and_value_head_dim():
    q, k, v = _qkv(kv_heads=2, dv=3)
    bshd = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
    out = flashlib.attention(*bshd, layout="bshd", impl="reference", softcap=4.0)
    np.testing.assert_allclose(out.transpose(0, 2, 1, 3),
                               reference.attention_oracle(q, k, v, softcap=4.0), atol=1e-5)
    assert out.shape == (2, 5, 4, 3)


@COMPILED
@given(cases(max_len=12), st.sampled_from(("blockwise", "xla")), st.data())
def test_bfloat16_by_flashattentions_rule(case, impl, data):
    """bfloat16 inputs, outputs and gradients (sinks' too), by FlashAttention's rule: at most twice the error
    of the naive implementation in bfloat16 against the float64 oracle (:mod:`flashlib.checks`)."""
    q, k, v, variants = case
    given_ = _given(variants)
    if not _supported(impl, q, k, v, given_):
        impl = "blockwise"
    jax_variants = dict(given_)
    if "segment_ids" in given_:
        jax_variants["segment_ids"] = tuple(jnp.asarray(ids, jnp.int32) for ids in given_["segment_ids"])
    sinks = None if "sinks" not in given_ else jnp.asarray(given_["sinks"], jnp.bfloat16)
    jax_variants.pop("sinks", None)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    do = jnp.asarray(np.random.default_rng(2).normal(size=q.shape[:-1] + (v.shape[-1],)), jnp.bfloat16)
    options = _impl_options(impl, data)

    def fn(q, k, v, *maybe_sinks):
        extra = {"sinks": maybe_sinks[0]} if maybe_sinks else {}
        return flashlib.attention(q, k, v, causal=variants["causal"], impl=impl, **jax_variants, **extra, **options)

    primals = (q, k, v) if sinks is None else (q, k, v, sinks)
    out, *grads = _compiled_out_and_grads(fn, *primals, do)
    flashlib.checks.check_attention_and_grads(out, grads, q, k, v, do, causal=variants["causal"], sinks=sinks,
                                              quiet=True, **jax_variants)
