"""The peers' own test cases for the attention variants — GQA/MQA, a value head_dim of its own, sliding windows,
soft-capping, segment ids, sinks — run on the CPU against every implementation behind ``flashlib.attention``.

Peers (read at the snapshots named in ``test_flash_attention.py`` and ``test_jax_splash.py``):

* ``Dao-AILab/flash-attention`` ``tests/test_flash_attn.py`` (snapshot 0251105a; GQA already at 765fbd92):
  ``test_flash_attn_output`` (``mha_type`` mha/mqa/gqa with 6 query heads and 1 or 2 kv heads — 9 and 3 at
  765fbd92 —, ``local`` with ``window_size = torch.randint(0, seqlen_k, (2,))``, ``softcap`` 0 or 50 with
  q * 50), ``test_flash_attn_causal``, ``test_flash_attn_splitkv`` (``local``) and ``test_flash_attn_kvcache``
  (``mha_type``, ``local``). With ``causal`` the peer's reference sets the window's right side to 0.
* ``Dao-AILab/flash-attention`` ``tests/cute/test_flash_attn.py::test_flash_attn_output``: ``has_learnable_sink``
  (``torch.randn(nheads)`` in the input dtype), a value head_dim of its own (d 128 with dv 64, d 192 with
  dv 128), ``softcap`` 15 with q * 15 / 4, ``local_enum`` 1 (a window drawn in ``[0, seqlen_k)`` per side; never
  with causal), ``mha_type`` with 6 query heads and 3 or 1 kv heads.
* ``jax-ml/jax`` ``tests/pallas/tpu_splash_attention_kernel_test.py::test_splash_attention_bwd`` (``is_mqa``,
  heads (4, 1), (8, 4), (6, 2), head dims (128, 192) and (192, 128), ``is_segmented``, ``use_sinks``, local masks,
  ``attn_logits_soft_cap`` in [1, 50]) and ``tests/pallas/tpu_splash_attention_mask_test.py::
  test_local_attention_mask``.

Rules. FlashAttention's, per quantity: ``max|impl - oracle| <= mult * max|naive same-dtype - oracle| + atol``
(:mod:`peers.rules`; the naive implementation rounds the variants where the peer's ``attention_ref(upcast=False,
reorder_ops=True)`` does, :func:`peers.rules.naive_same_dtype`). ``test_flash_attn_output``: out 2x; grads 2x
for GQA/MQA alone (765fbd92, where ``mha_type`` first appears), 3x with a window or a soft-cap (the snapshot,
where ``local`` and ``softcap`` appear, relaxed its grads to 3x). ``_causal`` 2x + 1e-5; ``_splitkv`` out
2x + 1e-5, grads 2x + 2e-4; ``_kvcache`` forward only, 3x + 1e-5. tests/cute: mult 2 (3 with a soft-cap) plus
``2 * max|(ref + 0.3 - 0.3) - ref|`` in the input dtype (+ 3e-4 on grads with a soft-cap); dsinks per head
``mult * max|naive - ref| + 2 ulp + atol``. Splash's: ``assert_allclose`` out 3e-3/3e-3, dq, dk, dv
atol 2e-2 rtol 3e-2, dsinks atol 5e-3 rtol 3e-2, against its backward reference, whose ``D = rowsum(o * do)``
uses the implementation's own ``o`` (here in float64 from the rounded inputs).

Which implementations. Every case runs on every name in ``rules.IMPLS``: where
``flashlib.api.get_implementation(impl).features`` covers the case's variants it is measured; where it does
not, the test asserts the refusal (a ``ValueError`` naming the implementation). An implementation that gains a
feature is measured by these cases from then on, with no edit here.

Cut for CI (a 2-core machine runs the suite in two environments; the peers run on a GPU or TPU). Every case is
a compile per implementation plus a float64 oracle, so:

* batch x heads: FlashAttention's 4 x 6 (or 4 x 4 with softcap; 8 x 9 causal; 1 x 12 splitkv; 2 x 6 kvcache;
  9 x 6 cute) become 2 x 4 or 1 x 4 with 2 (gqa) or 1 (mqa) kv heads, 1 x 2 (one kv head) for the 1023 x 1024
  pair, 2 x 2 or 1 x 2 for the MHA-only causal and splitkv tests; kvcache and cute keep 6 query heads (3 or 1
  kv heads) with batch 2 or 1.
* Pairs: output keeps (113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1023, 1024); causal
  (1, 239) and (3, 799) swapped, (127, 513); splitkv (1, 339), (3, 799), (64, 2048); kvcache (1, 128),
  (3, 1024), (64, 800); cute (113, 203), (128, 217), (239, 1), (64, 128). The rest of each list is dropped.
* The parameter products (pair x d x causal x local x softcap x mha_type x dtype ...) are not run in full:
  each pair kept runs once, the other parameters in rotation, so that mqa and gqa, windows with and without
  causal, soft-caps with and without windows, both layouts and many head dims appear. Windows are the peer's
  draws (uniform in ``[0, seqlen_k)`` per side), fixed per case by its seed. float32 joins only the tests whose
  rule has an atol (as in ``test_flash_attention.py``).
* Dropped: alibi, dropout, kvpacked/varlen/paged/rotary/leftpad, deterministic; cute's ``local_enum`` 2 and 3
  (negative window sides; flashlib's sides are >= 0), ``has_qv``, fp8, pack_gqa and num_splits (kernel
  options). As in the peer, cute checks gradients only for dv == d <= 128 or (d, dv) = (192, 128), and not
  where a window or causal meets seqlen_k < seqlen_q.
* Splash: lengths 1024-4096 become 256 and 512 (four cases; the variants cost a float64 reference and a
  compile each, and the plain 1024/2048 lengths run in ``test_jax_splash.py``); heads (8, 4) become (4, 2),
  (4, 1) and (6, 2) stay;
  a local mask runs in the form flashlib can state (square, the peer's ``offset`` folded into the window's
  sides, both >= 0, so the peer's ``| diagonal`` changes nothing); random and composed masks, dynamic masks,
  block sizes, layouts, ``downcast_smem_data`` and the fused backward are not flashlib's.
* The splash mask test keeps its square 4 x 4 windows; its rectangles are top-left aligned (offset 0), which
  flashlib's bottom-right windows state only for some of them.

Smoke environment (``tests/conftest.py``, marker ``rotate_jnp_impls``): under ``make test-colab`` each fixed case
here runs on pallas and on one of reference, blockwise and xla (chosen per case); ``make test`` runs every
case on every impl.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlib
from flashlib.api import get_implementation
from flashlib.masks import element_visible
from flashlib.reference import attention_oracle, attention_vjp_oracle, default_scale
from peers import rules

pytestmark = pytest.mark.rotate_jnp_impls


@dataclasses.dataclass(frozen=True)
class Case:
    """One peer case, cut to CI size; the variants by value so the case is hashable and its id readable."""

    q_len: int
    kv_len: int
    head_dim: int
    causal: bool = False
    heads: int = 4
    kv_heads: int = 4
    v_head_dim: int | None = None
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    sinks: bool = False
    segments: tuple[int, ...] | None = None  # segment starts (after 0) of one packed row, the same for q and kv
    dtype: str = "bfloat16"
    layout: str = "bhsd"
    batch: int = 2
    q_scale: float = 1.0
    draw: str = "normal"  # "uniform": splash's random.uniform in [0, 1), drawn in the dtype
    scale: float | None = None
    seed: int = 0

    @property
    def dv(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def features(self) -> frozenset[str]:
        used = (("gqa", self.kv_heads != self.heads), ("value_head_dim", self.dv != self.head_dim),
                ("window", self.window is not None), ("softcap", self.softcap is not None),
                ("segment_ids", self.segments is not None), ("sinks", self.sinks))
        return frozenset(name for name, on in used if on)

    @property
    def id(self) -> str:
        mha = "mha" if self.kv_heads == self.heads else ("mqa" if self.kv_heads == 1 else "gqa")
        dims = f"d{self.head_dim}" + (f"v{self.dv}" if self.dv != self.head_dim else "")
        parts = [f"{self.q_len}x{self.kv_len}", dims, f"{mha}{self.heads}-{self.kv_heads}",
                 "causal" if self.causal else "full"]
        parts += [f"w{self.window[0]}-{self.window[1]}"] if self.window else []
        parts += [f"cap{self.softcap:g}"] if self.softcap else []
        parts += ["seg"] if self.segments else []
        parts += ["sinks"] if self.sinks else []
        parts += [{"bfloat16": "bf16", "float32": "f32"}[self.dtype], self.layout]
        return "-".join(parts)


def drawn_window(kv_len: int, seed: int) -> tuple[int, int]:
    """The peer's ``torch.randint(0, seqlen_k, (2,))``, drawn once per case (NumPy, fixed by ``seed``)."""
    left, right = np.random.default_rng(seed).integers(0, kv_len, size=2)
    return int(left), int(right)


