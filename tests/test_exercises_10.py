"""Notebook 10's puzzles run three ways: the notebook's stub (reported as not attempted, the solution handed
back), plausible wrong answers (each fails with the message that names its mistake) and the solution (passes)."""

from __future__ import annotations

import inspect
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from flashlib import reference
from flashlib.checks import CheckFailed
from flashlib.exercises import decoding as nb10
from flashlib.exercises import decoding_kernel as nb10k


def _stub(*args, **kwargs):
    raise NotImplementedError


PUZZLES = (nb10.COMBINE_SPLITS, nb10.PAGE_TO_COPY, nb10.MERGE_SPLITS, nb10.DECODE_INTENSITY, nb10.WRITE_TOKEN)


def test_the_stubs_are_reported_as_not_attempted(capsys):
    for puzzle in PUZZLES:
        assert puzzle.use(_stub) is puzzle.solution
    assert capsys.readouterr().out.count("not attempted yet") == len(PUZZLES)


def test_the_solutions_pass():
    for puzzle in PUZZLES:
        puzzle.check(puzzle.solution)


def _averaged(states):  # each split normalised on its own, then the mean: ignores the splits' weights
    return jnp.mean(jnp.stack([jnp.where(s.l[..., None] > 0, s.acc / jnp.where(s.l > 0, s.l, 1.0)[..., None], 0.0)
                               for s in states]), axis=0)


def _folds_merge_states(states):  # the library's merge: the puzzle asks for it by hand
    merged = states[0]
    for state in states[1:]:
        merged = reference.merge_states(merged, state)
    return reference.state_output(merged)


