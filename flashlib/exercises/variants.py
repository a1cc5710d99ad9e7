"""Notebook 09's puzzles and exercises: the attention variants' element rule (window + causal + segments,
bottom-right aligned), a block's kind under a window (skip / mask / plain, as the kernels' ``pl.when`` guards
decide), notebook 06's forward kernel with a soft-cap and a sink (run by :func:`variants_call`), and the
checkers of exercises 1-2 (a window's compacted grid and its copies; the weight a sink takes).

The checkers judge the learner against the library's own rules — :mod:`flashlib.masks` for elements,
:mod:`flashlib.geometry` for blocks — on many cases (``q_len != kv_len`` both ways, rows that see no key,
``None`` sides, lengths that are not multiples of the blocks), and name the likely mistake when an answer
matches a known wrong rule.

Longer than 400 lines because each puzzle's cases and suspects (the wrong rules its messages name, found by
mutation testing: ``tests/mutants.py``) sit beside its checker, which is how a reader checks one against the
other."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib import env, geometry, viz
from flashlib.checks import CheckFailed, check_attention
from flashlib.exercises.puzzle import Puzzle
from flashlib.exercises.variants_solutions import (
    block_kind_solution,
    flash_kernel_variants_solution,
    sink_weight_solution,
    visible_solution,
    window_grid_solution,
)

__all__ = ["BLOCK_KIND", "KERNEL_VARIANTS", "SINK_WEIGHT", "VISIBLE", "WINDOW_GRID", "check_block_kind",
           "check_kernel_variants", "check_sink_weight", "check_visible", "check_window_grid", "variants_call"]


# -- puzzle 1: the element rule ---------------------------------------------------------------------------------
_VISIBLE_CASES = [  # (words, q_len, kv_len, causal, window, q_segments, kv_segments)
    ("causal, 6 queries over 6 keys", 6, 6, True, None, None, None),
    ("causal, 4 queries over 9 keys (offset 5: they are the last 4 positions)", 4, 9, True, None, None, None),
    ("causal, 9 queries over 4 keys (the first 5 rows see no key)", 9, 4, True, None, None, None),
    ("local causal window (2, 0), 8 x 8", 8, 8, True, (2, 0), None, None),
    ("window (1, 2), not causal, 5 queries over 9 keys", 5, 9, False, (1, 2), None, None),
    ("window (None, 1): unbounded on the left, 7 x 7", 7, 7, False, (None, 1), None, None),
    ("window (3, None) with causal, 6 queries over 10 keys", 6, 10, True, (3, None), None, None),
    ("window (0, 0): each query sees only its diagonal key, 6 x 6", 6, 6, False, (0, 0), None, None),
    ("segments [0 0 0 1 1 1 1] on both sides, not causal", 7, 7, False, None, [0, 0, 0, 1, 1, 1, 1],
     [0, 0, 0, 1, 1, 1, 1]),
    ("causal + window (2, 0) + segments, 6 queries over 8 keys", 6, 8, True, (2, 0), [0, 0, 1, 1, 1, 2],
     [0, 0, 0, 0, 1, 1, 1, 1]),
    ("causal + segments, a query whose segment (9) has no key", 5, 5, True, None, [0, 0, 9, 1, 1], [0, 0, 0, 1, 1]),
]


def _rule_matrix(rule: Callable, q_len, kv_len, causal, window, q_seg, kv_seg) -> np.ndarray:
    q_seg = [0] * q_len if q_seg is None else q_seg
    kv_seg = [0] * kv_len if kv_seg is None else kv_seg
    return np.array([[bool(rule(i, j, q_len=q_len, kv_len=kv_len, causal=causal, window=window,
                                q_segment=q_seg[i], kv_segment=kv_seg[j])) for j in range(kv_len)]
                     for i in range(q_len)])


def _top_left(i, j, *, q_len, kv_len, **kw):  # forgets the offset
    return visible_solution(i, j, q_len=q_len, kv_len=q_len, **kw)


def _strict_left(i, j, *, window, **kw):  # the left edge taken as exclusive
    inside = visible_solution(i, j, window=window, **kw)
    if window is None or window[0] is None:
        return inside
    return inside and j != i + kw["kv_len"] - kw["q_len"] - window[0]


def _window_without_causal(i, j, *, causal, window, **kw):
    return visible_solution(i, j, causal=causal and window is None, window=window, **kw)


def _none_as_zero(i, j, *, window, **kw):
    window = None if window is None else tuple(0 if side is None else side for side in window)
    return visible_solution(i, j, window=window, **kw)


def _no_segments(i, j, *, q_segment, kv_segment, **kw):
    return visible_solution(i, j, q_segment=0, kv_segment=0, **kw)


_VISIBLE_SUSPECTS = [
    (_no_segments, "segments: a query sees only keys whose segment id equals its own"),
    (_top_left, "alignment: the rule is bottom-right aligned — query i's diagonal key is i + (kv_len - q_len), "
                "not i"),
    (_window_without_causal, "causal and a window together: a key must pass both (causal caps the right side)"),
    (_none_as_zero, "a window side of None is unbounded on that side, not 0"),
    (_strict_left, "the window's left edge: key i + offset - left is inside (>=, not >)"),
]


def check_visible(visible: Callable) -> None:
    """``visible(i, j, *, q_len, kv_len, causal, window, q_segment, kv_segment)`` against :mod:`flashlib.masks`."""
    for words, q_len, kv_len, causal, window, q_seg, kv_seg in _VISIBLE_CASES:
        got = _rule_matrix(visible, q_len, kv_len, causal, window, q_seg, kv_seg)
        want = viz.visibility(q_len, kv_len, causal=causal, window=window, q_segments=q_seg, kv_segments=kv_seg)
        if np.array_equal(got, want):
            continue
        for suspect, hint in _VISIBLE_SUSPECTS:
            if np.array_equal(got, _rule_matrix(suspect, q_len, kv_len, causal, window, q_seg, kv_seg)):
                raise CheckFailed(f"failed: visible, case '{words}' — {hint}")
        i, j = (int(x) for x in np.argwhere(got != want)[0])
        raise CheckFailed(f"failed: visible, case '{words}' — query {i}, key {j}: expected {bool(want[i, j])}, "
                          f"got {bool(got[i, j])}")
    print(f"passed: visible agrees with flashlib.masks on all {len(_VISIBLE_CASES)} cases "
          f"({sum(c[1] * c[2] for c in _VISIBLE_CASES)} query/key pairs)")


VISIBLE = Puzzle(
    "puzzle 1: the element rule",
    check_visible,
    visible_solution,
    (
        "Start from the diagonal: with `offset = kv_len - q_len`, query `i` lines up with key `centre = i + "
        "offset`. Causal hides keys `j > centre`. Then each condition can only take visibility away: return "
        "False as soon as one fails.",
        "The window `(left, right)` keeps `centre - left <= j <= centre + right`, and a side that is `None` is "
        "not checked at all. Last, the segments: return `q_segment == kv_segment`.",
    ),
)


# -- puzzle 2: a block's kind under a window --------------------------------------------------------------------
_BLOCK_CASES = [  # (words, q_len, kv_len, block_q, block_k, causal, window)
    ("causal, 32 x 32, blocks 8 x 8", 32, 32, 8, 8, True, None),
    ("local causal window (10, 0), 48 x 48, blocks 8 x 8", 48, 48, 8, 8, True, (10, 0)),
    ("window (5, 3), not causal, 24 queries over 40 keys, blocks 8 x 8", 24, 40, 8, 8, False, (5, 3)),
    ("window (12, 0) with causal, 40 queries over 24 keys (early rows see nothing), blocks 8 x 8",
     40, 24, 8, 8, True, (12, 0)),
    ("window (None, 4), 32 x 32, blocks 8 x 16", 32, 32, 8, 16, False, (None, 4)),
    ("window (16, None) with causal, 32 queries over 64 keys, blocks 16 x 8", 32, 64, 16, 8, True, (16, None)),
    ("window (7, 0), 30 queries over 37 keys (padded last blocks), blocks 8 x 8", 30, 37, 8, 8, True, (7, 0)),
    ("no mask, 20 x 20 with blocks 8 x 8 (padding only)", 20, 20, 8, 8, False, None),
    # Edges that fall exactly on a block's first or last key: each of the solution's four comparisons is tight
    ("window (4, 1), 8 x 8, blocks 4 x 4 (block (0, 1)'s first key is the last row's last visible key)",
     8, 8, 4, 4, False, (4, 1)),
    ("window (1, 4), 16 x 16, blocks 4 x 4 (block (1, 0)'s last key is the first row's first visible key)",
     16, 16, 4, 4, False, (1, 4)),
    ("window (3, 3), 16 x 16, blocks 4 x 4 (block (0, 0)'s corner keys lie exactly on the band's edges)",
     16, 16, 4, 4, False, (3, 3)),
    # Causal caps a window's right side at 0 (not 1, not -1), and one padded key is still padding
    ("window (4, 2) with causal, 16 x 16, blocks 4 x 4 (causal wins: the right side is 0, not 2)",
     16, 16, 4, 4, True, (4, 2)),
    ("window (4, 2) with causal, 16 queries over 17 keys, blocks 4 x 4 (the diagonal lands on block (0, 1)'s "
     "first key)", 16, 17, 4, 4, True, (4, 2)),
    ("causal, 16 queries over 17 keys, blocks 4 x 4 (the diagonal lands on block (0, 1)'s first key)",
     16, 17, 4, 4, True, None),
    ("no mask, 16 queries over 23 keys, blocks 8 x 8 (the last key block has exactly one padded key)",
     16, 23, 8, 8, False, None),
]


def _edge_hint(i, j, q_len, kv_len, block_q, block_k, causal, window) -> str:
    """Where block ``(i, j)`` has a key exactly on the band's edge: that key is visible, so say so."""
    left, right = geometry.band(causal, window)
    offset, first_row, last_row = kv_len - q_len, i * block_q, (i + 1) * block_q - 1
    first_key, last_key = j * block_k, (j + 1) * block_k - 1
    edges = []
    if right is not None:
        edges += [(first_key, last_row, last_row + offset + right, "last visible"),
                  (last_key, first_row, first_row + offset + right, "last visible")]
    if left is not None:
        edges += [(last_key, first_row, first_row + offset - left, "first visible"),
                  (first_key, last_row, last_row + offset - left, "first visible")]
    tight = [f"key {key} is row {row}'s {which} key" for key, row, edge, which in edges if key == edge]
    if not tight:
        return ""
    return (f"; {' and '.join(tight)}, exactly on the band's edge: a key on the edge is seen, so compare "
            "strictly (> and <, not >= and <=)")


