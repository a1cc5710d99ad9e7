"""Notebook 01's puzzles and exercises: attention in three lines, the numerically stable softmax, a stable
attention of the learner's own, the bytes of a score matrix, and the previous-token head of a real model (their
solutions are in :mod:`flashlib.exercises.softmax_solutions`).

The softmax contract (puzzle :data:`STABLE_SOFTMAX`): ``stable_softmax(x, axis=-1)`` has ``x``'s shape and
dtype and sums to 1 along ``axis``; an entry of ``-inf`` (a masked key) gets weight exactly 0; a slice whose
entries are all ``-inf`` (a query that sees no key) is all zeros, not NaN — what flashlib's attention gives such
a query (:func:`flashlib.reference.attention_naive` returns a zero row). The textbook formula, and
:func:`flashlib.reference.softmax_stable`, give ``0 / 0 = NaN`` there.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from flashlib import checks
from flashlib.checks import CheckFailed
from flashlib.exercises.puzzle import Puzzle
from flashlib.exercises.softmax_solutions import (
    attention_solution,
    my_attention_solution,
    previous_token_head_solution,
    score_matrix_bytes_solution,
    stable_softmax_solution,
)

__all__ = [
    "ATTENTION",
    "MY_ATTENTION",
    "PREVIOUS_TOKEN_HEAD",
    "SCORE_MATRIX_BYTES",
    "STABLE_SOFTMAX",
    "attention_solution",
    "check_attention_three_lines",
    "check_my_attention",
    "check_previous_token_head",
    "check_score_matrix_bytes",
    "check_stable_softmax",
    "my_attention_solution",
    "previous_token_head_solution",
    "score_matrix_bytes_solution",
    "stable_softmax_solution",
]


# -- puzzle 1: attention in three lines ------------------------------------------------------------------------


def _qkv(n: int, m: int, d: int, seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((n, d), (m, d), (m, d)))


def _softmax64(x, axis: int = -1) -> np.ndarray:
    """Softmax in float64 NumPy under this module's contract (an all ``-inf`` slice gives zeros)."""
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0.0))
    total = e.sum(axis=axis, keepdims=True)
    return e / np.where(total == 0.0, 1.0, total)


