"""Notebook 11's timeline of a ring step: the schematic clock adds up, a slow transfer leaves waits, the last
step sends nothing, and the figure draws every pair, transfer and wait it is given."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported anywhere: no display needed

import pytest  # noqa: E402
from conftest import PICTURE_TEST_MARKS  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from flashlib import viz  # noqa: E402
from flashlib.ring import DIAGONAL, FULL, SKIP, chunks_of_device  # noqa: E402
from flashlib.ring_plan import RingPlan  # noqa: E402

pytestmark = PICTURE_TEST_MARKS

NAMES = {FULL: "full", DIAGONAL: "diagonal", SKIP: "skip"}


def _device_steps(device: int = 0, n: int = 4) -> list[dict[tuple[int, int], str]]:
    """One device's chunk pairs per step of a causal zig-zag ring, in the order the ring runs them."""
    plan = RingPlan.make(64 * n, n, True, "zigzag")
    mine = chunks_of_device(device, n, "zigzag")
    return [{(a, b): NAMES[int(plan.kind(a, b))] for a in mine for b in chunks_of_device((device - s) % n, n, "zigzag")}
            for s in range(n)]


def test_a_short_transfer_hides_and_a_long_one_leaves_a_wait():
    steps = _device_steps()
    assert list(steps[0].values()) == ["diagonal", "skip", "full", "diagonal"]  # chunks 0 and 7 against 0 and 7
    hidden = viz.ring_timeline(steps, transfer=1.5, skip=0.1)
    assert [t.step for t in hidden] == [0, 1, 2, 3]
    assert hidden[0].compute_end == pytest.approx(2.1)  # two diagonals, a full pair, a skipped sliver
    assert all(t.end == t.compute_end for t in hidden)  # the transfer ends first: no step waits
    assert hidden[-1].transfer_end is None  # the last step: nothing left to send
    assert all(t.start == before.end for before, t in zip(hidden, hidden[1:], strict=False))
    assert hidden[-1].end == pytest.approx(2.1 + 3 * 2.2)
    exposed = viz.ring_timeline(steps, transfer=3.0, skip=0.1)
    assert [t.end for t in exposed[:3]] == pytest.approx([3.0, 6.0, 9.0])  # the link's pace
    assert exposed[-1].end == pytest.approx(9.0 + 2.2)
    for t in exposed:  # within a step the pairs run back to back from its start
        bounds = [t.start] + [t1 for *_, t1 in t.pairs]
        assert [t0 for *_, t0, _ in t.pairs] == pytest.approx(bounds[:-1]) and bounds[-1] == t.compute_end
    with pytest.raises(ValueError, match="transfer and skip must be >= 0"):
        viz.ring_timeline(steps, transfer=-1.0)


def test_plot_ring_timeline_draws_each_pair_transfer_and_wait():
    steps = _device_steps()
    ax = viz.plot_ring_timeline(steps, transfer=3.0, title="t").axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("nothing left to send") == 1
    assert [t for t in texts if t.startswith("step")] == ["step 0", "step 1", "step 2", "step 3"]
    labelled = sorted(t for t in texts if "," in t)  # full and diagonal pairs carry their (a, b); skips none
    assert labelled == sorted(f"{a},{b}" for p in steps for (a, b), kind in p.items() if kind != "skip")
    rectangles = [p for p in ax.patches if isinstance(p, Rectangle)]
    waits = [p for p in rectangles if p.get_hatch()]
    assert len(rectangles) == 16 + 3 * 2 + len(waits) and len(waits) == 3  # pairs, k and v in flight, waits
    assert [t.get_text() for t in ax.get_legend().get_texts()][-2:] == ["collective-permute-start",
                                                                       "collective-permute-done"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["chunk pairs", "v chunks to\nthe next device",
                                                            "k chunks to\nthe next device"]
    quiet = viz.plot_ring_timeline(steps, transfer=1.0, legend=False, xlabel="").axes[0]
    assert quiet.get_legend() is None and quiet.get_xlabel() == ""
    assert not [p for p in quiet.patches if isinstance(p, Rectangle) and p.get_hatch()]  # hidden: no wait