def _kinds(rule: Callable, q_len, kv_len, block_q, block_k, causal, window) -> np.ndarray:
    nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
    return np.array([[rule(i, j, block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal,
                           window=window) for j in range(nk)] for i in range(nq)], dtype=object)


def _library_kind(i, j, **blocks):
    if not geometry.block_is_visible(i, j, **blocks):
        return "skip"
    return "mask" if geometry.block_needs_mask(i, j, **blocks) else "plain"


def _no_padding(i, j, *, block_q, block_k, q_len, kv_len, causal, window):  # padded keys taken as real
    if _library_kind(i, j, block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len, causal=causal,
                     window=window) == "skip":
        return "skip"
    (left, right), offset = geometry.band(causal, window), kv_len - q_len
    needs = ((right is not None and (j + 1) * block_k - 1 > i * block_q + offset + right)
             or (left is not None and j * block_k < (i + 1) * block_q - 1 + offset - left))
    return "mask" if needs else "plain"


def _first_row_skips(i, j, *, block_q, **kw):  # skips by the first row's reach instead of the last row's
    kind = block_kind_solution(i, j, block_q=block_q, **kw)
    one_row = block_kind_solution(i * block_q, j, block_q=1, **kw)
    return "skip" if one_row == "skip" and kind != "skip" else kind


