"""Notebook 01's puzzles and exercise checkers (:mod:`flashlib.exercises.softmax`), run three ways: on the
notebook's stub (the puzzle falls back to its solution, the exercise is reported as not attempted), on plausible
wrong answers (each fails with the message naming its mistake) and on a solution (it passes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashlib.checks import CheckFailed
from flashlib.exercises import softmax as nb01


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- puzzle 1: attention in three lines -------------------------------------------------------------------------


def attention_unscaled(q, k, v):  # forgets the 1/sqrt(d)
    return jax.nn.softmax(q @ k.T, axis=-1) @ v


def attention_over_queries(q, k, v):  # normalises the columns of S
    return jax.nn.softmax(q @ k.T / jnp.sqrt(q.shape[-1]), axis=0) @ v


def attention_returns_p(q, k, v):  # stops at the weights
    return jax.nn.softmax(q @ k.T / jnp.sqrt(q.shape[-1]), axis=-1)


def test_attention_stub_falls_back_to_the_solution(capsys):
    assert nb01.ATTENTION.use(_stub) is nb01.attention_solution
    assert "not attempted yet" in capsys.readouterr().out


def attention_scaled_by_keys(q, k, v):  # sqrt(M): k.shape[0] instead of the head dimension
    return jax.nn.softmax(q @ k.T / jnp.sqrt(k.shape[0]), axis=-1) @ v


def attention_times_sqrt_d(q, k, v):  # multiplies by sqrt(d)
    return jax.nn.softmax(q @ k.T * jnp.sqrt(q.shape[-1]), axis=-1) @ v


def attention_fixed_d(q, k, v):  # d = 4 of the notebook's example, hard-coded
    return jax.nn.softmax(q @ k.T / 2.0, axis=-1) @ v


@pytest.mark.parametrize("wrong, message", [
    (attention_unscaled, "case '8 queries, 12 keys, d = 4' — the scores are not scaled"),
    (attention_over_queries, "the softmax runs over the queries"),
    (attention_returns_p, "output shape \\(8, 12\\), expected \\(8, 4\\)"),
    (attention_scaled_by_keys, "case '8 queries, 12 keys, d = 4' — the scale uses k.shape\\[0\\], the number of keys"),
    (attention_times_sqrt_d, "the scores are multiplied by sqrt\\(d\\)"),
    (attention_fixed_d, "case '5 queries, 3 keys, d = 16.* a fixed 1/sqrt\\(4\\), but here d = 16"),
])
def test_attention_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb01.check_attention_three_lines(wrong)


def test_attention_solution_passes(capsys):
    assert nb01.ATTENTION.use(nb01.attention_solution) is nb01.attention_solution
    assert "passed: attention" in capsys.readouterr().out


@pytest.mark.parametrize("valid", [
    lambda q, k, v: (v.T @ jax.nn.softmax(k @ q.T / jnp.sqrt(q.shape[-1]), axis=0)).T,  # the transposed products
    lambda q, k, v: jnp.einsum("nm,md->nd", jax.nn.softmax(jnp.einsum("nd,md->nm", q, k) * q.shape[-1] ** -0.5), v),
])
def test_attention_other_styles_pass(valid, capsys):
    nb01.check_attention_three_lines(valid)
    assert capsys.readouterr().out.startswith("passed: attention")


# -- puzzle 2: the stable softmax -------------------------------------------------------------------------------


def softmax_naive(x, axis=-1):
    e = jnp.exp(x)
    return e / jnp.sum(e, axis=axis, keepdims=True)


def softmax_no_keepdims(x, axis=-1):
    m = jnp.max(x, axis=axis)
    e = jnp.exp(x - m)
    return e / jnp.sum(e, axis=axis)


def softmax_global_max(x, axis=-1):
    e = jnp.exp(x - jnp.max(x))
    return e / jnp.sum(e, axis=axis, keepdims=True)


def softmax_unguarded(x, axis=-1):  # the textbook stable softmax: NaN for a row of only -inf
    e = jnp.exp(x - jnp.max(x, axis=axis, keepdims=True))
    return e / jnp.sum(e, axis=axis, keepdims=True)


def softmax_last_axis_only(x, axis=-1):  # ignores `axis`
    return nb01.stable_softmax_solution(x)


def softmax_in_float32(x, axis=-1):  # returns float32 for bfloat16 logits
    return nb01.stable_softmax_solution(x.astype(jnp.float32), axis=axis)


def softmax_default_axis_first(x, axis=0):  # a mutant of the solution: the default axis is not the last one
    return nb01.stable_softmax_solution(x, axis=axis)


def test_stable_softmax_stub_falls_back_to_the_solution(capsys):
    assert nb01.STABLE_SOFTMAX.use(_stub) is nb01.stable_softmax_solution
    assert "not attempted yet" in capsys.readouterr().out


def softmax_masks_with_a_big_number(x, axis=-1):  # -inf -> -1e9: a row of only -inf comes out uniform
    return softmax_unguarded(jnp.where(jnp.isneginf(x), -1e9, x), axis)


@pytest.mark.parametrize("wrong, message", [
    (softmax_masks_with_a_big_number, "case 'a row where every entry is -inf.*' — a row of only -inf got nonzero "
                                      "weights: it must be all zeros"),
    (softmax_naive, "case 'large logits, \\[10, 50, 100\\].*exp overflowed to inf: subtract the maximum"),
    (softmax_no_keepdims, "case 'ordinary logits, a 6 x 6 matrix' — sums along axis -1 .*keepdims=True"),
    (softmax_global_max, "case 'rows on very different scales.*not the maximum of the whole array"),
    (softmax_unguarded, "case 'a row where every entry is -inf.*must give zeros"),
    (jax.nn.softmax, "case 'a row where every entry is -inf"),
    (softmax_last_axis_only, "case 'axis=0 of a 3 x 5 matrix' — sums along axis 0"),
    (softmax_in_float32, "case 'bfloat16 logits.*dtype float32, expected x's dtype bfloat16"),
    (softmax_default_axis_first, "case 'called without axis'.*the default must be the last axis"),
])
def test_stable_softmax_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb01.check_stable_softmax(wrong)


def test_stable_softmax_solution_passes(capsys):
    assert nb01.STABLE_SOFTMAX.use(nb01.stable_softmax_solution) is nb01.stable_softmax_solution
    assert "passed: stable_softmax" in capsys.readouterr().out


def softmax_logsumexp(x, axis=-1):  # exp(x - logsumexp(x)): as stable, rounds x - lse at |x| ~ 1000
    lse = jax.scipy.special.logsumexp(x, axis=axis, keepdims=True)
    return jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(x - lse)).astype(x.dtype)


def softmax_nan_to_num(x, axis=-1):  # the textbook stable softmax, its NaN row zeroed afterwards
    return jnp.nan_to_num(softmax_unguarded(x, axis))


@pytest.mark.parametrize("valid", [softmax_logsumexp, softmax_nan_to_num])
def test_stable_softmax_other_styles_pass(valid, capsys):
    nb01.check_stable_softmax(valid)
    assert capsys.readouterr().out.startswith("passed: stable_softmax")


def test_the_all_masked_row_contract_is_flashlibs():
    """A row of only -inf gives zeros, as flashlib's attention gives a query that sees no key."""
    from flashlib.reference import attention_naive
    q = jnp.ones((1, 1, 3, 4))
    out = attention_naive(q, q[:, :, :1], q[:, :, :1], causal=True)  # queries 0 and 1 see no key
    np.testing.assert_array_equal(np.asarray(out[0, 0, :2]), 0.0)
    np.testing.assert_array_equal(np.asarray(nb01.stable_softmax_solution(jnp.full((2, 3), -jnp.inf))), 0.0)


