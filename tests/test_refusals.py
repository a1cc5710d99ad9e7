"""Refuse or compute right, at every entry point (issue 24): ``attention``, ``decode_attention`` (every impl),
``sharded_attention`` and ``ring_attention`` share one validation (:mod:`flashlib.arguments`), so a bad argument is
a ``ValueError`` naming it at each door, and an input the contract accepts gets the float64 oracle's answer.

Fixed cases, one per repro of the issue, and one search: :func:`test_bad_inputs_are_refused_or_answered_right`
draws a bad (or borderline) argument and an entry point and asserts "a ValueError whose message names the
argument, or the oracle's answer" (``derandomize=False``: a random draw each run, the seed printed on failure).
Search or smoke (``tests/conftest.py``): the search runs in full in the main environment and as a random quarter
under ``make test-colab`` (the checks it reaches are plain Python and jnp on tiny shapes).

Sharded and ring attention run here on a one-device mesh (``jax.make_mesh((1,), ("x",))``: Explicit axes in the
newest jax, Auto in jax 0.7.2); what needs several devices to show — ``layout="bshd"`` splitting the right
axis, an eager gradient on the default mesh outside ``jax.set_mesh`` — is a case of ``tests/sharded_checks.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlib
from flashlib import decode
from flashlib.kernels import decode_attention
from flashlib.reference import attention_oracle
from flashlib.ring import ring_attention
from flashlib.sharded import sharded_attention

F32 = jnp.float32
ATOL = 2e-5  # float32 against the float64 oracle at these tiny sizes (measured errors ~1e-7)


def _qkv(batch=1, heads=2, q_len=4, kv_len=4, d=8, kv_heads=None, seed=0):
    rng = np.random.default_rng(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    return tuple(jnp.asarray(rng.normal(size=shape), F32) for shape in
                 ((batch, heads, q_len, d), (batch, kv_heads, kv_len, d), (batch, kv_heads, kv_len, d)))


def _mesh():
    return jax.make_mesh((1,), ("x",))


# ---------------------------------------------------------------------------------------------------
# attention: values that were taken for something else
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "blockwise", "xla", "pallas"])
@pytest.mark.parametrize(("argument", "value"), [("causal", "False"), ("causal", 1), ("causal", None),
                                                  ("scale", True), ("scale", "0.1"), ("scale", 0.0),
                                                  ("scale", float("nan")), ("scale", -1)])
def test_attention_refuses_a_causal_or_scale_of_the_wrong_kind(impl, argument, value):
    """``causal="False"`` was taken as True (a non-empty string), ``scale=True`` as 1.0."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=argument):
        flashlib.attention(q, k, v, impl=impl, **{argument: value})


@pytest.mark.parametrize("scale", [np.float32(0.125), np.float64(0.3), np.int64(1), 2])
def test_attention_takes_numpy_scalars_as_scale(scale):
    """``scale=np.float32(0.125)`` was refused as "not a positive finite number"."""
    q, k, v = _qkv()
    got = flashlib.attention(q, k, v, scale=scale, causal=np.bool_(True), impl="reference")
    np.testing.assert_allclose(got, attention_oracle(q, k, v, causal=True, scale=float(scale)), atol=ATOL)


@pytest.mark.parametrize("impl", ["reference", "blockwise", "xla", "pallas"])
def test_int64_segment_ids_beyond_int32_are_refused_not_wrapped(impl):
    """q ids 2**32 and kv ids 0: no query may see any key; cast to int32, 2**32 wrapped to 0 and every impl
    returned full attention."""
    q, k, v = _qkv()
    ids = (np.full((1, 4), 2**32, np.int64), np.zeros((1, 4), np.int64))
    with pytest.raises(ValueError, match=r"segment_ids' q_segments .*int32.*renumber"):
        flashlib.attention(q, k, v, segment_ids=ids, impl=impl)
    with pytest.raises(ValueError, match=r"segment_ids' kv_segments"):
        flashlib.attention(q, k, v, segment_ids=(ids[1], np.full((1, 4), -(2**31) - 1, np.int64)), impl=impl)
    if impl == "reference":  # int64 ids inside int32's range are fine (the check runs before any impl)
        small = (ids[0] - 2**32 + 7, ids[1] + 7)
        np.testing.assert_allclose(flashlib.attention(q, k, v, segment_ids=small, impl=impl),
                                   attention_oracle(q, k, v), atol=ATOL)


@pytest.mark.parametrize("impl", ["reference", "blockwise", "xla", "pallas"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_sinks_are_refused(impl, bad):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sinks must be finite"):
        flashlib.attention(q, k, v, sinks=jnp.asarray([bad, 0.0]), impl=impl)


def test_a_minus_inf_sink_is_no_sink():
    q, k, v = _qkv()
    got = flashlib.attention(q, k, v, sinks=jnp.asarray([-jnp.inf, 0.5]), impl="reference")
    np.testing.assert_allclose(got, attention_oracle(q, k, v, sinks=np.asarray([-np.inf, 0.5])), atol=ATOL)


@pytest.mark.parametrize("impl", ["reference", "blockwise", "xla", "pallas"])
@pytest.mark.parametrize(("shapes", "axis"), [
    (((0, 2, 4, 8), (0, 2, 4, 8)), "batch"),
    (((1, 0, 4, 8), (1, 1, 4, 8)), "heads of q"),
    (((1, 2, 4, 8), (1, 0, 4, 8)), "heads of k"),
])
def test_an_empty_batch_or_head_axis_is_named(impl, shapes, axis):
    """Batch 0 or heads 0 was a ZeroDivisionError, an einsum error or a Pallas TypeError (xla returned empty)."""
    qs, ks = shapes
    with pytest.raises(ValueError, match=f"empty input: {axis}"):
        flashlib.attention(jnp.zeros(qs), jnp.zeros(ks), jnp.zeros(ks), impl=impl)