def _no_left_mask(i, j, *, window, **kw):  # masks only at the right edge (the causal habit)
    kind = block_kind_solution(i, j, window=window, **kw)
    if kind != "mask" or window is None or window[0] is None:
        return kind
    return block_kind_solution(i, j, window=(None, window[1]), **kw)


def _block_top_left(i, j, *, q_len, kv_len, **kw):
    return block_kind_solution(i, j, q_len=kv_len, kv_len=kv_len, **kw)


def _window_right_uncapped(i, j, *, causal, window, **blocks):  # a window's right side kept beyond the diagonal
    if causal and window is not None and window[1] is not None and window[1] > 0:
        return _library_kind(i, j, causal=False, window=window, **blocks)
    return _library_kind(i, j, causal=causal, window=window, **blocks)


_BLOCK_SUSPECTS = [
    (_window_right_uncapped, "with causal=True no row sees past its diagonal, whatever the window's right side "
                             "says: the band's right side is min(right, 0)"),
    (_block_top_left, "alignment: bottom-right — query row r's diagonal key is r + (kv_len - q_len)"),
    (_no_padding, "a block holding padded keys (positions >= kv_len) must be masked even inside the band"),
    (_first_row_skips, "skip only when no row of the block sees any key: the last row reaches furthest right"),
    (_no_left_mask, "a block that straddles the window's left edge needs a mask too: its first key lies before "
                    "what the block's last row may see"),
]