# ---------------------------------------------------------------------------------------------------
# Inputs, the float64 oracle and the naive same-dtype errors (shared by the implementations of a case)
# ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def inputs(case: Case) -> dict:
    """q, k, v, do (``[b, h, s, d]``, NumPy arrays in the dtype), sinks ``[heads]`` in the dtype (or None) and
    segment ids, drawn with NumPy (``jax.random`` would compile a program per shape, eagerly: seconds a case)."""
    dtype = jnp.dtype(case.dtype)
    rng = np.random.default_rng(case.seed)
    shapes = {"q": (case.batch, case.heads, case.q_len, case.head_dim), "k": (case.batch, case.kv_heads, case.kv_len,
              case.head_dim), "v": (case.batch, case.kv_heads, case.kv_len, case.dv), "do": (case.batch, case.heads,
              case.q_len, case.dv), "sinks": (case.heads,)}
    if case.draw == "uniform":  # splash: random.uniform in [0, 1) in the dtype; its sinks 1.0 * uniform
        arrays = {name: rng.random(shape, np.float32) for name, shape in shapes.items()}
    else:  # FlashAttention: randn in the dtype (q times q_scale, then rounded); learnable_sink randn(nheads)
        arrays = {name: rng.standard_normal(shape, np.float32) for name, shape in shapes.items()}
        arrays["q"] = arrays["q"] * np.float32(case.q_scale)
    arrays = {name: x.astype(dtype) for name, x in arrays.items()}
    segment_ids = None
    if case.segments is not None:
        row = np.zeros(case.q_len, np.int32)
        for start in case.segments:
            row[start:] += 1
        ids = np.tile(row, (case.batch, 1))
        segment_ids = (ids, ids)
    return {**arrays, "sinks": arrays["sinks"] if case.sinks else None, "segment_ids": segment_ids}


