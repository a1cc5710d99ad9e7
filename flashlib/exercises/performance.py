"""Notebook 08's puzzle and exercises: choosing block sizes by the compiler's estimate under a VMEM budget
(:data:`CHOOSE_BLOCKS`), and exercise 1 (a kernel's intensity with padding, :data:`KERNEL_INTENSITY`), 2 (the
fixed cost per grid step, fitted, :data:`STEP_COST`) and 3 (where flashlib's kernel starts to beat XLA,
:data:`CROSSOVER`). The solutions are in :mod:`flashlib.exercises.performance_solutions`.

The checkers read only committed tables (``data/``) and small synthetic ones: nothing here compiles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from flashlib import cost, data, perf_data
from flashlib.checks import CheckFailed
from flashlib.exercises.performance_solutions import (
    choose_blocks_solution,
    crossover_solution,
    kernel_intensity_solution,
    step_cost_solution,
)
from flashlib.exercises.puzzle import Puzzle
from flashlib.kernels import BlockSizes
from flashlib.kernels.block_sizes import MIB, vmem_limit_bytes
from flashlib.kernels.tuned_table import TableKey, load_tuned_table

__all__ = ["CHOOSE_BLOCKS", "CROSSOVER", "KERNEL_INTENSITY", "STEP_COST", "check_choose_blocks", "check_crossover",
           "check_intensity", "check_step_cost", "choose_blocks_solution", "crossover_solution",
           "kernel_intensity_solution", "step_cost_solution"]

# -- the puzzle: choose the blocks ------------------------------------------------------------------------

Estimates = Sequence[tuple[BlockSizes, int]]


def _label(sizes: BlockSizes) -> str:
    major = f"/km{sizes.block_k_major}" if sizes.block_k_major else ""
    return f"q{sizes.block_q}{major}/k{sizes.block_k}"


def _table_estimates(generation: str, seq: int) -> Estimates:
    """The committed tuned table's estimated candidates for one non-causal bf16 head_dim=128 shape."""
    entry = load_tuned_table()[TableKey(generation, "bfloat16", False, 128, seq, seq)]
    return [(BlockSizes(**t.blocks), t.cycles) for t in entry.trials if t.ok]


def _choose_cases() -> list[tuple[str, Estimates, int, Any, int]]:
    """``(case, estimates, head_dim, dtype, budget)``; VMEM by flashlib's count (bf16, head_dim 128): q1024/k1024
    17.0 MiB, q1024/k512 10.5, q512/k1024 9.0, q512/k512 5.5 (float32 with head_dim 256: 24, 16, 14, 9)."""
    big, wide, tall, small = BlockSizes(1024, 1024), BlockSizes(1024, 512), BlockSizes(512, 1024), BlockSizes(512, 512)
    bf16 = jnp.bfloat16
    return [
        ("the committed table, v5e T=2048, at v5e's 16 MiB", _table_estimates("v5e", 2048), 128, bf16,
         vmem_limit_bytes("v5e")),
        ("the fastest candidate needs more VMEM than the budget", [(big, 100_000), (wide, 120_000),
                                                                   (small, 150_000)], 128, bf16, 16 * MIB),
        ("v6e's committed T=4096 candidates under v5e's 16 MiB (v6e's fastest needs 26 MiB)",
         _table_estimates("v6e", 4096), 128, bf16, 16 * MIB),
        ("two candidates tie on cycles, the one needing more VMEM listed first",
         [(wide, 120_000), (tall, 120_000), (small, 150_000)], 128, bf16, 16 * MIB),
        ("two candidates tie on cycles, the one needing less VMEM listed first",
         [(small, 150_000), (tall, 120_000), (wide, 120_000)], 128, bf16, 16 * MIB),
        ("two candidates tie on cycles, the one needing less VMEM has the larger block_q (q1024/k256, 7.25 MiB)",
         [(tall, 120_000), (BlockSizes(1024, 256), 120_000), (small, 150_000)], 128, bf16, 16 * MIB),
        ("two candidates tie on cycles and on VMEM (q512/k512 and q128/k2048, 5.5 MiB each): the earlier wins",
         [(big, 100_000), (small, 120_000), (BlockSizes(128, 2048), 120_000), (tall, 130_000)], 128, bf16, 16 * MIB),
        ("a candidate needs exactly the budget", [(big, 100_000), (wide, 120_000), (small, 150_000)], 128, bf16,
         wide.vmem_bytes(128, bf16)),
        ("float32 with head_dim 256, a budget of 15 MiB", [(wide, 100_000), (tall, 120_000), (small, 150_000)], 256,
         jnp.float32, 15 * MIB),
        ("nothing fits a budget of 4 MiB", [(wide, 120_000), (tall, 130_000), (small, 150_000)], 128, bf16, 4 * MIB),
        ("no candidates at all", [], 128, bf16, 16 * MIB),
    ]


