"""The teaching solutions of notebook 06's puzzles (the forward kernel; the causal index map and kernel) and
exercises (the softcapped kernel, the skipped steps and copies counted, the blocks that fit a budget), kept apart
from their checkers in :mod:`flashlib.exercises.flash_kernel`, which imports them. Their source is what the
notebook's hint cells show (``notebooks/make_hint_cells.py``)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flashlib.geometry import MASK_VALUE
from flashlib.kernels import BlockSizes
from flashlib.kernels.block_sizes import vmem_limit_bytes

__all__ = ["NT_DIMS", "causal_kv_index_map_solution", "skip_counts_solution", "flash_kernel_causal_solution",
           "flash_kernel_softcap_solution", "flash_kernel_solution", "pick_blocks_solution"]

NT_DIMS = (((1,), (1,)), ((), ()))  # [m, d] x [n, d] -> [m, n]: q @ k.T without a transpose


# -- the solutions: what the notebook's stubs ask for -------------------------------------------------------
def flash_kernel_solution(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, scale):
    kv_block = pl.program_id(3)

    @pl.when(kv_block == 0)  # init: the first key block of this query block starts from an empty state
    def init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # body, every step: fold this key block into the running state (notebook 04's update, on refs)
    s = lax.dot_general(q_ref[...], k_ref[...], NT_DIMS, preferred_element_type=jnp.float32) * scale  # [bq, bk]
    m_prev = m_ref[...]  # [bq, 1]
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)  # rescales what was accumulated against the old maximum
    p = jnp.exp(s - m_next)  # [bq, bk]
    m_ref[...] = m_next
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)

    @pl.when(kv_block == pl.num_programs(3) - 1)  # finalize: one division per row, on the last key block
    def finalize():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def causal_kv_index_map_solution(b, h, i, j, *, block_q, block_k, offset):
    last = lax.div((i + 1) * block_q - 1 + offset, block_k)  # the block of query block i's last visible key
    return b, h, jnp.minimum(j, last), 0  # past the diagonal: repeat the block already in VMEM, no copy


def flash_kernel_causal_solution(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, scale, offset):
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    q_block, kv_block = pl.program_id(2), pl.program_id(3)

    @pl.when(kv_block == 0)
    def init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(kv_block <= lax.div((q_block + 1) * block_q - 1 + offset, block_k))  # skip blocks past the diagonal
    def body():
        s = lax.dot_general(q_ref[...], k_ref[...], NT_DIMS, preferred_element_type=jnp.float32) * scale
        q_pos = q_block * block_q + lax.broadcasted_iota(jnp.int32, s.shape, 0)  # [bq, bk] absolute positions
        kv_pos = kv_block * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(kv_pos <= q_pos + offset, s, MASK_VALUE)  # finite: a masked row never makes -inf - -inf
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha, p = jnp.exp(m_prev - m_next), jnp.exp(s - m_next)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v_ref.dtype), v_ref[...],
                                                      preferred_element_type=jnp.float32)

    @pl.when(kv_block == pl.num_programs(3) - 1)  # the last grid step, skipped or not
    def finalize():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


# -- the exercises' solutions --------------------------------------------------------------------------------
def flash_kernel_softcap_solution(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, scale, cap):
    kv_block = pl.program_id(3)

    @pl.when(kv_block == 0)
    def init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    s = lax.dot_general(q_ref[...], k_ref[...], NT_DIMS, preferred_element_type=jnp.float32) * scale  # [bq, bk]
    s = cap * jnp.tanh(s / cap)  # the softcap, on the scaled scores, before the online update
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next)
    m_ref[...] = m_next
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)

    @pl.when(kv_block == pl.num_programs(3) - 1)
    def finalize():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def skip_counts_solution():
    tokens, block_q, block_k = 1024, 128, 256
    skipped, copies, previous = 0, 0, None
    for i in range(tokens // block_q):  # the grid's steps in order: query blocks, then key blocks
        last = ((i + 1) * block_q - 1) // block_k  # the key block of query block i's last query (causal: key <= query)
        for j in range(tokens // block_k):
            skipped += j > last  # past the diagonal: pl.when skips the body
            block = min(j, last)  # the clamped index map
            copies += block != previous  # Pallas copies only when the block index changes from the step before
            previous = block
    return skipped, copies


def pick_blocks_solution(head_dim, dtype, generation):
    sizes = (128, 256, 512, 1024, 2048)
    limit = vmem_limit_bytes(generation)
    fits = [(bq, bk) for bq in sizes for bk in sizes if BlockSizes(bq, bk).vmem_bytes(head_dim, dtype) <= limit]
    return max(fits, key=lambda b: (b[0] * b[1], b[0]))  # the largest product; between equal ones, the larger bq