# -- exercise 1: my_attention, stable, in plain jnp ------------------------------------------------------------


my_attention_solution = nb01.my_attention_solution


def my_attention_through_stable_softmax(q, k, v):  # another valid style: the learner's stable_softmax of puzzle 2
    return nb01.stable_softmax_solution(q @ k.T / jnp.sqrt(q.shape[-1])) @ v


def my_attention_naive_softmax(q, k, v):
    return softmax_naive(q @ k.T / jnp.sqrt(q.shape[-1])) @ v


def my_attention_scaled_by_d(q, k, v):
    return nb01.stable_softmax_solution(q @ k.T / q.shape[-1]) @ v


def test_my_attention_stub_is_not_attempted(capsys):
    assert nb01.MY_ATTENTION.use(_stub) is nb01.my_attention_solution  # as the notebook calls it
    assert "exercise 1: attention in three lines, your way: not attempted yet" in capsys.readouterr().out


def my_attention_jax_softmax(q, k, v):  # right numbers, but the exercise is plain jnp
    return jax.nn.softmax(q @ k.T / jnp.sqrt(q.shape[-1]), axis=-1) @ v


def my_attention_global_max(q, k, v):  # subtracts the maximum of the whole score matrix
    s = q @ k.T / jnp.sqrt(q.shape[-1])
    e = jnp.exp(s - jnp.max(s))
    return e / jnp.sum(e, axis=-1, keepdims=True) @ v


@pytest.mark.parametrize("wrong, message", [
    (my_attention_naive_softmax, "case '8 queries, 12 keys, d = 4, q x 100' — the output has NaN or inf"),
    (my_attention_scaled_by_d, "case '8 queries, 12 keys, d = 4' — the scores are divided by d"),
    (attention_unscaled, "the scores are not scaled"),
    (my_attention_jax_softmax, "right numbers, but through jax.nn.softmax: the exercise is plain jnp"),
    (my_attention_global_max, "case '8 queries, 12 keys, d = 4, q x 100' — the output has NaN or inf.*each row's"),
])
def test_my_attention_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb01.check_my_attention(wrong)