def variants(case: Case, data: dict) -> dict:
    """The keyword variants of ``flashlib.attention`` for the case (only those it sets)."""
    given = {"window": case.window, "softcap": case.softcap, "segment_ids": data["segment_ids"],
             "sinks": data["sinks"], "scale": case.scale}
    return {name: value for name, value in given.items() if value is not None}


def _to_layout(x, layout: str):
    return x if layout == "bhsd" else np.swapaxes(x, 1, 2)


@functools.cache
def vjp_fn(impl: str, case: Case, with_grads: bool = True):
    """jit of ``(q, k, v, do, sinks, segment_ids) -> (out, dq, dk, dv[, dsinks])`` (the arrays in the case's
    layout), or ``(out,)`` without grads."""

    def run(q, k, v, do, sinks, segment_ids):
        def attend(q, k, v, *maybe_sinks):
            extra = {"sinks": maybe_sinks[0]} if maybe_sinks else {}
            return flashlib.attention(q, k, v, causal=case.causal, window=case.window, softcap=case.softcap,
                                      segment_ids=segment_ids, scale=case.scale, layout=case.layout, impl=impl,
                                      **extra)

        primals = (q, k, v) if sinks is None else (q, k, v, sinks)
        if not with_grads:
            return (attend(*primals),)
        out, pullback = jax.vjp(attend, *primals)
        return (out, *pullback(do))

    return jax.jit(run)