def _expected(estimates: Estimates, head_dim: int, dtype, budget: int) -> BlockSizes | None:
    fitting = [(cycles, sizes.vmem_bytes(head_dim, dtype), i) for i, (sizes, cycles) in enumerate(estimates)
               if sizes.vmem_bytes(head_dim, dtype) <= budget]
    return estimates[min(fitting)[2]][0] if fitting else None


def check_choose_blocks(choose_blocks: Callable[..., BlockSizes | None]) -> None:
    """``choose_blocks(estimates, head_dim, dtype, budget)``: among ``[(BlockSizes, cycles)]``, the candidate with
    the fewest cycles whose ``vmem_bytes(head_dim, dtype) <= budget``; a tie goes to less VMEM; None if none fits."""
    cases = _choose_cases()
    for case, estimates, head_dim, dtype, budget in cases:
        _check_choice(choose_blocks, case, estimates, head_dim, dtype, budget)
    print(f"passed: choose_blocks picks the fastest candidate that fits, in all {len(cases)} cases (ties, the "
          "fastest over budget, nothing fitting)")


def _check_choice(choose_blocks, case: str, estimates: Estimates, head_dim: int, dtype, budget: int) -> None:
    want = _expected(estimates, head_dim, dtype, budget)
    fail = f"failed: choose_blocks, case '{case}' —"
    try:
        got = choose_blocks(list(estimates), head_dim, dtype, budget)
    except ValueError as err:
        if want is not None:
            raise
        raise CheckFailed(f"{fail} raised ValueError ({err}): when no candidate fits, return None "
                          "(min(..., default=None), or test the filtered list first)") from err
    if isinstance(got, tuple) and got and isinstance(got[0], BlockSizes):
        raise CheckFailed(f"{fail} returned the pair {got}: return the BlockSizes itself (the pair's first item)")
    if got is not None and not isinstance(got, BlockSizes):
        raise CheckFailed(f"{fail} returned {got!r}: return one of the candidates' BlockSizes, or None")
    if got == want:
        return
    cycles = {sizes: c for sizes, c in reversed(estimates)}
    vmem = {sizes: sizes.vmem_bytes(head_dim, dtype) for sizes, _ in estimates}
    if want is None:
        raise CheckFailed(f"{fail} returned {_label(got)}, which needs {vmem.get(got, 0) / MIB:.1f} MiB: nothing fits "
                          f"the budget of {budget / MIB:.1f} MiB, so return None")
    if got is None:
        raise CheckFailed(f"{fail} returned None, but {_label(want)} fits ({vmem[want] / MIB:.1f} of "
                          f"{budget / MIB:.1f} MiB by sizes.vmem_bytes(head_dim, dtype))")
    if got not in cycles:
        raise CheckFailed(f"{fail} returned {_label(got)}, which is not one of the candidates: return one of them")
    if vmem[got] > budget:
        raise CheckFailed(f"{fail} picked {_label(got)}, which needs {vmem[got] / MIB:.1f} MiB for head_dim={head_dim} "
                          f"{jnp.dtype(dtype).name}, over the budget of {budget / MIB:.1f} MiB: keep only candidates "
                          "with sizes.vmem_bytes(head_dim, dtype) <= budget (with the head_dim and dtype given)")
    if cycles[got] == cycles[want] and vmem[got] == vmem[want]:
        raise CheckFailed(f"{fail} picked {_label(got)}, but {_label(want)} comes earlier in the list, takes as few "
                          f"cycles and needs the same {vmem[want] / MIB:.2f} MiB: of two candidates equal in both, the "
                          "earlier wins (min keeps the first of equal keys; a loop must replace only on <, not <=)")
    if cycles[got] == cycles[want]:
        raise CheckFailed(f"{fail} picked {_label(got)} ({vmem[got] / MIB:.1f} MiB), but {_label(want)} takes as few "
                          f"cycles and needs {vmem[want] / MIB:.1f} MiB: a tie in cycles goes to the candidate needing "
                          "less VMEM")
    if vmem[want] == budget:
        raise CheckFailed(f"{fail} picked {_label(got)} at {cycles[got]:,} cycles, but {_label(want)} needs exactly "
                          f"the budget and takes {cycles[want]:,}: a candidate that needs exactly the budget fits "
                          "(<=, not <)")
    raise CheckFailed(f"{fail} picked {_label(got)} at {cycles[got]:,} cycles, but {_label(want)} fits and takes "
                      f"{cycles[want]:,}: pick the fewest cycles among the candidates that fit")


