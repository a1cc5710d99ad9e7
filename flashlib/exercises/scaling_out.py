"""Notebook 11's puzzles and exercise checker.

Puzzles: :data:`RING_STEP`, one step of ring attention on one device: fold the attention of its queries over
the key/value chunk that just arrived into the running ``(out, lse)`` (notebook 03's merge, written for
normalised outputs and log-sum-exps); :data:`ZIGZAG_CHUNKS`, which two of the ``2n`` chunks device ``i`` holds
under the zig-zag assignment; :data:`CAUSAL_PAIRS`, which chunk pairs a device computes in full, as the causal
diagonal, or skips at each ring step. Exercise: the causal
imbalance of a ring with contiguous chunks, as a formula in the ring size (:data:`CONTIGUOUS_IMBALANCE`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from flashlib.checks import CheckFailed
from flashlib.exercises.puzzle import Puzzle
from flashlib.reference import attention_oracle
from flashlib.ring import DIAGONAL, FULL, SKIP, RingPlan, chunks_of_device, ring_schedule, to_ring_order

__all__ = ["CAUSAL_PAIRS", "CONTIGUOUS_IMBALANCE", "RING_STEP", "ZIGZAG_CHUNKS", "causal_pairs_solution",
           "check_causal_pairs", "check_contiguous_imbalance", "check_ring_step", "check_zigzag_chunks",
           "contiguous_imbalance_solution", "ring_step_solution", "run_ring", "zigzag_chunks_solution"]


def ring_step_solution(out, lse, q, k, v, scale):
    """``(out, lse)`` after folding in one chunk: q [c, d], k [r, d], v [r, dv]; out [c, dv], lse [c]."""
    s = (q @ k.T) * scale  # [c, r] this chunk's scores
    lse_chunk = jnp.log(jnp.sum(jnp.exp(s - s.max(axis=-1, keepdims=True)), axis=-1)) + s.max(axis=-1)  # [c]
    out_chunk = jnp.exp(s - lse_chunk[:, None]) @ v  # [c, dv] attention over this chunk alone
    lse_new = jnp.logaddexp(lse, lse_chunk)  # log(e^lse + e^lse_chunk): the denominators add up
    out_new = jnp.exp(lse - lse_new)[:, None] * out + jnp.exp(lse_chunk - lse_new)[:, None] * out_chunk
    return out_new, lse_new


def run_ring(ring_step: Callable, q, k, v, devices: int) -> np.ndarray:
    """Non-causal ring attention of ``q, k, v [seq, d]`` simulated on ``devices`` devices, one Python loop per
    step: device ``i`` keeps query chunk ``i`` and at step ``s`` holds key/value chunk ``(i - s) mod devices``."""
    q_chunks, k_chunks, v_chunks = (np.split(np.asarray(x, np.float32), devices) for x in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1])
    outs = []
    for device in range(devices):
        out = jnp.zeros((q_chunks[device].shape[0], v.shape[-1]), jnp.float32)
        lse = jnp.full(q_chunks[device].shape[0], -jnp.inf, jnp.float32)  # nothing seen yet
        for step in range(devices):
            source = (device - step) % devices
            out, lse = ring_step(out, lse, jnp.asarray(q_chunks[device]), jnp.asarray(k_chunks[source]),
                                 jnp.asarray(v_chunks[source]), scale)
        outs.append(np.asarray(out, np.float64))
    return np.concatenate(outs)


def _fail(case: str, why: str) -> CheckFailed:
    return CheckFailed(f"failed: ring_step, case '{case}' — {why}")


def check_ring_step(ring_step: Callable) -> None:
    """``ring_step(out, lse, q, k, v, scale) -> (out, lse)`` from an empty state, against a chunk with larger and
    one with smaller scores, and as a whole 4-device ring, against the float64 oracle."""
    rng = np.random.default_rng(11)
    c, d = 8, 16
    q = jnp.asarray(rng.normal(size=(c, d)), jnp.float32)
    k_low = jnp.asarray(rng.normal(size=(c, d)), jnp.float32)
    k_high = jnp.asarray(rng.normal(size=(c, d)) * 4.0, jnp.float32)  # scores several times larger
    v_low, v_high = (jnp.asarray(rng.normal(size=(c, d)), jnp.float32) for _ in range(2))
    scale = 1.0 / np.sqrt(d)
    empty = (jnp.zeros((c, d), jnp.float32), jnp.full(c, -jnp.inf, jnp.float32))

    def oracle(k, v):
        return attention_oracle(np.asarray(q)[None, None], np.asarray(k)[None, None], np.asarray(v)[None, None],
                                scale=scale)[0, 0]

    def lse_oracle(k):
        s = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T * scale
        return np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)

    out, lse = (np.asarray(x, np.float64) for x in ring_step(*empty, q, k_low, v_low, scale))
    if np.isnan(out).any() or np.isnan(lse).any():
        raise _fail("the first chunk, from the empty state (out = 0, lse = -inf)", "NaN in the result: the empty "
                    "state's weight exp(lse - lse_new) must come out 0, so combine the log-sum-exps with "
                    "jnp.logaddexp (not by subtracting -inf from -inf)")
    if not np.allclose(lse, lse_oracle(k_low), atol=1e-4):
        raise _fail("the first chunk, from the empty state", "lse is not log(sum(exp(scores))) of the chunk: "
                    "it must be the log of the softmax denominator, not the maximum score")
    if not np.allclose(out, oracle(k_low, v_low), atol=1e-4):
        raise _fail("the first chunk, from the empty state", "out is not attention over the chunk: out must be "
                    "normalised, exp(s - lse) @ v (the state of notebook 03 divided by l)")
    both_k, both_v = jnp.concatenate([k_low, k_high]), jnp.concatenate([v_low, v_high])
    for case, first, second in (("a chunk with larger scores arrives second", "low", "high"),
                                ("a chunk with smaller scores arrives second", "high", "low")):
        ks = {"low": (k_low, v_low), "high": (k_high, v_high)}
        state = ring_step(*empty, q, *ks[first], scale)
        out, lse = (np.asarray(x, np.float64) for x in ring_step(*state, q, *ks[second], scale))
        if not np.allclose(lse, lse_oracle(both_k), atol=1e-4):
            raise _fail(case, "lse is not the log-sum-exp over both chunks: the denominators add, "
                        "lse_new = log(e^lse + e^lse_chunk) = jnp.logaddexp(lse, lse_chunk) (not a maximum)")
        if not np.allclose(out, oracle(both_k, both_v), atol=1e-4):
            raise _fail(case, "out is not attention over both chunks: each side is normalised over its own keys, "
                        "so weigh it by its share of the new denominator, exp(lse_side - lse_new), then add")
    _check_large_scores(ring_step, q, (k_high * 15.0, v_high), (k_low * 40.0, v_low), scale, oracle, lse_oracle)
    seq = 32
    q_seq, k_seq, v_seq = (jnp.asarray(rng.normal(size=(seq, d)), jnp.float32) for _ in range(3))
    got = run_ring(ring_step, q_seq, k_seq, v_seq, devices=4)
    want = attention_oracle(*(np.asarray(x)[None, None] for x in (q_seq, k_seq, v_seq)))[0, 0]
    if not np.allclose(got, want, atol=1e-4):
        raise _fail("a 4-device ring over 32 tokens", f"max error {np.max(np.abs(got - want)):.3g} against the "
                    "oracle")
    print("passed: ring_step merges chunks in either order, from the empty state, with scores too large for exp, and "
          "runs a 4-device ring exactly")


def _check_large_scores(ring_step: Callable, q, first, second, scale: float, oracle, lse_oracle) -> None:
    """Two chunks whose scores reach about +-150, where ``exp`` of a score, or of a log-sum-exp, overflows float32
    (beyond ~88): only the max-subtracted log-sum-exp and ``jnp.logaddexp`` survive."""
    (k1, v1), (k2, v2) = first, second
    both_k, both_v = jnp.concatenate([k1, k2]), jnp.concatenate([v1, v2])
    top = float(np.max(np.abs(np.asarray(q, np.float64) @ np.asarray(both_k, np.float64).T * scale)))
    case = f"two chunks with large scores (up to {top:.0f}; exp overflows float32 beyond 88)"
    overflow = ("exp of a score or of a log-sum-exp this large is inf in float32: subtract the row max before exp "
                "(lse_chunk = m + log(sum(exp(s - m)))), and merge the two log-sum-exps with jnp.logaddexp, never "
                "log(exp(lse) + exp(lse_chunk))")
    alone = [np.asarray(x, np.float64) for x in ring_step(jnp.zeros((q.shape[0], v1.shape[1]), jnp.float32),
                                                          jnp.full(q.shape[0], -jnp.inf, jnp.float32), q, k1, v1,
                                                          scale)]
    if not all(np.isfinite(x).all() for x in alone) or not np.allclose(alone[1], lse_oracle(k1), rtol=1e-5, atol=1e-4):
        raise _fail(case, f"the first chunk alone already goes wrong: {overflow}")
    state = ring_step(*(jnp.asarray(x, jnp.float32) for x in alone), q, k2, v2, scale)
    out, lse = (np.asarray(x, np.float64) for x in state)
    if not (np.isfinite(out).all() and np.isfinite(lse).all()):
        raise _fail(case, f"inf or NaN after the merge: {overflow}")
    if not (np.allclose(lse, lse_oracle(both_k), rtol=1e-5, atol=1e-4) and np.allclose(out, oracle(both_k, both_v),
                                                                                        atol=1e-4)):
        raise _fail(case, f"max error {np.max(np.abs(out - oracle(both_k, both_v))):.3g} in out: {overflow}")


RING_STEP = Puzzle("puzzle: one ring step", check_ring_step, ring_step_solution, (
    "Two quantities describe the chunk on its own, as section 3 wrote them: its log-sum-exp per query row, "
    "`lse_chunk` (the log of its softmax denominator), and its output normalised over its own keys, "
    "`out_chunk`. Compute them as notebook 03 did, with the row max subtracted before `exp` so that scores of "
    "about 150 do not overflow. Then the running `(out, lse)` and the chunk's are two states to merge.",
    "The merged denominator is the sum of the two: in log form `lse_new = log(e^lse + e^lse_chunk)` "
    "(`jnp.logaddexp` computes it without overflow, and with `lse = -inf` as well). Each side's output is "
    "normalised over its own keys; by what factor, written with `lse` and `lse_new`, must the old `out` be "
    "scaled to count with its share of the new denominator? The chunk's side is the same with `lse_chunk`.",
))


def check_contiguous_imbalance(imbalance: Callable[[int], Any]) -> None:
    """``imbalance(n)``: the causal ring's time over the ideal with contiguous chunks on ``n`` devices, for long
    chunks (a diagonal chunk pair counts half), against :func:`flashlib.ring.ring_schedule`'s count."""
    for n in (1, 2, 3, 4, 8, 16):
        counted = ring_schedule(n, causal=True, load_balance=None, length=4096 * n)["imbalance"]
        got = float(imbalance(n))
        if not np.isclose(got, counted, rtol=2e-3):
            raise CheckFailed(
                f"failed: contiguous imbalance, n = {n} — got {got:.4f}, the schedule counts {counted:.4f}. Each "
                "step lasts as long as its busiest device: step 0 is every device's diagonal (half a chunk pair), "
                "each later step has some device with a whole pair; the total work is n^2 / 2 pairs, so the ideal "
                "time is n / 2")
    print("passed: contiguous_imbalance(n) matches the counted schedule for n = 1, 2, 3, 4, 8, 16")