def run_impl(impl: str, case: Case, with_grads: bool = True) -> list[np.ndarray]:
    """``impl``'s out (and gradients) on the case, back in ``[b, h, s, d]``, as float64."""
    data = inputs(case)
    args = [_to_layout(data[name], case.layout) for name in ("q", "k", "v", "do")]
    values = vjp_fn(impl, case, with_grads)(*args, data["sinks"], data["segment_ids"])
    return [_to_layout(np.asarray(x, np.float64), case.layout) if x.ndim == 4 else np.asarray(x, np.float64)
            for x in values]


def _oracle_variants(case: Case, data: dict) -> dict:
    given = variants(case, data)
    given.pop("scale", None)
    if "sinks" in given:
        given["sinks"] = np.asarray(given["sinks"], np.float64)
    if "segment_ids" in given:
        given["segment_ids"] = tuple(np.asarray(ids) for ids in given["segment_ids"])
    return given


@functools.lru_cache(maxsize=1)
def expected(case: Case, with_grads: bool = True):
    """The float64 oracle ``[out(, dq, dk, dv[, dsinks])]``, the naive same-dtype values and their errors."""
    data = inputs(case)
    q, k, v, do = (np.asarray(data[name], np.float64) for name in ("q", "k", "v", "do"))
    given = _oracle_variants(case, data)
    oracle = [attention_oracle(q, k, v, causal=case.causal, scale=case.scale, **given)]
    if with_grads:
        oracle += list(attention_vjp_oracle(q, k, v, do, causal=case.causal, scale=case.scale, **given))

    def naive(q, k, v, *maybe_sinks):
        return rules.naive_same_dtype(q, k, v, causal=case.causal, scale=case.scale, window=case.window,
                                      softcap=case.softcap, segment_ids=data["segment_ids"],
                                      sinks=maybe_sinks[0] if maybe_sinks else None)

    def naive_and_grads(do, *primals):
        out, pullback = jax.vjp(naive, *primals)
        return (out, *pullback(do))

    primals = tuple(data[name] for name in ("q", "k", "v")) + ((data["sinks"],) if case.sinks else ())
    naive_values = (jax.jit(naive_and_grads)(data["do"], *primals) if with_grads else (jax.jit(naive)(*primals),))
    return oracle, naive_values, rules.max_errors(naive_values, oracle)


def supported(impl: str, case: Case) -> bool:
    return case.features <= get_implementation(impl).features


def check_refusal(impl: str, case: Case) -> None:
    """``impl`` lacks one of the case's variants: ``flashlib.attention`` refuses it by name, before any work."""
    data = inputs(case)
    with pytest.raises(ValueError, match=rf"impl='{impl}' does not support"):
        flashlib.attention(*(_to_layout(data[n], case.layout) for n in ("q", "k", "v")), causal=case.causal,
                           layout=case.layout, impl=impl, **variants(case, data))


def params(cases: list[Case]):
    """``(case, impl)`` for every case and every implementation (case-major: the per-case caches hold one case)."""
    return [pytest.param(case, impl, id=f"{case.id}-{impl}") for case in cases for impl in rules.IMPLS]


def check_fa_rule(impl: str, case: Case, rule: rules.Rule, with_grads: bool = True) -> list[np.ndarray]:
    """FlashAttention's rule on out (and dq, dk, dv, dsinks); nothing NaN; rows that see no key are zero."""
    oracle, _, naive_errors = expected(case, with_grads)
    values = run_impl(impl, case, with_grads)
    names = rules.NAMES_WITH_SINKS[:len(values)]
    rules.Comparison(impl, rules.max_errors(values, oracle), naive_errors).check(rule, names)
    for name, value in zip(names, values, strict=True):
        assert np.all(np.isfinite(value)), f"impl={impl!r}: {name} has non-finite entries"
    empty = ~np.any(_visible(case), axis=-1)  # [b or 1, q]
    if np.any(empty):
        rows = np.broadcast_to(empty[:, None, :], values[0].shape[:3])
        for name, value in zip(("out", "dq"), values, strict=False):
            assert np.all(value[rows] == 0.0), f"impl={impl!r}: {name} is not zero on rows that see no key"
    return values