CHOOSE_BLOCKS = Puzzle(
    "puzzle 1: choose the blocks",
    check_choose_blocks,
    choose_blocks_solution,
    (
        "Two steps. First keep the candidates that fit: `sizes.vmem_bytes(head_dim, dtype) <= budget` (a "
        "candidate that needs exactly the budget fits). Then, among those, take the one with the fewest "
        "cycles. If none fits, return `None` before asking for a minimum of nothing.",
        "`min` takes a `key`, and a tuple key breaks ties: `key=lambda pair: (cycles, VMEM)` puts the fewest "
        "cycles first and, among equal cycles, the least VMEM; of two equal keys `min` keeps the earlier one. "
        "Return the `BlockSizes` (the pair's first item), not the pair.",
    ),
)


# -- exercise 1: a kernel's intensity, padding included --------------------------------------------------


def check_intensity(kernel_intensity: Callable[[int, int, int], float]) -> None:
    """``kernel_intensity(seq, block_q, block_k)``: FLOPs over HBM bytes of flashlib's kernel as it runs, for
    ``[1, 8, seq, 128]`` bfloat16, not causal (the blocks clamped to the sequence, padding counted)."""
    cases = ((1000, 256, 512), (4096, 128, 1024), (300, 512, 512), (100, 512, 512))
    for seq, block_q, block_k in cases:
        got = float(kernel_intensity(seq, block_q, block_k))
        want, mistakes = _intensities(seq, block_q, block_k)
        if np.isclose(got, want, rtol=1e-9, atol=0.0):
            continue
        why = next((hint for value, hint in mistakes if np.isclose(got, value, rtol=1e-9, atol=0.0)),
                   "count both with flashlib.cost, given block_sizes= (the blocks as the kernel runs them)")
        raise CheckFailed(f"failed: kernel intensity, case T={seq} in {block_q}x{block_k} blocks — got {got:.6g}, "
                          f"expected {want:.6g}: {why}")
    print(f"passed: kernel intensity in all {len(cases)} cases (padding and clamped blocks included)")