def contiguous_imbalance_solution(n):
    # each step lasts as long as its busiest device (a chunk pair is one unit of time, a diagonal pair half)
    time = 0.5 + (n - 1)  # step 0: every device its own diagonal; each later step: some device a whole pair
    ideal = (n * n / 2) / n  # the causal half of the n x n chunk pairs, shared evenly by the n devices
    return time / ideal


CONTIGUOUS_IMBALANCE = Puzzle("exercise 1: the price of contiguous chunks", check_contiguous_imbalance,
                              contiguous_imbalance_solution, (
    "Count in chunk pairs (a diagonal pair counts half). A step lasts as long as its busiest device. At step 0 "
    "every device computes its own diagonal; at each later step the device holding the last chunk computes a "
    "whole pair (every kv chunk that reaches it lies in its past).",
    "Add up the ring's time first: step 0 costs half a pair, each of the `n - 1` later steps a whole pair. The "
    "ideal is the total causal work in pairs (which of the `n x n` pairs does the mask keep, the diagonal at "
    "half?) shared evenly by the `n` devices.",
))


# -- zig-zag: which chunks a device holds -----------------------------------------------------------------


def zigzag_chunks_solution(device, n):
    """The two chunks of the ``2n`` that device ``device`` of ``n`` holds under zig-zag: (early, late)."""
    return device, 2 * n - 1 - device  # an early chunk and its mirror from the end


