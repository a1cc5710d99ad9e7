"""Notebook 09's puzzles and exercises (:mod:`flashlib.exercises.variants`), each run three ways: the notebook's
stub (reported as not attempted), plausible wrong answers (each fails with the message that names its mistake)
and the solution (it passes)."""

from __future__ import annotations

import inspect
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from flashlib.checks import CheckFailed
from flashlib.exercises import variants as nb09
from flashlib.exercises.variants_solutions import NT_DIMS


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- puzzle 1: the element rule ------------------------------------------------------------------------------------
def _visible(*, align="bottom-right", combine="both", none_side="unbounded", left_edge="inclusive", segments=True,
             right_edge="inclusive"):
    """A learner's ``visible`` with one mistake switched on (the defaults make it right)."""
    def visible(i, j, *, q_len, kv_len, causal, window, q_segment, kv_segment):
        centre = i + (kv_len - q_len if align == "bottom-right" else 0)
        ok = True
        if causal and not (combine == "window wins" and window is not None):
            ok = ok and j <= centre
        if window is not None:
            left, right = window
            if none_side == "zero":
                left, right = left or 0, right or 0
            if left is not None:
                ok = ok and (j >= centre - left if left_edge == "inclusive" else j > centre - left)
            if right is not None:
                ok = ok and (j <= centre + right if right_edge == "inclusive" else j < centre + right)
        return ok and (q_segment == kv_segment or not segments)
    return visible


def test_visible_stub_falls_back_to_the_solution(capsys):
    assert nb09.VISIBLE.use(_stub) is nb09.visible_solution
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (_visible(align="top-left"), "case 'causal, 4 queries over 9 keys.*bottom-right aligned"),
    (_visible(segments=False), "segments: a query sees only keys whose segment id equals its own"),
    (_visible(combine="window wins"), "causal and a window together: a key must pass both"),
    (_visible(none_side="zero"), "a window side of None is unbounded on that side, not 0"),
    (_visible(left_edge="exclusive"), "the window's left edge: key i \\+ offset - left is inside"),
    (_visible(right_edge="exclusive"),
     "case 'local causal window \\(2, 0\\).*query 0, key 0: expected True, got False"),
], ids=["top-left", "no segments", "window without causal", "None as 0", "left edge exclusive",
        "right edge exclusive"])
def test_visible_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb09.check_visible(wrong)


def test_visible_solution_and_a_rewrite_pass(capsys):
    nb09.check_visible(nb09.visible_solution)
    assert capsys.readouterr().out.startswith("passed: visible agrees with flashlib.masks on all 11 cases")
    nb09.check_visible(_visible())
    assert nb09.VISIBLE.use(_visible()) is not nb09.visible_solution


# -- puzzle 2: a block's kind -----------------------------------------------------------------------------------------
def _block_kind(*, padding=True, skip_row="last", left_mask=True, align="bottom-right", names=("skip", "mask",
                                                                                                 "plain")):
    """A learner's ``block_kind`` written element by element over the block, with one mistake switched on."""
    def block_kind(q_block, kv_block, *, block_q, block_k, q_len, kv_len, causal, window):
        left, right = (None, None) if window is None else window
        if causal:
            right = 0 if right is None else min(right, 0)
        offset = kv_len - q_len if align == "bottom-right" else 0
        rows = np.arange(q_block * block_q, (q_block + 1) * block_q)[:, None]
        keys = np.arange(kv_block * block_k, (kv_block + 1) * block_k)[None, :]
        seen = np.ones((block_q, block_k), bool)
        if right is not None:
            seen &= keys <= rows + offset + right
        if left is not None and left_mask:
            seen &= keys >= rows + offset - left
        reach = seen if skip_row == "last" else seen[:1]
        if left is not None and not left_mask:  # the left edge checked for skipping only
            reach = reach & (keys >= rows + offset - left)
        if not reach.any():
            return names[0]
        if not seen.all() or (padding and (kv_block + 1) * block_k > kv_len):
            return names[1]
        return names[2]
    return block_kind


def test_block_kind_stub_falls_back_to_the_solution(capsys):
    assert nb09.BLOCK_KIND.use(_stub) is nb09.block_kind_solution
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (_block_kind(padding=False), "a block holding padded keys .* must be masked"),
    (_block_kind(skip_row="first"), "skip only when no row of the block sees any key"),
    (_block_kind(left_mask=False), "straddles the window's left edge needs a mask too"),
    (_block_kind(align="top-left"), "alignment: bottom-right"),
    (_block_kind(names=(False, "masked", True)), "return 'skip', 'mask' or 'plain'"),
], ids=["no padding", "first row skips", "no left mask", "top-left", "wrong names"])
def test_block_kind_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb09.check_block_kind(wrong)


