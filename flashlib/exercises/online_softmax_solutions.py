"""The teaching solutions of notebook 03's puzzles and exercises (the online update, the merge of two states, the
merge of ``(m, l)`` alone, a balanced merge tree, the one-pass row visited backwards), kept apart from their
checkers in :mod:`flashlib.exercises.online_softmax`, which imports them. Their source is what the notebook's
hint cells show (``notebooks/make_hint_cells.py``)."""

from __future__ import annotations

import jax.numpy as jnp

from flashlib import reference
from flashlib.reference import SoftmaxState

__all__ = ["merge_ml_solution", "merge_states_solution", "merge_tree_solution",
           "online_attention_row_reversed_solution", "online_update_solution"]


# -- puzzles 1 and 2 -------------------------------------------------------------------------------------------


def online_update_solution(state, s, v):
    m_new = jnp.maximum(state.m, jnp.max(s, axis=-1))  # [q]: the larger of the old max and the block's
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no visible key yet: 0, not -inf
    alpha = jnp.exp(state.m - m_safe)  # [q]: how much everything seen so far shrinks
    p = jnp.exp(s - m_safe[:, None])  # [q, k]: the block's weights, all <= 1 (0 for a masked key)
    return SoftmaxState(m=m_new, l=alpha * state.l + p.sum(axis=-1), acc=alpha[:, None] * state.acc + p @ v)


def merge_states_solution(a, b):
    m = jnp.maximum(a.m, b.m)  # [q]: the common maximum
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)  # rows neither side has seen stay empty, not NaN
    alpha, beta = jnp.exp(a.m - m_safe), jnp.exp(b.m - m_safe)  # [q]: each side's rescale (0 for an empty side)
    return SoftmaxState(m=m, l=alpha * a.l + beta * b.l, acc=alpha[:, None] * a.acc + beta[:, None] * b.acc)


# -- exercises 1 to 3 ------------------------------------------------------------------------------------------


def merge_ml_solution(m_a, l_a, m_b, l_b):
    m = jnp.maximum(m_a, m_b)  # [q]: the common maximum
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)  # a row neither side has seen: 0, never -inf - (-inf)
    return m, l_a * jnp.exp(m_a - m_safe) + l_b * jnp.exp(m_b - m_safe)  # each sum rescaled to m, then added


def merge_tree_solution(states, merge=reference.merge_states):
    while len(states) > 1:  # one level of the tree per pass
        pairs = [merge(a, b) for a, b in zip(states[::2], states[1::2], strict=False)]  # neighbours, in pairs
        states = pairs + ([states[-1]] if len(states) % 2 else [])  # an odd one out is carried up a level
    return states[0]


def online_attention_row_reversed_solution(s, v, block, update=online_update_solution):
    state = SoftmaxState(m=jnp.full(1, -jnp.inf), l=jnp.zeros(1), acc=jnp.zeros((1, v.shape[1])))  # nothing seen
    for lo in reversed(range(0, len(s), block)):  # section 5's blocks, the last (maybe shorter) one first
        state = update(state, s[None, lo : lo + block], v[lo : lo + block])
    return reference.state_output(state)[0]  # acc / l, once at the end: [d]
