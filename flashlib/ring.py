"""Ring attention: the sequence split over a mesh axis, key/value chunks passed around a ring of devices.

Each of the ``n`` devices on ``seq_axis`` keeps its own query chunk(s) and, at ring step ``s``, holds the
key/value chunk(s) of device ``(i - s) mod n``. It computes attention of its queries over those keys with any
per-chunk worker (:mod:`flashlib.ring_workers`: reference, blockwise, pallas), which returns a partial
output and its log-sum-exp, and folds it into a running softmax state by notebook 03's merge identity
(:func:`flashlib.reference.merge_states`, with ``m = lse, l = 1, acc = out``). Then it hands its key/value
chunk to device ``i + 1`` (``jax.lax.ppermute``). After ``n`` steps every query has met every key; the
states are exact, not approximations (Liu et al., "Ring Attention with Blockwise Transformers", 2023).

Backward (a ``jax.custom_vjp``): the forward saves only ``q, k, v``, the output and the *global* lse. The
ring runs again; at each step the worker's backward recomputes the chunk pair's probabilities from the
global lse and returns its dQ (kept) and dK/dV, which travel around the ring after their k/v chunk as
accumulators, one step behind it (so that their transfer need not wait for the step's kernels); one last
hop brings every dK/dV home.

Causal and load balance: a query chunk ``a`` against key chunk ``b`` is fully visible (``b < a``), the
causal diagonal (``b == a``), or skipped (``b > a``; a ``lax.switch`` runs no branch's work). With
contiguous chunks device 0 has almost nothing to do and device ``n - 1`` everything, and every ring step
lasts as long as its busiest device. ``load_balance="zigzag"`` splits the sequence into ``2n`` chunks and
gives device ``i`` chunks ``i`` and ``2n - 1 - i``: then every device does the same work at every step
(:func:`ring_schedule` counts it).

Overlap: each step issues the ``ppermute`` of the next chunk before the worker's computation on the current
one, and nothing in the step depends on the transfer, so the two may run at once; XLA's scheduler decides
whether they do (on TPU the compiled program shows ``collective-permute-start`` ... ``-done`` around the
kernel; tests/test_ring_compile.py checks it for a v5e slice).

Lengths that do not divide: the sequence is padded at its end to a multiple of the chunk count. Causal
needs no mask for that (a real query never sees a later, padded key); otherwise the pair against the one
partly padded key chunk gives the worker only the chunk's real keys (a static slice: which chunk that is is
known when tracing), and wholly padded key chunks are skipped. Padded queries are dropped from the output.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from flashlib.api import check_layout, check_positive_ints, validate_inputs
from flashlib.arguments import check_causal
from flashlib.reference import SoftmaxState, default_scale, merge_states, state_output
from flashlib.ring_plan import (
    DIAGONAL,
    FULL,
    LOAD_BALANCES,
    PARTIAL,
    SKIP,
    RingPlan,
    chunks_of_device,
    ring_schedule,
    transfer_vs_compute,
)
from flashlib.ring_workers import Worker, make_worker
from flashlib.sharded import axis_size, check_divides, check_mesh_axis, place, working_mesh

__all__ = ["DIAGONAL", "FULL", "LOAD_BALANCES", "PARTIAL", "SKIP", "RingPlan", "chunks_of_device", "from_ring_order",
           "ring_attention", "ring_schedule", "to_ring_order", "transfer_vs_compute"]

_SWAP_SEQ_AND_HEADS = (0, 2, 1, 3)  # bshd <-> bhsd (its own inverse)

def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    seq_axis: str,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    causal: bool = False,
    scale: float | None = None,
    impl: str = "blockwise",
    load_balance: str | None = "zigzag",
    in_ring_order: bool = False,
    layout: str = "bhsd",
    **options: Any,
) -> jax.Array:
    """Self-attention with the sequence split over ``seq_axis`` of ``mesh`` (and optionally batch and heads).

    Args:
      q: ``[batch, heads, seq, head_dim]``; k, v: ``[batch, kv_heads, seq, head_dim / v_head_dim]``, the same
        ``seq`` (one sequence split over the ring), float32 or bfloat16; ``kv_heads`` divides ``heads``.
      mesh, seq_axis: the ring is ``seq_axis`` of ``mesh``; batch_axis, head_axis: other mesh axes that split
        batch and heads (no communication along them; sizes must divide batch, heads and kv_heads).
      causal: bottom-right aligned = the usual causal mask for self-attention.
      scale: default ``1 / sqrt(head_dim)``.
      impl: the per-chunk worker, ``"blockwise"``, ``"pallas"`` or ``"reference"``; options go to it
        (``block_q``/``block_k``; ``block_sizes``/``interpret``).
      load_balance: ``"zigzag"`` (2n chunks; device i holds chunks i and 2n-1-i) or None (contiguous).
        The reordering happens around the ring here (on a mesh, XLA moves data for it: collective-permutes).
      in_ring_order: q, k, v are already in ring order (:func:`to_ring_order`; the sequence a multiple of the
        chunk count), and so is the output: no reordering and no padding around the ring, so a model that
        keeps its activations in ring order pays only the ring's own transfers.
      layout: ``"bhsd"`` (as above) or ``"bshd"`` (``[batch, seq, heads, head_dim]`` arrays and output), handled
        here: the ring splits the sequence, ``head_axis`` the heads, whatever the layout.

    Returns:
      ``out [batch, heads, seq, v_head_dim]`` (in ``layout``) in q's dtype, differentiable in q, k, v (first
      order), on Auto and Explicit meshes outside ``jax.set_mesh`` too (:func:`flashlib.sharded.working_mesh`);
      inputs already sharded on Explicit axes are differentiated inside ``with jax.set_mesh(mesh):`` (JAX's rule).
    """
    causal = check_causal(causal)
    shape = validate_inputs(q, k, v, scale=scale, layout=check_layout(layout))
    if shape.q_len != shape.kv_len:
        raise ValueError(f"ring attention splits one sequence: q and k must have the same length (axis 2), got "
                         f"{shape.q_len} and {shape.kv_len}; for cross-attention use sharded_attention")
    if load_balance not in LOAD_BALANCES:
        raise ValueError(f"load_balance must be one of {LOAD_BALANCES}, got {load_balance!r}")
    if seq_axis is None:
        raise ValueError("seq_axis must name the mesh axis of the ring, e.g. seq_axis='seq'")
    for name, axis in (("seq_axis", seq_axis), ("batch_axis", batch_axis), ("head_axis", head_axis)):
        check_mesh_axis(mesh, name, axis)
    if seq_axis in (batch_axis, head_axis):
        raise ValueError(f"seq_axis={seq_axis!r} is also the batch or head axis; give the ring its own mesh axis")
    check_divides(mesh, shape, batch_axis=batch_axis, head_axis=head_axis)
    scale = default_scale(shape.head_dim) if scale is None else float(scale)
    if impl == "blockwise":  # its block sizes, checked before tracing (0 was a ZeroDivisionError in tiling)
        check_positive_ints(shape, causal=causal, scale=scale,
                            options={n: x for n, x in options.items() if n in ("block_q", "block_k")})
    worker = make_worker(impl, scale, dict(options))
    plan = RingPlan.make(shape.q_len, axis_size(mesh, seq_axis), causal, load_balance)
    if in_ring_order and plan.padded_length != shape.q_len:
        raise ValueError(f"in_ring_order=True needs the sequence ({shape.q_len}) to be a multiple of the chunk count "
                         f"{plan.n * plan.chunks_per_device}; pad it (or pass in_ring_order=False: padded for you)")

    def to_ring(x):  # [b, h, L, d] -> [b, h, padded L, d], chunks in device order
        x = jnp.pad(x, ((0, 0), (0, 0), (0, plan.padded_length - x.shape[2]), (0, 0)))
        return _reorder(x, plan, to_ring=True)

    spec = PartitionSpec(batch_axis, head_axis, seq_axis)

    def body(q, k, v):
        return _ring(q, k, v, plan, worker, seq_axis)

    if layout == "bshd":
        q, k, v = (jnp.asarray(x).transpose(_SWAP_SEQ_AND_HEADS) for x in (q, k, v))
    mesh = working_mesh(mesh, q, k, v)
    # one program, eagerly too (as sharded_attention: jax 0.7.2 refuses some ops run one by one on Explicit axes)
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False))
    if in_ring_order:
        out = run(*(place(x, mesh, spec) for x in (q, k, v)))
    else:
        out = run(*(place(to_ring(x), mesh, spec) for x in (q, k, v)))
        out = place(out, mesh, PartitionSpec(batch_axis, head_axis))  # Explicit axes: whole sequence, to reorder
        out = _reorder(out, plan, to_ring=False)[:, :, :shape.q_len]
    return out.transpose(_SWAP_SEQ_AND_HEADS) if layout == "bshd" else out


def to_ring_order(x: jax.Array, *, n: int, load_balance: str | None = "zigzag") -> jax.Array:
    """``x [b, h, L, d]`` (``L`` a multiple of the chunk count) with its sequence in the ring's device order:
    device ``i``'s contiguous block is its chunks (zig-zag: ``i`` and ``2n - 1 - i``)."""
    return _reorder(x, _plan_for(x, n, load_balance), to_ring=True)


def from_ring_order(x: jax.Array, *, n: int, load_balance: str | None = "zigzag") -> jax.Array:
    """The inverse of :func:`to_ring_order`."""
    return _reorder(x, _plan_for(x, n, load_balance), to_ring=False)


def _plan_for(x: jax.Array, n: int, load_balance: str | None) -> RingPlan:
    plan = RingPlan.make(x.shape[2], n, True, load_balance)
    if plan.padded_length != x.shape[2]:
        raise ValueError(f"the sequence ({x.shape[2]}) must be a multiple of the chunk count "
                         f"{n * plan.chunks_per_device} to be put in ring order; pad it first")
    return plan


def _reorder(x: jax.Array, plan: RingPlan, *, to_ring: bool) -> jax.Array:
    """Sequence order <-> ring order (:meth:`RingPlan.ring_order`) along axis 2 of ``x [b, h, L, d]``, by
    slices, flips and stacks (no gather: its transpose is a scatter, which Explicit mesh axes refuse)."""
    if plan.load_balance is None:
        return x
    b, h, length, d = x.shape
    n, c = plan.n, plan.chunk
    if to_ring:  # chunks [0 .. n-1 | n .. 2n-1] -> [0, 2n-1, 1, 2n-2, ...]
        blocks = x.reshape(b, h, 2 * n, c, d)
        pairs = jnp.stack([blocks[:, :, :n], jnp.flip(blocks[:, :, n:], axis=2)], axis=3)  # [b, h, n, 2, c, d]
        return pairs.reshape(b, h, length, d)
    pairs = x.reshape(b, h, n, 2, c, d)
    return jnp.concatenate([pairs[:, :, :, 0], jnp.flip(pairs[:, :, :, 1], axis=2)], axis=2).reshape(b, h, length, d)


# ---------------------------------------------------------------------------------------------------
# Inside the ring (per device): q [b, h, C * c, d], k [b, hk, C * c, d], v [b, hk, C * c, dv]
# ---------------------------------------------------------------------------------------------------


def _chunks(x: jax.Array, plan: RingPlan) -> list[jax.Array]:
    return [x[:, :, i * plan.chunk:(i + 1) * plan.chunk] for i in range(plan.chunks_per_device)]


def _pass_on(x: Any, axis: str, n: int) -> Any:
    """Send to the next device on the ring (device i -> i + 1), receive from the previous one."""
    return jax.lax.ppermute(x, axis, perm=[(i, (i + 1) % n) for i in range(n)])


def _pair_forward(worker: Worker, plan: RingPlan, kind, q, k, v) -> tuple[jax.Array, jax.Array]:
    """The worker on one chunk pair, by ``kind`` (a traced int): ``(out [b, h, c, dv] f32, lse [b, h, c])``."""
    rows = q.shape[:3]

    def skip(q, k, v):
        return jnp.zeros((*rows, v.shape[3]), jnp.float32), jnp.full(rows, -jnp.inf, jnp.float32)

    branches = [skip, lambda q, k, v: worker.forward(q, k, v, False), lambda q, k, v: worker.forward(q, k, v, True)]
    if plan.partial_keys:
        r = plan.partial_keys
        branches.append(lambda q, k, v: worker.forward(q, k[:, :, :r], v[:, :, :r], False))
    return jax.lax.switch(jnp.minimum(kind, len(branches) - 1), branches, q, k, v)


def _pair_backward(worker: Worker, plan: RingPlan, kind, q, k, v, out, lse, do):
    """The worker's backward on one chunk pair, by ``kind``: ``(dq, dk, dv)`` in f32."""

    def skip(q, k, v, out, lse, do):
        return jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)

    def partial(q, k, v, out, lse, do):
        r, pad = plan.partial_keys, ((0, 0), (0, 0), (0, plan.chunk - plan.partial_keys), (0, 0))
        dq, dk, dv = worker.backward(q, k[:, :, :r], v[:, :, :r], out, lse, do, False)
        return dq, jnp.pad(dk, pad), jnp.pad(dv, pad)

    branches = [skip, lambda *a: worker.backward(*a, False), lambda *a: worker.backward(*a, True)]
    if plan.partial_keys:
        branches.append(partial)
    return jax.lax.switch(jnp.minimum(kind, len(branches) - 1), branches, q, k, v, out, lse, do)


