"""Notebook 08's puzzle and exercises, run three ways: on the notebook's stub (reported as not attempted, no
traceback), on plausible wrong answers (each fails with the message that points at its mistake) and on a
solution (it passes). Nothing compiles: the checkers read committed tables and small synthetic ones."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from flashlib import cost, data, perf_data
from flashlib.checks import CheckFailed, exercise
from flashlib.exercises import performance as nb08
from flashlib.kernels import BlockSizes
from flashlib.kernels.block_sizes import MIB, vmem_limit_bytes


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- puzzle 1: choose the blocks -------------------------------------------------------------------------


def _fits(estimates, head_dim, dtype, budget):
    return [(s, c) for s, c in estimates if s.vmem_bytes(head_dim, dtype) <= budget]


def choose_ignoring_vmem(estimates, head_dim, dtype, budget):  # the fastest, whether it fits or not
    return min(estimates, key=lambda pair: pair[1])[0] if estimates else None


def choose_without_tie_break(estimates, head_dim, dtype, budget):  # min by cycles alone: the first of a tie
    fitting = _fits(estimates, head_dim, dtype, budget)
    return min(fitting, key=lambda pair: pair[1])[0] if fitting else None


def choose_last_of_a_tie(estimates, head_dim, dtype, budget):  # a loop with <=: the last of a tie
    best = None
    for sizes, cycles in _fits(estimates, head_dim, dtype, budget):
        if best is None or cycles <= best[1]:
            best = (sizes, cycles)
    return None if best is None else best[0]


def choose_strictly_below(estimates, head_dim, dtype, budget):  # < instead of <=
    fitting = [(s, c) for s, c in estimates if s.vmem_bytes(head_dim, dtype) < budget]
    return min(fitting, key=lambda p: (p[1], p[0].vmem_bytes(head_dim, dtype)))[0] if fitting else None


def choose_at_128_bf16(estimates, head_dim, dtype, budget):  # counts VMEM for the usual shape, not the one given
    return nb08.choose_blocks_solution(estimates, 128, jnp.bfloat16, budget)


def choose_at_the_chips_budget(estimates, head_dim, dtype, budget):  # the chip's limit, not the budget given
    return nb08.choose_blocks_solution(estimates, head_dim, dtype, vmem_limit_bytes("v5e"))


def choose_min_of_nothing(estimates, head_dim, dtype, budget):  # min() of an empty list raises ValueError
    fitting = _fits(estimates, head_dim, dtype, budget)
    return min(fitting, key=lambda p: (p[1], p[0].vmem_bytes(head_dim, dtype)))[0]


def choose_returns_the_pair(estimates, head_dim, dtype, budget):
    fitting = _fits(estimates, head_dim, dtype, budget)
    return min(fitting, key=lambda p: (p[1], p[0].vmem_bytes(head_dim, dtype))) if fitting else None


def test_choose_blocks_stub_is_not_attempted(capsys):
    def choose_blocks(estimates, head_dim, dtype, budget):
        raise NotImplementedError  # your code here
    assert nb08.CHOOSE_BLOCKS.use(choose_blocks) is nb08.choose_blocks_solution  # as the notebook runs it
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (choose_ignoring_vmem, "case 'the fastest candidate needs more VMEM than the budget' — picked q1024/k1024, "
                           "which needs 17.0 MiB .* over the budget of 16.0 MiB"),
    (choose_without_tie_break, "case 'two candidates tie on cycles, the one needing more VMEM listed first' — .*a tie "
                               "in cycles goes to the candidate needing less VMEM"),
    (choose_last_of_a_tie, "case 'two candidates tie on cycles, the one needing less VMEM listed first' — .*a tie in "
                           "cycles goes to the candidate needing less VMEM"),
    (choose_strictly_below, r"case 'a candidate needs exactly the budget' — .*\(<=, not <\)"),
    (choose_at_128_bf16, "case 'float32 with head_dim 256, a budget of 15 MiB' — picked q1024/k512, which needs 16.0 "
                         "MiB .* over the budget"),
    (choose_at_the_chips_budget, "case 'float32 with head_dim 256, a budget of 15 MiB' — .*over the budget"),
    (choose_min_of_nothing, "case 'nothing fits a budget of 4 MiB' — raised ValueError .*return None"),
    (choose_returns_the_pair, "returned the pair .*return the BlockSizes itself"),
])
def test_choose_blocks_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb08.check_choose_blocks(wrong)
    assert nb08.CHOOSE_BLOCKS.use(wrong) is nb08.choose_blocks_solution


def test_choose_blocks_solution_passes(capsys):
    assert nb08.CHOOSE_BLOCKS.use(nb08.choose_blocks_solution) is nb08.choose_blocks_solution
    out = capsys.readouterr().out
    assert out.startswith("passed: choose_blocks") and "solved" in out


def test_the_cases_are_what_their_names_say():
    cases = {case: (est, hd, dt, budget) for case, est, hd, dt, budget in nb08._choose_cases()}
    est, hd, dt, budget = cases["v6e's committed T=4096 candidates under v5e's 16 MiB (v6e's fastest needs 26 MiB)"]
    fastest = min(est, key=lambda pair: pair[1])[0]
    assert fastest.vmem_bytes(hd, dt) == 26 * MIB > budget
    est, hd, dt, budget = cases["a candidate needs exactly the budget"]
    assert nb08.choose_blocks_solution(est, hd, dt, budget).vmem_bytes(hd, dt) == budget
    assert all(nb08.choose_blocks_solution(*cases[c]) is None for c in cases if c.startswith(("nothing", "no cand")))


# -- exercise 1: intensity with padding ------------------------------------------------------------------


def intensity_solution(seq, block_q, block_k):
    sizes = BlockSizes(block_q, block_k).fit(seq, seq, jnp.bfloat16)
    return (cost.attention_flops(1, 8, seq, seq, 128, False, sizes)
            / cost.attention_bytes(1, 8, seq, seq, 128, False, jnp.bfloat16, sizes))


def intensity_ideal(seq, block_q, block_k):
    return cost.attention_flops(1, 8, seq, seq, 128, False) / cost.attention_bytes(1, 8, seq, seq, 128, False,
                                                                                   jnp.bfloat16)


def intensity_formula(seq, block_q, block_k):  # section 1's formula: no padding
    return 1 / (1 / seq + 1 / block_q)


def intensity_unfitted(seq, block_q, block_k):
    sizes = BlockSizes(block_q, block_k)
    return (cost.attention_flops(1, 8, seq, seq, 128, False, sizes)
            / cost.attention_bytes(1, 8, seq, seq, 128, False, jnp.bfloat16, sizes))


def intensity_float32(seq, block_q, block_k):
    sizes = BlockSizes(block_q, block_k).fit(seq, seq, jnp.bfloat16)
    return (cost.attention_flops(1, 8, seq, seq, 128, False, sizes)
            / cost.attention_bytes(1, 8, seq, seq, 128, False, jnp.float32, sizes))


def test_intensity_stub_is_not_attempted(capsys):
    def kernel_intensity(seq, block_q, block_k):
        raise NotImplementedError  # your count here
    exercise("exercise 1", lambda: kernel_intensity, nb08.check_intensity)
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (intensity_ideal, "case T=1000 .*that is the ideal T/2"),
    (intensity_formula, "case T=1000 .*section 1's formula"),
    (intensity_unfitted, r"case T=300 .*clamps its blocks to the sequence: BlockSizes\(block_q, block_k\)\.fit"),
    (intensity_float32, "case T=1000 .*bfloat16, 2 bytes a value"),
])
def test_intensity_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb08.check_intensity(wrong)


def test_intensity_solution_passes(capsys):
    exercise("exercise 1", lambda: intensity_solution, nb08.check_intensity)
    assert capsys.readouterr().out.startswith("passed: kernel intensity")


# -- exercise 2: the step cost, fitted -------------------------------------------------------------------


def _sweep_fit(generation=None, x="grid_steps", y="cycles"):
    rows = perf_data.read_table(data.find_data_file("estimates/block_sweep.csv"))
    rows = [r for r in rows if r["status"] == "ok" and generation in (None, r["generation"])]
    return np.polyfit([r[x] for r in rows], [r[y] for r in rows], 1)


def test_step_cost_stub_is_not_attempted(capsys):
    def my_step_cost():
        raise NotImplementedError  # np.polyfit(steps, cycles, 1) returns (slope, intercept)
    exercise("exercise 2", my_step_cost, nb08.check_step_cost)
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (lambda: _sweep_fit("v6e")[1], "that is the intercept"),
    (lambda: _sweep_fit("v5e")[0], "that is v5e's slope"),
    (lambda: _sweep_fit()[0], "fits both chips at once"),
    (lambda: _sweep_fit("v6e", "cycles", "grid_steps")[0], "fits steps against cycles"),
])
def test_step_cost_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb08.check_step_cost(wrong())


def test_step_cost_solution_passes(capsys):
    exercise("exercise 2", lambda: _sweep_fit("v6e")[0], nb08.check_step_cost)
    assert capsys.readouterr().out.startswith("passed: v6e fixed cycles per grid step")


# -- exercise 3: the crossover ---------------------------------------------------------------------------


def _ratios(rows, generation, impl="pallas"):
    ok = perf_data.select(rows, generation=generation, status="ok")
    xla = {r["seq"]: r["cycles"] for r in perf_data.select(ok, impl="xla")}
    return {r["seq"]: r["cycles"] / xla[r["seq"]] for r in perf_data.select(ok, impl=impl) if r["seq"] in xla}


def crossover_solution(rows, generation):
    ratios = _ratios(rows, generation)
    seqs = sorted(ratios)
    return next((s for i, s in enumerate(seqs) if all(ratios[t] < 1 for t in seqs[i:])), None)


def crossover_first_win(rows, generation):  # the first win, lost again or not
    ratios = _ratios(rows, generation)
    return min((s for s, r in ratios.items() if r < 1), default=None)


def crossover_wrong_column(rows, generation):  # JAX's kernel instead of flashlib's
    ratios = _ratios(rows, generation, impl="jax_flash") or _ratios(rows, generation)
    seqs = sorted(ratios)
    return next((s for i, s in enumerate(seqs) if all(ratios[t] < 1 for t in seqs[i:])), None)


def crossover_any_chip(rows, generation):  # forgets the generation: the last row of a length wins
    xla = {r["seq"]: r["cycles"] for r in rows if r["impl"] == "xla" and r["status"] == "ok"}
    ratios = {r["seq"]: r["cycles"] / xla[r["seq"]] for r in rows if r["impl"] == "pallas" and r["seq"] in xla}
    seqs = sorted(ratios)
    return next((s for i, s in enumerate(seqs) if all(ratios[t] < 1 for t in seqs[i:])), None)


def crossover_missing_is_a_loss(rows, generation):  # a length without an XLA estimate counted as a loss
    mine = perf_data.select(rows, generation=generation)
    xla = {r["seq"]: r["cycles"] for r in mine if r["impl"] == "xla"}
    wins = {r["seq"]: xla[r["seq"]] is not None and r["cycles"] < xla[r["seq"]] for r in mine if r["impl"] == "pallas"}
    seqs = sorted(wins)
    return next((s for i, s in enumerate(seqs) if all(wins[t] for t in seqs[i:])), None)


def crossover_no_status_filter(rows, generation):  # compares None cycles
    mine = perf_data.select(rows, generation=generation)
    xla = {r["seq"]: r["cycles"] for r in mine if r["impl"] == "xla"}
    wins = {r["seq"]: r["cycles"] < xla[r["seq"]] for r in mine if r["impl"] == "pallas"}
    seqs = sorted(wins)
    return next((s for i, s in enumerate(seqs) if all(wins[t] for t in seqs[i:])), None)


def test_crossover_stub_is_not_attempted(capsys):
    def crossover(rows, generation):
        raise NotImplementedError
    exercise("exercise 3", lambda: crossover, nb08.check_crossover)
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (crossover_first_win, "case 'flashlib wins at 256, loses at 512, wins from 1024 on' — got 256, expected 1024: "
                          "that is the first length where it wins"),
    (crossover_wrong_column, "case 'JAX's kernel starts to win earlier than flashlib's' — got 256, expected 2048: "
                             "that is where JAX's kernel"),
    (crossover_any_chip, "case 'both chips in one table.*got 512, expected 1024: that is the other chip's"),
    (crossover_missing_is_a_loss, "case 'XLA has no estimate at 1024.*got 2048, expected 512: a length without both"),
    (crossover_no_status_filter, "case 'XLA has no estimate at 1024.*TypeError .*keep the rows with status 'ok'"),
])
def test_crossover_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb08.check_crossover(wrong)


def test_crossover_solution_passes(capsys):
    exercise("exercise 3", lambda: crossover_solution, nb08.check_crossover)
    assert capsys.readouterr().out.startswith("passed: crossover")


def test_crossover_first_win_is_right_on_the_committed_sweep():
    """Why the checker needs its own tables: on the committed sweep the first win lasts, so a wrong rule agrees."""
    rows = perf_data.read_table(data.find_data_file("estimates/seq_sweep.csv"))
    for generation in ("v5e", "v6e"):
        assert crossover_first_win(rows, generation) == crossover_solution(rows, generation) == 512