def _attention_mistake(out: np.ndarray, q, k, v) -> str:
    """The likely mistake behind a wrong attention output, found by which wrong formula it matches."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = q @ k.T
    d = q.shape[-1]
    wrong = [
        (_softmax64(s) @ v, "the scores are not scaled: divide q k^T by sqrt(d) before the softmax"),
        (_softmax64(s / d) @ v, "the scores are divided by d: the scale is 1/sqrt(d)"),
        (_softmax64(s * np.sqrt(d)) @ v, "the scores are multiplied by sqrt(d): divide by it"),
        (_softmax64(s / np.sqrt(k.shape[0])) @ v, "the scale uses k.shape[0], the number of keys M: d is the "
                                                  "head dimension, q.shape[-1]"),
        (_softmax64(s / np.sqrt(q.shape[0])) @ v, "the scale uses q.shape[0], the number of queries N: d is the "
                                                  "head dimension, q.shape[-1]"),
        *((_softmax64(s / np.sqrt(fixed)) @ v, f"the scale is a fixed 1/sqrt({fixed}), but here d = {d}: take d "
           "from q.shape[-1], not from the example above") for fixed in (4, 8, 16, 32, 64) if fixed != d),
        (_softmax64(s / np.sqrt(d), axis=0) @ v, "the softmax runs over the queries (axis 0): each row of S, "
                                                 "one query against every key, is normalised (axis=-1)"),
    ]
    for want, mistake in wrong:
        if np.allclose(out, want, atol=1e-4):
            return mistake
    return "compare with O = softmax(q k^T / sqrt(d)) v, one row of weights per query"


def _within_rounding(out: np.ndarray, q, k, v) -> bool:
    """Within what rounding the scores to float32 allows, ``4 eps |s| max|v|`` (with ``|s|`` the largest score):
    a stable softmax written as ``exp(s - logsumexp(s))`` meets this bound but not the 2x-naive rule."""
    s = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T / np.sqrt(q.shape[-1])
    bound = 4 * np.finfo(np.float32).eps * np.max(np.abs(s)) * np.max(np.abs(np.asarray(v)))
    expected = np.asarray(_softmax64(s), np.float64) @ np.asarray(v, np.float64)
    return out.shape == expected.shape and bool(np.max(np.abs(out - expected)) <= bound + 1e-6)


def _attention_cases(scale_ups=(1.0,)) -> list[tuple[str, float, tuple[jax.Array, jax.Array, jax.Array]]]:
    cases = [("8 queries, 12 keys, d = 4", _qkv(8, 12, 4, 0)),
             ("5 queries, 3 keys, d = 16 (fewer keys than queries)", _qkv(5, 3, 16, 1)),
             ("one query, 7 keys, d = 8 (a decoder's step)", _qkv(1, 7, 8, 2))]
    return [(name if s == 1.0 else f"{name}, q x {s:g}", s, qkv) for s in scale_ups for name, qkv in cases]


def _check_attention_fn(fn: Callable, label: str, scale_ups=(1.0,)) -> int:
    cases = _attention_cases(scale_ups)
    for case, scale_up, (q, k, v) in cases:
        q = scale_up * q
        out = fn(q, k, v)
        shape = tuple(np.shape(out))
        if shape != tuple(q.shape):
            raise CheckFailed(f"failed: {label}, case '{case}' — output shape {shape}, expected {tuple(q.shape)} "
                              "[N, d]: one row per query, as wide as a value (P [N, M] times V [M, d])")
        got = np.asarray(out, np.float64)
        if not np.isfinite(got).all():
            raise CheckFailed(f"failed: {label}, case '{case}' — the output has NaN or inf: with scores this large "
                              "exp overflows; subtract each row's maximum before exponentiating")
        try:
            checks.check_attention(jnp.asarray(out)[None, None], q[None, None], k[None, None], v[None, None],
                                   name=label, quiet=True)
        except CheckFailed as failure:
            # exp(s - logsumexp(s)) is as stable, but rounds s in float32: within _within_rounding's bound it passes
            if jnp.asarray(out).dtype != q.dtype or not _within_rounding(got, q, k, v):
                raise CheckFailed(f"failed: {label}, case '{case}' — {_attention_mistake(got, q, k, v)} "
                                  f"({str(failure).split(' — ', 1)[-1]})") from None
    return len(cases)


def check_attention_three_lines(attention: Callable) -> None:
    """``attention(q, k, v)`` for one head (``q [N, d]``, ``k, v [M, d]``) against the float64 oracle."""
    count = _check_attention_fn(attention, "attention")
    print(f"passed: attention matches the float64 oracle in all {count} cases (N != M, one query)")


ATTENTION = Puzzle(
    "puzzle 1: attention in three lines",
    check_attention_three_lines,
    attention_solution,
    (
        "Three steps, one line each: the scores `S = Q Kᵀ / √d` (shape `[N, M]`), the weights "
        "`P = softmax(S)` taken along the keys (the last axis, so each row sums to 1), then `O = P V`.",
        "`q @ k.T` is `[N, M]`; `q.shape[-1]` is `d`; `jax.nn.softmax(s, axis=-1)`; `p @ v` is `[N, d]`.",
    ),
)


# -- puzzle 2: the stable softmax ------------------------------------------------------------------------------


def _softmax_cases() -> list[tuple[str, jax.Array, int, str]]:
    """``(case, x, axis, the likely mistake when the answer has NaN or inf)``."""
    rng = np.random.default_rng(0)
    masked = rng.normal(size=(4, 6)) * 3.0
    masked[0, 1] = masked[2, :4] = masked[3, 5] = -np.inf
    no_key = rng.normal(size=(3, 5))
    no_key[1] = -np.inf
    scales = np.stack([rng.normal(size=5) + 1000.0, rng.normal(size=5)])
    overflow = "exp overflowed to inf: subtract the maximum first, so every exponent is <= 0"
    cases = [
        ("ordinary logits, a 6 x 6 matrix", rng.normal(size=(6, 6)), -1, overflow),
        ("large logits, [10, 50, 100] (exp(100) overflows float32)", np.array([10.0, 50.0, 100.0]), -1, overflow),
        ("large logits, rows near 1000", rng.normal(size=(3, 5)) + 1000.0, -1, overflow),
        ("very negative logits, rows near -1000 (every exp underflows to 0)", rng.normal(size=(3, 5)) - 1000.0,
         -1, "exp underflowed to 0 in every entry, so the sum is 0 and 0 / 0 is NaN: subtract the maximum first"),
        ("rows on very different scales (one near 1000, one near 0)", scales, -1,
         "the row near 0 underflowed: subtract each row's own maximum (max along `axis`, keepdims=True), not "
         "the maximum of the whole array"),
        ("some entries -inf (masked keys)", masked, -1, overflow),
        ("a row where every entry is -inf (a query that sees no key)", no_key, -1,
         "a row of only -inf must give zeros, flashlib's contract for a query that sees no key; its maximum is "
         "-inf and -inf - (-inf) is NaN: exponentiate against 0 where the maximum is -inf, and divide by 1 "
         "where the sum is 0"),
        ("axis=0 of a 3 x 5 matrix", rng.normal(size=(3, 5)) * 2.0, 0, overflow),
        ("axis=1 of a 2 x 4 x 3 array", rng.normal(size=(2, 4, 3)) * 2.0, 1, overflow),
    ]
    return [(case, jnp.asarray(x, jnp.float32), axis, hint) for case, x, axis, hint in cases] + [
        ("bfloat16 logits (the result stays bfloat16)", jnp.asarray(rng.normal(size=(4, 8)) * 4.0, jnp.bfloat16),
         -1, overflow)]


def check_stable_softmax(stable_softmax: Callable) -> None:
    """``stable_softmax(x, axis=-1)`` against the float64 softmax, under the contract of this module's docstring."""
    cases = _softmax_cases()
    for case, x, axis, nan_hint in cases:
        _check_softmax_case(stable_softmax(x, axis=axis), x, axis, case, nan_hint)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 3, 5)) * 3.0, jnp.float32)  # [b, q, k]
    try:
        _check_softmax_case(stable_softmax(x), x, -1, "called without axis", "")
    except CheckFailed as failure:
        raise CheckFailed(f"{failure} — the default must be the last axis: `def stable_softmax(x, axis=-1)`, as "
                          "jax.nn.softmax's") from None
    print(f"passed: stable_softmax in all {len(cases)} cases (overflow, underflow, -inf entries and rows, axis, "
          "bfloat16)")