def _forward_ring(q, k, v, plan: RingPlan, worker: Worker, axis: str):
    """``(out [b, h, C c, dv] f32, lse [b, h, C c])`` for this device's queries over the whole sequence."""
    me = jax.lax.axis_index(axis)
    mine = chunks_of_device(me, plan.n, plan.load_balance)
    q_chunks = _chunks(q, plan)
    rows = q_chunks[0].shape[:3]
    empty = SoftmaxState(m=jnp.full(rows, -jnp.inf, jnp.float32), l=jnp.zeros(rows, jnp.float32),
                         acc=jnp.zeros((*rows, v.shape[3]), jnp.float32))

    def visit(states, k, v, step):
        theirs = chunks_of_device((me - step) % plan.n, plan.n, plan.load_balance)
        states = list(states)
        for i, (a, q_a) in enumerate(zip(mine, q_chunks, strict=True)):
            for b, k_b, v_b in zip(theirs, _chunks(k, plan), _chunks(v, plan), strict=True):
                out, lse = _pair_forward(worker, plan, plan.kind(a, b), q_a, k_b, v_b)
                part = SoftmaxState(m=lse, l=jnp.where(jnp.isfinite(lse), 1.0, 0.0), acc=out)
                states[i] = merge_states(states[i], part)  # notebook 03's identity
        return tuple(states)

    def step(carry, s):
        states, k, v = carry
        k_next, v_next = _pass_on((k, v), axis, plan.n)  # issued first: nothing below waits for it
        return (visit(states, k, v, s), k_next, v_next), None

    init = (tuple(empty for _ in q_chunks), k, v)
    (states, k, v), _ = jax.lax.scan(step, init, jnp.arange(plan.n - 1))
    states = visit(states, k, v, plan.n - 1)  # the last chunk: nothing left to send
    out = jnp.concatenate([state_output(s) for s in states], axis=2)
    lse = jnp.concatenate([jnp.where(jnp.isfinite(s.m), s.m, 0.0) + jnp.log(s.l) for s in states], axis=2)
    return out, lse


