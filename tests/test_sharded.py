"""flashlib.sharded and flashlib.ring on 8 simulated CPU devices, against the float64 oracle by
FlashAttention's rule; the ring's schedule and load balance, counted.

The device count is fixed when jax starts, so the 8-device checks run in one subprocess
(``tests/sharded_checks.py``, one JSON line per check) and each case's verdict is a test here. The schedule
tests need no devices and run in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from peers import rules
from sharded_checks import CASES

from flashlib.ring import (
    DIAGONAL,
    FULL,
    PARTIAL,
    SKIP,
    RingPlan,
    _reorder,
    from_ring_order,
    ring_schedule,
    to_ring_order,
)

SCRIPT = Path(__file__).with_name("sharded_checks.py")
# f32: the naive same-dtype errors are a few roundings (~3e-7), and merging 2n partial states adds a few more
# (measured up to 2.2x naive); 1e-6 is still 10^4-10^5 times below what a wrong merge or mask gives.
RULES = {"float32": rules.Rule(mult_out=2.0, mult_grad=2.0, atol_out=1e-6, atol_grad=1e-6),
         "bfloat16": rules.Rule(mult_out=2.0, mult_grad=2.0)}


# The case test_outputs_stay_sharded reads, whichever cases the run selected.
SHARDING_CASE = "sharded-blockwise-2x4-causal-gqa"


@pytest.fixture(scope="module")
def results(request) -> dict:
    """The checks of sharded_checks.py, by case id (and "bad_inputs"), from one 8-device subprocess: the cases
    this run selected (the smoke environment runs a share of them, tests/conftest.py), and the one
    test_outputs_stay_sharded reads."""
    selected = {item.callspec.params["case_id"] for item in request.session.items  # notebook cells among them
                if getattr(item, "originalname", None) == "test_matches_the_oracle_on_8_devices"}
    wanted = [] if selected == set(CASES) else [case for case in CASES if case in selected | {SHARDING_CASE}]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPT.parents[1]),
                                                                     os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(SCRIPT), *wanted], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, f"sharded_checks.py failed:\n{proc.stderr[-6000:]}"
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {line.get("case", "bad_inputs"): line for line in lines}


@pytest.mark.parametrize("case_id", list(CASES))
def test_matches_the_oracle_on_8_devices(results, case_id):
    result = results[case_id]
    rules.Comparison(case_id, result["errors"], result["naive_errors"]).check(RULES[result["dtype"]])


def test_outputs_stay_sharded(results):
    """Batch/head sharding hands back arrays split as the mesh says (the ring's output layout, after its
    reordering, is XLA's choice on jax 0.7.2's Auto axes: not checked)."""
    assert results[SHARDING_CASE]["out_sharding"] == ["x", "seq"]


BAD_INPUTS = {
    "ring-q-k-lengths": ("same length", "sharded_attention"),
    "ring-unknown-axis": ("seq_axis='sequence'", "its axes are ('x', 'seq')"),
    "ring-seq-axis-twice": ("seq_axis='seq'", "its own mesh axis"),
    "ring-load-balance": ("load_balance", "'zigzag'"),
    "ring-impl": ("impl='xla'", "'blockwise'"),
    "ring-option": ("interpret", "block_q, block_k"),
    "ring-not-a-mesh": ("mesh must be a jax.sharding.Mesh", "jax.make_mesh"),
    "ring-in-order-uneven": ("in_ring_order=True", "multiple of the chunk count 8"),
    "sharded-kv-heads": ("kv_heads", "divides 2"),
    "sharded-batch": ("batch = 3", "divides 3"),
    "sharded-same-axis": ("batch_axis and head_axis", "different"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_a_value_error_naming_the_fix(results, name):
    message = results["bad_inputs"]["bad_inputs"][name]
    assert message.startswith("ValueError: "), message
    for words in BAD_INPUTS[name]:
        assert words in message, message


# ---------------------------------------------------------------------------------------------------
# The schedule (no devices needed)
# ---------------------------------------------------------------------------------------------------


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    """Contiguous chunks: at step s only devices i >= s have a visible chunk, so the ring takes ~n/2 + 1/2
    chunk-pairs of time for n/2 of work (1.87x for n = 8). Zigzag: every device does the same at every step."""
    plain, zigzag = (ring_schedule(8, causal=True, load_balance=lb) for lb in (None, "zigzag"))
    assert plain["total"] == zigzag["total"] == 512 * 513 // 2  # the visible (query, key) pairs of 512 tokens
    assert plain["imbalance"] == pytest.approx(1.873, abs=1e-3)
    assert zigzag["imbalance"] == 1.0
    steady = zigzag["work"][1:]
    assert np.all(steady == steady[0, 0])  # after the diagonal step every device does 2 whole chunk pairs
    assert plain["work"][0].tolist() == [64 * 65 // 2] * 8  # step 0: every device its diagonal
    assert plain["work"][7].tolist() == [0] * 7 + [64 * 64]  # the last step: only device 7 works


def test_without_causal_every_layout_is_balanced():
    assert ring_schedule(4, causal=False, load_balance=None)["imbalance"] == 1.0
    assert ring_schedule(4, causal=False, load_balance="zigzag")["imbalance"] == 1.0


def test_the_plan_classifies_chunk_pairs_and_pads_at_the_end():
    plan = RingPlan.make(length=37, n=2, causal=True, load_balance="zigzag")  # 4 chunks of 10; 3 padded
    assert (plan.chunk, plan.padded_length, plan.partial_keys) == (10, 40, 7)
    assert plan.ring_order().tolist() == [0, 3, 1, 2]
    assert [int(plan.kind(3, b)) for b in range(4)] == [FULL, FULL, FULL, DIAGONAL]  # causal: no key mask needed
    assert int(plan.kind(1, 2)) == SKIP
    full = RingPlan.make(length=37, n=2, causal=False, load_balance=None)  # 2 chunks of 19: 18 + 1 padded
    assert [int(full.kind(0, b)) for b in range(2)] == [FULL, PARTIAL]
    assert int(RingPlan.make(length=9, n=8, causal=False, load_balance="zigzag").kind(0, 12)) == SKIP  # all pad


@pytest.mark.parametrize("load_balance", [None, "zigzag"])
def test_the_ring_order_round_trips(load_balance):
    plan = RingPlan.make(length=24, n=3, causal=True, load_balance=load_balance)
    x = jnp.arange(24.0).reshape(1, 1, 24, 1)
    ring = _reorder(x, plan, to_ring=True)
    assert ring[0, 0, :, 0].reshape(-1, plan.chunk)[:, 0].tolist() == [c * plan.chunk for c in plan.ring_order()]
    assert np.array_equal(_reorder(ring, plan, to_ring=False), x)


def test_ring_order_helpers_match_the_plan():
    x = jnp.arange(16.0).reshape(1, 1, 16, 1)  # 4 devices, zig-zag: 8 chunks of 2
    ring = to_ring_order(x, n=4)
    assert ring[0, 0, ::2, 0].tolist() == [0.0, 14.0, 2.0, 12.0, 4.0, 10.0, 6.0, 8.0]
    assert np.array_equal(from_ring_order(ring, n=4), x)
    with pytest.raises(ValueError, match="multiple of the chunk count 8"):
        to_ring_order(jnp.zeros((1, 1, 12, 1)), n=4)


def test_bad_load_balance_is_refused():
    with pytest.raises(ValueError, match="load_balance must be one of"):
        ring_schedule(4, load_balance="striped")


def test_ici_figures_and_the_transfer_compute_balance():
    """v5e: 400 GB/s over 4 ports -> 50 GB/s per link and direction; a 1024-token bf16 chunk pair of 8 heads of
    128 computes in 4 * 1024^2 * 8 * 128 / 197e12 s and its k/v (2 * 1024 * 8 * 128 * 2 bytes) cross in 84 us."""
    from flashlib.hardware import CHIPS
    from flashlib.ring import transfer_vs_compute

    assert CHIPS["v5e"].ici_link_bandwidth == 50e9
    assert CHIPS["v6e"].ici_link_bandwidth == 100e9
    assert CHIPS["v4"].ici_link_bandwidth is None
    v5e = transfer_vs_compute("v5e", chunk=1024, heads=8)
    assert v5e["compute_seconds"] == pytest.approx(4 * 1024**2 * 8 * 128 / 197e12)
    assert v5e["transfer_seconds"] == pytest.approx(2 * 1024 * 8 * 128 * 2 / 50e9)
    assert v5e["break_even_chunk"] == pytest.approx(3940.0)
    at_break_even = transfer_vs_compute("v5e", chunk=3940, heads=8)
    assert at_break_even["ratio"] == pytest.approx(1.0)
    assert transfer_vs_compute("v5e", chunk=1024, heads=8, kv_heads=1)["ratio"] == pytest.approx(v5e["ratio"] / 8)
    with pytest.raises(ValueError, match="no ICI figures recorded for v4"):
        transfer_vs_compute("v4", chunk=1024, heads=8)


@pytest.mark.usefixtures("no_open_figures")
def test_the_pictures_draw_what_they_are_given():
    from flashlib import viz
    from flashlib.ring import chunks_of_device

    mesh = viz.plot_mesh([["a", "b"], ["c", "d"]], ("data", "model"), title="t")
    assert sorted(t.get_text() for t in mesh.axes[0].texts) == ["a", "b", "c", "d"]
    work = ring_schedule(4, load_balance=None)["work"]
    heat = viz.plot_ring_work(work, vmax=float(work.max()))
    # step 0: every device its diagonal, a tie, no outline; step s: devices s..3 tie with a full pair each
    assert len(heat.axes[0].patches) == 3 + 2 + 1
    step = viz.plot_ring_step(1, [chunks_of_device(i, 4, None) for i in range(4)],
                              [chunks_of_device((i - 1) % 4, 4, None) for i in range(4)], work[1],
                              full_work=float(work.max()))
    assert [t.get_text().split("\n")[2] for t in step.axes[0].texts] == ["kv 3", "kv 0", "kv 1", "kv 2"]
    plain = viz.plot_ring_step(1, [[i] for i in range(4)], [[(i - 1) % 4] for i in range(4)], [1] * 4, full_work=1,
                               merged=[[i, (i - 1) % 4] for i in range(4)])  # no mask: the running state's chunks
    merged = [t.get_text().split("\n")[3] for t in plain.axes[0].texts]
    assert merged == [f"out: kv {i},{(i - 1) % 4}" for i in range(4)]