def _zig_fail(case: str, why: str) -> CheckFailed:
    return CheckFailed(f"failed: zigzag_chunks, case '{case}' — {why}")


def check_zigzag_chunks(zigzag_chunks: Callable) -> None:
    """``zigzag_chunks(device, n) -> (early, late)`` for n = 1, 2, 3, 4, 5, 8: every chunk of 2n held once, every
    device the same causal work, the library's assignment (:func:`flashlib.ring.chunks_of_device`) and its ring
    order."""
    for n in (1, 2, 3, 4, 5, 8):
        held = [tuple(int(c) for c in zigzag_chunks(i, n)) for i in range(n)]
        case = f"n = {n} devices, {2 * n} chunks"
        if any(len(pair) != 2 for pair in held):
            raise _zig_fail(case, f"got {held}: each device holds exactly two chunks, (early, late)")
        flat = sorted(c for pair in held for c in pair)
        if flat != list(range(2 * n)):
            twice, outside = sorted({c for c in flat if flat.count(c) > 1}), sorted(set(flat) - set(range(2 * n)))
            what = f"chunk(s) {outside} lie outside 0..{2 * n - 1}" if outside else f"chunk(s) {twice} are held twice"
            raise _zig_fail(case, f"got {held}: {what}, so chunk(s) {sorted(set(range(2 * n)) - set(flat))} are "
                            "held by none; device i's late chunk is its mirror from the end, 2n - 1 - i (the chunks "
                            "are numbered from 0)")
        work = [a + b + 2 for a, b in held]  # key chunks its queries see (a diagonal counts as one)
        if len(set(work)) > 1:
            raise _zig_fail(case, f"got {held}: devices see {work} key chunks, not the same number — pair an early "
                            "chunk with a late one so that the sums i + (2n - 1 - i) are equal")
        for i, pair in enumerate(held):
            if pair != tuple(chunks_of_device(i, n, "zigzag")):
                raise _zig_fail(f"{case}, device {i}", f"got {pair}, the library holds "
                                f"{tuple(chunks_of_device(i, n, 'zigzag'))}: device i holds chunk i first (the "
                                "early one), then 2n - 1 - i")
        seq = np.arange(2 * n, dtype=np.float32).reshape(1, 1, 2 * n, 1)  # chunk c's one token is c
        ring = np.asarray(to_ring_order(jnp.asarray(seq), n=n, load_balance="zigzag")).ravel().astype(int)
        if list(ring) != [c for pair in held for c in pair]:
            raise _zig_fail(case, f"to_ring_order lays the chunks out as {list(ring)}, not as yours")
    print("passed: zigzag_chunks holds every chunk once, balances the causal work and matches to_ring_order for "
          "n = 1, 2, 3, 4, 5 and 8")


