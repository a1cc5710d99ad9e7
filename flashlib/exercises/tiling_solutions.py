"""The teaching solutions of notebook 02's puzzles and exercises (the two products of attention tile by tile, a
blocked matmul with rectangular tiles, the census of a causal grid, the query tile that cuts HBM traffic
tenfold), kept apart from their checkers in :mod:`flashlib.exercises.tiling`, which imports them. Their source is
what the notebook's hint cells show (``notebooks/make_hint_cells.py``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["pick_block_q_solution", "causal_count_solution", "tiled_matmul_solution", "tiled_pv_solution",
           "tiled_scores_solution"]


# -- puzzles 1 and 2 -------------------------------------------------------------------------------------------


def tiled_scores_solution(q, k, block_q, block_k, matmul=jnp.matmul):
    scale = 1 / np.sqrt(q.shape[1])
    s = jnp.zeros((q.shape[0], k.shape[0]))
    for i in range(0, q.shape[0], block_q):
        for j in range(0, k.shape[0], block_k):
            s_ij = matmul(q[i : i + block_q], k[j : j + block_k].T) * scale  # [block_q, block_k], shorter at the ends
            s = s.at[i : i + block_q, j : j + block_k].set(s_ij)
    return s


def tiled_pv_solution(p, v, block_q, block_k, matmul=jnp.matmul):
    out = jnp.zeros((p.shape[0], v.shape[1]))
    for i in range(0, p.shape[0], block_q):
        acc = jnp.zeros((p[i : i + block_q].shape[0], v.shape[1]))  # [rows of this tile, d]: O_i being summed
        for j in range(0, p.shape[1], block_k):
            acc += matmul(p[i : i + block_q, j : j + block_k], v[j : j + block_k])
        out = out.at[i : i + block_q].set(acc)  # written once, after its last key tile
    return out


# -- exercises 1 to 3 ------------------------------------------------------------------------------------------


def tiled_matmul_solution(a, b, block_m, block_n, block_k, matmul=jnp.matmul):
    c = jnp.zeros((a.shape[0], b.shape[1]))
    for i in range(0, a.shape[0], block_m):  # row of output tiles
        for j in range(0, b.shape[1], block_n):  # column of output tiles
            acc = jnp.zeros((block_m, block_n))  # output tile (i, j), summed over the shared dimension
            for p in range(0, a.shape[1], block_k):
                acc += matmul(a[i : i + block_m, p : p + block_k], b[p : p + block_k, j : j + block_n])
            c = c.at[i : i + block_m, j : j + block_n].set(acc)  # written once
    return c


def causal_count_solution():
    q_len, kv_len, block = 384, 1024, 128
    offset = kv_len - q_len  # bottom-right aligned: query i sees keys j <= i + offset
    counts = {"steps": 0, "skipped": 0, "masked": 0}
    for q_lo in range(0, q_len, block):  # the tile's queries: q_lo to q_lo + block - 1
        for k_lo in range(0, kv_len, block):  # its keys: k_lo to k_lo + block - 1
            counts["steps"] += 1
            if k_lo > q_lo + block - 1 + offset:  # even the tile's last query sees none of its keys
                counts["skipped"] += 1
            elif k_lo + block - 1 > q_lo + offset:  # its first query misses some: the diagonal cuts through
                counts["masked"] += 1
    return counts


def pick_block_q_solution():
    n, d, itemsize = 4096, 128, 2  # one bfloat16 head
    naive = itemsize * (4 * n * d + 4 * n * n)  # Q, K, V read, O written; S written, read; P written, read
    for block_q in [2**p for p in range(13)]:  # 1, 2, 4, ..., 4096: the smallest first
        tiled = itemsize * (2 * n * d + 2 * -(-n // block_q) * n * d)  # Q, O once; K, V once per query tile
        if naive >= 10 * tiled:
            return block_q, block_q * d * itemsize / 1024  # the [block_q, d] Q tile, in KiB