def _intensities(seq: int, block_q: int, block_k: int) -> tuple[float, list[tuple[float, str]]]:
    """The right intensity, and the values of the likely mistakes with what each one forgot."""
    shape, bf16 = (1, 8, seq, seq, 128, False), jnp.bfloat16
    fitted, unfitted = BlockSizes(block_q, block_k).fit(seq, seq, bf16), BlockSizes(block_q, block_k)
    flops, traffic = cost.attention_flops(*shape, fitted), cost.attention_bytes(*shape, bf16, fitted)
    mistakes = [
        (cost.attention_flops(*shape) / cost.attention_bytes(*shape, bf16),
         "that is T/2, the ideal of the unpadded sequence with k and v read once; the kernel runs whole (padded) "
         "blocks and re-reads k and v once per query block: count with flashlib.cost, given block_sizes="),
        (1 / (1 / seq + 1 / block_q), "that is section 1's formula, which assumes lengths that are multiples of "
         "the blocks; the kernel runs whole blocks (count with flashlib.cost, given block_sizes=)"),
        (cost.attention_flops(*shape) / traffic, "the FLOPs leave out the padded blocks the kernel computes: pass "
         "block_sizes= to attention_flops too"),
        (cost.attention_flops(*shape, unfitted) / cost.attention_bytes(*shape, bf16, unfitted),
         "the kernel first clamps its blocks to the sequence: BlockSizes(block_q, block_k).fit(seq, seq, dtype)"),
        (flops / cost.attention_bytes(*shape, jnp.float32, fitted), "the tensors are bfloat16, 2 bytes a value"),
        (flops / cost.attention_bytes(*shape, bf16, fitted, with_lse=True), "this kernel writes no lse (only the "
         "backward pass needs it): leave attention_bytes' with_lse at its default, False"),
        (flops / cost.attention_bytes(*shape, bf16, None), "the bytes leave out the re-reads of k and v: pass "
         "block_sizes= to attention_bytes too"),
    ]
    if block_q != block_k:
        swapped = BlockSizes(block_k, block_q).fit(seq, seq, bf16)
        mistakes.append((cost.attention_flops(*shape, swapped) / cost.attention_bytes(*shape, bf16, swapped),
                         "block_q and block_k are swapped: BlockSizes(block_q, block_k), queries first"))
    f32_fit = BlockSizes(block_q, block_k).fit(seq, seq, jnp.float32)
    if f32_fit != fitted:
        mistakes.append((cost.attention_flops(*shape, f32_fit) / cost.attention_bytes(*shape, bf16, f32_fit),
                         "the blocks were fitted for float32 (8-row tiles); the tensors are bfloat16, whose tiles "
                         "have 16 rows: fit(seq, seq, jnp.bfloat16)"))
    return flops / traffic, mistakes


KERNEL_INTENSITY = Puzzle(
    "exercise 1: intensity with padding",
    check_intensity,
    kernel_intensity_solution,
    (
        "Three steps: the blocks the kernel really runs, `BlockSizes(block_q, block_k).fit(seq, seq, "
        "jnp.bfloat16)`; the FLOPs and the HBM bytes of the shape `[1, 8, seq, 128]` with those blocks; their "
        "ratio. Section 1's formula assumes lengths that are multiples of the blocks, so it is not the answer.",
        "`cost.attention_flops(1, 8, seq, seq, 128, False, sizes)` counts every score of every padded block, and "
        "`cost.attention_bytes(1, 8, seq, seq, 128, False, jnp.bfloat16, sizes)` the bytes, k and v re-read once "
        "per query block. Pass the *fitted* `sizes` to both (no lse: leave `with_lse` at its default).",
    ),
)


# -- exercise 2: the fixed cost per grid step, fitted ----------------------------------------------------


def _block_sweep() -> list[perf_data.Row]:
    path = data.find_data_file("estimates/block_sweep.csv")
    if path is None:
        raise FileNotFoundError("data/estimates/block_sweep.csv is missing: run the notebook's setup cell")
    return perf_data.read_table(path)


