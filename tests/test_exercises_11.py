"""Notebook 11's puzzle and exercise checker, run three ways: on the notebook's stub (not attempted, no
traceback), on plausible wrong answers (each fails with the message that points at its mistake) and on a
solution (it passes)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from flashlib.checks import CheckFailed
from flashlib.exercises import scaling_out as nb11


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- 11 puzzle: one ring step ---------------------------------------------------------------------------


def _chunk(q, k, v, scale):
    s = (q @ k.T) * scale
    lse = jnp.log(jnp.sum(jnp.exp(s - s.max(-1, keepdims=True)), -1)) + s.max(-1)
    return jnp.exp(s - lse[:, None]) @ v, lse


def ring_step_adds_outputs(out, lse, q, k, v, scale):  # forgets that each side is normalised over its own keys
    out_c, lse_c = _chunk(q, k, v, scale)
    return out + out_c, jnp.logaddexp(lse, lse_c)


def ring_step_max_lse(out, lse, q, k, v, scale):  # keeps the larger log-sum-exp instead of adding denominators
    out_c, lse_c = _chunk(q, k, v, scale)
    new = jnp.maximum(lse, lse_c)
    return jnp.exp(lse - new)[:, None] * out + jnp.exp(lse_c - new)[:, None] * out_c, new


def ring_step_max_score(out, lse, q, k, v, scale):  # carries the maximum score where the lse belongs
    s = (q @ k.T) * scale
    out_c = jnp.exp(s - s.max(-1, keepdims=True)) / jnp.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True) @ v
    return out_c, s.max(-1)


def ring_step_unnormalised(out, lse, q, k, v, scale):  # the chunk's exp(s) @ v, never divided
    s = (q @ k.T) * scale
    lse_c = jnp.log(jnp.sum(jnp.exp(s), -1))
    new = jnp.logaddexp(lse, lse_c)
    return jnp.exp(lse - new)[:, None] * out + jnp.exp(s) @ v, new


def ring_step_nan(out, lse, q, k, v, scale):  # log(exp(lse) + exp(lse_c)) by hand, against the larger side
    out_c, lse_c = _chunk(q, k, v, scale)
    top = jnp.maximum(lse, lse_c)
    new = top + jnp.log(jnp.exp(lse - top) + jnp.exp(lse_c - top)) * jnp.where(jnp.isfinite(lse), 1.0, jnp.nan)
    return jnp.exp(lse - new)[:, None] * out + jnp.exp(lse_c - new)[:, None] * out_c, new


def ring_step_unstable(out, lse, q, k, v, scale, *, chunk=True, merge=True):
    """The issue's unstable ring step: the chunk's log-sum-exp without the max (``chunk``), the merge as
    ``log(exp(lse) + exp(lse_chunk))`` (``merge``); right for small scores, inf/NaN past ~88 in float32."""
    s = (q @ k.T) * scale
    lse_c = jnp.log(jnp.exp(s).sum(-1)) if chunk else _chunk(q, k, v, scale)[1]
    out_c = jnp.exp(s - lse_c[:, None]) @ v
    new = jnp.log(jnp.exp(lse) + jnp.exp(lse_c)) if merge else jnp.logaddexp(lse, lse_c)
    return jnp.exp(lse - new)[:, None] * out + jnp.exp(lse_c - new)[:, None] * out_c, new


def test_ring_step_stub_is_not_attempted(capsys):
    nb11.RING_STEP.use(_stub)
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (ring_step_adds_outputs, "weigh it by its share of the new denominator"),
    (ring_step_max_lse, "the denominators add"),
    (ring_step_max_score, "not the maximum score"),
    (ring_step_unnormalised, "out must be normalised"),
    (ring_step_nan, "NaN in the result"),
    (ring_step_unstable, r"case 'two chunks with large scores \(up to \d+; .*' — the first chunk alone .*subtract the "
                         r"row max before exp"),
    (functools.partial(ring_step_unstable, merge=False), r"the first chunk alone already goes wrong"),
    (functools.partial(ring_step_unstable, chunk=False), r"case 'two chunks with large scores .*' — the first chunk "
                                                         r"alone .*jnp.logaddexp, never log\(exp\(lse\)"),
], ids=["adds outputs", "max lse", "max score", "unnormalised", "nan", "unstable", "unstable chunk", "unstable merge"])
def test_ring_step_wrong_answers_fail_with_their_mistake(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb11.check_ring_step(wrong)


def test_ring_step_solution_passes(capsys):
    nb11.check_ring_step(nb11.ring_step_solution)
    assert "passed: ring_step" in capsys.readouterr().out
    assert nb11.RING_STEP.use(nb11.ring_step_solution) is nb11.ring_step_solution


# -- 11 exercise: the contiguous ring's imbalance -------------------------------------------------------


def test_imbalance_stub_is_not_attempted(capsys):
    def contiguous_imbalance(n):
        raise NotImplementedError  # your code here: return a number
    assert nb11.CONTIGUOUS_IMBALANCE.use(contiguous_imbalance) is nb11.contiguous_imbalance_solution
    assert "exercise 1: the price of contiguous chunks: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [lambda n: 2.0, lambda n: n / 2, lambda n: (n + 1) / n])
def test_imbalance_wrong_answers_fail(wrong):
    with pytest.raises(CheckFailed, match="the schedule counts"):
        nb11.check_contiguous_imbalance(wrong)


@pytest.mark.parametrize("answer", [nb11.contiguous_imbalance_solution, lambda n: 2 - 1 / n],
                         ids=["solution", "the formula simplified"])
def test_imbalance_solution_passes(answer, capsys):
    assert nb11.CONTIGUOUS_IMBALANCE.use(answer) is answer
    out = capsys.readouterr().out
    assert "passed: contiguous_imbalance" in out and "exercise 1: the price of contiguous chunks: passed" in out


# -- 11 puzzle: the zig-zag assignment ------------------------------------------------------------------


@pytest.mark.parametrize("wrong, message", [
    (lambda i, n: (i, 2 * n - i), r"case 'n = 1 devices.*chunk\(s\) \[2\] lie outside 0..1.*2n - 1 - i"),  # mutant
    (lambda i, n: (i, 2 * n + 1 - i), r"chunk\(s\) \[3\] lie outside 0..1"),  # mutant
    (lambda i, n: (i, 2 * n - 1 + i), r"case 'n = 2 devices.*chunk\(s\) \[4\] lie outside"),  # mutant
    (lambda i, n: (i, 2 / n - 1 - i), r"case 'n = 2 devices.*chunk\(s\) \[-1\] lie outside"),  # mutant
    (lambda i, n: (i, 3 * n - 1 - i), r"chunk\(s\) \[2\] lie outside"),  # mutant
    (lambda i, n: (i, n - 1 - i), r"case 'n = 1 devices.*chunk\(s\) \[0\] are held twice"),  # mutant (1 * n)
    (lambda i, n: (i, 2 * n - 2 - i), r"chunk\(s\) \[0\] are held twice"),  # mutant
    (lambda i, n: (2 * i, 2 * i + 1), r"case 'n = 2 devices.*not the same number.*pair an early chunk with a late"),
    (lambda i, n: (2 * n - 1 - i, i), r"case 'n = 1 devices, 2 chunks, device 0' — got \(1, 0\).*chunk i first"),
    (lambda i, n: (i,), "each device holds exactly two chunks"),
], ids=["2n-i", "2n+1-i", "2n-1+i", "2/n", "3n", "n-1-i", "2n-2-i", "neighbours", "late first", "one chunk"])
def test_zigzag_wrong_answers_fail_with_their_mistake(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb11.check_zigzag_chunks(wrong)


def test_zigzag_stub_and_solution(capsys):
    nb11.ZIGZAG_CHUNKS.use(_stub)
    assert "not attempted yet" in capsys.readouterr().out
    assert nb11.ZIGZAG_CHUNKS.use(nb11.zigzag_chunks_solution) is nb11.zigzag_chunks_solution
    assert "passed: zigzag_chunks" in capsys.readouterr().out


# -- 11 puzzle: the causal ring step --------------------------------------------------------------------


def _pairs(device, step, n, zigzag, *, source=lambda i, s, n: (i - s) % n, late=lambda i, n: 2 * n - 1 - i,
           kind=lambda a, b: nb11.FULL if b < a else nb11.DIAGONAL if b == a else nb11.SKIP):
    """The solution with one piece swapped for a learner's mistake (the defaults give the right answer)."""
    def chunks(i):
        return (i, late(i, n)) if zigzag else (i,)
    return {(a, b): kind(a, b) for a in chunks(device) for b in chunks(source(device, step, n))}


