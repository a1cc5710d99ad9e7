"""The teaching solutions of notebook 08's puzzle and exercises (choosing the blocks; a kernel's intensity with
padding; the fixed cost per grid step, fitted; where flashlib's kernel starts to beat XLA), kept apart from their
checkers in :mod:`flashlib.exercises.performance`, which imports them. Their source is what the notebook's hint
cells show (``notebooks/make_hint_cells.py``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from flashlib import cost, data, perf_data
from flashlib.kernels import BlockSizes

__all__ = ["choose_blocks_solution", "crossover_solution", "kernel_intensity_solution", "step_cost_solution"]


def choose_blocks_solution(estimates, head_dim, dtype, budget):
    fitting = [(sizes, cycles) for sizes, cycles in estimates if sizes.vmem_bytes(head_dim, dtype) <= budget]
    if not fitting:
        return None
    # fewest cycles; a tie goes to less VMEM (min keeps the earlier of two equal keys)
    sizes, _ = min(fitting, key=lambda pair: (pair[1], pair[0].vmem_bytes(head_dim, dtype)))
    return sizes


def kernel_intensity_solution(seq, block_q, block_k):
    sizes = BlockSizes(block_q, block_k).fit(seq, seq, jnp.bfloat16)  # the blocks as the kernel runs them
    shape = (1, 8, seq, seq, 128, False)  # batch, heads, q_len, kv_len, head_dim, causal
    flops = cost.attention_flops(*shape, sizes)  # every score of every (padded) block
    traffic = cost.attention_bytes(*shape, jnp.bfloat16, sizes)  # k and v re-read once per query block
    return flops / traffic


def step_cost_solution():
    rows = perf_data.read_table(data.data_dir() / "estimates" / "block_sweep.csv")  # the notebook's BLOCK_SWEEP
    ok = [r for r in rows if r["generation"] == "v6e" and r["status"] == "ok"]
    per_step, rest = np.polyfit([r["grid_steps"] for r in ok], [r["cycles"] for r in ok], 1)  # slope, intercept
    return per_step


def crossover_solution(rows, generation):
    ok = [r for r in rows if r["generation"] == generation and r["status"] == "ok"]
    xla = {r["seq"]: r["cycles"] for r in ok if r["impl"] == "xla"}
    ours = {r["seq"]: r["cycles"] for r in ok if r["impl"] == "pallas"}
    seqs = sorted(set(xla) & set(ours))  # the lengths where both have an estimate, shortest first
    wins = [ours[seq] < xla[seq] for seq in seqs]  # a tie is not a win
    # the first length from which every longer one is a win too
    return next((seq for i, seq in enumerate(seqs) if all(wins[i:])), None)