def check_step_cost(per_step: float) -> None:
    """``per_step``: the slope of ``cycles = per_step * grid_steps + rest`` over the ``"ok"`` v6e rows of the block
    sweep, within 0.1%."""
    rows = _block_sweep()

    def fit(chosen, x="grid_steps", y="cycles"):
        ok = [r for r in chosen if r["status"] == "ok"]
        return np.polyfit([r[x] for r in ok], [r[y] for r in ok], 1)

    want = fit(perf_data.select(rows, generation="v6e"))
    mistakes = [
        (want[1], "that is the intercept (rest): np.polyfit(x, y, 1) returns (slope, intercept)"),
        (fit(perf_data.select(rows, generation="v5e"))[0], "that is v5e's slope: select the v6e rows"),
        (fit(rows)[0], "that fits both chips at once: select the v6e rows"),
        (fit(perf_data.select(rows, generation="v6e"), "cycles", "grid_steps")[0],
         "that fits steps against cycles: x is grid_steps, y is cycles"),
    ]
    if np.ndim(per_step) != 0:
        raise CheckFailed(f"failed: v6e fixed cycles per grid step — got {np.size(per_step)} numbers: return the "
                          "slope alone (np.polyfit(x, y, 1) returns [slope, intercept]: take [0])")
    got = float(per_step)
    if abs(got / want[0] - 1.0) <= 1e-3:
        print(f"passed: v6e fixed cycles per grid step ({got:,.0f}, the sweep's fit)")
        return
    why = next((hint for value, hint in mistakes if abs(got / value - 1.0) <= 1e-3),
               "fit cycles against grid_steps over the v6e rows with status 'ok' and return the slope")
    raise CheckFailed(f"failed: v6e fixed cycles per grid step — got {got:,.6g}, expected {want[0]:,.6g}: {why}")


STEP_COST = Puzzle(
    "exercise 2: fit the step cost yourself",
    check_step_cost,
    step_cost_solution,
    (
        "Keep the rows of `BLOCK_SWEEP` (a list of dicts) whose `\"generation\"` is `\"v6e\"` and whose "
        "`\"status\"` is `\"ok\"`; x is each row's `\"grid_steps\"`, y its `\"cycles\"`.",
        "`np.polyfit(x, y, 1)` fits a line and returns its coefficients highest power first: `per_step, rest = "
        "np.polyfit(steps, cycles, 1)`. Return `per_step` alone, one number.",
    ),
    answer_is_value=True,
)


# -- exercise 3: where does flashlib's kernel start to win? -----------------------------------------------


def _sweep(generation: str, cycles: dict[str, Sequence[int | None]], seqs=(128, 256, 512, 1024, 2048, 4096)):
    """Rows like ``seq_sweep.csv``'s: ``cycles[impl][i]`` at ``seqs[i]`` (None: a compile error, no estimate)."""
    return [{"generation": generation, "impl": impl, "seq": seq, "status": "ok" if c is not None else "compile_error",
             "cycles": c} for impl, column in cycles.items() for seq, c in zip(seqs, column, strict=True)]


_XLA = [4000, 7000, 17000, 58000, 220000, 2500000]