def _non_strict(*which: int):
    """The solution with some of its four strict comparisons (skip right, skip left, mask right, mask left)
    made non-strict: each skips or masks a block whose edge key is visible (issue 25: each passed 8 grids)."""
    def block_kind(q_block, kv_block, *, block_q, block_k, q_len, kv_len, causal, window):
        left, right = (None, None) if window is None else window
        if causal:
            right = 0 if right is None else min(right, 0)
        offset = kv_len - q_len
        first_row, last_row = q_block * block_q, (q_block + 1) * block_q - 1
        first_key, last_key = kv_block * block_k, (kv_block + 1) * block_k - 1

        def beyond(a, b, n):  # a > b, or a >= b where comparison n is made non-strict
            return a >= b if n in which else a > b

        if right is not None and beyond(first_key, last_row + offset + right, 0):
            return "skip"
        if left is not None and beyond(first_row + offset - left, last_key, 1):
            return "skip"
        if last_key >= kv_len:
            return "mask"
        if right is not None and beyond(last_key, first_row + offset + right, 2):
            return "mask"
        if left is not None and beyond(last_row + offset - left, first_key, 3):
            return "mask"
        return "plain"
    return block_kind


@pytest.mark.parametrize("which, message", [
    ((0,), r"window \(4, 1\).* — skip only when no row of the block sees any key"),
    ((1,), r"window \(1, 4\).* block \(1, 0\): expected 'mask', got 'skip'; key 3 is row 4's first visible key, "
           r"exactly on the band's edge: .* compare strictly"),
    ((2,), r"window \(3, 3\).* block \(0, 0\): expected 'plain', got 'mask'; key 3 is row 0's last visible key"),
    ((3,), r"window \(3, 3\).* block \(0, 0\): expected 'plain', got 'mask'; .*key 0 is row 3's first visible key"),
    ((0, 1, 2, 3), r"window \(4, 1\)"),
], ids=["skip right", "skip left", "mask right", "mask left", "all four"])
def test_block_kind_with_a_non_strict_edge_fails(which, message):
    with pytest.raises(CheckFailed, match=message):
        nb09.check_block_kind(_non_strict(*which))


def _solution_with(old: str, new: str):
    """The solution with one edit: the survivors of mutation testing (tests/mutants.py), now killed."""
    source = textwrap.dedent(inspect.getsource(nb09.block_kind_solution))
    assert source.count(old) == 1
    namespace = dict(nb09.block_kind_solution.__globals__)
    exec(source.replace(old, new), namespace)  # noqa: S102 - the solution's own source, edited
    return namespace["block_kind_solution"]


@pytest.mark.parametrize("old, new, message", [
    ("if last_key >= kv_len:", "if last_key > kv_len:", "'no mask, 16 queries over 23 keys.*padded keys "
     "\\(positions >= kv_len\\) must be masked"),
    ("min(right, 0)", "min(right, 1)", "'window \\(4, 2\\) with causal, 16 x 16.*whatever the window's right side "
     "says: the band's right side is min\\(right, 0\\)"),
    ("min(right, 0)", "min(right, -1)", "'window \\(4, 2\\) with causal, 16 queries over 17 keys"),
    ("right = 0 if right is None", "right = -1 if right is None", "'causal, 16 queries over 17 keys"),
])
def test_block_kind_mutants_of_the_solution_fail(old, new, message):
    with pytest.raises(CheckFailed, match=message):
        nb09.check_block_kind(_solution_with(old, new))


def test_block_kind_solution_and_an_element_wise_rewrite_pass(capsys):
    nb09.check_block_kind(_non_strict())  # all four strict: the solution, rewritten
    nb09.check_block_kind(nb09.block_kind_solution)
    assert capsys.readouterr().out.startswith("passed: block_kind agrees with flashlib.geometry on all 15 grids")
    nb09.check_block_kind(_block_kind())


# -- exercise 1: a window's compacted grid ---------------------------------------------------------------------------
def test_window_grid_stub_is_not_attempted(capsys):
    def my_grid():
        raise NotImplementedError  # as the notebook's stub
    assert nb09.WINDOW_GRID.use(my_grid) == (3, 20)  # the solution's value
    assert "exercise 1: a window's grid: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    ((8, 20), "8 is every key block"),
    ((3, 24), "one copy per grid step is too many"),
    ((3, 21), "one copy per computing step is nearly it"),
    ((20, 3), "the right pair in the wrong order"),
    ((2, 20), "count the key blocks one query block's rows can reach"),
])
def test_window_grid_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb09.check_window_grid(wrong)
    assert nb09.WINDOW_GRID.use(lambda: wrong) == (3, 20)