def check_block_kind(block_kind: Callable) -> None:
    """``block_kind(q_block, kv_block, *, block_q, block_k, q_len, kv_len, causal, window)`` -> ``"skip"``,
    ``"mask"`` or ``"plain"``, against :func:`geometry.block_is_visible` and :func:`geometry.block_needs_mask`."""
    for words, *case in _BLOCK_CASES:
        got = _kinds(block_kind, *case)
        want = _kinds(_library_kind, *case)
        if np.array_equal(got, want):
            continue
        bad = {str(x) for x in got.ravel()} - {"skip", "mask", "plain"}
        if bad:
            raise CheckFailed(f"failed: block_kind, case '{words}' — return 'skip', 'mask' or 'plain', got {bad}")
        for suspect, hint in _BLOCK_SUSPECTS:
            if np.array_equal(got, _kinds(suspect, *case)):
                raise CheckFailed(f"failed: block_kind, case '{words}' — {hint}")
        i, j = (int(x) for x in np.argwhere(got != want)[0])
        raise CheckFailed(f"failed: block_kind, case '{words}' — block ({i}, {j}): expected {want[i, j]!r}, "
                          f"got {got[i, j]!r}{_edge_hint(i, j, *case)}")
    print(f"passed: block_kind agrees with flashlib.geometry on all {len(_BLOCK_CASES)} grids "
          f"({sum(_kinds(_library_kind, *c[1:]).size for c in _BLOCK_CASES)} blocks)")


BLOCK_KIND = Puzzle(
    "puzzle 3: a block's kind under a window",
    check_block_kind,
    block_kind_solution,
    (
        "Work with the band `(left, right)` around the diagonal (causal makes `right` at most 0). The block "
        "holds rows `first_row .. last_row` and keys `first_key .. last_key`; row `r` sees keys "
        "`r + offset - left .. r + offset + right`. Skip when even the most generous row misses every key.",
        "Skip if `first_key > last_row + offset + right` (the last row reaches furthest right) or `last_key < "
        "first_row + offset - left` (the first row reaches furthest left). Otherwise mask if `last_key >= "
        "kv_len` (padding), `last_key > first_row + offset + right` or `first_key < last_row + offset - left`; "
        "else plain. Skip any test whose side is `None`.",
    ),
)


