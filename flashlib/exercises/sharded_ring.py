"""Notebook 11's sharded puzzle: the ring's forward written with ``jax.shard_map`` and ``jax.lax.ppermute``.

:data:`RING_FORWARD`: ``ring_forward(q, k, v, mesh, ring_step)`` runs non-causal attention of ``q, k, v
[batch, heads, seq, d]`` with the sequence split in contiguous chunks over the mesh's one axis ``"seq"``: each
device keeps its query chunk, folds in the key/value chunk it holds with the notebook's ``ring_step`` (one
head's ``[c, d]`` arrays; ``jax.vmap`` it over batch and heads) and passes that chunk on with ``ppermute``.
The checker runs it on 1, 2, 4 and 8 of the CPU devices against the float64 oracle and reads the compiled
program: only collective-permutes may move data (no all-gather, all-reduce, reduce-scatter or all-to-all).

Exercises: :data:`STRIPED_IMBALANCE`, the causal imbalance of a striped ring (device ``i`` holds chunks ``i, i + n,
...``) counted as :func:`flashlib.ring.ring_schedule` counts; :data:`BACKWARD_RATIO`, one backward ring step's
transfer (k, v in bf16 and the dK/dV accumulators in f32) against its compute at a chip's peaks.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flashlib.checks import CheckFailed
from flashlib.exercises.puzzle import Puzzle
from flashlib.exercises.scaling_out import ring_step_solution
from flashlib.reference import attention_oracle
from flashlib.ring import DIAGONAL, FULL, RingPlan, ring_schedule, transfer_vs_compute
from flashlib.slice_compile import collective_counts

__all__ = ["BACKWARD_RATIO", "RING_FORWARD", "STRIPED_IMBALANCE", "backward_ratio_solution", "check_backward_ratio",
           "check_ring_forward", "check_striped_imbalance", "ring_forward_solution", "striped_imbalance_solution"]

RINGS = (1, 2, 4, 8)  # ring sizes the checker runs, as far as the devices go


def ring_forward_solution(q, k, v, mesh, ring_step):
    """Non-causal attention of q, k, v [batch, heads, seq, d], the sequence split over the mesh axis "seq"."""
    n = mesh.shape["seq"]
    step = jax.vmap(jax.vmap(ring_step, in_axes=(0, 0, 0, 0, 0, None)), in_axes=(0, 0, 0, 0, 0, None))
    scale = q.shape[-1] ** -0.5

    def per_device(q, k, v):  # this device's chunks: [batch, heads, seq / n, d]
        out = jnp.zeros((*q.shape[:3], v.shape[3]), jnp.float32)
        lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)  # nothing seen yet
        for s in range(n):
            out, lse = step(out, lse, q, k, v, scale)  # fold in the chunk this device holds
            if s < n - 1:  # pass it on: device i sends to i + 1, receives from i - 1
                k, v = jax.lax.ppermute((k, v), "seq", perm=[(i, (i + 1) % n) for i in range(n)])
        return out

    spec = PartitionSpec(None, None, "seq")  # the sequence (axis 2) split over "seq"
    return jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)


def _fail(case: str, why: str) -> CheckFailed:
    return CheckFailed(f"failed: ring_forward, case '{case}' — {why}")


def _devices() -> list:
    return jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")  # on a 1-chip TPU: the CPU's


def _oracle_per_device(q, k, v, n: int, drop: int | None = None) -> np.ndarray:
    """Device i's queries over every key chunk (or all but chunk ``(i + drop) mod n``), in sequence order."""
    qs, ks, vs = (np.split(np.asarray(x, np.float64), n, axis=2) for x in (q, k, v))
    outs = []
    for i in range(n):
        keep = [j for j in range(n) if drop is None or j != (i + drop) % n]
        outs.append(attention_oracle(qs[i], np.concatenate([ks[j] for j in keep], axis=2),
                                     np.concatenate([vs[j] for j in keep], axis=2)))
    return np.concatenate(outs, axis=2)


def _run(ring_forward: Callable, q, k, v, mesh: Mesh):
    sharding = NamedSharding(mesh, PartitionSpec(None, None, "seq"))
    q, k, v = (jax.device_put(jnp.asarray(x, jnp.float32), sharding) for x in (q, k, v))
    compiled = jax.jit(lambda q, k, v: ring_forward(q, k, v, mesh, ring_step_solution)).lower(q, k, v).compile()
    return np.asarray(compiled(q, k, v), np.float64), collective_counts(compiled.as_text())