def _check_softmax_case(out, x, axis: int, case: str, nan_hint: str) -> None:
    where = f"failed: stable_softmax, case '{case}' —"
    if tuple(np.shape(out)) != tuple(x.shape):
        raise CheckFailed(f"{where} shape {tuple(np.shape(out))}, expected x's shape {tuple(x.shape)}")
    if np.dtype(getattr(out, "dtype", None)) != np.dtype(x.dtype):
        raise CheckFailed(f"{where} dtype {np.dtype(getattr(out, 'dtype', None))}, expected x's dtype "
                          f"{np.dtype(x.dtype)}: compute in x's dtype, or cast the result back with .astype(x.dtype)")
    got, want = np.asarray(out, np.float64), _softmax64(x, axis)
    if not np.isfinite(got).all():
        raise CheckFailed(f"{where} the result has NaN or inf: {nan_hint}")
    masked = np.isneginf(np.asarray(x, np.float64))
    if np.any(got[masked & masked.all(axis=axis, keepdims=True)] != 0.0):
        raise CheckFailed(f"{where} a row of only -inf got nonzero weights: it must be all zeros, flashlib's contract "
                          "for a query that sees no key (replacing -inf by a large finite number, or by 1/n, makes "
                          "that row uniform): exponentiate against 0 where the maximum is -inf, divide by 1 where "
                          "the sum is 0")
    if np.any(got[masked] != 0.0):
        raise CheckFailed(f"{where} a masked entry (-inf) got a nonzero weight: exp(-inf - m) is exactly 0")
    atol = 10 * checks.tolerance(x.dtype) if x.dtype == jnp.bfloat16 else 2e-6
    # plus float32's rounding of x (eps |x|, relative), which exp(x - logsumexp(x)), as stable, inherits
    rounding = 4 * float(np.finfo(np.float32).eps) * float(np.max(np.abs(np.where(masked, 0.0, np.asarray(x, float)))))
    sums, want_sums = got.sum(axis=axis), want.sum(axis=axis)
    if not np.allclose(sums, want_sums, atol=4 * atol + rounding):
        raise CheckFailed(f"{where} sums along axis {axis} are {np.round(sums, 6).ravel()}, expected "
                          f"{want_sums.ravel()}: take the max and the sum along `axis` with keepdims=True, so they "
                          "broadcast back along the axis they were taken over")
    if not np.all(np.abs(got - want) <= atol + rounding * want):
        error = float(np.max(np.abs(got - want)))
        raise CheckFailed(f"{where} max error {error:.3g} against the float64 softmax (allowed {atol:g} + "
                          f"{rounding:.2g} x the weight): normalise along axis {axis}, exp(x - max) / "
                          "sum(exp(x - max))")