def _backward_ring(q, k, v, out, lse, do, plan: RingPlan, worker: Worker, axis: str):
    """``(dq, dk, dv)`` f32 for this device's chunks.

    dK/dV accumulators follow their k/v chunk around the ring one step behind it, so that no transfer waits
    for the step's kernels: at step ``t`` a device sends its k/v chunk on *and* the accumulator of the chunk
    it held at step ``t - 1`` (what arrived for it, plus this device's contribution computed then), and only
    then computes on its current chunk. The next device holds that chunk at step ``t`` and receives its
    accumulator during the step. After the last step one more hop brings every accumulator home.
    """
    me = jax.lax.axis_index(axis)
    mine = chunks_of_device(me, plan.n, plan.load_balance)
    q_chunks, out_chunks, lse_chunks, do_chunks = (_chunks(x, plan) for x in (q, out, lse[..., None], do))

    def visit(dq, k, v, step):
        """This step's dQ (added to ``dq``) and this device's contribution to the held chunk's dK, dV."""
        theirs = chunks_of_device((me - step) % plan.n, plan.n, plan.load_balance)
        dq, dk, dv = list(dq), [], []
        for b, k_b, v_b in zip(theirs, _chunks(k, plan), _chunks(v, plan), strict=True):
            dk_b, dv_b = jnp.zeros(k_b.shape, jnp.float32), jnp.zeros(v_b.shape, jnp.float32)
            for i, a in enumerate(mine):
                grads = _pair_backward(worker, plan, plan.kind(a, b), q_chunks[i], k_b, v_b, out_chunks[i],
                                       lse_chunks[i][..., 0], do_chunks[i])
                dq[i], dk_b, dv_b = dq[i] + grads[0], dk_b + grads[1], dv_b + grads[2]
            dk.append(dk_b)
            dv.append(dv_b)
        return tuple(dq), (jnp.concatenate(dk, axis=2), jnp.concatenate(dv, axis=2))

    def add(a, b):
        return a[0] + b[0], a[1] + b[1]

    def step(carry, s):
        dq, kv, acc, contribution = carry  # acc: what arrived for the chunk held last step; contribution: ours
        kv_next = _pass_on(kv, axis, plan.n)  # both transfers issued before the kernels; neither waits on them
        acc = _pass_on(add(acc, contribution), axis, plan.n)
        dq, contribution = visit(dq, *kv, s)
        return (dq, kv_next, acc, contribution), None

    dq0 = tuple(jnp.zeros(x.shape, jnp.float32) for x in q_chunks)
    zero = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    kv = _pass_on((k, v), axis, plan.n) if plan.n > 1 else (k, v)  # step 0: no accumulator to pass yet
    dq, contribution = visit(dq0, k, v, 0)
    carry = (dq, kv, zero, contribution)
    if plan.n > 1:
        carry, _ = jax.lax.scan(step, carry, jnp.arange(1, plan.n - 1))  # steps 1 .. n-2
        dq, kv, acc, contribution = carry
        acc = _pass_on(add(acc, contribution), axis, plan.n)  # the last step: no k/v left to send
        dq, contribution = visit(dq, *kv, plan.n - 1)
        carry = (dq, kv, acc, contribution)
    dq, _, acc, contribution = carry
    dk, dv = _pass_on(add(acc, contribution), axis, plan.n)  # the last hop: home
    return jnp.concatenate(dq, axis=2), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q, k, v, plan: RingPlan, worker: Worker, axis: str):
    out, _ = _forward_ring(q, k, v, plan, worker, axis)
    return out.astype(q.dtype)


def _ring_fwd(q, k, v, plan, worker, axis):
    out, lse = _forward_ring(q, k, v, plan, worker, axis)
    return out.astype(q.dtype), (q, k, v, out, lse)


def _ring_bwd(plan, worker, axis, residuals, do):
    q, k, v, out, lse = residuals
    dq, dk, dv = _backward_ring(q, k, v, out, lse, do, plan, worker, axis)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)