def _visible(case: Case) -> np.ndarray:
    """``[b or 1, q, k]``: which key each query sees (the case's mask)."""
    rows, cols = np.arange(case.q_len)[:, None], np.arange(case.kv_len)[None, :]
    visible = np.broadcast_to(element_visible(rows, cols, q_len=case.q_len, kv_len=case.kv_len, causal=case.causal,
                                              window=case.window), (case.q_len, case.kv_len))[None]
    ids = inputs(case)["segment_ids"]
    if ids is not None:
        visible = visible & (np.asarray(ids[0])[:, :, None] == np.asarray(ids[1])[:, None, :])
    return visible


# ---------------------------------------------------------------------------------------------------
# tests/test_flash_attn.py::test_flash_attn_output: mha_type, local, softcap
# ---------------------------------------------------------------------------------------------------

OUTPUT_CASES = [
    Case(113, 203, 192, kv_heads=2, window=drawn_window(203, 1)),
    Case(128, 217, 224, causal=True, kv_heads=1, window=drawn_window(217, 2), layout="bshd"),
    Case(108, 256, 160, causal=True, kv_heads=2, softcap=50.0, q_scale=50.0, batch=1),
    Case(256, 512, 96, kv_heads=1, softcap=50.0, q_scale=50.0, window=drawn_window(512, 4), batch=1),
    Case(512, 256, 111, causal=True, kv_heads=2, batch=1, layout="bshd"),  # 256 rows see no key
    Case(1023, 1024, 40, heads=2, kv_heads=1, batch=1, window=drawn_window(1024, 5)),
]


@pytest.mark.parametrize("case, impl", params(OUTPUT_CASES))
def test_flash_attn_output(case, impl):
    """follows Dao-AILab/flash-attention tests/test_flash_attn.py::test_flash_attn_output (mha_type mqa/gqa,
    local, softcap 50 with q * 50; dropout 0, no alibi, not kvpacked): out at most 2x the naive same-dtype
    error, grads 2x (GQA alone, as at 765fbd92) or 3x (with a window or soft-cap, as in the snapshot).
    Cut: batch 4 -> 2 (1 at 1023 x 1024), heads 6 (4 with softcap) -> 4 (2), kv heads 1 or 2."""
    if not supported(impl, case):
        return check_refusal(impl, case)
    grads = 3.0 if (case.window or case.softcap) else 2.0
    check_fa_rule(impl, case, rules.Rule(mult_out=2.0, mult_grad=grads))


# ---------------------------------------------------------------------------------------------------
# tests/test_flash_attn.py::test_flash_attn_causal and ::test_flash_attn_splitkv with local=True
# ---------------------------------------------------------------------------------------------------

CAUSAL_CASES = [
    Case(239, 1, 72, causal=True, heads=2, kv_heads=2, window=drawn_window(1, 6), layout="bshd"),  # swap_sq_sk
    Case(799, 3, 64, causal=True, heads=2, kv_heads=2, window=drawn_window(3, 7), dtype="float32"),  # swap_sq_sk
    Case(127, 513, 59, causal=True, heads=2, kv_heads=2, window=drawn_window(513, 8)),
]


@pytest.mark.parametrize("case, impl", params(CAUSAL_CASES))
def test_flash_attn_causal_local(case, impl):
    """follows Dao-AILab/flash-attention tests/test_flash_attn.py::test_flash_attn_causal with local=True
    (causal and a drawn window; its reference sets the right side to 0): out and grads at most 2x the naive
    error + 1e-5, rows that see no key zero. Cut: batch 8 x heads 9 -> 2 x 2; pairs (1, 239), (3, 799) swapped
    and (127, 513); head dims in rotation."""
    if not supported(impl, case):
        return check_refusal(impl, case)
    check_fa_rule(impl, case, rules.Rule(mult_out=2.0, mult_grad=2.0, atol_out=1e-5, atol_grad=1e-5))


