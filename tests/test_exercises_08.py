"""Notebook 08's puzzle and exercises, run three ways: on the notebook's stub (reported as not attempted, no
traceback), on plausible wrong answers (each fails with the message that points at its mistake) and on a
solution (it passes). Nothing compiles: the checkers read committed tables and small synthetic ones."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from flashlib import cost, data, perf_data
from flashlib.checks import CheckFailed
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


def choose_last_of_equals(estimates, head_dim, dtype, budget):  # a loop with <= on (cycles, VMEM): the last of equals
    best = None
    for sizes, cycles in _fits(estimates, head_dim, dtype, budget):
        key = (cycles, sizes.vmem_bytes(head_dim, dtype))
        if best is None or key <= best[0]:
            best = (key, sizes)
    return None if best is None else best[1]


def choose_smaller_block_q(estimates, head_dim, dtype, budget):  # a tie goes to the smaller block_q, not less VMEM
    fitting = _fits(estimates, head_dim, dtype, budget)
    return min(fitting, key=lambda pair: (pair[1], pair[0].block_q))[0] if fitting else None


def choose_by_sorting(estimates, head_dim, dtype, budget):  # another valid style: a stable sort, then the first fit
    ranked = sorted(estimates, key=lambda pair: (pair[1], pair[0].vmem_bytes(head_dim, dtype)))
    return next((sizes for sizes, _ in ranked if sizes.vmem_bytes(head_dim, dtype) <= budget), None)


def choose_by_max(estimates, head_dim, dtype, budget):  # another valid style: max of the negated key
    fitting = _fits(estimates, head_dim, dtype, budget)  # max, like min, keeps the first of equal keys
    best = max(fitting, key=lambda pair: (-pair[1], -pair[0].vmem_bytes(head_dim, dtype)), default=None)
    return None if best is None else best[0]


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
    (choose_last_of_equals, r"case 'two candidates tie on cycles and on VMEM .*' — picked q128/k2048, but q512/k512 "
                            r"comes earlier .*the earlier wins .*not <="),
    (choose_smaller_block_q, "case 'two candidates tie on cycles, the one needing less VMEM has the larger block_q .*' "
                             "— picked q512/k1024 .*a tie in cycles goes to the candidate needing less VMEM"),
])
def test_choose_blocks_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb08.check_choose_blocks(wrong)
    assert nb08.CHOOSE_BLOCKS.use(wrong) is nb08.choose_blocks_solution


@pytest.mark.parametrize("answer", [nb08.choose_blocks_solution, choose_by_sorting, choose_by_max])
def test_choose_blocks_solution_passes(answer, capsys):
    assert nb08.CHOOSE_BLOCKS.use(answer) is answer
    out = capsys.readouterr().out
    assert out.startswith("passed: choose_blocks")
    assert "solved" in out or "passed — but this is flashlib's version" in out


def test_the_cases_are_what_their_names_say():
    cases = {case: (est, hd, dt, budget) for case, est, hd, dt, budget in nb08._choose_cases()}
    est, hd, dt, budget = cases["v6e's committed T=4096 candidates under v5e's 16 MiB (v6e's fastest needs 26 MiB)"]
    fastest = min(est, key=lambda pair: pair[1])[0]
    assert fastest.vmem_bytes(hd, dt) == 26 * MIB > budget
    est, hd, dt, budget = cases["two candidates tie on cycles and on VMEM (q512/k512 and q128/k2048, 5.5 MiB each): "
                                "the earlier wins"]
    (first, c1), (second, c2) = est[1:3]
    assert c1 == c2 and first.vmem_bytes(hd, dt) == second.vmem_bytes(hd, dt) == 5.5 * MIB and first != second
    est, hd, dt, budget = cases["a candidate needs exactly the budget"]
    assert nb08.choose_blocks_solution(est, hd, dt, budget).vmem_bytes(hd, dt) == budget
    assert all(nb08.choose_blocks_solution(*cases[c]) is None for c in cases if c.startswith(("nothing", "no cand")))


# -- exercise 1: intensity with padding ------------------------------------------------------------------


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


def intensity_with(seq, block_q, block_k, *, swap=False, with_lse=False, fit_dtype=jnp.bfloat16, bytes_blocks=True):
    sizes = (BlockSizes(block_k, block_q) if swap else BlockSizes(block_q, block_k)).fit(seq, seq, fit_dtype)
    return (cost.attention_flops(1, 8, seq, seq, 128, False, sizes)
            / cost.attention_bytes(1, 8, seq, seq, 128, False, jnp.bfloat16, sizes if bytes_blocks else None,
                                   with_lse=with_lse))


def intensity_by_hand(seq, block_q, block_k):  # another valid style: whole blocks counted by hand
    block_q, block_k = min(block_q, -(-seq // 16) * 16), min(block_k, -(-seq // 128) * 128)  # fit: bf16 rows, lanes
    n_q, n_k = -(-seq // block_q), -(-seq // block_k)
    flops = 4 * (n_q * block_q) * (n_k * block_k) * 128  # every score of every padded block, two matmuls
    return flops / (2 * 128 * (2 * n_q * block_q + 2 * n_q * n_k * block_k))  # q, out once; k, v per query block


def test_intensity_stub_is_not_attempted(capsys):
    def kernel_intensity(seq, block_q, block_k):
        raise NotImplementedError  # your count here
    assert nb08.KERNEL_INTENSITY.use(kernel_intensity) is nb08.kernel_intensity_solution  # as the notebook runs it
    assert "exercise 1: intensity with padding: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (intensity_ideal, "case T=1000 .*that is T/2, the ideal"),
    (intensity_formula, "case T=1000 .*section 1's formula"),
    (intensity_unfitted, r"case T=300 .*clamps its blocks to the sequence: BlockSizes\(block_q, block_k\)\.fit"),
    (intensity_float32, "case T=1000 .*bfloat16, 2 bytes a value"),
    (functools.partial(intensity_with, swap=True), r"case T=1000 .*block_q and block_k are swapped"),
    (functools.partial(intensity_with, with_lse=True), r"case T=1000 .*writes no lse"),
    (functools.partial(intensity_with, fit_dtype=jnp.float32), r"case T=100 in 512x512 blocks .*fitted for float32"),
    (functools.partial(intensity_with, bytes_blocks=False), r"case T=1000 .*pass block_sizes= to attention_bytes too"),
])
def test_intensity_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb08.check_intensity(wrong)


@pytest.mark.parametrize("answer", [nb08.kernel_intensity_solution, intensity_by_hand])
def test_intensity_solution_passes(answer, capsys):
    assert nb08.KERNEL_INTENSITY.use(answer) is answer
    out = capsys.readouterr().out
    assert out.startswith("passed: kernel intensity") and "exercise 1: intensity with padding: passed" in out


# -- exercise 2: the step cost, fitted -------------------------------------------------------------------


def _sweep_fit(generation=None, x="grid_steps", y="cycles"):
    rows = perf_data.read_table(data.find_data_file("estimates/block_sweep.csv"))
    rows = [r for r in rows if r["status"] == "ok" and generation in (None, r["generation"])]
    return np.polyfit([r[x] for r in rows], [r[y] for r in rows], 1)


def test_step_cost_stub_is_not_attempted(capsys):
    def my_step_cost():
        raise NotImplementedError  # np.polyfit(steps, cycles, 1) returns (slope, intercept)
    assert nb08.STEP_COST.use(my_step_cost) == nb08.step_cost_solution()  # as the notebook runs it
    assert "exercise 2: fit the step cost yourself: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (lambda: _sweep_fit("v6e")[1], "that is the intercept"),
    (lambda: _sweep_fit("v5e")[0], "that is v5e's slope"),
    (lambda: _sweep_fit()[0], "fits both chips at once"),
    (lambda: _sweep_fit("v6e", "cycles", "grid_steps")[0], "fits steps against cycles"),
    (lambda: _sweep_fit("v6e"), r"got 2 numbers: return the slope alone .*take \[0\]"),
])
def test_step_cost_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb08.check_step_cost(wrong())


def _lstsq_slope():  # another valid style: least squares by hand
    rows = [r for r in perf_data.read_table(data.find_data_file("estimates/block_sweep.csv"))
            if r["generation"] == "v6e" and r["status"] == "ok"]
    design = np.array([[r["grid_steps"], 1.0] for r in rows])
    return float(np.linalg.lstsq(design, np.array([r["cycles"] for r in rows], float), rcond=None)[0][0])


@pytest.mark.parametrize("answer", [nb08.step_cost_solution, _lstsq_slope])
def test_step_cost_solution_passes(answer, capsys):
    assert nb08.STEP_COST.use(answer) == answer()  # a value answer: the function that works it out, or the value
    assert nb08.STEP_COST.use(answer()) == answer()
    out = capsys.readouterr().out
    assert out.startswith("passed: v6e fixed cycles per grid step") and out.count("yourself: passed") == 2


# -- exercise 3: the crossover ---------------------------------------------------------------------------


def _ratios(rows, generation, impl="pallas"):
    ok = perf_data.select(rows, generation=generation, status="ok")
    xla = {r["seq"]: r["cycles"] for r in perf_data.select(ok, impl="xla")}
    return {r["seq"]: r["cycles"] / xla[r["seq"]] for r in perf_data.select(ok, impl=impl) if r["seq"] in xla}


crossover_solution = nb08.crossover_solution


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


def crossover_ties_win(rows, generation):  # <= : equal cycles counted as a win
    ratios = _ratios(rows, generation)
    seqs = sorted(ratios)
    return next((s for i, s in enumerate(seqs) if all(ratios[t] <= 1 for t in seqs[i:])), None)


def crossover_fixed_lengths(rows, generation):  # the committed sweep's lengths, hard-coded
    ratios = _ratios(rows, generation)
    seqs = [s for s in (128, 256, 512, 1024, 2048, 4096) if s in ratios]
    return next((s for i, s in enumerate(seqs) if all(ratios[t] < 1 for t in seqs[i:])), None)


def crossover_upside_down(rows, generation):  # XLA / flashlib < 1: where XLA wins
    ratios = {s: 1 / r for s, r in _ratios(rows, generation).items()}
    seqs = sorted(ratios)
    return next((s for i, s in enumerate(seqs) if all(ratios[t] < 1 for t in seqs[i:])), None)


def crossover_in_row_order(rows, generation):  # walks the lengths in the order the rows come
    ratios = _ratios(rows, generation)
    seqs = list(ratios)
    return next((s for i, s in enumerate(seqs) if all(ratios[t] < 1 for t in seqs[i:])), None)


def crossover_missing_pallas_is_a_loss(rows, generation):  # walks XLA's lengths; no flashlib estimate = a loss
    mine = perf_data.select(rows, generation=generation, status="ok")
    xla = {r["seq"]: r["cycles"] for r in mine if r["impl"] == "xla"}
    ours = {r["seq"]: r["cycles"] for r in mine if r["impl"] == "pallas"}
    seqs = sorted(xla)
    return next((s for i, s in enumerate(seqs) if all(t in ours and ours[t] < xla[t] for t in seqs[i:])), None)


def crossover_after_the_last_loss(rows, generation):  # another valid style: the length after the last loss
    ratios = _ratios(rows, generation)
    seqs = sorted(ratios)
    losses = [i for i, s in enumerate(seqs) if ratios[s] >= 1]
    after = losses[-1] + 1 if losses else 0
    return seqs[after] if after < len(seqs) else None


def test_crossover_stub_is_not_attempted(capsys):
    def crossover(rows, generation):
        raise NotImplementedError
    assert nb08.CROSSOVER.use(crossover) is nb08.crossover_solution  # as the notebook runs it
    assert "exercise 3: where the kernel starts to win: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (crossover_first_win, "case 'flashlib wins at 256, loses at 512, wins from 1024 on' — got 256, expected 1024: "
                          "that is the first length where it wins"),
    (crossover_wrong_column, "case 'JAX's kernel starts to win earlier than flashlib's' — got 256, expected 2048: "
                             "that is where JAX's kernel"),
    (crossover_any_chip, "case 'both chips in one table.*got 512, expected 1024: that is the other chip's"),
    (crossover_missing_is_a_loss, "case 'XLA has no estimate at 1024.*got 2048, expected 512: a length without both"),
    (crossover_no_status_filter, "case 'XLA has no estimate at 1024.*TypeError .*keep the rows with status 'ok'"),
    (crossover_ties_win, r"case 'flashlib ties XLA at 512 .*got 512, expected 1024: .*a tie is not a win.*<, not <="),
    (crossover_fixed_lengths, r"case 'other lengths .*got None, expected 1536: take the lengths from the rows"),
    (crossover_upside_down, r"case 'flashlib wins at 256.*got None, expected 1024: .*check the comparison's direction"),
    (crossover_in_row_order, r"case 'both chips in one table.*got None, expected 1024: .*sort the lengths"),
    (crossover_missing_pallas_is_a_loss, r"case 'flashlib has no estimate at 2048.*got 4096, expected 512: a length "
                                         r"without both estimates says nothing"),
])
def test_crossover_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb08.check_crossover(wrong)


@pytest.mark.parametrize("answer", [crossover_solution, crossover_after_the_last_loss])
def test_crossover_solution_passes(answer, capsys):
    assert nb08.CROSSOVER.use(answer) is answer
    out = capsys.readouterr().out
    assert out.startswith("passed: crossover") and "starts to win: passed" in out


def test_crossover_first_win_is_right_on_the_committed_sweep():
    """Why the checker needs its own tables: on the committed sweep the first win lasts, so a wrong rule agrees."""
    rows = perf_data.read_table(data.find_data_file("estimates/seq_sweep.csv"))
    for generation in ("v5e", "v6e"):
        assert crossover_first_win(rows, generation) == crossover_solution(rows, generation) == 512
