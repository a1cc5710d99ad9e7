"""Notebook 06's puzzle 3, :data:`COMPACTED_GRID`: the compacted causal grid — the tables of the live (query
block, key block) pairs that :func:`flashlib.geometry.live_schedule` builds for the library's forward, and the
``PrefetchScalarGridSpec`` index maps that read them.

The setting is the notebook's section 4: grid ``(batch, heads, num_live)`` instead of ``(batch, heads, nq, nk)``;
``q_len`` a multiple of ``block_q``, ``num_kv_blocks`` the key blocks covering ``kv_len`` (the last one may be
partly filled), ``offset = kv_len - q_len >= 0`` (bottom-right causal: query ``i`` sees key ``j <= i + offset``).
The learner writes ``causal_schedule`` (four int32 tables over the live steps, query block major, key blocks
ascending; ``first`` / ``last`` 1 at a query block's first / last live step) and the two index maps. The kernel
body is given (:func:`compacted_flash_kernel`: section 4's causal kernel, its init and finalize on the tables'
``first`` and ``last``). The checker compares the tables with ``geometry.live_schedule`` on five shapes, calls the
maps on every live step, then runs the kernel on the learner's tables and maps under ``pltpu.InterpretParams()``
(NaN scratch) with a NaN key block past the last one, against the float64 oracle.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib import geometry
from flashlib.checks import CheckFailed, check_attention
from flashlib.exercises.flash_kernel_solutions import NT_DIMS
from flashlib.exercises.puzzle import Puzzle
from flashlib.geometry import MASK_VALUE

__all__ = ["COMPACTED_GRID", "causal_schedule_solution", "check_compaction", "compact_kv_index_map_solution",
           "compact_q_index_map_solution", "compacted_flash", "compacted_flash_kernel"]


# -- the solution ------------------------------------------------------------------------------------------------
def causal_schedule_solution(num_q_blocks, num_kv_blocks, *, block_q, block_k, offset):
    q_block, kv_block, first, last = [], [], [], []
    for i in range(num_q_blocks):
        last_kv = ((i + 1) * block_q - 1 + offset) // block_k  # the block of query block i's last visible key
        for j in range(last_kv + 1):  # live: key blocks 0 .. last_kv, in order; the rest are never visited
            q_block.append(i)
            kv_block.append(j)
            first.append(j == 0)  # init runs here
            last.append(j == last_kv)  # finalize runs here: the diagonal block
    return tuple(np.array(table, np.int32) for table in (q_block, kv_block, first, last))


def compact_q_index_map_solution(b, h, t, q_block_ref, kv_block_ref, first_ref, last_ref):
    return b, h, q_block_ref[t], 0  # live step t works on query block q_block[t]


def compact_kv_index_map_solution(b, h, t, q_block_ref, kv_block_ref, first_ref, last_ref):
    return b, h, kv_block_ref[t], 0  # ... and on key block kv_block[t]


# -- the given kernel and its pallas_call ------------------------------------------------------------------------
def compacted_flash_kernel(q_block_ref, kv_block_ref, first_ref, last_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref,
                           acc_ref, *, scale, offset):
    """Section 4's causal kernel on the compacted grid: every step is live (no skip guard); the block indices
    and the init / finalize flags come from the scalar-prefetched tables at live step ``t``."""
    t = pl.program_id(2)
    q_block, kv_block = q_block_ref[t], kv_block_ref[t]

    @pl.when(first_ref[t] != 0)  # a query block's first live step
    def init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    s = lax.dot_general(q_ref[...], k_ref[...], NT_DIMS, preferred_element_type=jnp.float32) * scale
    q_pos = q_block * q_ref.shape[0] + lax.broadcasted_iota(jnp.int32, s.shape, 0)  # [bq, bk] absolute positions
    kv_pos = kv_block * k_ref.shape[0] + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(kv_pos <= q_pos + offset, s, MASK_VALUE)  # the diagonal block (and a partly filled last one)
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha, p = jnp.exp(m_prev - m_next), jnp.exp(s - m_next)
    m_ref[...] = m_next
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)

    @pl.when(last_ref[t] != 0)  # a query block's last live step
    def finalize():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def compacted_flash(q, k, v, schedule, q_index_map: Callable, kv_index_map: Callable, *, block_q: int, block_k: int,
                    kv_len: int | None = None, interpret=None) -> jax.Array:
    """Causal attention of ``q [b, h, q_len, d]`` over ``k``, ``v [b, h, >= kv_len, d]`` on the compacted grid
    ``(b, h, num_live)``: the four tables of ``schedule`` scalar-prefetched (SMEM), the index maps reading them.
    ``kv_len`` (default: k's length) is the keys the mask counts; ``interpret`` None: ``pltpu.InterpretParams()``."""
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2] if kv_len is None else kv_len
    tables = [jnp.asarray(np.asarray(table), jnp.int32) for table in schedule]  # [num_live] each
    q_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, block_q, head_dim), q_index_map)
    kv_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, block_k, head_dim), kv_index_map)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(batch, heads, tables[0].size), in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32)] * 2 + [pltpu.VMEM((block_q, head_dim), jnp.float32)])
    return pl.pallas_call(
        functools.partial(compacted_flash_kernel, scale=head_dim**-0.5, offset=kv_len - q_len), grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret is None else interpret,
    )(*tables, q, k, v)


