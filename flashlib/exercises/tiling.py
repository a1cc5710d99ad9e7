"""Notebook 02's puzzles and exercises: the two products of attention tile by tile (``S = QKᵀ/√d``, then
``O = PV`` with an accumulator per query tile), a blocked matmul with rectangular tiles, the causal grid's
census, and the query tile that buys a tenfold cut in HBM traffic.

The tiled functions take the matmul they must call for every tile product (``matmul=jnp.matmul``); the
checkers pass an instrumented one that records each call's operand shapes, so an answer that is right but
not tiled (one big product, tiles larger than the blocks, ``@`` instead of ``matmul``) fails as well as one
that computes the wrong numbers. Every puzzle and exercise is a :class:`~flashlib.exercises.puzzle.Puzzle`; their
solutions are in :mod:`flashlib.exercises.tiling_solutions`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from flashlib.checks import CheckFailed
from flashlib.exercises.puzzle import Puzzle
from flashlib.exercises.tiling_solutions import (
    causal_count_solution,
    pick_block_q_solution,
    tiled_matmul_solution,
    tiled_pv_solution,
    tiled_scores_solution,
)
from flashlib.viz import tiling_steps

__all__ = [
    "BLOCK_Q", "CAUSAL_COUNT", "TILED_MATMUL", "TILED_PV", "TILED_SCORES", "causal_count_solution",
    "pick_block_q_solution",
    "check_block_q", "check_causal_count", "check_tiled_matmul", "check_tiled_pv", "check_tiled_scores",
    "tiled_matmul_solution", "tiled_pv_solution", "tiled_scores_solution",
]

Shapes = tuple[tuple[int, ...], tuple[int, ...]]


class _Recorder:
    """A matmul that records the shapes of its two operands, call by call."""

    def __init__(self) -> None:
        self.calls: list[Shapes] = []

    def __call__(self, a, b):
        self.calls.append((tuple(np.shape(a)), tuple(np.shape(b))))
        return jnp.matmul(a, b)


def _spans(length: int, block: int) -> list[int]:
    """The sizes of the tiles that cut ``length`` into ``block``s: the last one is shorter when it does not divide."""
    return [min(block, length - start) for start in range(0, length, block)]


def _show(shapes: Shapes) -> str:
    return " @ ".join(f"[{', '.join(map(str, shape))}]" for shape in shapes)


def _check_calls(name: str, case: str, calls: list[Shapes], expected: Counter, swapped: Counter, tile: str) -> None:
    """The recorded ``calls`` are one per tile product, of the tiles' shapes (``expected``, a Counter of shapes)."""
    if not calls:
        raise CheckFailed(f"failed: {name}, case '{case}' — matmul was never called: compute each tile's product "
                          "with matmul(...), the function passed in, so the checker can see the tiles (not with @)")
    if Counter(calls) == expected:
        return
    if Counter(calls) == swapped:
        raise CheckFailed(f"failed: {name}, case '{case}' — the tiles have the shapes of swapped block sizes: "
                          f"check which block cuts which dimension ({tile})")
    empty = next((shapes for shapes in calls if 0 in (*shapes[0], *shapes[1])), None)
    if empty:
        raise CheckFailed(f"failed: {name}, case '{case}' — a call multiplied {_show(empty)}, an empty tile: the loop "
                          "runs one tile past the end; range(0, length, block) stops by itself")
    biggest = [max(shapes[side][axis] for shapes in expected) for side in (0, 1) for axis in (0, 1)]
    for shapes in calls:
        if shapes not in expected:
            if any(got > most for got, most in zip((*shapes[0], *shapes[1]), biggest, strict=False)):
                raise CheckFailed(f"failed: {name}, case '{case}' — not tiled: a call multiplied {_show(shapes)}, "
                                  f"larger than one tile product; each call is one tile product ({tile})")
            raise CheckFailed(f"failed: {name}, case '{case}' — a call multiplied {_show(shapes)}, which is not one "
                              f"of the grid's tile products ({tile}; a length that does not divide its block ends "
                              "in a shorter tile: slice it, do not pad it)")
    if len(calls) == expected.total():
        extra = next(shapes for shapes, count in Counter(calls).items() if count > expected[shapes])
        raise CheckFailed(f"failed: {name}, case '{case}' — {Counter(calls)[extra]} calls multiplied {_show(extra)}, "
                          f"the grid has {expected[extra]}: where a length does not divide its block, the last tile "
                          "is the shorter rest (slice to the end: do not pad it, or shift it back over the one before)")
    raise CheckFailed(f"failed: {name}, case '{case}' — {len(calls)} calls to matmul, expected {expected.total()}: one "
                      f"per tile product, each computed once ({tile})")


