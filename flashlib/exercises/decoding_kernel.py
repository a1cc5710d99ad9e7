"""Notebook 10's puzzle 3, :data:`PAGED_DECODE_KERNEL`: the paged decode kernel in Pallas — its clamped index map
over the block table (puzzle 2's ``page_to_copy``, in-kernel on SMEM refs) and its body (init, pages past the
length skipped, the partly filled last page masked, the online update, finalize). And exercise 4,
:data:`PAGE_WASTE`: what a page size wastes in a sequence's half-empty last page (a value answer).

The setting is :mod:`flashlib.kernels.tpu_decode`'s, cut down: one kv head, one new token per sequence, its GQA
group's query heads packed as the ``rows`` of ``q [batch, rows, d]``; a pool ``k_pages``, ``v_pages
[num_pages, page_size, d]``; grid ``(batch, pages_per_seq)``; ``lengths [batch]`` (each at least 1) and the
flattened block table ``[batch * pages_per_seq]`` by scalar prefetch; ``m``, ``l`` ``[rows, 1]`` and ``acc [rows,
d]`` f32 VMEM scratch. The checker runs it under ``pltpu.InterpretParams()`` (scratch starts as NaN) with every
pool slot that holds no live token — the tail of a partly filled page, the pages past a sequence's length —
filled with NaN, so stale contents that reach the output show.
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

from flashlib.checks import CheckFailed
from flashlib.exercises.flash_kernel import _primitives
from flashlib.exercises.flash_kernel_solutions import NT_DIMS
from flashlib.exercises.puzzle import Puzzle
from flashlib.geometry import MASK_VALUE

__all__ = ["PAGED_DECODE_KERNEL", "PAGE_WASTE", "check_paged_decode", "check_page_waste", "page_index_map_solution",
           "page_waste_solution", "paged_decode", "paged_decode_kernel_solution"]


# -- the solution ------------------------------------------------------------------------------------------------
def paged_decode_kernel_solution(lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *,
        scale, page_size):
    b, j = pl.program_id(0), pl.program_id(1)
    length = lengths_ref[b]  # this sequence's cached tokens (SMEM, scalar prefetch)

    @pl.when(j == 0)
    def init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j * page_size < length)  # a page past the length: not copied (index map), not computed
    def body():
        s = lax.dot_general(q_ref[...], k_ref[...], NT_DIMS, preferred_element_type=jnp.float32) * scale
        key = j * page_size + lax.broadcasted_iota(jnp.int32, s.shape, 1)  # [rows, page_size] positions
        s = jnp.where(key < length, s, MASK_VALUE)  # the tail of the last page holds no token
        slot = j * page_size + lax.broadcasted_iota(jnp.int32, v_ref.shape, 0)  # [page_size, d]
        v = jnp.where(slot < length, v_ref[...], 0.0)  # stale values (even NaN) never reach acc via 0 * v
        m_prev = m_ref[...]  # [rows, 1]
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha, p = jnp.exp(m_prev - m_next), jnp.exp(s - m_next)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(1) - 1)  # the last step, skipped or not
    def finalize():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def page_index_map_solution(b, j, lengths_ref, table_ref, *, page_size, pages_per_seq):
    last = lax.div(lengths_ref[b] + page_size - 1, page_size) - 1  # the last live page (lengths >= 1)
    return table_ref[b * pages_per_seq + jnp.minimum(j, last)], 0, 0  # past it: the same page, no new copy


# -- the harness: the notebook's pallas_call, under TPU interpret semantics ---------------------------------------
def _call(kernel, index_map, q, k_pages, v_pages, table, lengths):
    """``q [batch, rows, d]``, pools ``[num_pages, page_size, d]``, ``table [batch, pages_per_seq]``, ``lengths
    [batch]`` -> ``[batch, rows, d]`` f32."""
    (batch, rows, d), page_size, pages_per_seq = q.shape, k_pages.shape[1], table.shape[1]
    page_spec = pl.BlockSpec((pl.squeezed, page_size, d), functools.partial(
        index_map, page_size=page_size, pages_per_seq=pages_per_seq))
    row_spec = pl.BlockSpec((pl.squeezed, rows, d), lambda b, j, lengths_ref, table_ref: (b, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(batch, pages_per_seq), in_specs=[row_spec, page_spec, page_spec],
        out_specs=row_spec,
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32)] * 2 + [pltpu.VMEM((rows, d), jnp.float32)])
    return pl.pallas_call(
        functools.partial(kernel, scale=d**-0.5, page_size=page_size), grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, rows, d), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams(),
    )(jnp.asarray(lengths, jnp.int32), jnp.asarray(table, jnp.int32).reshape(-1),
      *(jnp.asarray(x, jnp.float32) for x in (q, k_pages, v_pages)))


def paged_decode(kernel: Callable, index_map: Callable, q, cache) -> jax.Array:
    """Run ``kernel`` / ``index_map`` on ``q [batch, heads, 1, d]`` and a one-kv-head
    :class:`flashlib.decode.PagedKVCache`: ``[batch, heads, 1, d]``, comparable with ``decode.decode_oracle``."""
    batch, heads, _, d = q.shape
    out = _call(kernel, index_map, q.reshape(batch, heads, d), cache.k_pages[:, 0], cache.v_pages[:, 0],
                cache.block_table, cache.lengths)
    return out.reshape(batch, heads, 1, d)


def _probed(kernel):
    """``kernel`` with the running max set to NaN before every step past the length and put back after it: a
    kernel that computes such a step turns l and acc into NaN, one that skips it is unchanged."""
    def probe(lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, scale, page_size):
        dead = pl.program_id(1) * page_size >= lengths_ref[pl.program_id(0)]
        saved = m_ref[...]
        pl.when(dead)(lambda: m_ref.__setitem__(..., jnp.full(m_ref.shape, jnp.nan, jnp.float32)))
        kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, scale=scale,
               page_size=page_size)
        pl.when(dead)(lambda: m_ref.__setitem__(..., saved))
    return probe


# -- the case and the float64 suspects ----------------------------------------------------------------------------
PAGE, PAGES_PER_SEQ, ROWS, HEAD_DIM, NUM_PAGES = 16, 4, 8, 32, 18
LENGTHS = [64, 37, 16, 32, 48, 20]  # full, a partly filled last page, one page, a page boundary; two far below
FAR = 4  # sequences FAR.. score about -150 everywhere (exp(s - 0) underflows unless m starts at -inf)
CASE = ("six sequences: 64 tokens (every page full), 37 (a partly filled last page), 16 (one page), 32 (ending "
        "exactly on a page boundary), 48 and 20 with every score far below zero (about -150)")


def _case(stale=np.nan, stale_v=None):
    """A pool whose live pages are shuffled into the table; every slot holding no live token (the tail of a
    partly filled page, the pages past a length, which the table's dead entries name) is ``stale`` in the keys
    and ``stale_v`` (default ``stale``) in the values."""
    rng = np.random.default_rng(10)
    live = [-(-n // PAGE) for n in LENGTHS]
    order = rng.permutation(NUM_PAGES)
    used, dead = iter(order[:sum(live)]), order[sum(live):]
    table = np.array([[next(used) if p < n else dead[(b + p) % len(dead)] for p in range(PAGES_PER_SEQ)]
                      for b, n in enumerate(live)], np.int32)
    q, k, v = (rng.normal(size=shape) for shape in [(len(LENGTHS), ROWS, HEAD_DIM)] + [(NUM_PAGES, PAGE, HEAD_DIM)] * 2)
    q[FAR:] = -3.0 + 0.2 * q[FAR:]
    k[table[FAR:, :].reshape(-1)] = 9.0 + 0.2 * k[table[FAR:, :].reshape(-1)]
    holds = np.zeros((NUM_PAGES, PAGE), bool)
    for b, n in enumerate(LENGTHS):
        for t in range(n):
            holds[table[b, t // PAGE], t % PAGE] = True
    k[~holds], v[~holds] = stale, stale if stale_v is None else stale_v
    return q, k, v, table, np.asarray(LENGTHS, np.int32)


def _emulate(q, k, v, table, lengths, *, shift: int | None = 0, zero_values: bool = True, rescale: bool = True,
             divide: bool = True, scaled: bool = True, first_page_only: bool = False) -> np.ndarray:
    """The kernel in float64 page by page, with a mistake switched on: keys visible while ``pos < length + shift``
    (``None``: every key of a live page), values past the length zeroed or not, and so on."""
    out = np.zeros(q.shape)
    scale = q.shape[-1] ** -0.5 if scaled else 1.0
    for b, n in enumerate(lengths.tolist()):
        m, l, acc = np.full((ROWS, 1), -np.inf), np.zeros((ROWS, 1)), np.zeros((ROWS, HEAD_DIM))  # noqa: E741
        for p in range(1 if first_page_only else -(-n // PAGE)):
            pos = p * PAGE + np.arange(PAGE)
            s = q[b] @ k[table[b, p]].T * scale
            s = np.where(pos < n + shift, s, -np.inf) if shift is not None else s
            vals = np.where((pos < n)[:, None], v[table[b, p]], 0.0) if zero_values else v[table[b, p]]
            m_next = np.maximum(m, s.max(axis=1, keepdims=True))
            alpha, e = (np.exp(m - m_next) if rescale else 1.0), np.exp(s - m_next)
            m, l, acc = m_next, alpha * l + e.sum(axis=1, keepdims=True), alpha * acc + e @ vals  # noqa: E741
        out[b] = acc / l if divide else acc
    return out


def _near(got, want) -> bool:
    return bool(np.all(np.abs(np.asarray(got, np.float64) - want) <= 1e-4))


_NAN = ("NaN in the output: scratch starts as garbage (NaN under InterpretParams), so set m = -inf, l = 0, acc = 0 "
        "under pl.when(j == 0) only, fold each live page in, and write acc / l under pl.when(j == last step) — that "
        "step may be a skipped one; and rescale by alpha = exp(m_prev - m_next)")
_OFF_BY_ONE = ("the mask is off by one at the length: a sequence of n tokens holds positions 0 .. n - 1, so keep "
               "scores where position < length (position = j * page_size + iota)")
_UNMASKED = ("the tail of the partly filled last page is not masked: its slots hold no token (stale pool "
             "contents); set their scores to MASK_VALUE where position >= length")
_FROM_ZERO = ("the sequences whose scores are all near -150 come out wrong: the running max m starts at 0, not "
              "-inf? exp(s - 0) underflows to 0 for every key, so l stays 0: start m at -inf, so the first page's "
              "maximum replaces it")


_STALE_VALUES = ("NaN from the stale VALUES past the length: a masked score gives p = 0, but 0 * NaN is NaN, so zero "
                 "the values too before p @ v: v = jnp.where(slot < length, v_ref[...], 0.0), with slot = j * "
                 "page_size + lax.broadcasted_iota(jnp.int32, v_ref.shape, 0), an iota over v's rows [page_size, d]")
_STALE_KEYS = ("NaN from the stale KEYS past the length: their scores are NaN, and adding a mask (NaN + "
               "MASK_VALUE) or multiplying p by one (0 * NaN) keeps them NaN; replace them with "
               "s = jnp.where(position < length, s, MASK_VALUE), before the maximum")


def _diagnose(out, kernel, index_map) -> None:
    where = f"failed: paged decode kernel, case '{CASE}'"
    q, k, v, table, lengths = _case()
    if np.isnan(np.asarray(out)).any():  # refill the stale keys, the stale values, or both, with finite numbers:
        def fixed(stale, stale_v):      # which NaN reaches the output names the fix
            case = _case(stale, stale_v)
            got = _call(kernel, index_map, *case)
            return _near(np.asarray(got)[:FAR], _emulate(*case)[:FAR]), got, case

        stale_nan = np.isnan(np.asarray(out)[:FAR]).any()  # sequence 1's last page has stale slots
        both_fixed, out, (q, k, v, table, lengths) = fixed(2.0, 2.0)
        if stale_nan and both_fixed:
            keys_fixed, values_fixed = fixed(2.0, np.nan)[0], fixed(np.nan, 2.0)[0]
            if values_fixed and not keys_fixed:
                raise CheckFailed(f"{where} — {_STALE_VALUES}")
            if keys_fixed and not values_fixed:
                raise CheckFailed(f"{where} — {_STALE_KEYS}")
            raise CheckFailed(f"{where} — NaN from both the stale keys and the stale values past the length: "
                              f"{_STALE_KEYS}; and {_STALE_VALUES}")
        if np.isnan(np.asarray(out)[:FAR]).any():
            raise CheckFailed(f"{where} — {_NAN}")
    out = np.asarray(out, np.float64)
    for switches, hint in [
        (dict(shift=1), _OFF_BY_ONE), (dict(shift=1, zero_values=False), _OFF_BY_ONE),
        (dict(shift=None), _UNMASKED), (dict(shift=None, zero_values=False), _UNMASKED),
        (dict(first_page_only=True), "the output is attention over each sequence's FIRST page alone: finalize "
         "runs on the first step; run it when j == pl.num_programs(1) - 1"),
        (dict(rescale=False), "l and acc are not rescaled when the maximum grows: multiply them by alpha = "
         "exp(m_prev - m_next) before adding this page's sums"),
        (dict(divide=False), "the output is acc, not acc / l: divide by l in finalize"),
        (dict(scaled=False), "the scores are not scaled: multiply q k^T by scale"),
    ]:
        if _near(out[:FAR], _emulate(q, k, v, table, lengths, **switches)[:FAR]):
            raise CheckFailed(f"{where} — {hint}")
    if _near(out[:FAR], _emulate(q, k, v, table, lengths)[:FAR]):
        raise CheckFailed(f"{where} — {_FROM_ZERO}")
    raise CheckFailed(f"{where} — the output is not attention over the sequence's cached tokens: check the "
                      "online update (m, then l and acc rescaled by alpha, then p @ v), the mask at the length and "
                      "that o_ref is written on the last step")


def _check_index_map(index_map: Callable) -> list[list[int]]:
    """The page the map names at every step for many lengths, against ``table[b, min(j, last live page)]``."""
    lengths = [64, 37, 16, 32, 1, 17, 48, 63, 15]
    table = (np.arange(len(lengths) * PAGES_PER_SEQ).reshape(len(lengths), PAGES_PER_SEQ) * 7 + 3) % 40
    flat = jnp.asarray(table.reshape(-1), jnp.int32)
    named = []
    for b, n in enumerate(lengths):
        named.append([])
        last = -(-n // PAGE) - 1
        for j in range(PAGES_PER_SEQ):
            got = index_map(jnp.int32(b), jnp.int32(j), jnp.asarray(lengths, jnp.int32), flat, page_size=PAGE,
                            pages_per_seq=PAGES_PER_SEQ)
            got = tuple(int(x) for x in got) if isinstance(got, tuple) else (int(got),)
            case = f"failed: page index map, length {n}, page_size {PAGE}, step j={j}"
            if len(got) != 3 or got[1:] != (0, 0):
                raise CheckFailed(f"{case} — it returns {got}: return the pool block (page, 0, 0)")
            named[-1].append(got[0])
            if got[0] == table[b, min(j, last)]:
                continue
            if n % PAGE == 0 and got[0] == table[b, min(j, n // PAGE)]:
                raise CheckFailed(f"{case} — {n} tokens fill exactly {n // PAGE} page{'s' * (n > PAGE)}, so the "
                                  f"last live page is index {n // PAGE - 1}: round the page count up "
                                  "(lax.div(length + page_size - 1, page_size)), then subtract one")
            if j > last and got[0] == table[b, j]:
                raise CheckFailed(f"{case} — the map names the table's entry {j}, a page past the sequence's last "
                                  f"live page (index {last}): it is not clamped, so Pallas copies a page nobody "
                                  "uses; name table_ref[b * pages_per_seq + jnp.minimum(j, last)]")
            raise CheckFailed(f"{case} — got page {got[0]}, expected {table[b, min(j, last)]} (table row "
                              f"{table[b].tolist()}): the entry b * pages_per_seq + min(j, last) of the flattened "
                              "table")
    try:  # Pallas traces the index map: Python's min, max or if on a traced int cannot run there
        jaxpr = jax.make_jaxpr(functools.partial(index_map, page_size=PAGE, pages_per_seq=PAGES_PER_SEQ))(
            jnp.int32(0), jnp.int32(0), jnp.asarray(lengths, jnp.int32), flat).jaxpr
    except jax.errors.ConcretizationTypeError as error:  # TracerBoolConversionError among them
        raise CheckFailed("failed: page index map — right pages on concrete ints, but Pallas traces the index map, "
                          "and Python's min, max or if needs a concrete bool of a traced int "
                          f"({type(error).__name__}): use jnp.minimum (the index map is traced)") from None
    if "sign" in _primitives(jaxpr):
        raise CheckFailed("failed: page index map — it divides a traced int with //, which lowers through sign(): "
                          "Mosaic cannot lower that on a TPU; divide with lax.div (both operands >= 0 here)")
    return named


def _conds(kernel, *args) -> int:
    jaxpr = jax.make_jaxpr(lambda *a: _call(kernel, page_index_map_solution, *a))(*args).jaxpr
    (call,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "pallas_call"]
    inner = call.params["jaxpr"]
    return sum(eqn.primitive.name == "cond" for eqn in getattr(inner, "jaxpr", inner).eqns)


def check_paged_decode(answer) -> None:
    """``answer = (paged_decode_kernel, page_index_map)``: the map names the clamped page at every step, the
    kernel matches attention over each sequence's tokens, and no step past the length computes (run once with
    the running max poisoned on those steps, :func:`_probed`; run plainly only to name a failure)."""
    if not (isinstance(answer, tuple) and len(answer) == 2 and all(map(callable, answer))):
        raise CheckFailed("failed: paged decode kernel — give the pair (paged_decode_kernel, page_index_map)")
    kernel, index_map = answer
    named = _check_index_map(index_map)
    q, k, v, table, lengths = _case()
    want = _emulate(q, k, v, table, lengths)
    if not _near(_call(_probed(kernel), index_map, q, k, v, table, lengths), want):
        out = _call(kernel, index_map, q, k, v, table, lengths)
        if _near(out, want):
            raise CheckFailed(f"failed: paged decode kernel, case '{CASE}' — right numbers, but the body runs on a "
                              "step past the length (handed a NaN running max there, it made NaN): a page starting "
                              "at j * page_size >= length holds no token; run the body under pl.when(j * page_size "
                              "< length)")
        _diagnose(out, kernel, index_map)
    if _conds(kernel, q, k, v, table, lengths) < 3:
        raise CheckFailed("failed: paged decode kernel — right numbers, but fewer than three pl.when in the kernel: "
                          "init under pl.when(j == 0), the page under pl.when(j * page_size < length), finalize "
                          "under pl.when(j == pl.num_programs(1) - 1), each paid only on the steps that need it")
    copies = sum(1 + int(np.count_nonzero(np.diff(pages))) for pages in named)
    print(f"passed: paged decode kernel matches attention over {len(LENGTHS)} sequences (full, partly filled, "
          "one-page and boundary lengths, scores near -150), skips the pages past each length, and the clamped "
          f"index map copies {copies} pages for {len(named)} sequences where an unclamped one copies "
          f"{len(named) * PAGES_PER_SEQ}")


PAGED_DECODE_KERNEL = Puzzle(
    "puzzle 3: the paged decode kernel",
    check_paged_decode,
    (paged_decode_kernel_solution, page_index_map_solution),
    (
        "Two functions, two jobs. The index map is puzzle 2 again: only its length and table row now come from "
        "SMEM refs, and its step is a traced int. The kernel is notebook 06's forward kernel walking pages instead "
        "of key blocks; what is new is deciding, from `lengths_ref[b]`, which steps do any work and which keys of "
        "a page count.",
        "The index map: count the live pages (a page partly filled is live), clamp `j` to the last of them with "
        "`jnp.minimum`, and read the table at row `b`'s offset, `b * pages_per_seq`. The kernel: `b, j = "
        "pl.program_id(0), pl.program_id(1)` and `length = lengths_ref[b]`, then three `pl.when` blocks — init on "
        "the first step, the online update while the page starts before the length, and `acc / l` into `o_ref` "
        "on the last step (`pl.num_programs(1) - 1`), whether or not that step was skipped. In the update, a key's "
        "position is `j * page_size` plus its column: positions at or past the length are masked, in the scores "
        "and in the values.",
        "The live pages are `lax.div(length + page_size - 1, page_size)` (`lax.div` truncates toward zero, so "
        "`-lax.div(-length, page_size)` is not a ceiling; `//` does not lower on traced ints), the block "
        "`(table_ref[b * pages_per_seq + jnp.minimum(j, last)], 0, 0)`. The page runs under `pl.when(j * page_size "
        "< length)`: `s = lax.dot_general(q_ref[...], k_ref[...], NT_DIMS, preferred_element_type=jnp.float32) * "
        "scale`; `s = jnp.where(j * page_size + lax.broadcasted_iota(jnp.int32, s.shape, 1) < length, s, "
        "MASK_VALUE)`; `v = jnp.where(j * page_size + lax.broadcasted_iota(jnp.int32, v_ref.shape, 0) < length, "
        "v_ref[...], 0.0)` — a stale NaN survives an added mask, and NaN times p = 0 is still NaN. Then notebook "
        "06's online update with `v` in place of `v_ref[...]`.",
    ),
)


# -- exercise 4: what a page size wastes -------------------------------------------------------------------------
CACHE_LEN = 4096  # section 5's sequence length


def page_waste_solution():
    # -> {page_size: (tokens wasted per sequence on average, that waste's share of a 4096-token cache)}
    return {page: (page / 2, page / 2 / 4096) for page in (128, 512)}  # a random length: its last page half empty


def check_page_waste(answer) -> None:
    """``{page_size: (wasted, share)}`` for 128- and 512-token pages: the slots a sequence of random length leaves
    empty in its last page on average (``page_size / 2``; the exact ``(page_size - 1) / 2`` passes too) and their
    share of a :data:`CACHE_LEN`-token cache, as a fraction."""
    if not isinstance(answer, dict) or sorted(answer) != [128, 512]:
        raise CheckFailed("failed: page waste — return a dict with one entry per page size: {128: (wasted, share), "
                          "512: (wasted, share)}")
    for page in (128, 512):
        if np.size(answer[page]) != 2:
            raise CheckFailed(f"failed: page waste, {page}-token pages — give a pair (tokens wasted, share)")
        wasted, share = (float(x) for x in answer[page])
        if not any(np.isclose(wasted, w, rtol=0, atol=1e-9) for w in (page / 2, (page - 1) / 2)):
            why = ("a whole page: the length ends anywhere in its last page, uniformly, so on average half of that "
                   "page is empty" if np.isclose(wasted, page) else "the empty slots of the last page range "
                   "evenly from none to nearly all of it: page_size / 2 on average")
            raise CheckFailed(f"failed: page waste, {page}-token pages — {wasted:g} tokens wasted a sequence, "
                              f"expected {page / 2:g}: {why}")
        if np.isclose(share, 100 * wasted / CACHE_LEN, rtol=1e-6, atol=0):
            raise CheckFailed(f"failed: page waste, {page}-token pages — share {share:g} is a percentage: give the "
                              f"fraction, wasted / {CACHE_LEN}")
        if not np.isclose(share, wasted / CACHE_LEN, rtol=1e-6, atol=0):
            raise CheckFailed(f"failed: page waste, {page}-token pages — share {share:g}, expected "
                              f"{wasted / CACHE_LEN:g}: the tokens wasted over the sequence's {CACHE_LEN} tokens")
    print(f"passed: a half-empty last page wastes about {answer[128][0]:g} tokens a sequence with 128-token pages "
          f"({answer[128][1]:.2%} of a {CACHE_LEN}-token cache) and {answer[512][0]:g} with 512-token pages "
          f"({answer[512][1]:.2%})")


PAGE_WASTE = Puzzle(
    "exercise 4: choosing a page size",
    check_page_waste,
    page_waste_solution,
    (
        "A random length ends anywhere in its last page, uniformly: that page may be nearly full or nearly empty. "
        "On average, how many of its slots hold no token?",
        "The empty slots of the last page range evenly over 0 ... page_size - 1: what is their average? Its "
        "share is that count over the 4096 tokens the sequence holds, as a fraction (not a percentage).",
    ),
    answer_is_value=True,
)