SPLITKV_CASES = [
    Case(1, 339, 256, causal=True, heads=2, kv_heads=2, batch=1, window=drawn_window(339, 9)),
    Case(3, 799, 80, heads=2, kv_heads=2, batch=1, window=drawn_window(799, 10), dtype="float32"),
    Case(64, 2048, 128, causal=True, heads=2, kv_heads=2, batch=1, window=drawn_window(2048, 11), layout="bshd"),
]


@pytest.mark.parametrize("case, impl", params(SPLITKV_CASES))
def test_flash_attn_splitkv_local(case, impl):
    """follows Dao-AILab/flash-attention tests/test_flash_attn.py::test_flash_attn_splitkv with local=True (no
    alibi): out at most 2x the naive error + 1e-5, grads 2x + 2e-4. Cut: heads 12 -> 2; pairs (1, 339),
    (3, 799), (64, 2048) unswapped."""
    if not supported(impl, case):
        return check_refusal(impl, case)
    check_fa_rule(impl, case, rules.Rule(mult_out=2.0, mult_grad=2.0, atol_out=1e-5, atol_grad=2e-4))


KVCACHE_CASES = [
    Case(1, 128, 32, causal=True, heads=6, kv_heads=1, window=drawn_window(128, 12)),
    Case(3, 1024, 80, heads=6, kv_heads=3, window=drawn_window(1024, 13), dtype="float32", layout="bshd"),
    Case(64, 800, 128, causal=True, heads=6, kv_heads=3, batch=1),
]


@pytest.mark.parametrize("case, impl", params(KVCACHE_CASES))
def test_flash_attn_kvcache_gqa_local(case, impl):
    """follows Dao-AILab/flash-attention tests/test_flash_attn.py::test_flash_attn_kvcache (mha_type mqa/gqa
    with 6 query heads and 1 or 3 kv heads, local; new_kv=False, no rotary/paging/leftpad, the whole cache
    valid): forward only, out at most 3x the naive error + 1e-5."""
    if not supported(impl, case):
        return check_refusal(impl, case)
    check_fa_rule(impl, case, rules.Rule(mult_out=3.0, atol_out=1e-5), with_grads=False)


# ---------------------------------------------------------------------------------------------------
# tests/cute/test_flash_attn.py::test_flash_attn_output: learnable sinks, a value head_dim, softcap 15
# ---------------------------------------------------------------------------------------------------

CUTE_CASES = [
    Case(113, 203, 192, v_head_dim=128, causal=True, heads=6, kv_heads=3, sinks=True),
    Case(128, 217, 64, heads=6, kv_heads=1, sinks=True, softcap=15.0, q_scale=15.0 / 4, window=drawn_window(217, 14)),
    Case(239, 1, 128, v_head_dim=64, causal=True, heads=6, kv_heads=1, sinks=True),  # 238 rows see no key
    Case(64, 128, 128, heads=6, kv_heads=3, softcap=15.0, q_scale=15.0 / 4),
]


def _cute_checks_grads(case: Case) -> bool:
    """The peer's condition for its backward check (bf16, no qv): dv == d <= 128 or (d, dv) = (192, 128), and
    not (causal or local) with seqlen_k < seqlen_q."""
    shapes = (case.dv == case.head_dim <= 128) or (case.head_dim, case.dv) == (192, 128)
    return shapes and not ((case.causal or case.window) and case.kv_len < case.q_len)