def _diagnose(name: str, case: str, got, want, rows: tuple[int, int], cols: tuple[int, int],
              known: dict[str, np.ndarray], factor: str = "") -> None:
    """Raise naming the likely mistake when ``got`` differs from ``want``: still all zeros, a known wrong result, off
    by a constant ``factor`` (its hint), the last shorter tile (``rows = (length, block)`` of the first axis, ``cols``
    of the second), or else the first wrong value."""
    got = np.asarray(got, np.float64)
    if got.shape != want.shape:
        raise CheckFailed(f"failed: {name}, case '{case}' — shape {list(got.shape)}, expected {list(want.shape)}")
    bad = ~(np.abs(got - want) <= 1e-4 * (1 + np.abs(want)))  # also catches NaN
    if not bad.any():
        return
    if not got.any():
        raise CheckFailed(f"failed: {name}, case '{case}' — the result is still all zeros: x.at[...].set(...) returns "
                          "a new array and leaves x as it was; assign it back, x = x.at[...].set(...)")
    for mistake, wrong in known.items():
        if np.allclose(got, wrong, atol=1e-4):
            raise CheckFailed(f"failed: {name}, case '{case}' — {mistake}")
    ratio = float(np.sum(got * want) / (np.sum(want * want) or 1.0))
    if factor and np.allclose(got, ratio * want, rtol=1e-4, atol=1e-5):
        raise CheckFailed(f"failed: {name}, case '{case}' — off by a constant factor {ratio:.4g}: {factor}")
    full_rows, full_cols = rows[0] - rows[0] % rows[1], cols[0] - cols[0] % cols[1]  # the region of whole tiles
    if full_rows * full_cols and not bad[:full_rows, :full_cols].any():
        raise CheckFailed(f"failed: {name}, case '{case}' — the full tiles are right but the last, shorter tile is "
                          "not: when a length does not divide its block, loop with range(0, length, block) and let "
                          "the slice [i : i + block] stop at the end by itself")
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise CheckFailed(f"failed: {name}, case '{case}' — {int(bad.sum())} of {bad.size} values off, first at {where}: "
                      f"got {got[where]:.6g}, expected {want[where]:.6g}")


def _normal(seed: int, *shape: int) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _products(q_len: int, kv_len: int, d: int, block_q: int, block_k: int, which: str) -> Counter:
    """The operand shapes of every tile product of ``S = Q Kᵀ`` (``which = "scores"``) or ``O = P V`` (``"pv"``)."""
    return Counter(((rows, d), (d, cols)) if which == "scores" else ((rows, cols), (cols, d))
                   for rows in _spans(q_len, block_q) for cols in _spans(kv_len, block_k))


# (case, q_len, kv_len, head_dim, block_q, block_k): block_q != block_k everywhere, so swapping them shows
_ATTENTION_CASES = [
    ("the lengths divide the blocks", 32, 48, 8, 16, 8),
    ("neither length divides its block, q_len != kv_len", 37, 29, 8, 8, 16),
    ("block_q is longer than the whole query", 5, 20, 4, 8, 16),
]


# -- puzzle 1: S = Q K^T / sqrt(d), tile by tile ---------------------------------------------------------------