STABLE_SOFTMAX = Puzzle(
    "puzzle 2: the stable softmax",
    check_stable_softmax,
    stable_softmax_solution,
    (
        "Subtract `m = max(x)` along `axis` before `exp`: the answer does not change and every exponent is "
        "`<= 0`. Keep the reduced axis (`keepdims=True`) so `m` and the sum broadcast back along it. The row of "
        "only `-inf` is the one case this does not cover yet: its `m` is `-inf` and `-inf - (-inf)` is NaN.",
        "`m = jnp.max(x, axis=axis, keepdims=True)`, then `m = jnp.where(jnp.isfinite(m), m, 0.0)` (so a row of "
        "only `-inf` exponentiates to zeros), `e = jnp.exp(x - m)`, `total = jnp.sum(e, axis=axis, "
        "keepdims=True)`, and divide by `jnp.where(total == 0.0, 1.0, total)`.",
    ),
)


# -- exercises -------------------------------------------------------------------------------------------------


def check_my_attention(my_attention: Callable) -> None:
    """Exercise 1: ``my_attention(q, k, v)``, stable, on ordinary queries and on queries scaled by 100, in plain
    jnp: a call of ``jax.nn.softmax`` (looked up as ``jax.nn.softmax`` when it runs) fails."""
    calls = []

    def softmax_spy(*args, **kwargs):
        calls.append(1)
        return softmax(*args, **kwargs)

    softmax = jax.nn.softmax
    with mock.patch.object(jax.nn, "softmax", softmax_spy):
        count = _check_attention_fn(my_attention, "my_attention", scale_ups=(1.0, 100.0))
    if calls:
        raise CheckFailed("failed: my_attention — right numbers, but through jax.nn.softmax: the exercise is plain "
                          "jnp (subtract each row's max, exp, divide by the sum; or call your stable_softmax)")
    print(f"passed: my_attention matches the float64 oracle in all {count} cases, scores in the hundreds included")


MY_ATTENTION = Puzzle(
    "exercise 1: attention in three lines, your way",
    check_my_attention,
    my_attention_solution,
    (
        "The same three lines as puzzle 1, with the softmax written out as puzzle 2 taught it: subtract each "
        "row's maximum from the scores before `exp`, so no exponent is positive and nothing overflows.",
        "`s = q @ k.T / jnp.sqrt(q.shape[-1])`; `e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))`; then "
        "`e / jnp.sum(e, axis=-1, keepdims=True) @ v` (or `stable_softmax(s) @ v` with your own "
        "`stable_softmax`).",
    ),
)


_BYTES_CASES = (
    ("a single float32 score", 1, jnp.float32),
    ("N = 1024, float32", 1024, jnp.float32),
    ("N = 8192, bfloat16", 8192, jnp.bfloat16),
    ("N = 3000, float32 (not a power of two)", 3000, jnp.float32),
    ("N = 65536, bfloat16 (one head: 8 GiB)", 65536, jnp.bfloat16),
)


def check_score_matrix_bytes(score_matrix_bytes: Callable[[int, Any], Any]) -> None:
    """Exercise 2: ``score_matrix_bytes(n, dtype)``, the bytes of one ``n x n`` matrix, as an exact integer."""
    for case, n, dtype in _BYTES_CASES:
        got = score_matrix_bytes(n, dtype)
        size = np.dtype(dtype).itemsize
        expected = n * n * size
        where = f"failed: score_matrix_bytes, case '{case}' — got {got!r}, expected {expected}:"
        if isinstance(got, jax.Array | np.ndarray) and np.ndim(got) == 0:
            got = got.item()
        if not isinstance(got, numbers.Number) or isinstance(got, bool):
            raise CheckFailed(f"{where} return a number of bytes (an int)")
        if got == expected:
            continue
        if got <= 0 and expected >= 2**31:
            raise CheckFailed(f"{where} {n}² x {size} overflows 32-bit integers (jnp arrays are int32): compute "
                              "with Python ints, n * n * np.dtype(dtype).itemsize")
        if got == n * n:
            raise CheckFailed(f"{where} that is the number of entries; multiply by the bytes per entry, "
                              "np.dtype(dtype).itemsize")
        if got == n * size:
            raise CheckFailed(f"{where} that is one row; the matrix has n x n entries")
        if got == 8 * expected:
            raise CheckFailed(f"{where} that is bits: itemsize already counts bytes (8 bits each)")
        if got in (n * n, 2 * n * n, 4 * n * n, 8 * n * n):
            raise CheckFailed(f"{where} {np.dtype(dtype).name} has {size} bytes per entry, not {got // (n * n)}: "
                              "ask np.dtype(dtype).itemsize instead of assuming a size")
        for unit, per in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("kB", 1e3), ("MB", 1e6), ("GB", 1e9)):
            if np.isclose(got, expected / per, rtol=1e-6, atol=0.0):
                raise CheckFailed(f"{where} that is in {unit}: return the number of bytes itself")
        raise CheckFailed(f"{where} n x n entries of np.dtype(dtype).itemsize bytes each")
    print(f"passed: score_matrix_bytes in all {len(_BYTES_CASES)} cases, up to 8 GiB for one bfloat16 head at "
          "N = 65536")