def test_window_grid_solution_passes(capsys):
    assert nb09.WINDOW_GRID.solution() == (3, 20)
    assert nb09.WINDOW_GRID.use(nb09.WINDOW_GRID.solution) == (3, 20)  # the function, as the notebook passes it
    assert nb09.WINDOW_GRID.use((3, 20)) == (3, 20)  # or the value itself
    out = capsys.readouterr().out
    assert out.startswith("passed: 3 kv steps per query block instead of 8, 20 k block copies")
    assert out.count("exercise 1: a window's grid: passed") == 2


# -- exercise 2: a sink's weight -------------------------------------------------------------------------------------
def test_sink_weight_stub_is_not_attempted(capsys):
    def sink_weight(scores, sink):
        raise NotImplementedError  # your code here
    assert nb09.SINK_WEIGHT.use(sink_weight) is nb09.sink_weight_solution  # as the notebook runs it
    assert "exercise 2: a sink's weight: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (lambda s, sink: np.exp(sink) / (np.exp(sink) + np.exp(s).sum()), "overflow: subtract the largest logit"),
    (lambda s, sink: 1 - nb09.sink_weight_solution(s, sink), "that is the weight on the keys"),
    (lambda s, sink: np.exp(sink - s.max()) / np.exp(s - s.max()).sum(), "the sink joins the denominator too"),
], ids=["unshifted", "keys' weight", "sink not in the denominator"])
def test_sink_weight_wrong_answers_fail_with_their_hint(wrong, message):
    with np.errstate(over="ignore", invalid="ignore"), pytest.raises(CheckFailed, match=message):
        nb09.check_sink_weight(wrong)


def test_sink_weight_solution_passes(capsys):
    assert nb09.SINK_WEIGHT.use(nb09.sink_weight_solution) is nb09.sink_weight_solution
    out = capsys.readouterr().out
    assert out.startswith("passed: sink_weight on all 4 rows") and "exercise 2: a sink's weight: passed" in out


# -- puzzle 3: a soft-cap and a sink in the kernel --------------------------------------------------------------------
def _variants_kernel(*, init="sink", cap="after scale", finalize="plain"):
    """The forward kernel with a soft-cap and a sink, one mistake switched on (the defaults make it right)."""
    def kernel(q_ref, k_ref, v_ref, sink_ref, o_ref, m_ref, l_ref, acc_ref, *, scale, **params):
        c = params["cap"]
        j, last = pl.program_id(3), pl.num_programs(3) - 1

        @pl.when(j == 0)
        def _():
            if init == "sink":
                m_ref[...] = jnp.broadcast_to(sink_ref[...], m_ref.shape)
                l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
            elif init == "plain":
                m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
                l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            elif init == "l only":  # l = 1 with m = -inf: the sink's term is rescaled away by alpha = 0
                m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
                l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        raw = lax.dot_general(q_ref[...], k_ref[...], NT_DIMS, preferred_element_type=jnp.float32)
        s = {"after scale": c * jnp.tanh(raw * scale / c), "before scale": c * jnp.tanh(raw / c) * scale,
             "none": raw * scale}[cap]
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha, p = jnp.exp(m_prev - m_next), jnp.exp(s - m_next)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)

        @pl.when(j == last)
        def _():
            extra = {"plain": 0.0, "shifted sink": jnp.exp(sink_ref[...] - m_ref[...]),
                     "unshifted sink": jnp.exp(sink_ref[...])}[finalize]
            o_ref[...] = (acc_ref[...] / (l_ref[...] + extra)).astype(o_ref.dtype)
    return kernel


def test_kernel_variants_stub_falls_back_to_the_solution(capsys):
    assert nb09.KERNEL_VARIANTS.use(_stub) is nb09.flash_kernel_variants_solution
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (_variants_kernel(init="plain"), "the sink never joins the denominator"),
    (_variants_kernel(init="l only"), "the sink never joins the denominator"),
    (_variants_kernel(init="plain", finalize="unshifted sink"), "shifted like the keys': exp\\(sink - m\\)"),
    (_variants_kernel(cap="none"), "the scores are not capped"),
    (_variants_kernel(cap="before scale"), "cap the scaled scores"),
    (_variants_kernel(init="none"), "NaN or inf in the output: start m at the sink"),
], ids=["no sink", "l = 1 with m = -inf", "unshifted sink", "no cap", "cap before scale", "no init"])
def test_kernel_variants_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb09.check_kernel_variants(wrong)


def test_kernel_variants_solution_and_a_sink_at_finalize_pass(capsys):
    nb09.check_kernel_variants(nb09.flash_kernel_variants_solution)
    assert capsys.readouterr().out.startswith("passed: kernel with a soft-cap and a sink matches the float64 oracle")
    nb09.check_kernel_variants(_variants_kernel(init="plain", finalize="shifted sink"))