@pytest.mark.parametrize("valid", [
    my_attention_solution,
    my_attention_through_stable_softmax,
    lambda q, k, v: softmax_logsumexp(q @ k.T / jnp.sqrt(q.shape[-1])) @ v,  # error ~1e-5 at scores in the hundreds
])
def test_my_attention_solution_passes(valid, capsys):
    assert nb01.MY_ATTENTION.use(valid) is valid
    out = capsys.readouterr().out
    assert out.startswith("passed: my_attention") and "attention in three lines, your way: passed" in out


# -- exercise 2: bytes of the score matrix ---------------------------------------------------------------------


def test_score_matrix_bytes_stub_is_not_attempted(capsys):
    assert nb01.SCORE_MATRIX_BYTES.use(_stub) is nb01.score_matrix_bytes_solution
    assert "exercise 2: bytes of the score matrix: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (lambda n, dtype: 4 * n * n, "case 'N = 8192, bfloat16' — .*bfloat16 has 2 bytes per entry, not 4"),
    (lambda n, dtype: n * n, "case 'a single float32 score' — .*the number of entries"),
    (lambda n, dtype: jnp.array(n) ** 2 * np.dtype(dtype).itemsize, "case 'N = 65536, .*overflows 32-bit"),
    (lambda n, dtype: n * np.dtype(dtype).itemsize, "case 'N = 1024, float32' — .*that is one row"),
    (lambda n, dtype: 8 * n * n * np.dtype(dtype).itemsize, "case 'a single float32 score' — .*that is bits"),
    (lambda n, dtype: n * n * np.dtype(dtype).itemsize / 2**30, "case 'a single float32 score' — .*that is in GiB"),
    (lambda n, dtype: 2 * n * n, "case 'a single float32 score' — .*float32 has 4 bytes per entry, not 2"),
])
def test_score_matrix_bytes_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb01.check_score_matrix_bytes(wrong)


def test_score_matrix_bytes_solution_passes(capsys):
    assert nb01.SCORE_MATRIX_BYTES.use(nb01.score_matrix_bytes_solution) is nb01.score_matrix_bytes_solution
    out = capsys.readouterr().out
    assert out.startswith("passed: score_matrix_bytes") and "bytes of the score matrix: passed" in out


# -- exercise 3: the previous-token head -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def heads():
    from flashlib.data import load_attention_data
    data = load_attention_data()
    scores = nb01._mean_offset_attention(data, -1)
    nexts = nb01._mean_offset_attention(data, +1)
    return data, max(scores, key=scores.get), max(nexts, key=nexts.get)


def test_previous_token_head_stub_is_not_attempted(capsys):
    assert nb01.PREVIOUS_TOKEN_HEAD.use(_stub) == nb01.previous_token_head_solution()  # the notebook's stub raises
    assert "exercise 3: a previous-token head: not attempted yet" in capsys.readouterr().out


def test_previous_token_head_wrong_answers_fail_with_their_hint(heads):
    data, best, following = heads
    assert following != best
    with pytest.raises(CheckFailed, match="the head that looks at the NEXT token"):
        nb01.check_previous_token_head(following, data)
    with pytest.raises(CheckFailed, match="count(s)? from 0"):
        nb01.check_previous_token_head((best[0] + 1, best[1] + 1), data)
    with pytest.raises(CheckFailed, match="one past the best head in layer: layers and heads count from 0"):
        nb01.check_previous_token_head((best[0] + 1, best[1]), data)
    if best[0] != best[1]:
        with pytest.raises(CheckFailed, match="is the best head's \\(head, layer\\): answer \\(layer, head\\)"):
            nb01.check_previous_token_head((best[1], best[0]), data)
    other = (0, 0) if best != (0, 0) else (0, 1)
    with pytest.raises(CheckFailed, match="one head does better"):
        nb01.check_previous_token_head(other, data)
    with pytest.raises(CheckFailed, match="not a \\(layer, head\\) pair"):
        nb01.check_previous_token_head(3, data)


def test_previous_token_head_solution_passes(heads, capsys):
    data, best, _ = heads
    nb01.check_previous_token_head(list(best), data)
    assert capsys.readouterr().out.startswith("passed: the previous-token head")
    assert nb01.previous_token_head_solution() == best
    assert nb01.PREVIOUS_TOKEN_HEAD.use(lambda: best) == best  # the checker loads the data itself
    assert capsys.readouterr().out.endswith("exercise 3: a previous-token head: passed\n")
