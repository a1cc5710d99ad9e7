"""Every exercise checker moved into :mod:`flashlib.exercises`, run three ways: on the notebook's stub (it is
reported as not attempted, no traceback), on plausible wrong answers (each fails, with the message that points
at its mistake) and on a solution (it passes)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from flashlib import reference
from flashlib.checks import CheckFailed
from flashlib.exercises import online_softmax as nb03
from flashlib.reference import SoftmaxState

# -- 03 exercise 1: merge (m, l) ----------------------------------------------------------------------


merge_ml_solution = nb03.merge_ml_solution


def merge_ml_unsafe(m_a, l_a, m_b, l_b):  # exponentiates against m itself: NaN when both sides are empty
    m = jnp.maximum(m_a, m_b)
    return m, l_a * jnp.exp(m_a - m) + l_b * jnp.exp(m_b - m)


def merge_ml_no_rescale(m_a, l_a, m_b, l_b):  # forgets that the sums were taken against different maxima
    return jnp.maximum(m_a, m_b), l_a + l_b


def merge_ml_first_max(m_a, l_a, m_b, l_b):  # keeps the first side's maximum
    safe = jnp.where(jnp.isfinite(m_a), m_a, 0.0)
    return m_a, l_a + l_b * jnp.exp(m_b - safe)


def test_merge_ml_stub_is_not_attempted(capsys):
    def merge_ml(m_a, l_a, m_b, l_b):
        raise NotImplementedError  # your code here: return m, l
    assert nb03.MERGE_ML.use(merge_ml) is merge_ml_solution  # as the notebook calls it
    assert "exercise 1: merge (m, l) only: not attempted yet" in capsys.readouterr().out


def merge_ml_returns_safe_m(m_a, l_a, m_b, l_b):  # hands back the safe maximum (0) for a row nobody has seen
    m, l = merge_ml_solution(m_a, l_a, m_b, l_b)
    return jnp.where(jnp.isfinite(m), m, 0.0), l


def merge_ml_l_first(m_a, l_a, m_b, l_b):  # the right pair, in the wrong order
    return merge_ml_solution(m_a, l_a, m_b, l_b)[::-1]


@pytest.mark.parametrize("wrong, message", [
    (merge_ml_unsafe, "NaN in the result"),
    (merge_ml_no_rescale, "must be rescaled"),
    (merge_ml_first_max, "the larger of the two"),
    (merge_ml_returns_safe_m, "case 'neither side has seen a key' — m is .*a row that has seen no key keeps m = -inf"),
    (merge_ml_l_first, "case 'the second side has the larger maxima' — the result is \\(l, m\\): return m first"),
])
def test_merge_ml_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb03.check_merge_ml(wrong)


def merge_ml_logaddexp(m_a, l_a, m_b, l_b):  # through log-sum-exps: log(0) = -inf is harmless here
    m = jnp.maximum(m_a, m_b)
    lse = jnp.logaddexp(m_a + jnp.log(l_a), m_b + jnp.log(l_b))
    return m, jnp.where(jnp.isneginf(m), 0.0, jnp.exp(lse - jnp.where(jnp.isfinite(m), m, 0.0)))


@pytest.mark.parametrize("valid", [merge_ml_solution, merge_ml_logaddexp])
def test_merge_ml_solution_passes(valid, capsys):
    nb03.check_merge_ml(valid)
    assert capsys.readouterr().out.startswith("passed: merge_ml")


def test_merge_ml_use_says_passed_or_where_the_hints_are(capsys):
    assert nb03.MERGE_ML.use(merge_ml_logaddexp) is merge_ml_logaddexp
    assert capsys.readouterr().out.rstrip().endswith("exercise 1: merge (m, l) only: passed")
    assert nb03.MERGE_ML.use(merge_ml_no_rescale) is merge_ml_solution
    assert "exercise 1: merge (m, l) only: not passed yet — the hints are below" in capsys.readouterr().out


# -- 03 exercise 2: merge a list as a balanced tree -----------------------------------------------------


merge_tree_solution = nb03.merge_tree_solution


def merge_tree_left_fold(states, merge=reference.merge_states):  # right answer, wrong shape: depth n - 1
    result = states[0]
    for state in states[1:]:
        result = merge(result, state)
    return result


def merge_tree_drops_the_odd_one(states, merge=reference.merge_states):  # loses a state on an odd level
    while len(states) > 1:
        states = [merge(a, b) for a, b in zip(states[::2], states[1::2], strict=False)]
    return states[0]


def merge_tree_first_pair_only(states, merge=reference.merge_states):
    return merge(states[0], states[1])


def merge_tree_returns_the_list(states, merge=reference.merge_states):  # stops with [state], not state
    while len(states) > 1:
        states = [merge(a, b) for a, b in zip(states[::2], states[1::2], strict=False)] + states[len(states) // 2 * 2:]
    return states


def merge_tree_recursion_without_merge(states, merge=reference.merge_states):  # the halves use the default
    if len(states) == 1:
        return states[0]
    half = len(states) // 2
    return merge(merge_tree_recursion_without_merge(states[:half]), merge_tree_recursion_without_merge(states[half:]))


@pytest.mark.parametrize("wrong, message", [
    (merge_tree_left_fold, "8 states in order — the merges are 7 deep, a balanced tree of 8 is 3"),
    (merge_tree_drops_the_odd_one, "6 states in order — the output differs"),
    (merge_tree_first_pair_only, "8 states in order — the output differs"),
    (merge_tree_returns_the_list, "8 states in order — got list: return the one SoftmaxState"),
    (merge_tree_recursion_without_merge, "8 states in order — the merges are 1 deep.*use `merge`"),
])
def test_merge_tree_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb03.check_merge_tree(wrong)


def merge_tree_recursive(states, merge=reference.merge_states):  # halves, recursively: as balanced
    if len(states) == 1:
        return states[0]
    half = len(states) // 2
    return merge(merge_tree_recursive(states[:half], merge), merge_tree_recursive(states[half:], merge))


@pytest.mark.parametrize("valid", [merge_tree_solution, merge_tree_recursive])
def test_merge_tree_solution_passes(valid, capsys):
    nb03.check_merge_tree(valid)
    assert "passed: merge_tree" in capsys.readouterr().out


def test_merge_tree_stub_is_not_attempted(capsys):
    def merge_tree(states, merge=reference.merge_states):
        raise NotImplementedError  # your code here: return one SoftmaxState, merging with `merge`
    assert nb03.MERGE_TREE.use(merge_tree) is merge_tree_solution
    assert "exercise 2: order does not matter: not attempted yet" in capsys.readouterr().out
    assert nb03.MERGE_TREE.use(merge_tree_recursive) is merge_tree_recursive
    assert capsys.readouterr().out.rstrip().endswith("exercise 2: order does not matter: passed")


# -- 03 puzzle 1: the online update -------------------------------------------------------------------------


def _safe(m):
    return jnp.where(jnp.isfinite(m), m, 0.0)


def update_unsafe(state, s, v):  # exponentiates against m_new itself: NaN for an empty row and a masked block
    m_new = jnp.maximum(state.m, s.max(axis=-1))
    alpha, p = jnp.exp(state.m - m_new), jnp.exp(s - m_new[:, None])
    return SoftmaxState(m_new, alpha * state.l + p.sum(-1), alpha[:, None] * state.acc + p @ v)


def update_no_rescale_l(state, s, v):  # rescales acc but adds the block's sum to the old l as it was
    m_new = jnp.maximum(state.m, s.max(axis=-1))
    alpha, p = jnp.exp(state.m - _safe(m_new)), jnp.exp(s - _safe(m_new)[:, None])
    return SoftmaxState(m_new, state.l + p.sum(-1), alpha[:, None] * state.acc + p @ v)


def update_no_rescale_acc(state, s, v):  # rescales l but forgets acc
    m_new = jnp.maximum(state.m, s.max(axis=-1))
    alpha, p = jnp.exp(state.m - _safe(m_new)), jnp.exp(s - _safe(m_new)[:, None])
    return SoftmaxState(m_new, alpha * state.l + p.sum(-1), state.acc + p @ v)


def update_old_max(state, s, v):  # the block's weights against the old maximum (guarded against -inf)
    m_new = jnp.maximum(state.m, s.max(axis=-1))
    alpha, p = jnp.exp(state.m - _safe(m_new)), jnp.exp(s - _safe(state.m)[:, None])
    return SoftmaxState(m_new, alpha * state.l + p.sum(-1), alpha[:, None] * state.acc + p @ v)


def update_old_max_raw(state, s, v):  # the same with the old maximum as it is: e^(s + inf) on the first block
    m_new = jnp.maximum(state.m, s.max(axis=-1))
    alpha, p = jnp.exp(state.m - _safe(m_new)), jnp.exp(s - state.m[:, None])
    return SoftmaxState(m_new, alpha * state.l + p.sum(-1), alpha[:, None] * state.acc + p @ v)


def update_inverted_alpha(state, s, v):  # rescales by e^(m_new - m_old): inf times the empty l on the first block
    m_new = jnp.maximum(state.m, s.max(axis=-1))
    alpha, p = jnp.exp(m_new - state.m), jnp.exp(s - _safe(m_new)[:, None])
    return SoftmaxState(m_new, alpha * state.l + p.sum(-1), alpha[:, None] * state.acc + p @ v)


def update_returns_a_tuple(state, s, v):  # the right numbers, but the notebook reads state.m, state.l, state.acc
    return tuple(nb03.online_update_solution(state, s, v))


def update_keeps_old_m(state, s, v):  # updates l and acc right but returns the old maximum
    new = nb03.online_update_solution(state, s, v)
    return SoftmaxState(state.m, new.l, new.acc)


def update_divides_early(state, s, v):  # keeps the normalised output o = acc / l instead of acc
    new = nb03.online_update_solution(state, s, v)
    return SoftmaxState(new.m, new.l, reference.state_output(new))


def update_returns_safe_m(state, s, v):  # hands back m_safe (0) for a row that has seen nothing
    new = nb03.online_update_solution(state, s, v)
    return SoftmaxState(_safe(new.m), new.l, new.acc)


def test_online_update_stub_is_not_attempted(capsys):
    def online_update(state, s, v):
        raise NotImplementedError  # your code here
    assert nb03.ONLINE_UPDATE.use(online_update) is nb03.online_update_solution  # as the notebook calls it
    assert "puzzle 1: the online update: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (update_unsafe, "case 'a row that has seen no key meets a fully masked block' — NaN in the result"),
    (update_no_rescale_l, "case 'the block raises the maximum on every row' — l is off: the old sum is not rescaled"),
    (update_no_rescale_acc, "raises the maximum on every row' — acc is off: the old acc is not rescaled"),
    (update_old_max, "case 'the first block: .*' — l is off: the block's weights must be e\\^\\(s - m_new\\), "
                     "against the new maximum, not the old one"),
    (update_old_max_raw, "case 'the first block: .*' — inf in the result: .* exponentiate against the new maximum"),
    (update_inverted_alpha, "case 'the first block: .*' — NaN in the result on a row that has a visible key: an "
                            "infinite factor met a zero; every rescale factor is e\\^\\(old maximum - new maximum\\)"),
    (update_returns_a_tuple, "case 'the first block: .*' — return SoftmaxState\\(m=..., l=..., acc=...\\)"),
    (update_keeps_old_m, "case 'the first block: .*' — m is \\[-inf -inf -inf\\], expected .* the larger of the two"),
    (update_divides_early, "case 'the first block: .*' — acc is already divided by l"),
    (update_returns_safe_m, "case 'a row that has seen no key meets a fully masked block' — m is .*a row that has "
                            "seen no key keeps m = -inf; the safe maximum \\(0 there\\) is only what you exponentiate"),
])
def test_online_update_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb03.check_online_update(wrong)


def test_online_update_wrong_answer_falls_back_to_the_solution(capsys):
    assert nb03.ONLINE_UPDATE.use(update_no_rescale_acc) is nb03.online_update_solution
    assert "puzzle 1: the online update: not passed yet" in capsys.readouterr().out


def test_online_update_solution_passes(capsys):
    nb03.ONLINE_UPDATE.check(nb03.online_update_solution)
    assert capsys.readouterr().out.startswith("passed: online_update")
    assert nb03.ONLINE_UPDATE.use(update_where_guards) is update_where_guards
    assert "puzzle 1: the online update: solved" in capsys.readouterr().out


def update_where_guards(state, s, v):  # zero the factors of -inf entries instead of a safe maximum
    m_new = jnp.maximum(state.m, s.max(axis=-1))
    alpha = jnp.where(jnp.isneginf(state.m), 0.0, jnp.exp(state.m - m_new))
    p = jnp.where(jnp.isneginf(s), 0.0, jnp.exp(s - m_new[:, None]))
    return SoftmaxState(m_new, alpha * state.l + p.sum(-1), alpha[:, None] * state.acc + p @ v)


@pytest.mark.parametrize("valid", [
    update_where_guards, lambda state, s, v: reference.merge_states(state, reference.state_from_scores(s, v))])
def test_online_update_other_styles_pass(valid, capsys):
    nb03.check_online_update(valid)
    assert capsys.readouterr().out.startswith("passed: online_update")


# -- 03 puzzle 2: merging two states ------------------------------------------------------------------------


def merge_unsafe(a, b):  # exponentiates against m itself: NaN where neither side has seen a key
    m = jnp.maximum(a.m, b.m)
    alpha, beta = jnp.exp(a.m - m), jnp.exp(b.m - m)
    return SoftmaxState(m, alpha * a.l + beta * b.l, alpha[:, None] * a.acc + beta[:, None] * b.acc)


def merge_no_rescale(a, b):  # adds sums taken against different maxima
    return SoftmaxState(jnp.maximum(a.m, b.m), a.l + b.l, a.acc + b.acc)


def merge_no_rescale_acc(a, b):  # rescales l, forgets acc
    m = jnp.maximum(a.m, b.m)
    alpha, beta = jnp.exp(a.m - _safe(m)), jnp.exp(b.m - _safe(m))
    return SoftmaxState(m, alpha * a.l + beta * b.l, a.acc + b.acc)


def merge_first_max(a, b):  # assumes the first side holds the larger maximum
    beta = jnp.exp(b.m - _safe(a.m))
    return SoftmaxState(a.m, a.l + beta * b.l, a.acc + beta[:, None] * b.acc)


def merge_divides_early(a, b):  # returns the normalised output as acc
    merged = nb03.merge_states_solution(a, b)
    return SoftmaxState(merged.m, merged.l, reference.state_output(merged))


def merge_returns_safe_m(a, b):  # hands back m_safe (0) where neither side has seen a key
    merged = nb03.merge_states_solution(a, b)
    return SoftmaxState(_safe(merged.m), merged.l, merged.acc)


def test_merge_states_stub_is_not_attempted(capsys):
    def merge_states(a, b):
        raise NotImplementedError  # your code here
    assert nb03.MERGE_STATES.use(merge_states) is nb03.merge_states_solution
    assert "puzzle 2: merging two states: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (merge_unsafe, "case 'neither side has seen a key' — NaN in the result"),
    (merge_no_rescale, "case 'the second side has the larger maxima' — l is off: l_a \\+ l_b adds sums taken"),
    (merge_no_rescale_acc, "case 'the second side has the larger maxima' — acc is off: acc_a \\+ acc_b adds sums"),
    (merge_first_max, "case 'the second side has the larger maxima' — m is .* the larger of the two maxima"),
    (merge_divides_early, "case 'the second side has the larger maxima' — acc is already divided by l"),
    (merge_returns_safe_m, "case 'neither side has seen a key' — m is .*a row that has seen no key keeps m = -inf"),
])
def test_merge_states_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb03.check_merge_states(wrong)


def test_merge_states_solution_and_the_reference_pass(capsys):
    nb03.MERGE_STATES.check(nb03.merge_states_solution)
    assert nb03.MERGE_STATES.use(reference.merge_states) is reference.merge_states
    out = capsys.readouterr().out
    assert out.count("passed: merge_states") == 2 and "puzzle 2: merging two states: solved" in out


# -- 03 exercise 3: the row, blocks from the last to the first ----------------------------------------------


def _start(v):
    return SoftmaxState(m=jnp.full(1, -jnp.inf), l=jnp.zeros(1), acc=jnp.zeros((1, v.shape[1])))


reversed_solution = nb03.online_attention_row_reversed_solution


def reversed_forward(s, v, block, update=nb03.online_update_solution):  # section 5's loop, unchanged
    state = _start(v)
    for lo in range(0, len(s), block):
        state = update(state, s[None, lo:lo + block], v[lo:lo + block])
    return reference.state_output(state)[0]


def reversed_skips_the_head(s, v, block, update=nb03.online_update_solution):  # steps back from len - block
    state = _start(v)
    for lo in range(len(s) - block, -1, -block):
        state = update(state, s[None, lo:lo + block], v[lo:lo + block])
    return reference.state_output(state)[0]


def reversed_scores_only(s, v, block, update=nb03.online_update_solution):  # flips s, forgets to flip v
    return reversed_forward(s[::-1], v, block, update)


def reversed_starts_at_zero(s, v, block, update=nb03.online_update_solution):  # m = 0 for "nothing seen yet"
    state = SoftmaxState(m=jnp.zeros(1), l=jnp.zeros(1), acc=jnp.zeros((1, v.shape[1])))
    for lo in reversed(range(0, len(s), block)):
        state = update(state, s[None, lo:lo + block], v[lo:lo + block])
    return reference.state_output(state)[0]


def reversed_ignores_update(s, v, block, update=nb03.online_update_solution):  # right answer, no blocks seen
    return reversed_solution(s, v, block, nb03.online_update_solution)


def test_reversed_stub_is_not_attempted(capsys):
    def online_attention_row_reversed(s, v, block, update=nb03.online_update_solution):
        raise NotImplementedError  # your code here
    assert nb03.ROW_REVERSED.use(online_attention_row_reversed) is reversed_solution  # as the notebook calls it
    assert "exercise 3: backwards: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (reversed_forward, "'16 keys in blocks of 4' — the blocks were folded from the first to the last: start with "
                       "the last block \\(keys 12-15\\)"),
    (reversed_skips_the_head, "'16 keys in blocks of 3' — the blocks were keys 13-15, 10-12, 7-9, 4-6, 1-3, "
                              "expected 15, 12-14, 9-11, 6-8, 3-5, ..."),
    (reversed_scores_only, "'16 keys in blocks of 4' — the output .* is not attention over the row"),
    (reversed_ignores_update, "update was never called"),
    (reversed_starts_at_zero, "'12 keys in blocks of 5, every score near -120' — the output is zeros: .* start from "
                              "the empty state"),
])
def test_reversed_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb03.check_online_attention_row_reversed(wrong)


def test_reversed_solution_passes(capsys):
    nb03.ROW_REVERSED.check(reversed_solution)
    assert capsys.readouterr().out.startswith("passed: online_attention_row_reversed")

    def online_attention_row_reversed(s, v, block, update=nb03.online_update_solution):  # a learner's, passing
        return reversed_solution(s, v, block, update)
    assert nb03.ROW_REVERSED.use(online_attention_row_reversed) is online_attention_row_reversed
    assert capsys.readouterr().out.rstrip().endswith("exercise 3: backwards: passed")