# -- puzzle 3: a soft-cap and a sink in the kernel ----------------------------------------------------------------
def variants_call(kernel, q, k, v, sinks, *, cap: float, block_q: int = 64, block_k: int = 128, interpret=None):
    """Notebook 06's ``flash_call`` with one more input: ``sinks [heads]`` as a ``(1, 1)`` block per head (the
    head's sink logit). ``kernel(q_ref, k_ref, v_ref, sink_ref, o_ref, m_ref, l_ref, acc_ref, *, scale, cap)``;
    lengths multiples of the blocks, no mask. ``interpret``: TPU interpret mode off a TPU (the default)."""
    batch, heads, q_len, head_dim = q.shape
    interpret = (pltpu.InterpretParams() if env.interpret_default() else False) if interpret is None else interpret
    q_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, block_q, head_dim), lambda b, h, i, j: (b, h, i, 0))
    kv_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, block_k, head_dim), lambda b, h, i, j: (b, h, j, 0))
    sink_spec = pl.BlockSpec((pl.squeezed, 1, 1), lambda b, h, i, j: (h, 0, 0))
    return pl.pallas_call(
        functools.partial(kernel, scale=head_dim**-0.5, cap=cap),
        grid=(batch, heads, q_len // block_q, k.shape[2] // block_k),
        in_specs=[q_spec, kv_spec, kv_spec, sink_spec], out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32)] * 2 + [pltpu.VMEM((block_q, head_dim), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(q, k, v, jnp.asarray(sinks, jnp.float32).reshape(heads, 1, 1))


_KERNEL_CASES = [  # (words, seed, q_len, kv_len, hot, sinks, cap)
    ("scores up to about +-40, cap 5, sinks [0, 3], two key blocks", 0, 128, 256, 6.0, (0.0, 3.0), 5.0),
    ("cap 30, sinks [8, -2] (head 0's sink outweighs most keys), three key blocks", 1, 128, 384, 3.0, (8.0, -2.0),
     30.0),
]


def _kernel_qkv(seed: int, q_len: int, kv_len: int, hot: float):
    rng = np.random.default_rng(seed)
    shapes = [(1, 2, q_len, 32), (1, 2, kv_len, 32), (1, 2, kv_len, 32)]
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes)
    return hot * q, k, v


def _variant_out(q, k, v, sinks, cap, *, capped="after scale", sink="denominator") -> np.ndarray:
    """Float64 attention with a soft-cap and sinks, or with one of the mistakes the checker names."""
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bhqd,bhkd->bhqk", q64, k64) * q.shape[-1] ** -0.5
    if capped == "after scale":
        s = cap * np.tanh(s / cap)
    elif capped == "before scale":
        s = cap * np.tanh(s / q.shape[-1] ** -0.5 / cap) * q.shape[-1] ** -0.5
    z = np.asarray(sinks, np.float64)[None, :, None, None]
    m = np.maximum(s.max(axis=-1, keepdims=True), z if sink == "denominator" else -np.inf)
    p = np.exp(s - m)
    extra = {"denominator": np.exp(z - m), "none": 0.0, "unshifted": np.exp(z)}[sink]
    return np.einsum("bhqk,bhkd->bhqd", p, v64) / (p.sum(axis=-1, keepdims=True) + extra)


def check_kernel_variants(kernel: Callable) -> None:
    """``kernel(q_ref, k_ref, v_ref, sink_ref, o_ref, m_ref, l_ref, acc_ref, *, scale, cap)`` under
    :func:`variants_call` against the float64 oracle with ``softcap=cap, sinks=sinks``."""
    for words, seed, q_len, kv_len, hot, sinks, cap in _KERNEL_CASES:
        q, k, v = _kernel_qkv(seed, q_len, kv_len, hot)
        out = variants_call(kernel, q, k, v, sinks, cap=cap, interpret=pltpu.InterpretParams())
        try:
            check_attention(out, q, k, v, softcap=cap, sinks=jnp.asarray(sinks), quiet=True)
            continue
        except CheckFailed:
            pass
        got = np.asarray(out, np.float64)
        if not np.isfinite(got).all():
            raise CheckFailed(f"failed: kernel with variants, case '{words}' — NaN or inf in the output: start m at "
                              "the sink's logit and l at 1 (exp(sink - m) = 1), acc at 0, on the first key block")
        for mistake, hint in [
            (dict(sink="none"), "the sink never joins the denominator: start the running state at it — m = sink, "
                                "l = 1 (its exp(sink - m)), acc = 0 (it carries no value)"),
            (dict(sink="unshifted"), "the sink's term must be shifted like the keys': exp(sink - m), not exp(sink)"),
            (dict(capped="none"), "the scores are not capped: s = cap * tanh(s / cap), before the running max"),
            (dict(capped="before scale"), "cap the scaled scores: cap * tanh((q k^T * scale) / cap)"),
        ]:
            if np.abs(got - _variant_out(q, k, v, sinks, cap, **mistake)).max() <= 1e-4:
                raise CheckFailed(f"failed: kernel with variants, case '{words}' — {hint}")
        raise CheckFailed(f"failed: kernel with variants, case '{words}' — not softmax attention with a soft-cap and "
                          "a sink: start from notebook 06's flash_kernel and change init and the scores only")
    print(f"passed: kernel with a soft-cap and a sink matches the float64 oracle in all {len(_KERNEL_CASES)} cases")


KERNEL_VARIANTS = Puzzle(
    "puzzle 2: a soft-cap and a sink in the kernel",
    check_kernel_variants,
    flash_kernel_variants_solution,
    (
        "Two changes to notebook 06's `flash_kernel`. The soft-cap is one line after the scale: `s = cap * "
        "jnp.tanh(s / cap)`, before the running max. The sink changes only init: it is a key of value zero that "
        "every row has already seen when the first key block arrives.",
        "Seen first, the sink makes the state `m = sink`, `l = exp(sink - m) = 1`, `acc = 0`: under "
        "`pl.when(kv_block == 0)` write `m_ref[...] = jnp.broadcast_to(sink_ref[...], m_ref.shape)`, `l_ref[...] "
        "= jnp.ones(l_ref.shape, jnp.float32)` and zeros to `acc_ref`. The body and finalize stay as they were.",
    ),
)


# -- exercise 1: a window's compacted grid and its copies ---------------------------------------------------------
def check_window_grid(answer, tokens: int = 256, block: int = 32, window=(63, 0)) -> None:
    """``answer = (kv grid steps per query block, k block copies per (batch, head))`` for local causal
    attention with ``window`` over ``tokens`` tokens, ``block x block`` blocks, one block per copy."""
    steps, copies = (int(x) for x in answer)
    plan = viz.block_plan(tokens, tokens, block, block, causal=True, window=window)
    want_steps, want_copies, num_kv = plan.fetched.shape[1], plan.copies, tokens // block
    name = "failed: window grid"
    if (steps, copies) == (want_copies, want_steps):
        raise CheckFailed(f"{name} — ({steps}, {copies}) is the right pair in the wrong order: (steps, copies)")
    if steps != want_steps:
        hint = (f"{steps} is every key block: with a left edge the grid walks only a query block's live range"
                if steps == num_kv else "count the key blocks one query block's rows can reach: from (first row "
                "- left) // block to last row // block")
        raise CheckFailed(f"{name} — {steps} steps is wrong: {hint}")
    if copies != want_copies:
        hint = {plan.fetched.size: "one copy per grid step is too many: a step that repeats the block before it "
                                   "copies nothing",
                int(plan.computes.sum()): "one copy per computing step is nearly it, but when the next query "
                                          "block starts on the block the last one ended on, Pallas copies nothing"
                }.get(copies, "Pallas copies when the fetched block index differs from the step before's")
        raise CheckFailed(f"{name} — {copies} copies is wrong: {hint}")
    print(f"passed: {steps} kv steps per query block instead of {num_kv}, {copies} k block copies")


WINDOW_GRID = Puzzle(
    "exercise 1: a window's grid",
    check_window_grid,
    window_grid_solution,
    (
        "Query block `i` holds rows `32 i` to `32 i + 31`; with `window=(63, 0)` row `r` sees keys `r - 63` to "
        "`r`. So it needs the key blocks from `max(first row - 63, 0) // 32` to `last row // 32`. After "
        "compaction every query block gets as many kv steps as the longest of these ranges.",
        "Pallas copies a k block whenever the block index fetched differs from the step before's, across query "
        "blocks too (the grid runs them one after another). Step `s` of a query block fetches `first + s`, "
        "clamped to its `last`: list the fetched indices in grid order and count the changes, plus one for the "
        "very first step.",
    ),
    answer_is_value=True,
)


# -- exercise 2: the weight a sink takes --------------------------------------------------------------------------
_SINK_CASES = [("scores [1, 2, 3], sink 0", [1.0, 2.0, 3.0], 0.0), ("one key, sink equal to its score", [0.5], 0.5),
               ("large scores [800, 801], sink 799", [800.0, 801.0], 799.0),
               ("a sink far above every score", [-3.0, -1.0], 40.0)]


def check_sink_weight(sink_weight: Callable) -> None:
    """``sink_weight(scores, sink)`` -> the softmax probability the sink takes in a row with ``scores``."""
    for words, scores, sink in _SINK_CASES:
        got = float(sink_weight(np.asarray(scores), sink))
        want = sink_weight_solution(scores, sink)
        if abs(got - want) <= 1e-9:
            continue
        others = np.exp(np.asarray(scores) - max(scores))
        if not np.isfinite(got):
            hint = "overflow: subtract the largest logit (the sink's included) before exp"
        elif abs(got - (1 - want)) <= 1e-9:
            hint = "that is the weight on the keys; the sink's is 1 minus it"
        elif abs(got - np.exp(sink - max(scores)) / others.sum()) <= 1e-9:
            hint = "the sink joins the denominator too: exp(sink) / (exp(sink) + sum of exp(scores))"
        else:
            hint = f"expected {want:.6g}, got {got:.6g}"
        raise CheckFailed(f"failed: sink_weight, case '{words}' — {hint}")
    print(f"passed: sink_weight on all {len(_SINK_CASES)} rows, large logits included")


SINK_WEIGHT = Puzzle(
    "exercise 2: a sink's weight",
    check_sink_weight,
    sink_weight_solution,
    (
        "The sink is one more logit in the row's softmax, a key that carries no value: its weight is "
        "`exp(sink) / (exp(sink) + sum of exp(scores))`. Written like that it overflows for scores in the hundreds.",
        "Shift every logit by the largest one, the sink included: `m = max(scores.max(), sink)`, then "
        "`exp(sink - m) / (exp(sink - m) + np.sum(np.exp(scores - m)))`. The shift cancels, and every `exp` is at "
        "most 1.",
    ),
)