def _kind(full, diagonal):
    return lambda a, b: nb11.FULL if full(a, b) else nb11.DIAGONAL if diagonal(a, b) else nb11.SKIP


@pytest.mark.parametrize("options, message", [
    ({"kind": _kind(lambda a, b: b <= a, lambda a, b: b == a)},  # mutant: < made <=
     r"case 'contiguous, n = 1, device 0, step 0.*want \{\(0, 0\): 'DIAGONAL'\}: a diagonal pair .* treated as full"),
    ({"kind": _kind(lambda a, b: b > a, lambda a, b: b == a)},  # mutant: < flipped
     r"case 'contiguous, n = 2, device 0, step 1.*that pair is SKIP"),
    ({"kind": _kind(lambda a, b: b < a, lambda a, b: b != a)},  # mutant: == made !=
     r"is the DIAGONAL: half of it is visible"),
    ({"kind": _kind(lambda a, b: b < a - 1, lambda a, b: b == a)}, r"that pair is FULL"),
    ({"source": lambda i, s, n: (i + s) % n},  # mutant: the ring the wrong way
     r"case 'contiguous, n = 3, device 0, step 1.*the ring runs the wrong way"),
    ({"source": lambda i, s, n: (i - s) // n}, r"case 'contiguous, n = 2, device 1, step 0.*off by one"),  # mutant
    ({"source": lambda i, s, n: (i - s - 1) % n}, r"case 'contiguous, n = 2, device 0.*off by one: at step 0"),
    ({"late": lambda i, n: 2 * n - i}, r"case 'zig-zag, n = 1, device 0, step 0.*the wrong chunk pairs.*2n - 1 - i"),
    ({"late": lambda i, n: 2 * n + 1 - i}, r"case 'zig-zag, n = 1.*the wrong chunk pairs"),  # mutant
    ({"late": lambda i, n: 2 * n - 1 + i}, r"case 'zig-zag, n = 2, device 1.*the wrong chunk pairs"),  # mutant
    ({"late": lambda i, n: 2 / n - 1 - i}, r"case 'zig-zag, n = 2, device 0.*the wrong chunk pairs"),  # mutant
    ({"late": lambda i, n: 3 * n - 1 - i}, r"case 'zig-zag, n = 1.*the wrong chunk pairs"),  # mutant
    ({"late": lambda i, n: n - 1 - i}, r"case 'zig-zag, n = 1.*the wrong chunk pairs"),  # mutant (1 * n)
    ({"late": lambda i, n: 2 * n - 2 - i}, r"case 'zig-zag, n = 1.*the wrong chunk pairs"),  # mutant
], ids=["b<=a full", "b>a full", "!= diagonal", "b<a-1 full", "wrong way", "//n", "one step late", "2n-i", "2n+1-i",
        "2n-1+i", "2/n", "3n", "n-1-i", "2n-2-i"])
def test_causal_pairs_wrong_answers_fail_with_their_mistake(options, message):
    with pytest.raises(CheckFailed, match=message):
        nb11.check_causal_pairs(functools.partial(_pairs, **options))


def test_causal_pairs_stub_and_solution(capsys):
    nb11.CAUSAL_PAIRS.use(_stub)
    assert "not attempted yet" in capsys.readouterr().out
    assert nb11.CAUSAL_PAIRS.use(nb11.causal_pairs_solution) is nb11.causal_pairs_solution
    assert "passed: causal_pairs" in capsys.readouterr().out
    nb11.check_causal_pairs(_pairs)  # the test's own right answer passes too