# -- the checker --------------------------------------------------------------------------------------------------
_TABLE_CASES = [  # (words, q_len, kv_len, block_q, block_k)
    ("256 queries, 256 keys, 64 x 64 blocks: square, the diagonal through every block's corner", 256, 256, 64, 64),
    ("256 queries over 384 keys (offset 128), 32 x 128 blocks: four query blocks share each diagonal block",
     256, 384, 32, 128),
    ("64 queries over 256 keys, 64 x 128 blocks: one query block, every key block live", 64, 256, 64, 128),
    ("256 queries, 256 keys, 128 x 64 blocks: taller query blocks than key blocks", 256, 256, 128, 64),
    ("128 queries over 193 keys, 64 x 128 blocks: query block 0's last visible key, 128, is key block 1's first",
     128, 193, 64, 128),
]
_KERNEL_CASE = ("128 queries over 192 keys, 32 x 64 blocks, a NaN key block past the last one", 128, 192, 32, 64)


def _expected(q_len: int, kv_len: int, bq: int, bk: int):
    nq, nk = q_len // bq, -(-kv_len // bk)
    return nq, nk, geometry.live_schedule(nq, nk, block_q=bq, kv_step=bk, q_len=q_len, kv_len=kv_len, causal=True)


def _tables(schedule: Callable, case) -> tuple[np.ndarray, ...]:
    """The learner's tables for ``case``, checked against ``geometry.live_schedule`` with messages naming the
    mistake."""
    words, q_len, kv_len, bq, bk = case
    nq, nk, want = _expected(q_len, kv_len, bq, bk)
    offset = kv_len - q_len
    where = (f"failed: compacted grid, case '{words}' — causal_schedule({nq}, {nk}, block_q={bq}, block_k={bk}, "
             f"offset={offset})")
    got = schedule(nq, nk, block_q=bq, block_k=bk, offset=offset)
    tables = [np.asarray(table) for table in got] if isinstance(got, (tuple, list)) else []
    if (len(tables) != 4 or any(t.ndim != 1 or t.shape != tables[0].shape for t in tables)
            or any(t.dtype.kind not in "biu" for t in tables)):
        raise CheckFailed(f"{where} returns {type(got).__name__}: return four 1-D integer tables of one length "
                          "(q_block, kv_block, first, last), one entry per live step")
    q_t, kv_t, first_t, last_t = (t.astype(np.int64) for t in tables)
    last_kv = [((i + 1) * bq - 1 + offset) // bk for i in range(nq)]  # each query block's diagonal block
    if q_t.size == nq * nk and want[0].size < nq * nk:
        raise CheckFailed(f"{where} has {q_t.size} steps, the full {nq} x {nk} grid: the compacted grid leaves out "
                          f"the steps above the diagonal ({want[0].size} steps are live): query block i visits only "
                          "key blocks 0 to ((i + 1) * block_q - 1 + offset) // block_k")
    pairs = list(zip(q_t.tolist(), kv_t.tolist(), strict=True))
    wanted = list(zip(want[0].tolist(), want[1].tolist(), strict=True))
    if pairs != wanted:
        if sorted(pairs) == sorted(wanted):
            raise CheckFailed(f"{where} has the right live pairs in the wrong order: {pairs[:6]}...; walk query block "
                              "major, key blocks ascending, so each query block's steps are consecutive (its output "
                              "block stays in VMEM from its first step to its last)")
        for i in range(nq):
            seen, needed = sorted(j for a, j in pairs if a == i), list(range(last_kv[i] + 1))
            limit = (i + 1) * bq - 1 + offset  # the last key query block i sees
            if seen == needed:
                continue
            if seen == list(range(last_kv[i] + 2)):
                raise CheckFailed(f"{where}: query block {i} visits key blocks 0 to {last_kv[i] + 1}, one too many: "
                                  f"key block {last_kv[i] + 1} starts at key {(last_kv[i] + 1) * bk}, past the last "
                                  f"key query block {i} sees, (i + 1) * block_q - 1 + offset = {limit}; its last "
                                  f"key block is {limit} // {bk} = {last_kv[i]} (is the - 1 missing?)")
            if seen == needed[:-1]:
                raise CheckFailed(f"{where}: query block {i} visits key blocks 0 to {last_kv[i] - 1}, one too few: "
                                  f"key block {last_kv[i]} holds key {last_kv[i] * bk}, and query block {i}'s last "
                                  f"row sees keys up to (i + 1) * block_q - 1 + offset = {limit}; a key block is "
                                  "live when its first key <= that limit (a < where <= belongs?)")
            raise CheckFailed(f"{where}: query block {i} visits key blocks {seen}, expected 0 to {last_kv[i]} (the "
                              f"block of its last visible key, (i + 1) * block_q - 1 + offset = {limit})")
        raise CheckFailed(f"{where}: the (q_block, kv_block) pairs {pairs} are not the live ones {wanted}")
    for name, table, right, meaning in (
            ("first", first_t, want[2], "first live step (key block 0): init runs there"),
            ("last", last_t, want[3], "last live step (its diagonal block): finalize runs there")):
        if not np.array_equal(table != 0, right != 0):
            t = int(np.flatnonzero((table != 0) != (right != 0))[0])
            hint = ""
            if name == "last" and np.array_equal(table != 0, kv_t == nk - 1):
                hint = (f" — it marks key block num_kv_blocks - 1 = {nk - 1}, but a query block's last live key "
                        "block is its diagonal block, ((i + 1) * block_q - 1 + offset) // block_k")
            raise CheckFailed(f"{where}: {name} is {table[t]} at live step {t} (query block {q_t[t]}, key block "
                              f"{kv_t[t]}); {name} is 1 exactly at each query block's {meaning}{hint}")
    return tables


def _check_maps(q_map: Callable, kv_map: Callable, tables) -> None:
    """Both maps called on every live step of ``tables`` (as SMEM would hand them: int32 arrays)."""
    refs = [jnp.asarray(table, jnp.int32) for table in tables]
    q_t, kv_t = (np.asarray(table) for table in tables[:2])
    b, h = 1, 2
    for name, index_map, table, other, words in (("q", q_map, q_t, kv_t, "query"), ("kv", kv_map, kv_t, q_t, "key")):
        ref = "q_block_ref" if name == "q" else "kv_block_ref"
        named = []
        for t in range(q_t.size):
            got = index_map(jnp.int32(b), jnp.int32(h), jnp.int32(t), *refs)
            got = tuple(int(x) for x in got) if isinstance(got, (tuple, list)) else (int(got),)
            if len(got) != 4 or got[:2] != (b, h) or got[3] != 0:
                raise CheckFailed(f"failed: compacted grid — {name}_index_map at live step t={t} (b={b}, h={h}) "
                                  f"returns {got}: return the block (b, h, {words} block, 0) — b and h as given, "
                                  "block 0 of the head dimension")
            named.append(got[2])
        if named == table.tolist():
            continue
        t = int(np.flatnonzero(np.asarray(named) != table)[0])
        where = f"failed: compacted grid — {name}_index_map at live step t={t} returns {words} block {named[t]}"
        if named == other.tolist():
            raise CheckFailed(f"{where}, the other table's entry: the {words} block of step t is {ref}[t] = "
                              f"{table[t]} (the tables arrive in the order q_block, kv_block, first, last)")
        if named == list(range(q_t.size)):
            raise CheckFailed(f"{where}, the grid step itself: on the compacted grid t counts live steps, and the "
                              f"{words} block of step t is the table's entry {ref}[t] = {table[t]}")
        raise CheckFailed(f"{where}, expected {ref}[t] = {table[t]} (steps' blocks {named}, expected "
                          f"{table.tolist()})")

def check_compaction(answer) -> None:
    """``answer = (causal_schedule, compact_q_index_map, compact_kv_index_map)``: the tables equal
    ``geometry.live_schedule``'s on five shapes, the maps read them, and the given kernel on them matches causal
    attention."""
    if not (isinstance(answer, tuple) and len(answer) == 3 and all(map(callable, answer))):
        raise CheckFailed("failed: compacted grid — give the three functions (causal_schedule, compact_q_index_map, "
                          "compact_kv_index_map)")
    schedule, q_map, kv_map = answer
    steps = [_tables(schedule, case)[0].size for case in _TABLE_CASES]
    words, q_len, kv_len, bq, bk = _KERNEL_CASE
    tables = _tables(schedule, _KERNEL_CASE)
    _check_maps(q_map, kv_map, tables)
    keys = jax.random.split(jax.random.key(6), 3)
    q, k, v = (jax.random.normal(key, (1, 2, n, 32)) for key, n in zip(keys, (q_len, kv_len, kv_len), strict=True))
    k_nan, v_nan = (jnp.concatenate([x, jnp.full((1, 2, bk, 32), jnp.nan)], axis=2) for x in (k, v))  # block nk
    out = compacted_flash(q, k_nan, v_nan, tables, q_map, kv_map, block_q=bq, block_k=bk, kv_len=kv_len)
    check_attention(out, q, k, v, causal=True, name=f"compacted grid, case '{words}'", quiet=True)
    full = [(q_len // b_q) * -(-n // b_k) for _, q_len, n, b_q, b_k in _TABLE_CASES]
    print(f"passed: compacted grid — the tables match geometry.live_schedule on {len(_TABLE_CASES)} shapes ("
          f"{', '.join(f'{s} of {f}' for s, f in zip(steps, full, strict=True))} grid steps live), the index maps "
          "read them, and the kernel on them matches causal attention")


COMPACTED_GRID = Puzzle(
    "puzzle 3: the compacted causal grid",
    check_compaction,
    (causal_schedule_solution, compact_q_index_map_solution, compact_kv_index_map_solution),
    (
        "Walk the full grid in the order the kernel should: query blocks `i` outer, key blocks `j` inner, and keep a "
        "pair only if it is live. Query block `i`'s last row sees keys up to `(i + 1) * block_q - 1 + offset`, so "
        "its live key blocks are `0` to `last_kv = ((i + 1) * block_q - 1 + offset) // block_k` (plain Python ints "
        "here: the tables are built before the kernel runs, so `//` is fine).",
        "Append to four lists as you go: `q_block.append(i)`, `kv_block.append(j)`, `first.append(j == 0)`, "
        "`last.append(j == last_kv)`; return `tuple(np.array(t, np.int32) for t in ...)`. The index maps receive "
        "the grid position `(b, h, t)` and then the four tables as SMEM refs: return `(b, h, q_block_ref[t], 0)` "
        "and `(b, h, kv_block_ref[t], 0)`.",
    ),
)