def check_tiled_scores(tiled_scores: Callable[..., Any]) -> None:
    """``tiled_scores(q, k, block_q, block_k, matmul)`` is ``Q Kᵀ / √d``, one ``matmul`` call per tile pair."""
    name = "tiled_scores"
    for case, q_len, kv_len, d, block_q, block_k in _ATTENTION_CASES:
        q, k = _normal(q_len, q_len, d), _normal(kv_len + 1, kv_len, d)
        matmul = _Recorder()
        got = tiled_scores(q, k, block_q, block_k, matmul=matmul)
        exact = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T
        _diagnose(name, case, got, exact / np.sqrt(d), (q_len, block_q), (kv_len, block_k), {
            "S is Q Kᵀ without the scale: multiply by 1 / sqrt(d), d = q.shape[1]": exact,
        }, f"the scale is 1 / sqrt(d) with d = q.shape[1] of the q passed in (here {d}), not a number from outside")
        _check_calls(name, case, matmul.calls, _products(q_len, kv_len, d, block_q, block_k, "scores"),
                     _products(q_len, kv_len, d, block_k, block_q, "scores"),
                     "a [≤ block_q, d] tile of Q times a [d, ≤ block_k] tile of Kᵀ")
    print(f"passed: tiled_scores computes Q Kᵀ / √d tile by tile, one matmul per tile pair, in all "
          f"{len(_ATTENTION_CASES)} cases (lengths that do not divide the blocks, q_len != kv_len)")


# -- puzzle 2: O = P V, accumulated over key tiles ---------------------------------------------------------------