SCORE_MATRIX_BYTES = Puzzle(
    "exercise 2: bytes of the score matrix",
    check_score_matrix_bytes,
    score_matrix_bytes_solution,
    (
        "The matrix has `n × n` entries, and each entry takes as many bytes as one element of `dtype`: 4 for "
        "float32, 2 for bfloat16. Ask NumPy rather than assuming a size.",
        "`n * n * np.dtype(dtype).itemsize`, in Python ints (a `jnp` array is int32 and overflows past 2 GiB).",
    ),
)


def _mean_offset_attention(data, offset: int) -> dict[tuple[int, int], float]:
    """``(layer, head) ->`` mean attention from token ``i`` to token ``i + offset``, over all sentences."""
    scores = {}
    for layer in range(data.num_layers):
        probs = [data.model_attention(layer, sentence=s)[0] for s in range(data.num_sentences)]  # [H, L, L] each
        for head in range(data.num_heads):
            rows = [p[head, i, i + offset] for p in probs for i in range(max(0, -offset), p.shape[1] - max(0, offset))]
            scores[(layer, head)] = float(np.mean(rows))
    return scores


def check_previous_token_head(answer, data=None) -> None:
    """Exercise 3: ``answer = (layer, head)``, the head with the most attention on the previous token, averaged
    over every query ``i >= 1`` of every sentence (entry ``[0, head, i, i - 1]`` of ``model_attention``)."""
    if data is None:
        from flashlib.data import load_attention_data

        data = load_attention_data()
    scores = _mean_offset_attention(data, -1)
    best = max(scores, key=scores.get)
    where = f"failed: the previous-token head, case 'all six sentences, queries i >= 1' — {answer!r}"
    try:
        layer, head = (int(x) for x in answer)
    except (TypeError, ValueError):
        raise CheckFailed(f"{where} is not a (layer, head) pair of ints") from None
    if (layer, head) == best:
        print(f"passed: the previous-token head is layer {best[0]}, head {best[1]}: {scores[best]:.1%} of its "
              "attention goes to the previous token")
        return
    if (layer, head) not in scores:
        raise CheckFailed(f"{where} is not a head of this model: layers 0-{data.num_layers - 1}, heads "
                          f"0-{data.num_heads - 1}, counted from 0")
    following = _mean_offset_attention(data, +1)
    if (layer, head) == max(following, key=following.get):
        raise CheckFailed(f"{where} is the head that looks at the NEXT token ([i, i + 1]); the previous token "
                          "is [i, i - 1]")
    for past, what in (((1, 1), "in both layer and head"), ((1, 0), "in layer"), ((0, 1), "in head")):
        if (layer - past[0], head - past[1]) == best:
            raise CheckFailed(f"{where} is one past the best head {what}: layers and heads count from 0")
    if (head, layer) == best:
        raise CheckFailed(f"{where} is the best head's (head, layer): answer (layer, head)")
    raise CheckFailed(f"{where} scores {scores[(layer, head)]:.0%}; one head does better: average "
                      "probs[i, i - 1] over i >= 1 of every sentence for every (layer, head), and take the largest")


PREVIOUS_TOKEN_HEAD = Puzzle(
    "exercise 3: a previous-token head",
    check_previous_token_head,
    previous_token_head_solution,
    (
        "Score every head, all `6 × 12` of them: for each `(layer, head)`, average the entries `[i, i - 1]` of "
        "its map over every query `i ≥ 1` of every sentence, then take the head with the largest average.",
        "`data.model_attention(layer, sentence=s)[0, head]` is that head's `[L, L]` map; its entries "
        "`[i, i - 1]` are the diagonal just below the main one, `np.diagonal(probs, offset=-1)`. Keep the "
        "averages in a dict keyed by `(layer, head)` and answer `max(share, key=share.get)`.",
    ),
    answer_is_value=True,
)