def _max_of_first_split(states):  # rescales against split 0's maximum, not the largest
    safe = jnp.where(jnp.isfinite(states[0].m), states[0].m, 0.0)
    total = sum(jnp.exp(s.m - safe) * s.l for s in states)
    acc = sum(jnp.exp(s.m - safe)[..., None] * s.acc for s in states)
    return jnp.where(total[..., None] > 0, acc / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def _unsafe_merge(states):  # rescales against the new maximum itself: NaN where both sides have seen no key
    m = states[0].m
    l, acc = states[0].l, states[0].acc  # noqa: E741
    for s in states[1:]:
        new = jnp.maximum(m, s.m)
        a, b = jnp.exp(m - new), jnp.exp(s.m - new)
        l, acc, m = a * l + b * s.l, a[..., None] * acc + b[..., None] * s.acc, new  # noqa: E741
    return acc / l[..., None]


def _no_rescale(states):  # acc and l summed as they are: each split measured against its own maximum
    acc, l = sum(s.acc for s in states), sum(s.l for s in states)  # noqa: E741
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def _last_split_only(states):
    s = states[-1]
    return jnp.where(s.l[..., None] > 0, s.acc / jnp.where(s.l > 0, s.l, 1.0)[..., None], 0.0)


@pytest.mark.parametrize("answer, message", [
    (_averaged, "the splits' outputs are averaged"),
    (_unsafe_merge, "NaN in the output"),
    (_no_rescale, "acc and l are added without rescaling: .* exp\\(m_split - m_max\\)"),
    (_last_split_only, "max error"),
    (_folds_merge_states, "calls reference.merge_states: this puzzle is the merge itself"),
    (_max_of_first_split, "split 1's m 100 higher .* the largest m_i over every split"),
])
def test_wrong_combinations_are_named(answer, message):
    with pytest.raises(CheckFailed, match=message):
        nb10.check_combine_splits(answer)


def _unclamped(step, length, table_row, page_size):
    return table_row[step]


def _floor(step, length, table_row, page_size):
    return table_row[min(step, length // page_size)]


def _no_empty_page(step, length, table_row, page_size):
    return table_row[min(step, -(-length // page_size) - 1)]  # -1 for an empty sequence: the table's last entry


@pytest.mark.parametrize("answer, message", [
    (_unclamped, r"page 5 is past the sequence's last live page \(index 3"),
    (_floor, "12 tokens fill exactly 3 pages"),
    (_no_empty_page, r"length 0, page_size 4, step 0 — got page 5, expected 7"),
])
def test_wrong_pages_are_named(answer, message):
    with pytest.raises(CheckFailed, match=message):
        nb10.check_page_to_copy(answer)


def test_the_hints_end_in_the_solutions():
    assert nb10.COMBINE_SPLITS.levels == 3 and nb10.PAGE_TO_COPY.levels == 3  # two hints, then the solution
    for puzzle in (nb10.COMBINE_SPLITS, nb10.PAGE_TO_COPY):
        assert "def " in puzzle.solution_source()
    assert "merge_states" not in nb10.COMBINE_SPLITS.solution_source()


def test_the_checker_restores_merge_states():
    merge_states, state_output = reference.merge_states, reference.state_output
    with pytest.raises(CheckFailed, match="calls reference.state_output"):
        nb10.check_combine_splits(lambda states: reference.state_output(states[0]))
    assert reference.merge_states is merge_states and reference.state_output is state_output
    assert np.isfinite(np.asarray(nb10.combine_splits_solution([reference.SoftmaxState(
        m=jnp.full((1,), -jnp.inf), l=jnp.zeros((1,)), acc=jnp.zeros((1, 2)))]))).all()


# -- the exercises' checkers: solutions pass, plausible wrong answers are named --------------------------------


merge_splits_solution = nb10.merge_splits_solution


def _merge_added_max(m, l, acc):  # exp2(m_i + m): the common factor cancels, until the scores are large (mutant)
    top = jnp.max(m, axis=0)
    w = jnp.exp2(m + jnp.where(jnp.isfinite(top), top, 0.0))
    total, merged = jnp.sum(w * l, axis=0), jnp.sum(w[..., None] * acc, axis=0)
    return jnp.where(total[..., None] > 0, merged / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def _merge_unsafe(m, l, acc):  # exponentiates against -inf on a row no split saw
    w = jnp.exp2(m - jnp.max(m, axis=0))
    return jnp.sum(w[..., None] * acc, axis=0) / jnp.sum(w * l, axis=0)[..., None]


def _merge_undivided(m, l, acc):  # the merged acc, never divided by l
    safe = jnp.where(jnp.isfinite(jnp.max(m, axis=0)), jnp.max(m, axis=0), 0.0)
    return jnp.sum(jnp.exp2(m - safe)[..., None] * acc, axis=0)


def _merge_averaged(m, l, acc):  # each split's output, then their mean
    return jnp.mean(jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0), axis=0)


def _merge_unscaled(m, l, acc):  # acc and l summed as they are
    total = jnp.sum(l, axis=0)
    return jnp.sum(acc, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]


def _merge_natural(m, l, acc):  # e^(m2_i - M2): the base-2 maxima read as natural ones
    top = jnp.max(m, axis=0)
    w = jnp.exp(m - jnp.where(jnp.isfinite(top), top, 0.0))
    total, merged = jnp.sum(w * l, axis=0), jnp.sum(w[..., None] * acc, axis=0)
    return jnp.where(total[..., None] > 0, merged / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def _merge_converted(m2, l, acc):  # back to natural units (m = m2 ln 2) and exp: the same factors, passes
    m = m2 * jnp.log(2.0)
    top = jnp.max(m, axis=0)
    w = jnp.exp(m - jnp.where(jnp.isfinite(top), top, 0.0))
    total, merged = jnp.sum(w * l, axis=0), jnp.sum(w[..., None] * acc, axis=0)
    return jnp.where(total[..., None] > 0, merged / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def _merge_wrong_axis(m, l, acc):  # reduces over the last axis (the rows) instead of the splits
    return merge_splits_solution(jnp.moveaxis(m, -1, 0), jnp.moveaxis(l, -1, 0), jnp.moveaxis(acc, -2, 0))


def test_merge_splits_solution_passes_and_the_stub_is_not_attempted(capsys):
    nb10.check_merge_splits(merge_splits_solution)
    nb10.check_merge_splits(_merge_converted)
    nb10.MERGE_SPLITS.use(_stub)
    out = capsys.readouterr().out
    assert "passed: merge_splits" in out and "exercise 1: the merge in base 2: not attempted yet" in out


@pytest.mark.parametrize("answer, message", [
    (_merge_unsafe, "NaN in the output"),
    (_merge_undivided, "the merged acc, not yet the output"),
    (_merge_averaged, "the splits' outputs are averaged"),
    (_merge_unscaled, r"summed without rescaling: .* exp2\(m2_i - M2\)"),
    (_merge_natural, "m2 is in base 2 .* use jnp.exp2"),
    (_merge_wrong_axis, "shape .* reduce over the leading"),
    (_merge_added_max, "every m2 200 higher.* overflow"),
])
def test_wrong_merges_are_named(answer, message):
    with pytest.raises(CheckFailed, match=message):
        nb10.check_merge_splits(answer)


decode_intensity_solution = nb10.decode_intensity_solution


def test_decode_intensity_solution_passes(capsys):
    nb10.check_decode_intensity(decode_intensity_solution)
    out = capsys.readouterr().out
    assert "GQA 8:1 in bf16 is 8 FLOP/B" in out and "q_len >= 31" in out


@pytest.mark.parametrize("answer, message", [
    (lambda h, kv, d, q, b: 2 * h * q * d / (2 * kv * d * b), "half the FLOPs"),
    (lambda h, kv, d, q, b: 4 * h * q * d / (kv * d * b), "reads K \\*and\\* V"),
    (lambda h, kv, d, q, b: 4 * h * q * d / (2 * h * d * b), "stored per kv head"),
    (lambda h, kv, d, q, b: 4 * h * d / (2 * kv * d * b), "q_len is missing"),
    (lambda h, kv, d, q, b: 4 * h * q * d / (2 * kv * d), "itemsize is missing"),
    (lambda h, kv, d, q, b: 4 * h * q * d * d / (2 * kv * d * b), "kv_len cancels"),
])
def test_wrong_intensities_are_named(answer, message):
    with pytest.raises(CheckFailed, match=message):
        nb10.check_decode_intensity(answer)


write_token_solution = nb10.write_token_solution


def test_write_token_solution_passes(capsys):
    nb10.check_write_token(write_token_solution)
    assert "passed: write_token" in capsys.readouterr().out


def _write_logical(k_pages, block_table, seq, position, k_new):  # the logical page, not the table's
    return k_pages.at[position // k_pages.shape[2], :, position % k_pages.shape[2]].set(k_new)


def _write_swapped(k_pages, block_table, seq, position, k_new):  # page from the remainder, slot from the quotient
    return k_pages.at[block_table[seq, position % k_pages.shape[2]], :, position // k_pages.shape[2]].set(k_new)


def _write_nothing(k_pages, block_table, seq, position, k_new):
    return k_pages


def _write_transposed(k_pages, block_table, seq, position, k_new):  # block_table[page, seq]: rows and columns swapped
    return k_pages.at[block_table[position // k_pages.shape[2] % 2, seq], :, position % k_pages.shape[2]].set(k_new)


@pytest.mark.parametrize("answer, message", [
    (_write_logical, "the sequence's logical page: look it up in the block table"),
    (_write_swapped, "page and slot are swapped"),
    (_write_nothing, "the pool is unchanged"),
    (_write_transposed, r"pages \[\d+\] changed, expected only page"),
])
def test_wrong_writes_are_named(answer, message):
    with pytest.raises(CheckFailed, match=message):
        nb10.check_write_token(answer)


# -- puzzle 3: the paged decode kernel (its index map and body), run under TPU interpret semantics --------------


def _variant(fn, *changes):
    """``fn`` (a solution) with pieces of its source replaced (``old, new`` or ``(old, new), (old, new), ...``): a
    learner's plausible mistake."""
    source = textwrap.dedent(inspect.getsource(fn))
    for old, new in changes if isinstance(changes[0], tuple) else [changes]:
        assert old in source, old
        source = source.replace(old, new)
    namespace = dict(fn.__globals__)
    exec(compile(source, f"<{fn.__name__} variant>", "exec"), namespace)  # noqa: S102
    return namespace[fn.__name__]


_KERNEL, _MAP = nb10k.paged_decode_kernel_solution, nb10k.page_index_map_solution


def test_the_paged_decode_kernel_stub_is_not_attempted_and_the_solution_passes(capsys):
    puzzle = nb10k.PAGED_DECODE_KERNEL
    assert puzzle.use((_stub, _stub)) is puzzle.solution
    assert "not attempted yet" in capsys.readouterr().out
    assert puzzle.use(puzzle.solution) is puzzle.solution
    out = capsys.readouterr().out
    assert "passed: paged decode kernel" in out and "copies 21 pages for 9 sequences" in out
    assert puzzle.levels == 4 and "def page_index_map(" in puzzle.solution_source()


@pytest.mark.parametrize("kernel_change, map_change, message", [
    # the index map
    (None, ("jnp.minimum(j, last)", "j"), "it is not clamped, so Pallas copies a page nobody uses"),
    (None, ("lax.div(lengths_ref[b] + page_size - 1, page_size) - 1", "lax.div(lengths_ref[b], page_size)"),
     "16 tokens fill exactly 1 page, so the last live page is index 0"),
    (None, ("b * pages_per_seq +", "b +"), "of the flattened table"),
    (None, ("jnp.minimum(j, last)", "min(j, last)"), r"use jnp.minimum \(the index map is traced\)"),
    (None, (", 0, 0  #", "  #"), r"return the pool block \(page, 0, 0\)"),
    (None, ("lax.div(lengths_ref[b] + page_size - 1, page_size)", "(lengths_ref[b] + page_size - 1) // page_size"),
     "divides a traced int with //"),
    # the kernel's phases
    (("@pl.when(j == 0)", "@pl.when(j >= 0)"), None, "NaN in the output: scratch starts as garbage"),
    (("@pl.when(j == pl.num_programs(1) - 1)  # the last step, skipped or not\n    def finalize():\n",
      "if True:  # no pl.when: finalize on every step\n"), None, "fewer than three pl.when"),
    (("j == pl.num_programs(1) - 1", "j == 0"), None, "FIRST page alone: finalize runs on the first step"),
    (("-jnp.inf, jnp.float32", "0.0, jnp.float32"), None, "the running max m starts at 0, not -inf"),
    # skipping and masking
    (("@pl.when(j * page_size < length)", "@pl.when(j >= 0)"), None, "the body runs on a step past the length"),
    (("@pl.when(j * page_size < length)", "@pl.when(j * page_size <= length)"), None,
     "the body runs on a step past the length"),
    (("s = jnp.where(key < length, s, MASK_VALUE)", "s = jnp.where(key <= length, s, MASK_VALUE)"), None,
     "the mask is off by one at the length"),
    (("s = jnp.where(key < length, s, MASK_VALUE)", "pass"), None,
     "the tail of the partly filled last page is not masked"),
    (("v = jnp.where(slot < length, v_ref[...], 0.0)", "v = v_ref[...]"), None,
     r"NaN from the stale VALUES past the length: .* 0 \* NaN is NaN, so zero the values too .* an iota over v's"),
    (("v = jnp.where(slot < length, v_ref[...], 0.0)", "v = jnp.where(slot <= length, v_ref[...], 0.0)"), None,
     "NaN from the stale VALUES past the length"),
    # the values zeroed, but the stale keys' NaN scores kept by an additive mask or a mask on p
    (("s = jnp.where(key < length, s, MASK_VALUE)", "s = s + jnp.where(key < length, 0.0, MASK_VALUE)"), None,
     r"NaN from the stale KEYS past the length: .* s = jnp.where\(position < length, s, MASK_VALUE\)"),
    ((("s = jnp.where(key < length, s, MASK_VALUE)", "live = key < length"),
      ("jnp.exp(s - m_next)\n", "jnp.exp(s - m_next) * live\n")), None, "NaN from the stale KEYS past the length"),
    ((("s = jnp.where(key < length, s, MASK_VALUE)", "s = s + jnp.where(key < length, 0.0, MASK_VALUE)"),
      ("v = jnp.where(slot < length, v_ref[...], 0.0)", "v = v_ref[...]")), None,
     "NaN from both the stale keys and the stale values"),
    # the online update
    (("alpha, p = jnp.exp(m_prev - m_next), jnp.exp(s - m_next)", "alpha, p = 1.0, jnp.exp(s - m_next)"), None,
     "l and acc are not rescaled"),
    (("(acc_ref[...] / l_ref[...])", "acc_ref[...]"), None, r"the output is acc, not acc / l"),
    (("preferred_element_type=jnp.float32) * scale", "preferred_element_type=jnp.float32)"), None,
     "the scores are not scaled"),
])
def test_wrong_paged_decode_kernels_are_named(kernel_change, map_change, message):
    kernel = _variant(_KERNEL, *kernel_change) if kernel_change else _KERNEL
    index_map = _variant(_MAP, *map_change) if map_change else _MAP
    with pytest.raises(CheckFailed, match=message):
        nb10k.check_paged_decode((kernel, index_map))


def test_a_single_function_is_not_the_pair():
    with pytest.raises(CheckFailed, match="give the pair"):
        nb10k.check_paged_decode(_KERNEL)


# -- exercise 4: what a page size wastes --------------------------------------------------------------------------


def test_page_waste_stub_solution_and_exact_mean(capsys):
    assert nb10k.PAGE_WASTE.use(_stub) == nb10k.page_waste_solution()
    assert "not attempted yet" in capsys.readouterr().out
    nb10k.PAGE_WASTE.check(nb10k.page_waste_solution)
    assert "64 tokens" in capsys.readouterr().out
    nb10k.check_page_waste({page: ((page - 1) / 2, (page - 1) / 2 / 4096) for page in (128, 512)})  # exact mean


@pytest.mark.parametrize(("answer", "message"), [
    ({128: (64, 64 / 4096)}, "one entry per page size"),
    ([(64, 64 / 4096), (256, 256 / 4096)], "one entry per page size"),
    ({128: 64, 512: 256}, "give a pair"),
    ({page: (page, page / 4096) for page in (128, 512)}, "a whole page"),
    ({page: (page / 4, page / 4 / 4096) for page in (128, 512)}, "page_size / 2 on average"),
    ({page: (page / 2, page / 2 / 4096 * 100) for page in (128, 512)}, "is a percentage"),
    ({page: (page / 2, page / 2 / 4095) for page in (128, 512)}, "the tokens wasted over"),
    ({128: (64, 64 / 4096), 512: (256, 128 / 4096)}, "512-token pages — share"),
])
def test_wrong_page_waste_answers_are_named(answer, message):
    with pytest.raises(CheckFailed, match=message):
        nb10k.check_page_waste(answer)
