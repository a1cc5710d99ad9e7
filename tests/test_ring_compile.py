"""Ring attention compiled ahead of time for real multi-chip TPU slices (libtpu, no TPU): the collectives
the compiler emitted, and what it scheduled while each transfer is in flight.

The ring's step issues the ``ppermute`` of the next key/value chunk before the Pallas kernels of the current
one; whether they overlap is the compiler's decision, read here from the compiled (scheduled) HLO.
"""

from __future__ import annotations

import importlib.metadata

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

from flashlib.ring import ring_attention
from flashlib.slice_compile import collective_counts, compile_for_slice, overlaps, ring_order, slice_mesh
from flashlib.tpu_compile import tpu_topology

pytestmark = pytest.mark.tpu
# [batch, heads, seq, head_dim]: 1024 tokens per chip, zigzag chunks of 512. The schedule depends on the sizes:
# at notebook 11's [1, 4, 2048, 128] the v6e and v5p compilers finish each transfer before the kernels (0
# conditionals in flight: test_at_the_notebooks_size_only_v5e_overlaps), at this size they keep it in flight
# across 2 of the step's 4 conditionals; v5e across all 4.
SHAPE = (1, 8, 4096, 128)
NOTEBOOK_SHAPE = (1, 4, 2048, 128)  # section 5 of notebooks/11_scaling_out.ipynb


def ring_program(mesh, *, grad: bool, in_ring_order: bool = False):
    def forward(q, k, v):
        return ring_attention(q, k, v, mesh=mesh, seq_axis="seq", causal=True, impl="pallas", interpret=False,
                              load_balance="zigzag", in_ring_order=in_ring_order)

    if not grad:
        return forward
    return jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))


def ring_loop_overlaps(hlo_text: str):
    """The collective-permutes inside loop bodies (the ring's steps), not the reordering around the ring."""
    return [o for o in overlaps(hlo_text) if not o.computation.startswith("main")]


def neighbours(a, b) -> bool:
    """Two chips one ICI link apart: coordinates one apart in exactly one dimension."""
    return sorted(abs(x - y) for x, y in zip(a.coords, b.coords, strict=True))[-2:] == [0, 1]


@pytest.mark.parametrize("topology", ["v5e:2x2", "v5e:2x4", "v5e:4x4", "v6e:2x4", "v5p:2x2x2", "v5e:4x8"])
def test_the_ring_follows_the_chips_links(topology):
    """Every hop of a one-axis slice mesh, the closing one included, is between neighbouring chips (by id a
    2 x 2 would be (0,0), (1,0), (0,1), (1,1): two diagonal hops, no link between their chips)."""
    ring = list(slice_mesh(topology, ("seq",)).devices)
    assert sorted(d.id for d in ring) == sorted(d.id for d in tpu_topology(topology).devices)
    hops = [(a.coords, b.coords) for a, b in zip(ring, ring[1:] + ring[:1], strict=True) if not neighbours(a, b)]
    assert not hops, hops
    if topology == "v5e:2x2":
        assert [d.id for d in ring] == [0, 1, 3, 2]


def test_a_line_keeps_its_natural_order():
    line = tpu_topology("v5e:1x4").devices
    assert [d.id for d in ring_order(line)] == sorted(d.id for d in line)


