"""flashlib.checks: passes print one stable line; failures raise and say where and by how much."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_qkv

from flashlib import checks, reference


def test_check_attention_passes_and_prints_one_line(capsys):
    q, k, v = make_qkv(1, 2, 9, 11, 32)
    naive = jax.jit(reference.attention_naive)(q, k, v)  # the checker's naive is this compiled program: ratio 1
    result = checks.check_attention(naive, q, k, v, name="naive")
    assert capsys.readouterr().out == "passed: naive matches the float64 oracle (within 2x the naive float32 error)\n"
    assert result.error <= result.allowed and result.ratio == pytest.approx(1.0)


def test_check_attention_catches_a_small_error():
    q, k, v = make_qkv(1, 2, 9, 11, 32)
    wrong = reference.attention_naive(q, k, v).at[0, 1, 3, 5].add(1e-3)
    with pytest.raises(checks.CheckFailed, match=r"max error 0.001 at \[b, h, q, d\] = \(0, 1, 3, 5\)"):
        checks.check_attention(wrong, q, k, v)


def test_check_attention_catches_the_wrong_mask():
    q, k, v = make_qkv(1, 1, 16, 16, 32)
    with pytest.raises(checks.CheckFailed, match="exceeds the allowed"):
        checks.check_attention(reference.attention_naive(q, k, v, causal=False), q, k, v, causal=True)


def test_check_attention_catches_shape_dtype_and_nan():
    q, k, v = make_qkv(1, 1, 4, 4, 32)
    good = reference.attention_naive(q, k, v)
    with pytest.raises(checks.CheckFailed, match="output shape"):
        checks.check_attention(good[0], q, k, v)
    with pytest.raises(checks.CheckFailed, match="output dtype bfloat16"):
        checks.check_attention(good.astype(jnp.bfloat16), q, k, v)
    with pytest.raises(checks.CheckFailed, match="NaN"):
        checks.check_attention(good.at[0, 0, 0, 0].set(jnp.nan), q, k, v)


def test_bf16_tolerance_follows_the_naive_error():
    q, k, v = make_qkv(1, 2, 64, 64, 64, dtype=jnp.bfloat16)
    result = checks.check_attention(reference.attention_naive(q, k, v), q, k, v, quiet=True)
    assert 1e-4 < result.naive_error < 5e-2  # bf16 rounding, not f32
    assert checks.tolerance(jnp.bfloat16) > checks.tolerance(jnp.float32)


def test_check_close_and_check(capsys):
    checks.check_close(np.ones(3, np.float32), np.ones(3), "ones")
    checks.check(True, "truth")
    assert capsys.readouterr().out == "passed: ones\npassed: truth\n"
    with pytest.raises(checks.CheckFailed, match=r"1 of 3 values off, first at index \(2,\): got 2, expected 1"):
        checks.check_close(np.array([1.0, 1.0, 2.0]), np.ones(3), "ones")
    with pytest.raises(checks.CheckFailed, match="shape"):
        checks.check_close(np.ones(2), np.ones(3), "ones")
    with pytest.raises(checks.CheckFailed, match="failed: lie — hint"):
        checks.check(False, "lie", "hint")


def _naive_grads(q, k, v, do, causal=False):
    import jax

    _, vjp = jax.vjp(lambda q, k, v: reference.attention_naive(q, k, v, causal=causal), q, k, v)
    return vjp(do)


def test_check_attention_grads_passes_and_prints_one_line(capsys):
    q, k, v = make_qkv(1, 2, 9, 11, 32)
    do = jnp.cos(q)
    result = checks.check_attention_grads(_naive_grads(q, k, v, do, True), q, k, v, do, causal=True, name="naive")
    assert capsys.readouterr().out == (
        "passed: naive match the float64 oracle (dq, dk, dv within 2x the naive float32 error)\n"
    )
    assert set(result) == {"dq", "dk", "dv"}
    assert all(r.error <= r.allowed and r.ratio <= 2 for r in result.values())  # jit rounds a little differently


def test_check_attention_grads_names_the_wrong_gradient():
    q, k, v = make_qkv(1, 2, 9, 11, 32)
    do = jnp.cos(q)
    dq, dk, dv = _naive_grads(q, k, v, do)
    with pytest.raises(checks.CheckFailed, match=r"dk max error 0.001 at \[b, h, seq, d\] = \(0, 1, 3, 5\)"):
        checks.check_attention_grads((dq, dk.at[0, 1, 3, 5].add(1e-3), dv), q, k, v, do)
    with pytest.raises(checks.CheckFailed, match="dv is bfloat16"):
        checks.check_attention_grads((dq, dk, dv.astype(jnp.bfloat16)), q, k, v, do)
    with pytest.raises(checks.CheckFailed, match="dq contains NaN"):
        checks.check_attention_grads((dq * jnp.nan, dk, dv), q, k, v, do)
    with pytest.raises(checks.CheckFailed, match="exceeds the allowed"):  # the gradients of the unmasked problem
        checks.check_attention_grads((dq, dk, dv), q, k, v, do, causal=True)


def test_check_attention_and_grads_applies_both_rules_with_one_naive_program(capsys):
    """The combined check: the same two rules as check_attention and check_attention_grads (same verdicts, same
    numbers up to the compiled naive's rounding), the naive output and gradients from one compiled program."""
    q, k, v = make_qkv(1, 2, 9, 11, 32, dtype=jnp.bfloat16)
    do = jnp.cos(q)
    out, vjp = jax.vjp(lambda q, k, v: reference.attention_naive(q, k, v, causal=True), q, k, v)
    grads = vjp(do)
    both = checks.check_attention_and_grads(out, grads, q, k, v, do, causal=True, name="naive")
    assert capsys.readouterr().out == (
        "passed: naive and its gradients match the float64 oracle (within 2x the naive bfloat16 error)\n")
    alone = {"out": checks.check_attention(out, q, k, v, causal=True, quiet=True),
             **checks.check_attention_grads(grads, q, k, v, do, causal=True, quiet=True)}
    assert set(both) == set(alone) == {"out", "dq", "dk", "dv"}
    for label in both:
        assert both[label].error == alone[label].error
        assert both[label].naive_error == pytest.approx(alone[label].naive_error, rel=0.05, abs=1e-3), label
    before = checks._naive_vjp._cache_size()
    checks.check_attention_and_grads(out, grads, q, k, v, do, causal=True, quiet=True)
    assert checks._naive_vjp._cache_size() == before  # one program, shared with check_attention_grads


def test_check_attention_and_grads_names_what_is_wrong():
    q, k, v = make_qkv(1, 2, 9, 11, 32)
    do = jnp.cos(q)
    out = reference.attention_naive(q, k, v)
    dq, dk, dv = _naive_grads(q, k, v, do)
    with pytest.raises(checks.CheckFailed, match=r"failed: attention — max error 0.001 at \[b, h, q, d\] = \(0, 1, 3"):
        checks.check_attention_and_grads(out.at[0, 1, 3, 5].add(1e-3), (dq, dk, dv), q, k, v, do)
    with pytest.raises(checks.CheckFailed, match=r"attention gradients — dk max error 0.001 at \[b, h, seq, d\]"):
        checks.check_attention_and_grads(out, (dq, dk.at[0, 1, 3, 5].add(1e-3), dv), q, k, v, do)
    with pytest.raises(checks.CheckFailed, match="output shape"):
        checks.check_attention_and_grads(out[:, :1], (dq, dk, dv), q, k, v, do)
    with pytest.raises(checks.CheckFailed, match=r"expected 3 gradients \(dq, dk, dv\), got 2"):
        checks.check_attention_and_grads(out, (dq, dk), q, k, v, do)
    with pytest.raises(checks.CheckFailed, match="exceeds the allowed"):  # the unmasked problem's answers
        checks.check_attention_and_grads(out, (dq, dk, dv), q, k, v, do, causal=True)