@pytest.mark.parametrize("case, impl", params(CUTE_CASES))
def test_flash_attn_output_cute(case, impl):
    """follows Dao-AILab/flash-attention tests/cute/test_flash_attn.py::test_flash_attn_output (bf16;
    has_learnable_sink, dv of its own, softcap 15 with q * 15 / 4, local_enum 0 or 1, mha_type): out at most
    mult x the naive same-dtype error + 2 max|(ref + 0.3 - 0.3) - ref| (bf16), mult 2, or 3 with a soft-cap;
    dq, dk, dv the same (+ 3e-4 with a soft-cap), dsinks per head mult x the naive's max error + 2 ulp (+ 3e-4).
    Cut: batch 9 -> 2 (1 at 256 x 512), pairs and head dims in rotation, no pack_gqa/num_splits/deterministic."""
    if not supported(impl, case):
        return check_refusal(impl, case)
    with_grads = _cute_checks_grads(case)
    oracle, _, naive_errors = expected(case, with_grads)
    values = run_impl(impl, case, with_grads)
    mult = 2.0 if case.softcap is None else 3.0
    extra = 0.0 if case.softcap is None else 3e-4
    dtype = jnp.dtype(case.dtype)
    errors = rules.max_errors(values, oracle)
    failures = []
    for name in rules.NAMES[:len(values)]:
        i = rules.NAMES.index(name)
        bound = mult * naive_errors[name] + rules.rounding_atol(oracle[i], dtype) + (extra if name != "out" else 0.0)
        if not errors[name] <= bound:
            failures.append(f"{name}: error {errors[name]:.3g} > bound {bound:.3g} (naive {naive_errors[name]:.3g})")
    if with_grads and case.sinks:
        failures.append(rules.dsinks_failure(values[4], oracle[4], naive_errors["dsinks"], mult=mult, atol=extra,
                                             dtype=dtype))
    rules.assert_all(impl, case.id, failures)
    if case.kv_len < case.q_len and case.causal:
        assert np.all(values[0][:, :, :case.q_len - case.kv_len] == 0.0), "rows that see no key are not zero"


# ---------------------------------------------------------------------------------------------------
# tpu_splash_attention_kernel_test.py::test_splash_attention_bwd: mqa/gqa, segments, sinks, local, soft-cap
# ---------------------------------------------------------------------------------------------------

SPLASH_OUT_TOL = {"atol": 3e-3, "rtol": 3e-3}
SPLASH_GRAD_TOL = {"atol": 2e-2, "rtol": 3e-2}
SPLASH_DSINKS_TOL = {"atol": 5e-3, "rtol": 3e-2}


def splash_window(seq_len: int, left: int | None, right: int | None, offset: int) -> tuple[int | None, int | None]:
    """Splash's ``LocalMask((n, n), (left, right), offset)`` (query i sees ``i + offset - left <= j <= i + offset +
    right``) as flashlib's square window: ``(left - offset, right + offset)``, each side >= 0 (or None)."""
    sides = (None if left is None else left - offset, None if right is None else right + offset)
    assert all(s is None or 0 <= s for s in sides), "not a window flashlib can state"
    return sides


SPLASH_CASES = [
    Case(512, 512, 128, causal=True, heads=4, kv_heads=1, segments=(50, 205, 425), sinks=True, batch=1,
         dtype="float32", draw="uniform", scale=1.0, seed=0),
    Case(256, 256, 128, v_head_dim=192, heads=4, kv_heads=2, window=splash_window(256, 100, 37, 13), softcap=23.5,
         batch=1, draw="uniform", scale=1.0, seed=1),
    Case(256, 512, 192, v_head_dim=128, heads=6, kv_heads=2, sinks=True, batch=1, draw="uniform", scale=1.0, seed=2),
    Case(256, 256, 64, heads=4, kv_heads=2, segments=(2, 150), window=splash_window(256, None, 40, -20), batch=1,
         draw="uniform", scale=1.0, seed=3),
]