def test_ring_gradient_compiles_for_a_v5e_2x2_slice():
    """Forward and backward ring on 4 v5e chips: every transfer is a collective-permute (no all-reduce or
    all-to-all anywhere), async, and in flight while the step's kernels run."""
    mesh = slice_mesh("v5e:2x2", ("seq",))
    x = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)
    result = compile_for_slice(ring_program(mesh, grad=True), mesh, x, x, x)
    counts = collective_counts(result.hlo_text)
    assert result.chips == 4 and counts["collective-permute"] > 0, counts
    assert counts["all-reduce"] == 0 and counts["all-to-all"] == 0, counts
    loops = ring_loop_overlaps(result.hlo_text)
    # forward step: k, v (bf16 chunks); backward step: k, v and the f32 dK/dV accumulators
    assert len(loops) == 6, loops
    # every one of them in flight across the step's four kernel calls (before the accumulators were sent one
    # step behind their chunk, the backward's four transfers started only after the kernels: 0 in flight)
    assert all(o.conditionals_between == 4 for o in loops), [(o.start, o.conditionals_between) for o in loops]
    assert result.cost.get("flops", 0) > 0
    print(f"v5e:2x2 ring fwd+bwd: {counts}; overlaps in the ring loops: "
          f"{[(o.start, o.conditionals_between) for o in loops]}; libtpu estimate "
          f"{result.cost.get('optimal_seconds', float('nan')) * 1e6:.0f} us, compiled in {result.seconds:.1f} s")


@pytest.mark.parametrize("topology", ["v6e:2x2"])  # v5p:2x2x1 passes too (measured); left out for CI time
def test_ring_forward_compiles_for_other_slices(topology):
    mesh = slice_mesh(topology, ("seq",))
    x = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)
    result = compile_for_slice(ring_program(mesh, grad=False), mesh, x, x, x)
    loops = ring_loop_overlaps(result.hlo_text)
    in_flight = [o.conditionals_between for o in loops]
    assert len(loops) == 2 and all(n >= 2 for n in in_flight), in_flight  # measured on v6e: 2 and 2
    assert collective_counts(result.hlo_text)["all-reduce"] == 0


def test_in_ring_order_the_ring_is_the_only_communication():
    """With q, k, v already sharded in ring order the program's only collectives are the ring's: the forward's
    loop sends k and v (the last step sends nothing); the reordering's permutes are gone."""
    mesh = slice_mesh("v5e:2x2", ("seq",))
    x = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)
    result = compile_for_slice(ring_program(mesh, grad=False, in_ring_order=True), mesh, x, x, x,
                               spec=PartitionSpec(None, None, "seq"))
    assert collective_counts(result.hlo_text) == {"collective-permute": 2, "all-gather": 0, "all-reduce": 0,
                                                  "reduce-scatter": 0, "all-to-all": 0}
    assert all(o.conditionals_between == 4 for o in ring_loop_overlaps(result.hlo_text))


def test_at_the_notebooks_size_only_v5e_overlaps():
    """Notebook 11's section 5 ring (4 heads of 2048 tokens, zigzag chunks of 256): on v5e both of the loop's
    transfers are in flight across the step's 4 chunk-pair conditionals; on v6e (and v5p, measured) the newest
    libtpu's scheduler finishes each transfer before the conditionals run: 0 in flight, no overlap at this size,
    while Colab's libtpu 0.0.23 overlaps all 4 there (the decision moves between compiler versions too). Outside
    the loop: 15 permutes cut q, k and v (5 each) into ring order, 7 put the output back in sequence order."""
    x = jax.ShapeDtypeStruct(NOTEBOOK_SHAPE, jnp.bfloat16)
    found = {}
    for topology in ("v5e:2x2", "v6e:2x2"):
        mesh = slice_mesh(topology, ("seq",))
        found[topology] = compile_for_slice(ring_program(mesh, grad=False), mesh, x, x, x).permute_report()
    v6e = V6E_IN_FLIGHT_BY_LIBTPU.get(importlib.metadata.version("libtpu"), 0)
    assert found == {
        "v5e:2x2": "collective-permutes: 2 in the loop (4 and 4 conditionals between start and done), 15 before "
                   "it, 7 after it",
        "v6e:2x2": f"collective-permutes: 2 in the loop ({v6e} and {v6e} conditionals between start and done), 15 "
                   "before it, 7 after it",
    }, found


# Conditionals in flight on v6e at the notebook's size, where a libtpu differs from the newest (0): measured.
V6E_IN_FLIGHT_BY_LIBTPU = {"0.0.23": 4}