def check_ring_forward(ring_forward: Callable) -> None:
    """``ring_forward(q, k, v, mesh, ring_step)`` on rings of 1, 2, 4 and 8 CPU devices against the float64
    oracle, with scores up to about +-150 on 4, and only collective-permutes in its compiled program."""
    devices = _devices()
    rng = np.random.default_rng(11)
    for n in (r for r in RINGS if r <= len(devices)):
        mesh = Mesh(np.array(devices[:n]), ("seq",))
        q, k, v = (rng.normal(size=(2, 2, 4 * n, 8)).astype(np.float32) for _ in range(3))
        case = f"a ring of {n} device(s), q, k, v [2, 2, {4 * n}, 8]: chunks of 4 tokens"
        got, counts = _run(ring_forward, q, k, v, mesh)
        others = {c: counts[c] for c in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all") if counts[c]}
        if others:
            raise _fail(case, f"the compiled program holds {others}: the key/value chunks must travel by "
                        "jax.lax.ppermute alone (inside jax.shard_map each device sees only its chunk; gathering "
                        "the whole k and v puts the sequence on every device, which ring attention avoids)")
        if n > 1 and counts["collective-permute"] == 0:
            raise _fail(case, "no collective-permute in the compiled program: the chunks never travel; run the "
                        "body under jax.shard_map and pass k and v on with jax.lax.ppermute")
        if got.shape != q.shape:
            raise _fail(case, f"the output has shape {got.shape}, not q's {q.shape}: out_specs splits the "
                        "sequence (axis 2) over 'seq', as in_specs do")
        want = _oracle_per_device(q, k, v, n)
        if not np.allclose(got, want, atol=1e-4):
            short = np.allclose(got, 0.0) if n == 1 else any(  # one chunk fewer (for n = 1: none at all)
                np.allclose(got, _oracle_per_device(q, k, v, n, drop), atol=1e-4) for drop in (1, -1))
            if short:
                raise _fail(case, "each device misses one key chunk: the last one it receives — n devices take n "
                            "steps, so fold in the chunk after the last ppermute too (n folds, n - 1 transfers)")
            raise _fail(case, f"max error {np.max(np.abs(got - want)):.3g} against the oracle: every device folds "
                        "each of the n chunks in once, with ring_step, from out = 0, lse = -inf")
    if len(devices) < 4:  # after the 1-device ring, so that a stub still reads as not attempted
        raise RuntimeError(f"ring_forward's checker needs 4 or more devices, found {len(devices)}: run the "
                           "notebook's setup cells first (8 simulated CPU devices), after a restart if jax had started")
    n = 4
    mesh = Mesh(np.array(devices[:n]), ("seq",))
    q = rng.normal(size=(1, 2, 4 * n, 8)).astype(np.float32) * 6.0
    k = rng.normal(size=(1, 2, 4 * n, 8)).astype(np.float32) * 6.0
    v = rng.normal(size=(1, 2, 4 * n, 8)).astype(np.float32)
    top = float(np.max(np.abs(np.einsum("bhqd,bhkd->bhqk", q, k)))) * 8 ** -0.5
    got, _ = _run(ring_forward, q, k, v, mesh)
    want = _oracle_per_device(q, k, v, n)
    if not np.allclose(got, want, atol=1e-4):
        bad = "" if np.isfinite(got).all() else ", NaN or inf"
        raise _fail(f"a ring of 4 devices, scores up to {top:.0f} (exp overflows float32 beyond 88)",
                    f"max error {np.nanmax(np.abs(got - want)):.3g}{bad}: merge each chunk with ring_step (its "
                    "log-sum-exp subtracts the row max, its merge uses jnp.logaddexp), not with exp of the scores")
    print(f"passed: ring_forward matches the oracle on rings of {', '.join(str(r) for r in RINGS if r <= len(devices))}"
          " devices (and with scores up to about 150), and its compiled program moves data by collective-permutes "
          "alone (either ring direction is right)")


RING_FORWARD = Puzzle("puzzle: the ring on a mesh", check_ring_forward, ring_forward_solution, (
    "Two pieces: a body that one device runs on its own chunks `[batch, heads, seq / n, d]`, and `jax.shard_map` "
    "around it, whose `in_specs` and `out_specs` cut axis 2 (the sequence) over the mesh axis `\"seq\"`. "
    "`ring_step` works on one head's `[c, d]` arrays: inside the body, `jax.vmap` it over batch and over heads "
    "(`scale` is the same for every head).",
    "In the body, which of `q`, `k`, `v` and the running `(out, lse)` stay on the device, and which move on with "
    "`jax.lax.ppermute` after each fold? Of the `n` folds, after which one is there no reason to send anything? A "
    "Python `for` over `range(n)` is fine: `n` is known when tracing.",
))


# -- exercise 2: a striped ring's imbalance ---------------------------------------------------------------


def striped_imbalance_solution(n, stripes, chunk):
    """The causal ring's time over the ideal when device ``i`` of ``n`` holds chunks ``i, i + n, ...`` of the
    ``stripes * n`` chunks of ``chunk`` tokens, counted as ``ring_schedule`` counts (visible token pairs)."""
    work = np.zeros((n, n))  # [step, device]
    for step in range(n):
        for device in range(n):
            source = (device - step) % n  # the kv chunks it holds came from device - step
            for a in range(device, stripes * n, n):  # its query chunks
                for b in range(source, stripes * n, n):  # the key chunks it holds
                    if b < a:  # every key earlier than every query: a full pair
                        work[step, device] += chunk * chunk
                    elif b == a:  # the diagonal: query j sees keys 0 .. j of the chunk
                        work[step, device] += chunk * (chunk + 1) // 2
    busiest = work.max(axis=1).sum()  # each step lasts as long as its busiest device
    return busiest / (work.sum() / n)  # the ideal: the total shared evenly


def _striped_reference(n: int, stripes: int, chunk: int, diagonal: float | None = None) -> float:
    diagonal = chunk * (chunk + 1) // 2 if diagonal is None else diagonal  # query j of the chunk sees keys 0 .. j
    plan = RingPlan.make(chunk * stripes * n, stripes * n, True, None)  # one chunk per "device": kind(a, b)
    work = np.zeros((n, n))
    for step in range(n):
        for device in range(n):
            for a in range(device, stripes * n, n):
                for b in range((device - step) % n, stripes * n, n):
                    kind = plan.kind(a, b)
                    work[step, device] += chunk * chunk if kind == FULL else diagonal if kind == DIAGONAL else 0
    return float(work.max(axis=1).sum() * n / work.sum())


def check_striped_imbalance(striped_imbalance: Callable) -> None:
    """``striped_imbalance(n, stripes, chunk)`` against a count over :meth:`RingPlan.kind`, for rings of 1, 2, 3,
    4 and 8 devices, 1, 2 and 4 stripes, chunks of 1 and 16 tokens (and ``ring_schedule`` for one stripe)."""
    for n in (1, 2, 3, 4, 8):
        for stripes in (1, 2, 4):
            for chunk in (1, 16):
                got, want = float(striped_imbalance(n, stripes, chunk)), _striped_reference(n, stripes, chunk)
                if abs(got - want) <= 1e-9 * want:
                    continue
                case = f"n = {n} devices, {stripes} stripe(s), chunks of {chunk} token(s)"
                if abs(got - _striped_reference(n, stripes, chunk, chunk * chunk)) <= 1e-9 * want:
                    why = ("a diagonal pair (b == a) is counted as full: query j of the chunk sees only keys 0 .. j, "
                           "chunk (chunk + 1) / 2 token pairs")
                elif abs(got - _striped_reference(n, stripes, chunk, chunk * chunk / 2)) <= 1e-9 * want:
                    why = ("the diagonal is chunk (chunk + 1) / 2 token pairs, not chunk^2 / 2: query j sees j + 1 "
                           "keys, itself included")
                elif stripes == 1:
                    contiguous = ring_schedule(n, load_balance=None, length=n * chunk)["imbalance"]
                    why = (f"with one stripe this is the contiguous ring: ring_schedule({n}, load_balance=None, "
                           f"length={n * chunk}) gives {contiguous:.4f}")
                else:
                    why = ("count each device's visible (query, key) token pairs per step (a full pair chunk^2, a "
                           "diagonal chunk (chunk + 1) / 2 x chunk), add the busiest device's per step, and divide by "
                           "the total over n")
                raise CheckFailed(f"failed: striped_imbalance, case '{case}' — got {got:.4f}, want {want:.4f}: {why}")
    print("passed: striped_imbalance matches the count for rings of 1, 2, 3, 4 and 8 devices, 1, 2 and 4 stripes, "
          "chunks of 1 and 16 tokens")


STRIPED_IMBALANCE = Puzzle("exercise 2: a striped ring", check_striped_imbalance, striped_imbalance_solution, (
    "Reuse `causal_pairs`' reasoning with `stripes` chunks per device: device `i` keeps query chunks `i, i + n, "
    "..., i + (stripes - 1) n` (`range(i, stripes * n, n)`), and at step `s` holds the key chunks of device "
    "`(i - s) % n`. Fill a `[step, device]` array of visible token pairs: `chunk**2` for `b < a`, "
    "`chunk * (chunk + 1) // 2` for `b == a`, nothing for `b > a`.",
    "A step lasts as long as its busiest device: the ring's time is `work.max(axis=1).sum()`; the ideal is the "
    "total shared evenly, `work.sum() / n`. The imbalance is their ratio.",
))


# -- exercise 3: the backward ring's transfer against its compute ------------------------------------------


def backward_ratio_solution(chip, chunk, heads, head_dim):
    """One backward ring step's transfer time over its compute time at ``chip``'s peaks: contiguous chunks, MHA."""
    flops = 5 * 2 * chunk * chunk * heads * head_dim  # five c x c x d matmuls per head: S, dP, dV, dQ, dK
    received = 2 * chunk * heads * head_dim * 2 + 2 * chunk * heads * head_dim * 4  # k, v in bf16; dK, dV in f32
    return (received / chip.ici_link_bandwidth) / (flops / chip.peak_bf16_flops)


def check_backward_ratio(backward_ratio: Callable) -> None:
    """``backward_ratio(chip, chunk, heads, head_dim)`` on v5e, v6e and v5p for three shapes, against the forward's
    :func:`~flashlib.ring.transfer_vs_compute` scaled by the backward's bytes (x 3) and FLOPs (x 2.5)."""
    from flashlib.hardware import CHIPS

    for name in ("v5e", "v6e", "v5p"):
        chip = CHIPS[name]
        for chunk, heads, head_dim in ((1024, 8, 128), (4096, 1, 64), (512, 16, 256)):
            forward = transfer_vs_compute(chip, chunk=chunk, heads=heads, head_dim=head_dim)["ratio"]
            want, got = forward * 3 / 2.5, float(backward_ratio(chip, chunk, heads, head_dim))
            if abs(got - want) <= 1e-9 * want:
                continue
            case = f"{name}, chunk {chunk}, {heads} heads of {head_dim}"
            mistakes = {forward: "that is the forward's ratio",
                        forward / 2.5: "the dK/dV accumulators travel too: f32, 4 bytes a value, behind each k/v chunk",
                        forward * 2 / 2.5: "the dK/dV accumulators are f32 (4 bytes a value), not bf16",
                        forward * 3 / 2: "the backward is five c x c x d matmuls per head (S recomputed, dP, dV, dQ, "
                                         "dK), 2 FLOPs a multiply-add",
                        forward * 3 / 5: "a c x c x d matmul is 2 c^2 d FLOPs (a multiply and an add)",
                        forward * 3: "the backward computes 2.5x the forward's FLOPs (five matmuls against two)"}
            why = next((w for r, w in mistakes.items() if abs(got - r) <= 1e-9 * r), "transfer = (k, v in bf16 + dK, "
                       "dV in f32) bytes / ici_link_bandwidth; compute = 10 c^2 h d FLOPs / peak_bf16_flops")
            raise CheckFailed(f"failed: backward_ratio, case '{case}' — got {got:.4g}, want {want:.4g}: {why}")
    print("passed: backward_ratio matches for v5e, v6e and v5p at three shapes")


BACKWARD_RATIO = Puzzle("exercise 3: the backward ring's transfer", check_backward_ratio, backward_ratio_solution, (
    "Per ring step and head, the backward receives the next k and v chunks (bf16, `2 * chunk * head_dim` values) "
    "and the dK and dV accumulators that follow them (f32, as many values again). It computes five "
    "`chunk x chunk x head_dim` matmuls, each `2 * chunk**2 * head_dim` FLOPs.",
    "Time is bytes over `chip.ici_link_bandwidth` and FLOPs over `chip.peak_bf16_flops`, both for all `heads`. "
    "Start with the bytes: k and v take 2 bytes a value, dK and dV 4, each `chunk * heads * head_dim` values. "
    "The FLOPs are the five matmuls of hint 1; the answer is the transfer time over the compute time.",
))
