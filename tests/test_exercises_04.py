"""Notebook 04's puzzle and exercises (:mod:`flashlib.exercises.flash_jax`), run three ways: on the notebook's stub
(reported as not attempted, no traceback), on plausible wrong answers (each fails, with the message that names
its mistake) and on a solution (it passes)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashlib import reference
from flashlib.blockwise import pad_to_multiple
from flashlib.checks import CheckFailed, exercise
from flashlib.exercises import flash_jax as nb04


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- the puzzle: flash_attention_head ------------------------------------------------------------------------


def head_with(mistake, q, k, v, *, causal=False, block_q=128, block_k=128):
    """The notebook's one-head flash attention, with one learner's mistake switched on."""
    (q_len, d), kv_len = q.shape, k.shape[0]
    block_q, block_k = min(block_q, q_len), min(block_k, kv_len)
    qb = pad_to_multiple(q, 0, block_q).reshape(-1, block_q, d)
    kb = pad_to_multiple(k, 0, block_k).reshape(-1, block_k, d)
    vb = pad_to_multiple(v, 0, block_k).reshape(-1, block_k, d)

    def one_q_block(i, q_blk):
        q_pos = i * block_q + jnp.arange(block_q)[:, None]

        def kv_step(state, inputs):
            m, l, acc = state  # noqa: E741
            j, k_blk, v_blk = inputs
            kv_pos = j * block_k + jnp.arange(block_k)[None, :]
            visible = kv_pos < kv_len if mistake != "no padding mask" else jnp.ones((1, block_k), bool)
            if causal:
                offset = 0 if mistake == "top-left" else kv_len - q_len
                visible = visible & (kv_pos <= q_pos + offset)
            s = jnp.where(visible, q_blk @ k_blk.T * reference.default_scale(d), -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[:, None])
            if mistake == "no rescale":  # forgets that acc was accumulated against the old maximum
                return (m_new, alpha * l + p.sum(axis=1), acc + p @ v_blk), None
            return (m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v_blk), None

        init = (jnp.full(block_q, -jnp.inf), jnp.zeros(block_q), jnp.zeros((block_q, d)))
        if mistake == "python loops":  # right numbers, but the loop is unrolled into the program
            state = init
            for j in range(len(kb)):
                state, _ = kv_step(state, (j, kb[j], vb[j]))
            m, l, acc = state  # noqa: E741
        else:
            (m, l, acc), _ = jax.lax.scan(kv_step, init, (jnp.arange(len(kb)), kb, vb))
        if mistake == "no division":
            return acc
        return acc / jnp.where(l == 0.0, 1.0, l)[:, None]

    if mistake == "vmap":  # right numbers, but every query block's tile exists at once
        out = jax.vmap(one_q_block)(jnp.arange(len(qb)), qb)
    elif mistake == "python loops":
        out = jnp.stack([one_q_block(i, qb[i]) for i in range(len(qb))])
    else:
        out = jax.lax.map(lambda args: one_q_block(*args), (jnp.arange(len(qb)), qb))
    return out.reshape(-1, d)[:q_len]


def test_head_stub_falls_back_to_the_solution(capsys):
    assert nb04.FLASH_ATTENTION_HEAD.use(_stub) is nb04.flash_attention_head_solution
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, message", [
    ("no padding mask", r"padded keys are visible.*kv_pos < kv_len"),
    ("top-left", r"top-left aligned.*bottom-right"),
    ("no division", r"not normalised: divide acc by l"),
    ("no rescale", r"alpha = exp\(m_old - m_new\)"),
    ("python loops", r"traced program.*jax.lax.scan"),
    ("vmap", r"scratch memory.*one after another with jax.lax.map"),
])
def test_head_wrong_answers_fail_with_their_hint(mistake, message):
    with pytest.raises(CheckFailed, match=message):
        nb04.check_flash_attention_head(functools.partial(head_with, mistake))


def test_head_solution_passes(capsys):
    answer = nb04.flash_attention_head_solution
    assert nb04.FLASH_ATTENTION_HEAD.use(answer) is answer
    out = capsys.readouterr().out
    assert out.startswith("passed: flash_attention_head")
    assert "solved — the rest of this notebook runs your version" in out


# -- exercise 1: one head from scratch -------------------------------------------------------------------------


def one_head_solution(q, k, v, block_k):
    m, l, acc = jnp.full(q.shape[0], -jnp.inf), jnp.zeros(q.shape[0]), jnp.zeros(q.shape)  # noqa: E741
    for lo in range(0, k.shape[0], block_k):
        s = q @ k[lo:lo + block_k].T * reference.default_scale(q.shape[1])
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new[:, None])
        m, l, acc = m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v[lo:lo + block_k]  # noqa: E741
    return acc / l[:, None]


def one_head_whole_blocks_only(q, k, v, block_k):  # range(kv_len // block_k): the short last block is lost
    m, l, acc = jnp.full(q.shape[0], -jnp.inf), jnp.zeros(q.shape[0]), jnp.zeros(q.shape)  # noqa: E741
    for b in range(max(1, k.shape[0] // block_k)):
        lo = b * block_k
        s = q @ k[lo:lo + block_k].T * reference.default_scale(q.shape[1])
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new[:, None])
        m, l, acc = m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v[lo:lo + block_k]  # noqa: E741
    return acc / l[:, None]


def one_head_numpy_float64(q, k, v, block_k):  # right numbers, but np.zeros makes a float64 accumulator
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    m, l, acc = np.full(q.shape[0], -np.inf), np.zeros(q.shape[0]), np.zeros(q.shape)  # noqa: E741
    for lo in range(0, k.shape[0], block_k):
        s = q @ k[lo:lo + block_k].T * reference.default_scale(q.shape[1])
        m_new = np.maximum(m, s.max(axis=1))
        alpha, p = np.exp(m - m_new), np.exp(s - m_new[:, None])
        m, l, acc = m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v[lo:lo + block_k]  # noqa: E741
    return acc / l[:, None]


def one_head_no_division(q, k, v, block_k):
    m, acc = jnp.full(q.shape[0], -jnp.inf), jnp.zeros(q.shape)
    for lo in range(0, k.shape[0], block_k):
        s = q @ k[lo:lo + block_k].T * reference.default_scale(q.shape[1])
        m_new = jnp.maximum(m, s.max(axis=1))
        acc = jnp.exp(m - m_new)[:, None] * acc + jnp.exp(s - m_new[:, None]) @ v[lo:lo + block_k]
        m = m_new
    return acc  # forgot acc / l


def one_head_all_at_once(q, k, v, block_k):  # right numbers, but ignores block_k: plain softmax attention
    return jax.nn.softmax(q @ k.T * reference.default_scale(q.shape[1]), axis=1) @ v


def test_one_head_stub_is_not_attempted(capsys):
    exercise("exercise 1", lambda: _stub, nb04.check_one_head)  # as the notebook calls it
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (one_head_whole_blocks_only, r"case 'block_k = 32 does not divide.*keys past the last whole block are missing"),
    (one_head_numpy_float64, r"output dtype float64, expected q's dtype float32"),
    (one_head_no_division, r"not normalised"),
    (one_head_all_at_once, r"the scores of all 75 keys exist at once .*block by block"),
])
def test_one_head_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb04.check_one_head(wrong)


def test_one_head_solution_passes(capsys):
    exercise("exercise 1", lambda: one_head_solution, nb04.check_one_head)
    assert capsys.readouterr().out.startswith("passed: exercise 1")


# -- exercise 2: the log-sum-exp ----------------------------------------------------------------------------------


def with_lse(q, k, v, block_k, *, lse_of=lambda m, l: m + jnp.log(l)):  # noqa: E741
    m, l, acc = jnp.full(q.shape[0], -jnp.inf), jnp.zeros(q.shape[0]), jnp.zeros(q.shape)  # noqa: E741
    for lo in range(0, k.shape[0], block_k):
        s = q @ k[lo:lo + block_k].T * reference.default_scale(q.shape[1])
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new[:, None])
        m, l, acc = m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v[lo:lo + block_k]  # noqa: E741
    return acc / l[:, None], lse_of(m, l)


def test_lse_stub_is_not_attempted(capsys):
    exercise("exercise 2", lambda: _stub, nb04.check_lse)
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("lse_of, message", [
    (lambda m, l: m, r"lse equals the row maximum m: add log\(l\)"),  # noqa: E741
    (lambda m, l: jnp.log(l), r"lse equals log\(l\) alone"),  # noqa: E741
    (lambda m, l: m + jnp.log(l)[:, None], r"lse has shape \(50, 50\), expected \(50,\)"),  # noqa: E741
])
def test_lse_wrong_answers_fail_with_their_hint(lse_of, message):
    with pytest.raises(CheckFailed, match=message):
        nb04.check_lse(functools.partial(with_lse, lse_of=lse_of))


def test_lse_all_at_once_fails():  # jax.nn.logsumexp of the whole score matrix: right numbers, not flash attention
    def all_at_once(q, k, v, block_k):
        s = q @ k.T * reference.default_scale(q.shape[1])
        return jax.nn.softmax(s, axis=1) @ v, jax.nn.logsumexp(s, axis=1)

    with pytest.raises(CheckFailed, match=r"exercise 2, case 'block_k = 32' — the scores of all 75 keys exist at once"):
        nb04.check_lse(all_at_once)


def test_lse_solution_passes(capsys):
    exercise("exercise 2", lambda: with_lse, nb04.check_lse)
    assert capsys.readouterr().out.startswith("passed: exercise 2")


# -- exercise 3: how scratch scales -------------------------------------------------------------------------------


RIGHT = {"naive": (2, 0), "library blockwise": (1, 1), "ours": (0, 1)}


def test_exponents_stub_is_not_attempted(capsys):
    exercise("exercise 3", lambda: {"naive": None, "library blockwise": None, "ours": None},
             nb04.check_scratch_exponents)
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    ({**RIGHT, "ours": (0, 0)}, r"ours — you predicted scratch ∝ block_k\^0.*\[block_q, block_k\]"),
    ({**RIGHT, "library blockwise": (2, 1)}, r"library blockwise — you predicted scratch ∝ N\^2.*\[N, block_k\] slab"),
    ({**RIGHT, "naive": (2, 1)}, r"naive — .*block_k\^1.*no blocks"),
])
def test_exponents_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb04.check_scratch_exponents(wrong)


def test_exponents_solution_passes(capsys):
    exercise("exercise 3", lambda: RIGHT, nb04.check_scratch_exponents)
    assert capsys.readouterr().out.startswith("passed: exercise 3")