ZIGZAG_CHUNKS = Puzzle("puzzle: the zig-zag assignment", check_zigzag_chunks, zigzag_chunks_solution, (
    "Cut the sequence into `2n` chunks, numbered `0 .. 2n-1`. Under the causal mask chunk `c`'s queries see "
    "`c + 1` key chunks: early chunks are cheap, late ones dear. Give each device one of each.",
    "A chunk's causal work grows with its number, so a device's work grows with the sum of its two chunks' "
    "numbers: make the sum of a device's two chunk numbers equal for all devices. Return the early one "
    "first.",
))


# -- the causal ring step: which chunk pairs are full, diagonal or skipped --------------------------------


def causal_pairs_solution(device, step, n, zigzag):
    """``{(a, b): kind}`` for every query chunk ``a`` device ``device`` keeps and key chunk ``b`` it holds at ring
    step ``step`` of ``n``: FULL, DIAGONAL or SKIP; one chunk each (contiguous) or two (zig-zag) of the sequence."""
    source = (device - step) % n  # the kv chunks move one device on per step: they came from device - step

    def chunks(i):
        return (i, 2 * n - 1 - i) if zigzag else (i,)

    return {(a, b): FULL if b < a else DIAGONAL if b == a else SKIP for a in chunks(device) for b in chunks(source)}


