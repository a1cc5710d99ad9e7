"""The teaching solutions of notebook 04's puzzle (the one-head flash attention and its fold) and exercises (one
head from scratch, the log-sum-exp, the exponents of scratch memory), kept apart from their checkers in
:mod:`flashlib.exercises.flash_jax`, which imports them. Their source is what the notebook's hint cells show
(``notebooks/make_hint_cells.py``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from flashlib import reference
from flashlib.blockwise import pad_to_multiple

__all__ = ["flash_attention_head_solution", "flash_attention_one_head_solution", "flash_attention_with_lse_solution",
           "fold_kv_block", "scratch_exponents_solution"]


# -- the puzzle's solution (the notebook's worked code) ---------------------------------------------------


def fold_kv_block(m, l, acc, s, v_blk):  # noqa: E741 (the notebook's section 1, repeated for the solution)
    m_new = jnp.maximum(m, s.max(axis=1))  # [bq]
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # [bq]    a row that has seen no key yet: 0, not NaN
    alpha = jnp.exp(m - m_safe)  # [bq]    rescales what was accumulated so far (<= 1)
    p = jnp.exp(s - m_safe[:, None])  # [bq, bk] this block's unnormalised probabilities
    return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v_blk


def flash_attention_head_solution(q, k, v, *, causal=False, block_q=128, block_k=128):
    # Flash attention for one head: q [q_len, d], k, v [kv_len, d] -> [q_len, d]. Any lengths.
    (q_len, d), kv_len = q.shape, k.shape[0]
    block_q, block_k = min(block_q, q_len), min(block_k, kv_len)  # a short sequence is one block
    qb = pad_to_multiple(q, 0, block_q).reshape(-1, block_q, d)  # [nq, bq, d], zero-padded
    kb = pad_to_multiple(k, 0, block_k).reshape(-1, block_k, d)  # [nk, bk, d]
    vb = pad_to_multiple(v, 0, block_k).reshape(-1, block_k, d)  # [nk, bk, d]

    def one_q_block(i, q_blk):
        q_pos = i * block_q + jnp.arange(block_q)[:, None]  # [bq, 1] absolute query positions

        def kv_step(state, inputs):
            j, k_blk, v_blk = inputs
            kv_pos = j * block_k + jnp.arange(block_k)[None, :]  # [1, bk] absolute key positions
            visible = kv_pos < kv_len  # padded keys are never visible
            if causal:
                visible = visible & reference.causal_visible(q_pos, kv_pos, q_len=q_len, kv_len=kv_len)
            s = jnp.where(visible, q_blk @ k_blk.T * reference.default_scale(d), -jnp.inf)  # [bq, bk]
            return fold_kv_block(*state, s, v_blk), None

        init = (jnp.full(block_q, -jnp.inf), jnp.zeros(block_q), jnp.zeros((block_q, d)))
        (m, l, acc), _ = jax.lax.scan(kv_step, init, (jnp.arange(len(kb)), kb, vb))
        return acc / jnp.where(l == 0.0, 1.0, l)[:, None]  # a row that saw no key gives 0, not NaN

    out = jax.lax.map(lambda args: one_q_block(*args), (jnp.arange(len(qb)), qb))  # [nq, bq, d]
    return out.reshape(-1, d)[:q_len]  # drop the padded query rows


# -- the exercises' solutions -------------------------------------------------------------------------------


def flash_attention_one_head_solution(q, k, v, block_k):
    # q [q_len, d], k, v [kv_len, d] -> out [q_len, d], no mask; the state in q's dtype
    m = jnp.full(q.shape[0], -jnp.inf, q.dtype)  # running maximum of each row's scores
    l, acc = jnp.zeros(q.shape[0], q.dtype), jnp.zeros(q.shape, q.dtype)  # running sum, unnormalised output
    for lo in range(0, k.shape[0], block_k):  # the last block is shorter, or the whole of k
        s = q @ k[lo:lo + block_k].T * reference.default_scale(q.shape[1])  # [q_len, <= block_k]
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new[:, None])  # rescale the past; this block's weights
        m, l, acc = m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v[lo:lo + block_k]
    return acc / l[:, None]  # divide once, at the end


def flash_attention_with_lse_solution(q, k, v, block_k):
    # exercise 1's loop, returning (out [q_len, d], lse [q_len])
    m = jnp.full(q.shape[0], -jnp.inf, q.dtype)
    l, acc = jnp.zeros(q.shape[0], q.dtype), jnp.zeros(q.shape, q.dtype)
    for lo in range(0, k.shape[0], block_k):
        s = q @ k[lo:lo + block_k].T * reference.default_scale(q.shape[1])
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new[:, None])
        m, l, acc = m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v[lo:lo + block_k]
    return acc / l[:, None], m + jnp.log(l)  # l = sum of e^(s - m), so log(sum of e^s) = m + log(l)


def scratch_exponents_solution():
    # The largest array each method holds at once (one head), as a number of floats:
    block_q = 128
    peak = {"naive": lambda n, block_k: n * n,  # the whole [N, N] score matrix
            "library blockwise": lambda n, block_k: n * block_k,  # one [N, block_k] slab: every query block at once
            "ours": lambda n, block_k: block_q * block_k}  # one [block_q, block_k] tile; N only sets the step count
    n, block_k = 2048, 256  # where the checker starts doubling
    exponents = {}
    for method, size in peak.items():  # doubling a size multiplies it by 2^exponent
        a = math.log2(size(2 * n, block_k) / size(n, block_k))
        b = math.log2(size(n, 2 * block_k) / size(n, block_k))
        exponents[method] = (round(a), round(b))
    return exponents
