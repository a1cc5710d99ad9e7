"""The teaching solutions of notebook 01's puzzles and exercises, kept apart from their checkers in
:mod:`flashlib.exercises.softmax`, which imports them. Their source is what the notebook's hint cells show
(``notebooks/make_hint_cells.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flashlib.data import load_attention_data

__all__ = ["attention_solution", "my_attention_solution", "previous_token_head_solution",
           "score_matrix_bytes_solution", "stable_softmax_solution"]


# -- the puzzles -----------------------------------------------------------------------------------------------


def attention_solution(q, k, v):
    s = q @ k.T / jnp.sqrt(q.shape[-1])  # [N, M]  scores
    p = jax.nn.softmax(s, axis=-1)  # [N, M]  each row sums to 1
    return p @ v  # [N, d]  weighted average of value rows


def stable_softmax_solution(x, axis=-1):
    m = jnp.max(x, axis=axis, keepdims=True)  # the row maximum, kept as an axis so it broadcasts back
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row of only -inf: exponentiate against 0 (exp(-inf) = 0)
    e = jnp.exp(x - m)  # every exponent <= 0: no overflow
    total = jnp.sum(e, axis=axis, keepdims=True)  # >= 1, except for a row of only -inf (0)
    return e / jnp.where(total == 0.0, 1.0, total)  # that row stays 0 instead of 0 / 0 = NaN


# -- the exercises ---------------------------------------------------------------------------------------------


def my_attention_solution(q, k, v):
    s = q @ k.T / jnp.sqrt(q.shape[-1])  # [N, M]  scores
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))  # [N, M]  each row's maximum subtracted: exponents <= 0
    return e / jnp.sum(e, axis=-1, keepdims=True) @ v  # [N, d]  each row of weights sums to 1


def score_matrix_bytes_solution(n, dtype):
    return n * n * np.dtype(dtype).itemsize  # n x n entries of itemsize bytes; Python ints never overflow


def previous_token_head_solution():
    data = load_attention_data()  # the notebook's `data`
    share = {}  # (layer, head) -> mean attention of query i on key i - 1, over every i >= 1 of every sentence
    for layer in range(data.num_layers):
        maps = [data.model_attention(layer, sentence=s)[0] for s in range(data.num_sentences)]  # [heads, L, L]
        for head in range(data.num_heads):
            # the entries [i, i - 1] are the diagonal just below the main one
            below = [np.diagonal(probs[head], offset=-1) for probs in maps]
            share[(layer, head)] = np.mean(np.concatenate(below))
    return max(share, key=share.get)