_NAMES = {FULL: "FULL", DIAGONAL: "DIAGONAL", SKIP: "SKIP"}
_HOLDS = "at step 0 a device holds its own kv chunks, at step s those of device (i - s) mod n"


def _want_pairs(device, step, n, zigzag, shift=0, sign=-1):
    plan = RingPlan.make(64 * n, n, True, "zigzag" if zigzag else None)
    source = (device + sign * step + shift) % n
    return {(a, b): int(plan.kind(a, b)) for a in chunks_of_device(device, n, plan.load_balance)
            for b in chunks_of_device(source, n, plan.load_balance)}


def _pairs_mistake(got, want, device, step, n, zigzag) -> str:
    for sign, shift, why in ((1, 0, "the ring runs the wrong way: kv chunks go from device i to i + 1, so at step s "
                              "device i holds the chunks of device (i - s) mod n, not (i + s)"),
                             (-1, 1, f"off by one: {_HOLDS}"), (-1, -1, f"off by one: {_HOLDS}")):
        if set(got) == set(_want_pairs(device, step, n, zigzag, shift, sign)) != set(want):
            return why
    if set(got) != set(want):
        return (f"the wrong chunk pairs: {_HOLDS}; a device keeps (and passes on) chunk i, or under zig-zag chunks i "
                "and 2n - 1 - i of the 2n")
    wrong = [(got[p], w) for p, w in want.items() if got[p] != w]
    if any(w == DIAGONAL and g == FULL for g, w in wrong):
        return "a diagonal pair (query chunk a, key chunk a) is treated as full: it needs the causal mask inside"
    if any(w == DIAGONAL for g, w in wrong):
        return "query chunk a against key chunk a is the DIAGONAL: half of it is visible, under the causal mask"
    if any(w == SKIP for g, w in wrong):
        return "a later key chunk (b > a) is visible to no query of chunk a: that pair is SKIP"
    return "an earlier key chunk (b < a) is visible to every query of chunk a: that pair is FULL"


def check_causal_pairs(causal_pairs: Callable) -> None:
    """``causal_pairs(device, step, n, zigzag)`` against the library's plan (:meth:`flashlib.ring.RingPlan.kind`
    over :func:`~flashlib.ring.chunks_of_device`, as :func:`~flashlib.ring.ring_schedule` counts it) for every
    device and step of rings of 1, 2, 3, 4, 5 and 8 devices, both layouts."""
    for zigzag in (False, True):
        for n in (1, 2, 3, 4, 5, 8):
            for step in range(n):
                for device in range(n):
                    want = _want_pairs(device, step, n, zigzag)
                    got = {(int(a), int(b)): int(kind) for (a, b), kind in dict(causal_pairs(device, step, n,
                                                                                            zigzag)).items()}
                    case = (f"{'zig-zag' if zigzag else 'contiguous'}, n = {n}, device {device}, step {step}: query "
                            f"chunks {chunks_of_device(device, n, 'zigzag' if zigzag else None)}")
                    if got != want:
                        shown = {p: _NAMES.get(k, k) for p, k in sorted(got.items())}
                        wanted = {p: _NAMES[k] for p, k in sorted(want.items())}
                        raise CheckFailed(f"failed: causal_pairs, case '{case}' — got {shown}, want {wanted}: "
                                          + _pairs_mistake(got, want, device, step, n, zigzag))
    print("passed: causal_pairs matches the library's plan for every device and step of rings of 1, 2, 3, 4, 5 and "
          "8 devices, contiguous and zig-zag")


CAUSAL_PAIRS = Puzzle("puzzle: the causal ring step", check_causal_pairs, causal_pairs_solution, (
    "First, which kv chunks does the device hold? They move one device on per step (i to i + 1): at step 1, "
    "whose chunks does device 0 hold? At step 2? A device keeps chunk `i` (contiguous), or chunks `i` and "
    "`2n - 1 - i` (zig-zag), for its queries and for its keys alike.",
    "At step `s` device `i` holds the chunks that started on device `(i - s) % n`. Then each (query chunk `a`, "
    "key chunk `b`) pair, every `a` of the device's against every `b` it holds: "
    "`b < a` every key is earlier than every query, `FULL`; `b == a` the causal diagonal, `DIAGONAL`; `b > a` no "
    "query sees any key, `SKIP`. A dict comprehension over both builds the answer.",
))