def splash_reference(case: Case, out) -> list[np.ndarray]:
    """Splash's references in float64 from the rounded inputs: the exact output, and its backward reference
    (``_attention_reference_custom_bwd``, "flash"): exact probabilities and ``dp = do v^T``, ``D = rowsum(o * do)``
    from the implementation's own ``o``; dq, dk, dv (summed over each kv head's group), dsinks =
    ``-sum p_sink * D``. BLAS matmuls, per head."""
    data = inputs(case)
    q, k, v, do = (np.asarray(data[name], np.float64) for name in ("q", "k", "v", "do"))
    group = case.heads // case.kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = default_scale(case.head_dim) if case.scale is None else case.scale
    raw = q @ k.swapaxes(-1, -2) * scale  # [b, h, q, k]
    s = raw if case.softcap is None else case.softcap * np.tanh(raw / case.softcap)
    s = np.where(_visible(case)[:, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    sinks = None if data["sinks"] is None else np.asarray(data["sinks"], np.float64)[None, :, None, None]
    if sinks is not None:
        m = np.maximum(m, sinks)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True) + (0.0 if sinks is None else np.exp(sinks - m))
    p, p_sink = p / total, (None if sinks is None else np.exp(sinks - m) / total)
    d_rows = np.sum(np.asarray(out, np.float64) * do, axis=-1, keepdims=True)
    ds = p * (do @ v.swapaxes(-1, -2) - d_rows)
    if case.softcap is not None:
        ds = ds * (1.0 - np.tanh(raw / case.softcap) ** 2)
    dq = ds @ k * scale
    dk, dv = ds.swapaxes(-1, -2) @ q * scale, p.swapaxes(-1, -2) @ do
    dk, dv = (x.reshape(x.shape[0], case.kv_heads, group, *x.shape[2:]).sum(axis=2) for x in (dk, dv))
    grads = [p @ v, dq, dk, dv]
    return grads if p_sink is None else [*grads, -(p_sink * d_rows).sum(axis=(0, 2, 3))]


@pytest.mark.parametrize("case, impl", params(SPLASH_CASES))
def test_splash_attention_bwd(case, impl):
    """follows jax-ml/jax tests/pallas/tpu_splash_attention_kernel_test.py::test_splash_attention_bwd (is_mqa,
    grouped heads, is_segmented, use_sinks, local mask, attn_logits_soft_cap, head dims (128, 192) and (192, 128);
    uniform inputs, no softmax scale): out within atol = rtol = 3e-3, dq, dk, dv within atol 2e-2 rtol 3e-2 and
    dsinks within atol 5e-3 rtol 3e-2 of its backward reference. Cut: lengths (the peer's
    1024-4096 -> 256 and 512), one batch row, NumPy draws fixed by seed instead of hypothesis, no block sizes,
    layouts or dynamic masks."""
    if not supported(impl, case):
        return check_refusal(impl, case)
    values = run_impl(impl, case)
    ref = splash_reference(case, values[0])
    names = rules.NAMES_WITH_SINKS[:len(values)]
    tols = {"out": SPLASH_OUT_TOL, "dsinks": SPLASH_DSINKS_TOL}
    rules.assert_all(impl, case.id, [rules.allclose_failure(name, got, want, **tols.get(name, SPLASH_GRAD_TOL))
                                     for name, got, want in zip(names, values, ref, strict=True)])


# ---------------------------------------------------------------------------------------------------
# tpu_splash_attention_mask_test.py::test_local_attention_mask: the window's element rule
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window, rows", [
    ((1, None), ["1111", "1111", "0111", "0011"]),
    ((None, 2), ["1110", "1111", "1111", "1111"]),
    ((1, 1), ["1100", "1110", "0111", "0011"]),
    ((1, 0), ["1000", "1100", "0110", "0011"]),
    ((0, 2), ["1110", "0111", "0011", "0001"]),
    ((0, None), ["1111", "0111", "0011", "0001"]),
], ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else None)
def test_local_attention_mask(window, rows):
    """follows jax-ml/jax tests/pallas/tpu_splash_attention_mask_test.py::test_local_attention_mask (square 4 x 4,
    offset 0, where splash's top-left and flashlib's bottom-right alignments agree): the visible keys of each
    query, and the reference implementation's output on one-hot values (each query's output row is exactly its
    visible keys, averaged)."""
    want = np.array([[c == "1" for c in row] for row in rows])
    positions = np.arange(4)
    got = np.broadcast_to(element_visible(positions[:, None], positions[None, :], q_len=4, kv_len=4, causal=False,
                                          window=window), (4, 4))
    np.testing.assert_array_equal(got, want)
    q = jnp.zeros((1, 1, 4, 8), jnp.float32)  # equal scores: each row averages its visible keys
    v = jnp.eye(4, dtype=jnp.float32)[None, None]
    out = np.asarray(flashlib.attention(q, q, v, window=window, impl="reference"))[0, 0]
    np.testing.assert_allclose(out, want / want.sum(axis=1, keepdims=True), rtol=1e-6)