def check_tiled_pv(tiled_pv: Callable[..., Any]) -> None:
    """``tiled_pv(p, v, block_q, block_k, matmul)`` is ``P V``, ``O_i = Σ_j P_ij V_j`` one ``matmul`` per tile pair."""
    name = "tiled_pv"
    for case, q_len, kv_len, d, block_q, block_k in _ATTENTION_CASES:
        p = np.asarray(np.exp(_normal(q_len + 2, q_len, kv_len)), np.float64)
        p = jnp.asarray(p / p.sum(axis=1, keepdims=True), jnp.float32)  # rows of probabilities, like softmax's
        v = _normal(kv_len + 3, kv_len, d)
        matmul = _Recorder()
        got = tiled_pv(p, v, block_q, block_k, matmul=matmul)
        p64, v64 = np.asarray(p, np.float64), np.asarray(v, np.float64)
        last, full = (kv_len - 1) // block_k * block_k, kv_len - kv_len % block_k
        known = {} if last == 0 else {
            "only the last key tile counts: O_i is the sum of P_ij V_j over ALL key tiles j — add each product "
            "to the accumulator (acc += ...), and start it at zero once per query tile, before the key loop":
                p64[:, last:] @ v64[last:],
        }
        if q_len % block_q == 0 and q_len > block_q:  # equal query tiles: an acc that is never reset adds them up
            tiles = (p64 @ v64).reshape(q_len // block_q, block_q, d)
            known["acc carries over from the previous query tile: start it at zero for each query tile, before "
                  "the key loop"] = np.cumsum(tiles, axis=0).reshape(q_len, d)
        renormalised = sum(p64[:, j : j + block_k] / p64[:, j : j + block_k].sum(axis=1, keepdims=True)
                           @ v64[j : j + block_k] for j in range(0, kv_len, block_k))
        if kv_len > block_k:
            known["each P tile is re-normalised by its own row sums: P's rows already sum to 1 over all the keys, "
                  "so multiply each tile as it is (normalising belongs to the whole row, not to one tile)"] = (
                renormalised)
        if full not in (0, kv_len):
            known["the last, shorter key tile is missing: loop with range(0, kv_len, block_k) and let the slice "
                  "[j : j + block_k] stop at the end by itself"] = p64[:, :full] @ v64[:full]
        _diagnose(name, case, got, p64 @ v64, (q_len, block_q), (d, d), known)
        _check_calls(name, case, matmul.calls, _products(q_len, kv_len, d, block_q, block_k, "pv"),
                     _products(q_len, kv_len, d, block_k, block_q, "pv"),
                     "a [≤ block_q, ≤ block_k] tile of P times a [≤ block_k, d] tile of V")
    print(f"passed: tiled_pv accumulates O_i = Σ_j P_ij V_j tile by tile, one matmul per tile pair, in all "
          f"{len(_ATTENTION_CASES)} cases")


TILED_SCORES = Puzzle(
    "puzzle 1: tiled scores", check_tiled_scores, tiled_scores_solution, (
        "Two loops, over query tiles outside (`for i in range(0, q_len, block_q)`) and key tiles inside "
        "(`for j in range(0, kv_len, block_k)`). A slice `q[i : i + block_q]` stops at the end of the array by "
        "itself, so the last, shorter tile needs no special case.",
        "Start from `s = jnp.zeros((q_len, kv_len))`. In the inner loop, "
        "`s_ij = matmul(q[i : i + block_q], k[j : j + block_k].T) * scale` with `scale = 1 / np.sqrt(d)`, then "
        "`s = s.at[i : i + block_q, j : j + block_k].set(s_ij)` (a JAX array is immutable: `.at[...].set` "
        "returns a new one).",
    ))

TILED_PV = Puzzle(
    "puzzle 2: tiled PV", check_tiled_pv, tiled_pv_solution, (
        "Output tile `O_i` (rows `i : i + block_q`) is a sum over the key tiles `j` of `P_ij V_j`: loop over "
        "query tiles outside and key tiles inside, with an accumulator `acc` for `O_i` that lives through the "
        "whole inner loop — exactly `acc` in `blocked_matmul`.",
        "Before the inner loop, `acc = jnp.zeros((rows, d))` with `rows = p[i : i + block_q].shape[0]` (the last "
        "query tile may be shorter than `block_q`); inside it, "
        "`acc += matmul(p[i : i + block_q, j : j + block_k], v[j : j + block_k])`; after it, "
        "`out = out.at[i : i + block_q].set(acc)`.",
    ))


# -- exercise 1: a blocked matmul with rectangular tiles -----------------------------------------------------------

# (case, (m, k, n), (block_m, block_n, block_k)): the three blocks differ, each divides its dimension
_MATMUL_CASES = [
    ("block_m, block_n and block_k all differ", (12, 40, 16), (6, 4, 8)),
    ("one output tile, a long shared dimension", (16, 32, 24), (16, 24, 4)),
    ("tall thin output tiles", (12, 12, 18), (4, 9, 6)),
]


def check_tiled_matmul(tiled_matmul: Callable[..., Any]) -> None:
    """``tiled_matmul(a, b, block_m, block_n, block_k, matmul)`` is ``a @ b`` from
    ``[block_m, block_k] @ [block_k, block_n]`` tile products, one ``matmul`` call each."""
    name = "tiled_matmul"
    for case, (m, kdim, n), (block_m, block_n, block_k) in _MATMUL_CASES:
        a, b = _normal(m, m, kdim), _normal(n + 1, kdim, n)
        matmul = _Recorder()
        got = tiled_matmul(a, b, block_m, block_n, block_k, matmul=matmul)
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        last, strips = kdim - block_k, (a64 @ b64).reshape(m, n // block_n, block_n)
        _diagnose(name, case, got, a64 @ b64, (m, block_m), (n, block_n), {
            "only the last block_k slice of the shared dimension counts: each output tile is the SUM over the "
            "shared dimension — add each tile product to the accumulator (acc += ...)": a64[:, last:] @ b64[last:],
            "acc carries over from the output tile to its left: start it at zero for each output tile (i, j), "
            "inside the loop over j": np.cumsum(strips, axis=1).reshape(m, n),
        })
        tiles = Counter({((block_m, block_k), (block_k, block_n)): m // block_m * (n // block_n) * (kdim // block_k)})
        swapped = Counter({((block_m, block_n), (block_n, block_k)): m // block_m * (n // block_k) * (kdim // block_n)})
        _check_calls(name, case, matmul.calls, tiles, swapped,
                     f"a [block_m, block_k] tile of a times a [block_k, block_n] tile of b, here "
                     f"[{block_m}, {block_k}] @ [{block_k}, {block_n}]")
    print(f"passed: tiled_matmul is a @ b from one matmul per tile product, in all {len(_MATMUL_CASES)} cases "
          "(three different block sizes)")


TILED_MATMUL = Puzzle(
    "exercise 1: tiled matmul with rectangular tiles", check_tiled_matmul, tiled_matmul_solution, (
        "It is `blocked_matmul` of section 1 with three block sizes instead of one: `block_m` cuts the rows of `a` "
        "(and of the output), `block_n` the columns of `b` (and of the output), and `block_k` the shared dimension "
        "(the columns of `a`, the rows of `b`). Each output tile has its own accumulator, summed over the shared "
        "dimension.",
        "Loop `i` over `range(0, m, block_m)` and `j` over `range(0, n, block_n)`; inside them start "
        "`acc = jnp.zeros((block_m, block_n))`, loop `p` over `range(0, k, block_k)` with "
        "`acc += matmul(a[i : i + block_m, p : p + block_k], b[p : p + block_k, j : j + block_n])`, and after "
        "that loop write the tile once, `c = c.at[i : i + block_m, j : j + block_n].set(acc)`.",
    ))


# -- exercise 2: the causal grid of 384 queries and 1024 keys ---------------------------------------------------------


def _top_left(q_len: int, kv_len: int, block: int) -> Counter:
    """The census of the grid if the mask were top-left aligned (query i sees keys j <= i): the usual slip."""
    kinds: Counter = Counter()
    for q_lo in range(0, q_len, block):
        for k_lo in range(0, kv_len, block):
            q_hi, k_hi = min(q_lo + block, q_len) - 1, min(k_lo + block, kv_len) - 1
            kinds["skipped" if k_lo > q_hi else "masked" if k_hi > q_lo else "compute"] += 1
    return kinds


def check_causal_count(answer: dict | None, q_len: int = 384, kv_len: int = 1024, block: int = 128) -> None:
    """``answer = {"steps": ..., "skipped": ..., "masked": ...}`` for the causal grid of ``q_len`` queries (the
    last ones: bottom-right aligned) and ``kv_len`` keys in ``block x block`` tiles."""
    if answer is None:
        raise NotImplementedError
    name = f"causal count of the {q_len} x {kv_len} grid"
    if not isinstance(answer, dict) or not {"steps", "skipped", "masked"} <= set(answer):
        raise CheckFailed(f"failed: {name} — answer a dict {{'steps': ..., 'skipped': ..., 'masked': ...}}, "
                          f"got {answer!r}")
    kinds = Counter(step.kind for step in tiling_steps(q_len, kv_len, block, block, causal=True))
    steps, tiles = sum(kinds.values()), f"{-(-q_len // block)} query tiles x {-(-kv_len // block)} key tiles"
    if answer["steps"] != steps:
        extra = " (the skipped steps count too: the grid has them, the kernel just does nothing in them)" if (
            answer["steps"] == steps - kinds["skipped"]) else ""
        raise CheckFailed(f"failed: {name} — you said {answer['steps']} steps: the grid has one step per (query "
                          f"tile, key tile) pair, {tiles}{extra}")
    said = (answer["skipped"], answer["masked"])
    if said == (kinds["skipped"], kinds["masked"]):
        print(f"passed: {name} has {steps} steps, {kinds['skipped']} skipped and {kinds['masked']} masked")
        return
    top_left = _top_left(q_len, kv_len, block)
    if said == (top_left["skipped"], top_left["masked"]):
        raise CheckFailed(f"failed: {name} — you said {said[0]} skipped and {said[1]} masked: that is a top-left "
                          f"aligned mask (query i sees keys j <= i); here the queries are the LAST {q_len} positions, "
                          f"so query i sees keys j <= i + {kv_len - q_len}")
    raise CheckFailed(f"failed: {name} — you said {said[0]} skipped and {said[1]} masked: draw the diagonal, query i "
                      f"sees keys j <= i + {kv_len - q_len}; a tile is skipped when even its last query sees none of "
                      "its keys, masked when the diagonal cuts through it")


CAUSAL_COUNT = Puzzle(
    "exercise 2: count the causal grid", check_causal_count, causal_count_solution, (
        "The grid has one step per (query tile, key tile) pair, skipped ones included. The queries are the LAST "
        "384 positions, so query `i` sees keys `j <= i + 640` (640 = `kv_len - q_len`): the diagonal starts at "
        "key 640 in the first query row, not at key 0.",
        "Look at each tile's corners. It is skipped when even its last query sees none of its keys "
        "(`k_lo > q_lo + 127 + 640`), masked when its first query misses some of them (`k_lo + 127 > q_lo + "
        "640`: the diagonal cuts through), computed in full otherwise. Two loops over `q_lo` and `k_lo` in steps "
        "of 128 count them.",
    ), answer_is_value=True)


# -- exercise 3: the query tile that moves 10x fewer bytes -------------------------------------------------------


def _naive_bytes(n: int, d: int) -> int:
    return 2 * (4 * n * n + 4 * n * d)  # bfloat16: read Q, K, write S, read S, write P, read P, V, write O


def _tiled_bytes(n: int, d: int, block_q: int) -> int:
    return 2 * (2 * n * d + 2 * -(-n // block_q) * n * d)  # Q and O once, K and V once per query tile


def check_block_q(answer: tuple[Any, Any], n: int = 4096, d: int = 128) -> None:
    """``answer = (block_q, kib)``: the smallest power-of-two ``block_q`` whose fused pass moves at least 10x fewer
    HBM bytes than the naive one (one bfloat16 head of ``n`` x ``d``), and the KiB of its ``[block_q, d]`` Q tile."""
    block, kib = (x.item() if hasattr(x, "item") and np.ndim(x) == 0 else x for x in answer)  # 0-d jnp, NumPy
    if block is None or kib is None:
        raise NotImplementedError
    name = "the smallest block_q with 10x less traffic"
    fits = [2**p for p in range(3, 13) if _naive_bytes(n, d) >= 10 * _tiled_bytes(n, d, 2**p)]
    whole = isinstance(block, int | float | np.number) and float(block).is_integer() and block > 0
    if not whole or int(block) & (int(block) - 1):
        raise CheckFailed(f"failed: {name} — block_q = {block!r} is not a power of two: round the rule's estimate up "
                          "to the next power of two, then check it with the traffic formulas")
    block = int(block)
    ratio = _naive_bytes(n, d) / _tiled_bytes(n, d, int(block))
    if block < fits[0]:
        raise CheckFailed(f"failed: {name} — block_q = {block} gives only {ratio:.1f}x less traffic")
    if block > fits[0]:
        raise CheckFailed(f"failed: {name} — block_q = {block} gives {ratio:.1f}x, but a smaller power of two "
                          "already reaches 10x")
    want = fits[0] * d * 2 / 1024
    if kib != want:
        slip = {fits[0] * d * 4 / 1024: "a bfloat16 element is 2 bytes, not 4", fits[0] * d * 2: "that is bytes: "
                "a KiB is 1024 bytes", fits[0] * d * 2 / 1000: "a KiB is 1024 bytes, not 1000"}.get(kib, "")
        raise CheckFailed(f"failed: the Q tile's size in VMEM — you said {kib} KiB: block_q x head_dim x 2 bytes, "
                          f"in KiB{' (' + slip + ')' if slip else ''}")
    print(f"passed: block_q = {block} moves {ratio:.1f}x fewer bytes than the naive pass (the next smaller power of "
          f"two does not reach 10x), and its Q tile takes {kib:g} KiB of VMEM")


BLOCK_Q = Puzzle(
    "exercise 3: how big a query tile", check_block_q, pick_block_q_solution, (
        "The rule `2·block_q/d` puts 10x near `block_q = 5·d`; the power of two just above is the first guess. It "
        "is only an estimate because it drops the `n·d` terms: the naive pass also reads `Q`, `K`, `V` and writes "
        "`O`, and the tiled pass reads `Q` and writes `O` once. Check the guess and the power of two below it "
        "with `naive_traffic(4096, 128)` and `tiled_traffic(4096, 128, block_q)`.",
        "Double `block_q` from 1 until `naive_traffic(n, d) >= 10 * tiled_traffic(n, d, block_q)`. The `Q` tile "
        "holds `block_q × d` bfloat16 numbers of 2 bytes each, and a KiB is 1024 bytes: return "
        "`(block_q, block_q * d * 2 / 1024)`.",
    ), answer_is_value=True)
