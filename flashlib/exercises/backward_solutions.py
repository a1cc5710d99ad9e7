"""The teaching solutions of notebook 07's puzzles (``probabilities``, ``first_q_block`` and the dK/dV kernel;
``last_kv_block`` and the dQ kernel) and exercises (D both ways, dV of one key block, the busiest dK/dV
program), kept apart from their checkers in :mod:`flashlib.exercises.backward`, which
imports them. Their source is what the notebook's hint cells show (``notebooks/make_hint_cells.py``)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flashlib.geometry import MASK_VALUE

__all__ = ["NT_DIMS", "TN_DIMS", "busiest_solution", "d_both_ways_solution", "dkv_kernel", "dq_kernel",
           "dv_of_key_block_solution", "first_q_block", "last_kv_block", "probabilities"]

NT_DIMS = (((1,), (1,)), ((), ()))  # [m, d] x [n, d] -> [m, n]: a @ b.T
TN_DIMS = (((0,), (0,)), ((), ()))  # [m, n] x [m, d] -> [n, d]: a.T @ b


# -- the solutions: what the notebook's stubs ask for -------------------------------------------------------


def probabilities(q_ref, k_ref, lse_ref, q_block, kv_block, *, scale, causal, offset):
    # P = exp(S - lse) for one [block_q, block_k] tile, 0 where the causal mask hides the key.
    s = lax.dot_general(q_ref[...], k_ref[...], NT_DIMS, preferred_element_type=jnp.float32) * scale
    if causal:  # query i sees key j when j <= i + offset
        q_pos = q_block * q_ref.shape[0] + lax.broadcasted_iota(jnp.int32, s.shape, 0)  # [bq, bk]
        kv_pos = kv_block * k_ref.shape[0] + lax.broadcasted_iota(jnp.int32, s.shape, 1)  # [bq, bk]
        s = jnp.where(kv_pos <= q_pos + offset, s, MASK_VALUE)
    return jnp.exp(s - lse_ref[...])  # lse_ref: [bq, 1]


def first_q_block(j, block_q, block_k, offset):  # the first query block that sees key block j
    return lax.div(jnp.maximum(j * block_k - offset, 0), block_q)  # its first key is seen from query j*bk - offset


def dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dk_ref, dv_ref, dk_acc, dv_acc, *, scale, causal,
               offset):
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    kv_block, q_block = pl.program_id(2), pl.program_id(3)  # the key block stays; query blocks stream past

    @pl.when(q_block == 0)
    def init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    @pl.when(q_block >= first_q_block(kv_block, block_q, block_k, offset) if causal else True)
    def body():
        p = probabilities(q_ref, k_ref, lse_ref, q_block, kv_block, scale=scale, causal=causal, offset=offset)
        do = do_ref[...]  # [bq, d]
        dv_acc[...] += lax.dot_general(p.astype(do.dtype), do, TN_DIMS, preferred_element_type=jnp.float32)
        dp = lax.dot_general(do, v_ref[...], NT_DIMS, preferred_element_type=jnp.float32)  # [bq, bk]
        ds = p * (dp - d_ref[...])  # [bq, bk]   d_ref: [bq, 1]
        dk_acc[...] += lax.dot_general(ds.astype(q_ref.dtype), q_ref[...], TN_DIMS,
                                       preferred_element_type=jnp.float32)  # [bk, d]

    @pl.when(q_block == pl.num_programs(3) - 1)
    def finalize():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)  # the scale once, at the end
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def last_kv_block(i, block_q, block_k, offset):  # the last key block query block i sees (0 if it sees none)
    return lax.div(jnp.maximum((i + 1) * block_q - 1 + offset, 0), block_k)  # its last query sees up to there


def dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dq_ref, dq_acc, *, scale, causal, offset):
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    q_block, kv_block = pl.program_id(2), pl.program_id(3)  # the query block stays; key blocks stream past

    @pl.when(kv_block == 0)
    def init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    @pl.when(kv_block <= last_kv_block(q_block, block_q, block_k, offset) if causal else True)
    def body():
        p = probabilities(q_ref, k_ref, lse_ref, q_block, kv_block, scale=scale, causal=causal, offset=offset)
        dp = lax.dot_general(do_ref[...], v_ref[...], NT_DIMS, preferred_element_type=jnp.float32)  # [bq, bk]
        ds = p * (dp - d_ref[...])  # [bq, bk]
        dq_acc[...] += jnp.dot(ds.astype(k_ref.dtype), k_ref[...], preferred_element_type=jnp.float32)

    @pl.when(kv_block == pl.num_programs(3) - 1)
    def finalize():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


# -- the exercises' solutions --------------------------------------------------------------------------------


def d_both_ways_solution(p, dp, out, do):
    # p, dp [N, N]; out, do [N, d] -> two arrays [N]: one number per query row each
    return jnp.sum(p * dp, axis=1), jnp.sum(do * out, axis=1)  # the definition; the form a kernel has up front


def dv_of_key_block_solution(q, k, do, lse, j, *, block_q, block_k, scale):
    k_j = k[j * block_k:(j + 1) * block_k]  # [bk, d]
    kv_pos = j * block_k + jnp.arange(block_k)[None, :]  # [1, bk]
    dv = jnp.zeros((block_k, do.shape[1]), jnp.float32)
    for i in range(j * block_k // block_q, q.shape[0] // block_q):  # from the first query block that sees block j
        rows = slice(i * block_q, (i + 1) * block_q)
        q_pos = i * block_q + jnp.arange(block_q)[:, None]  # [bq, 1]
        s = jnp.where(kv_pos <= q_pos, q[rows] @ k_j.T * scale, -jnp.inf)  # causal: query i sees key j <= i
        dv += jnp.exp(s - lse[rows, None]).T @ do[rows]  # P_ij^T dO_i, P recomputed from the saved lse
    return dv


def busiest_solution():
    tokens, block = 4096, 512
    blocks = tokens // block
    steps = [0] * blocks  # body steps of each key block's program
    for j in range(blocks):  # the dK/dV kernel: one program per key block, query blocks stream past
        for i in range(blocks):
            steps[j] += i >= j  # causal, square blocks: query block i sees key block j when i >= j
    most = max(range(blocks), key=lambda j: steps[j])
    fewest = min(range(blocks), key=lambda j: steps[j])
    return most, steps[most], fewest, steps[fewest]