def _crossover_cases() -> list[tuple[str, list[dict[str, Any]], str, int | None, dict[int | None, str]]]:
    """``(case, rows, generation, expected, {a wrong answer: its likely mistake})``."""
    first_win = "that is the first length where it wins, but it loses again after it: the crossover is the " \
                "shortest length from which it wins at every longer length too"
    return [
        ("flashlib wins at 256, loses at 512, wins from 1024 on",
         _sweep("v5e", {"xla": _XLA, "pallas": [8000, 6000, 18000, 40000, 150000, 600000],
                        "jax_flash": [9000, 7500, 19000, 45000, 190000, 700000]}), "v5e", 1024,
         {256: first_win, None: "flashlib is faster at 1024, 2048 and 4096 (its cycles below XLA's): check the "
                                "comparison's direction, flashlib's cycles < XLA's (a ratio flashlib / XLA < 1)"}),
        ("JAX's kernel starts to win earlier than flashlib's",
         _sweep("v6e", {"xla": _XLA, "pallas": [8000, 9000, 20000, 60000, 150000, 600000],
                        "jax_flash": [5000, 6000, 15000, 50000, 200000, 700000]}), "v6e", 2048,
         {256: "that is where JAX's kernel (impl 'jax_flash') starts to win: compare the 'pallas' rows with the "
               "'xla' rows"}),
        ("flashlib loses at the longest length",
         _sweep("v5e", {"xla": _XLA, "pallas": [8000, 9000, 15000, 50000, 200000, 2600000]}), "v5e", None,
         {512: first_win}),
        ("flashlib wins at every length", _sweep("v6e", {"xla": _XLA, "pallas": [3000, 6000, 15000, 50000, 200000,
                                                                                 2000000]}), "v6e", 128, {}),
        ("both chips in one table, rows in no particular order",
         list(reversed(_sweep("v5e", {"xla": _XLA, "pallas": [8000, 9000, 15000, 50000, 200000, 600000]})
                       + _sweep("v6e", {"xla": _XLA, "pallas": [8000, 9000, 20000, 50000, 200000, 600000]}))), "v6e",
         1024, {512: "that is the other chip's crossover: keep the rows of the generation asked for",
                None: "the rows come in no particular order (here longest first): sort the lengths before you "
                      "walk them"}),
        ("XLA has no estimate at 1024 (status 'compile_error')",
         _sweep("v5e", {"xla": [4000, 7000, 17000, None, 220000, 2500000],
                        "pallas": [8000, 9000, 15000, 50000, 200000, 600000]}), "v5e", 512,
         {2048: "a length without both estimates says nothing: compare only the lengths where both rows are 'ok'"}),
        ("flashlib has no estimate at 2048 (status 'compile_error')",
         _sweep("v6e", {"xla": _XLA, "pallas": [8000, 9000, 15000, 50000, None, 600000]}), "v6e", 512,
         {4096: "a length without both estimates says nothing (neither a win nor a loss): compare only the lengths "
                "where both rows are 'ok'"}),
        ("flashlib ties XLA at 512 (the same cycles) and wins from 1024 on",
         _sweep("v5e", {"xla": _XLA, "pallas": [8000, 9000, 17000, 50000, 200000, 600000]}), "v5e", 1024,
         {512: "at 512 both take 17,000 cycles: a tie is not a win, 'faster' means fewer cycles (<, not <=)"}),
        ("other lengths than the committed sweep's (384 to 12288)",
         _sweep("v6e", {"xla": _XLA, "pallas": [8000, 9000, 15000, 50000, 200000, 600000]},
                seqs=(384, 768, 1536, 3072, 6144, 12288)), "v6e", 1536,
         {None: "take the lengths from the rows (sorted), not from a list of the committed sweep's lengths"}),
    ]


def check_crossover(crossover: Callable[[list[dict[str, Any]], str], int | None]) -> None:
    """``crossover(rows, generation)``: the shortest length in ``rows`` (a table like ``seq_sweep.csv``) from which
    flashlib's kernel (impl ``"pallas"``) is estimated faster than XLA at that length and every longer one, among
    the lengths where both have an ``"ok"`` estimate; None if it never is."""
    cases = _crossover_cases()
    for case, rows, generation, want, mistakes in cases:
        fail = f"failed: crossover, case '{case}' —"
        try:
            got = crossover([dict(row) for row in rows], generation)
        except TypeError as err:
            if not any(row["cycles"] is None for row in rows):
                raise
            raise CheckFailed(f"{fail} TypeError ({err}): some rows have no estimate (cycles None): keep the rows "
                              "with status 'ok'") from err
        got = None if got is None else int(got)
        if got != want:
            why = mistakes.get(got, "the shortest length from which every longer length is a win too (None if "
                                    "the longest is not a win)")
            raise CheckFailed(f"{fail} got {got}, expected {want}: {why}")
    print(f"passed: crossover in all {len(cases)} cases (a win that does not last, the other columns, another chip, "
          "missing estimates, a tie, other lengths)")


CROSSOVER = Puzzle(
    "exercise 3: where the kernel starts to win",
    check_crossover,
    crossover_solution,
    (
        "Keep the rows of this `generation` with status `\"ok\"`, make two dicts `{seq: cycles}`, one for impl "
        "`\"xla\"` and one for `\"pallas\"`, and walk the lengths both have, sorted, shortest first. A win is "
        "fewer cycles than XLA's (a tie is not a win).",
        "The first win is not the answer when a loss comes after it. With `wins = [ours[s] < xla[s] for s in "
        "seqs]`, the crossover is the first `seqs[i]` with `all(wins[i:])`: "
        "`next((s for i, s in enumerate(seqs) if all(wins[i:])), None)`.",
    ),
)
