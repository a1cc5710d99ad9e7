"""JAX's splash-attention kernel tests, reproduced against every implementation behind ``flashlib.attention``.

Peer: ``jax-ml/jax`` ``tests/pallas/tpu_splash_attention_kernel_test.py``, class ``SplashAttentionTest``
(read at the repository's head, July 2026). What its tests do, and what is kept here:

* Inputs: ``random.uniform`` in [0, 1), drawn directly in the input dtype; q ``[heads, q_len, head_dim]``
  (here ``[1, heads, q_len, head_dim]``), the cotangent ``do`` uniform in the output dtype. Splash takes no
  softmax scale (callers pre-scale q), and its reference multiplies raw ``q k^T``: every call here passes
  ``scale=1.0``, which makes the logits large (mean ``head_dim / 4``).
* Shapes: q_len and kv_len each from {1024, 2048, 4096}; head dims (qk, v) from {(64, 64), (128, 128),
  (256, 256), (128, 192), (192, 128)}; bfloat16 only when not both lengths are >= 4096; heads (q, kv) from
  {(1, 1), (2, 2), (4, 1), (8, 4), (6, 2)}; block sizes from {128, 256, 512} (forward: ``block_q``,
  ``block_kv``, ``block_kv_compute``; backward: ``block_q_dkv``, ``block_kv_dkv``, ``block_q_dq``,
  ``block_kv_dq`` from {128, 256}).
* Masks: full, causal, local, random (and compositions); causal is ``CausalMask((q_len, kv_len))`` with
  ``offset=0``: query ``i`` sees keys ``j <= i``, *top-left* aligned. flashlib's causal is bottom-right
  aligned (``j <= i + kv_len - q_len``); the two agree only when ``q_len == kv_len``, so causal cases here
  are square, and rectangular cases use the full mask (where every definition agrees).
* Tolerances (``np.testing.assert_allclose(x, ref, atol, rtol)``, bfloat16 upcast to float32), the same for
  both dtypes: output ``atol = rtol = 3e-3`` (``test_splash_attention``; ``test_splash_attention_bwd``
  checks it again, and so does its counterpart here), dq, dk, dv ``atol=2e-2, rtol=3e-2``;
  ``test_splash_attention_fwd`` logsumexp ``atol = rtol = 1e-3``; ``test_splash_attention_custom_bwd`` (a
  flash-style backward against autodiff, cotangent ``uniform / 10``) per dtype: float32 dv ``3e-3``, dq and
  dk ``0.05``; bfloat16 dv ``4e-3``, dq and dk ``0.05`` (atol = rtol; the TPU-generation overrides for dk
  do not apply to a CPU).
* Reference: the peer's, computed the way it computes it but in float64 on the same rounded inputs (the
  formulas of flashlib's oracle, with BLAS matmuls). Output and logsumexp: exact attention of the inputs (the
  peer: f32 math on the upcast inputs). Gradients in ``test_splash_attention_bwd``: the peer's backward
  reference, splash's ``_attention_reference_custom_bwd`` (``"flash"``): exact probabilities and
  ``dp = do v^T``, but ``D = rowsum(o * do)`` from the implementation's *own* output ``o``, as the peer
  feeds the kernel's output into it. Gradients in ``test_splash_attention_custom_bwd``: exact (the peer's
  autodiff reference, without its rounding).

Cut, and why:

* Length 4096 (the peer's float32-only tier): interpreted Pallas, XLA's bfloat16 dots on a CPU and the float64
  reference cost seconds per case at 2048 already, on a 2-core CI machine that runs the suite twice. The five
  cases keep 1024 and 2048 in every role: q longer, kv longer, square (both dtypes), causal at 1024 and 2048.
* Head dims (128, 192) and (192, 128), heads (4, 1), (8, 4), (6, 2) and the MQA variants, local masks,
  segment ids, logit soft-cap and attention sinks: run by ``tests/peers/test_variants_peers.py`` on the
  implementations that declare those variants (this file keeps the peer's plain cases).
* Random and composed masks, dynamic masks, q/k/v layouts, ``downcast_smem_data`` and the fused backward
  kernel: flashlib has no such options.
* Block sizes: one configuration per case from the peer's set instead of a hypothesis draw. Pallas maps
  ``block_kv`` -> ``block_k_major`` and ``block_kv_compute`` -> ``block_k``; ``"blockwise"`` takes
  ``block_q`` and the compute block; ``"reference"`` and ``"xla"`` have no blocks.
* Hypothesis draws (five seeds) become five fixed cases with fixed seeds.

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
from flashlib.blockwise import blockwise_attention
from flashlib.kernels import BlockSizes, flash_attention
from peers.rules import IMPLS, allclose_failure, assert_all

pytestmark = pytest.mark.rotate_jnp_impls

SCALE = 1.0  # splash has no softmax scale: its reference multiplies raw q k^T

# test_splash_attention_bwd: one rule for both dtypes.
OUT_TOL = {"atol": 3e-3, "rtol": 3e-3}
GRAD_TOL = {"atol": 2e-2, "rtol": 3e-2}
# test_splash_attention_fwd: the logsumexp residual.
LSE_TOL = {"atol": 1e-3, "rtol": 1e-3}
# test_splash_attention_custom_bwd: per dtype (atol = rtol), cotangent uniform / 10.
CUSTOM_BWD_TOL = {
    "float32": {"dv": 3e-3, "dq": 0.05, "dk": 0.05},
    "bfloat16": {"dv": 4e-3, "dq": 0.05, "dk": 0.05},
}


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One draw of the peer's ``block_sizes_strategy`` (``kv_compute`` None: the whole ``kv`` block)."""

    q: int
    kv: int
    kv_compute: int | None
    q_dkv: int
    kv_dkv: int
    q_dq: int
    kv_dq: int

    def options(self, impl: str) -> dict:
        """The same tiling in ``impl``'s own options."""
        compute = self.kv_compute or self.kv
        if impl == "pallas":
            return {"block_sizes": BlockSizes(
                block_q=self.q, block_k=compute, block_k_major=None if compute == self.kv else self.kv,
                block_q_dkv=self.q_dkv, block_k_dkv=self.kv_dkv, block_q_dq=self.q_dq, block_k_dq=self.kv_dq)}
        if impl == "blockwise":
            return {"block_q": self.q, "block_k": compute}
        return {}


@dataclasses.dataclass(frozen=True)
class Case:
    q_len: int
    kv_len: int
    heads: int
    head_dim: int
    dtype: str
    causal: bool
    blocks: Blocks
    seed: int

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"q{self.q_len}-kv{self.kv_len}-h{self.heads}-d{self.head_dim}-{self.dtype}-{mask}"


# Head dims rotate across the lengths; each dtype meets square and rectangular shapes; causal only where
# q_len == kv_len (see the module docstring).
CASES = [
    Case(1024, 1024, 2, 128, "float32", True, Blocks(512, 512, None, 256, 256, 256, 256), seed=0),
    Case(1024, 1024, 1, 256, "bfloat16", False, Blocks(256, 512, 256, 128, 128, 128, 128), seed=1),
    Case(2048, 1024, 1, 64, "bfloat16", False, Blocks(512, 256, None, 256, 128, 128, 256), seed=2),
    Case(1024, 2048, 1, 64, "float32", False, Blocks(128, 512, 128, 128, 256, 256, 128), seed=3),
    Case(2048, 2048, 1, 128, "bfloat16", True, Blocks(256, 256, 128, 256, 256, 128, 128), seed=4),
    # issue 24's row: pallas's dq error was 0.0272 against the 0.0203 allowed here (128 x 128 blocks throughout);
    # measured 0.013-0.018 over seeds 0-3 on 2026-12-03 (out, dk and dv within the rule too)
    Case(512, 512, 2, 128, "bfloat16", True, Blocks(128, 128, None, 128, 128, 128, 128), seed=5),
]
LSE_CASES = [CASES[0], CASES[2], CASES[4]]
LSE_IMPLS = ("blockwise", "pallas")  # the implementations that return the logsumexp


# impl="xla" is jax.nn.dot_product_attention, whose bfloat16 backward makes dP = dO V^T with a bfloat16 dot
# (the transpose of its P V einsum, which runs in the input dtype). With the peer's uniform inputs dP and
# D = rowsum(dO * O) are both about head_dim / 4, so ds = p * (dP - D) inherits dP's rounding (2^-9 |dP|)
# through the cancellation. On these two cases its dq is 3-5x outside the peer's rule, on both venvs;
# "reference", "blockwise" and "pallas" stay within it, and so does splash itself (interpreted on the CPU,
# the d=256 case: dq error 0.006).
# On the CPU impl="xla" now runs bf16 in f32 (flashlib/xla.py), so these two cases pass there; on a GPU or
# TPU, where it stays bf16, they would not. Known failures, (impl, case id) -> reason: none on this machine.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def params(cases, impls, known=None):
    """Case-major (impl varies fastest), so the per-case caches below hold one case at a time; ``known``
    marks the (impl, case id) pairs that fail the peer's rule as strict xfails, with the reason."""
    known = known or {}
    return [pytest.param(case, impl, id=f"{impl}-{case.id}",
                         marks=[pytest.mark.xfail(raises=AssertionError, strict=True, reason=known[impl, case.id])]
                         if (impl, case.id) in known else [])
            for case in cases for impl in impls]


@functools.lru_cache(maxsize=1)
def inputs(case: Case):
    """q, k, v and do (uniform in [0, 1), drawn in the input dtype, as the peer draws them)."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(case.seed), 4)
    dtype = jnp.dtype(case.dtype)
    q = jax.random.uniform(k1, (1, case.heads, case.q_len, case.head_dim), dtype)
    k = jax.random.uniform(k2, (1, case.heads, case.kv_len, case.head_dim), dtype)
    v = jax.random.uniform(k3, (1, case.heads, case.kv_len, case.head_dim), dtype)
    do = jax.random.uniform(k4, q.shape, dtype)
    return q, k, v, do


@dataclasses.dataclass(frozen=True)
class Exact:
    """float64 quantities of one case, from the rounded inputs: probabilities ``p``, ``out``, ``lse``, and for
    the cotangent ``do`` the exact ``dp = do v^T`` and ``dv = p^T do``."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    p: np.ndarray
    out: np.ndarray
    lse: np.ndarray
    dp: np.ndarray
    dv: np.ndarray

    def grads(self, d_rows: np.ndarray, dp: np.ndarray | None = None):
        """``(dq, dk)`` of the flash backward ``ds = p * (dp - D)``, ``dq = ds k``, ``dk = ds^T q`` (times the
        scale), for the row statistic ``D`` given (``[..., q_len, 1]``)."""
        ds = self.p * ((self.dp if dp is None else dp) - d_rows)
        return ds @ self.k * SCALE, ds.swapaxes(-1, -2) @ self.q * SCALE

    def peer_backward(self, out) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The peer's backward reference (splash ``_attention_reference_custom_bwd``, ``custom_type="flash"``),
        in float64: exact probabilities and ``dp``, but ``D = rowsum(o * do)`` from the implementation's own
        output ``o``, as the peer passes the kernel's output into it."""
        d_rows = np.sum(np.asarray(out, np.float64) * self.do, axis=-1, keepdims=True)
        return (*self.grads(d_rows), self.dv)

    def autodiff_backward(self, cotangent) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The exact gradients for ``cotangent`` (what autodiff of the reference computes, without rounding):
        ``D = rowsum(p * dp)``."""
        g = np.asarray(cotangent, np.float64)
        dp = g @ self.v.swapaxes(-1, -2)
        return (*self.grads(np.sum(self.p * dp, axis=-1, keepdims=True), dp), self.p.swapaxes(-1, -2) @ g)


@functools.lru_cache(maxsize=1)
def exact(case: Case) -> Exact:
    """The case's float64 reference (the formulas of ``flashlib.reference``'s oracle, with BLAS matmuls so
    the 2048 x 2048 cases stay cheap)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in inputs(case))
    s = q @ k.swapaxes(-1, -2) * SCALE  # [1, h, q, kv]
    if case.causal:  # flashlib's bottom-right rule; the cases are square, where splash's top-left one agrees
        s = np.where(np.tri(case.q_len, case.kv_len, case.kv_len - case.q_len, dtype=bool), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    p /= total
    return Exact(q, k, v, do, p, out=p @ v, lse=(m + np.log(total))[..., 0], dp=do @ v.swapaxes(-1, -2),
                 dv=p.swapaxes(-1, -2) @ do)


@functools.cache
def vjp_fn(impl: str, causal: bool, blocks: Blocks):
    """jit of (q, k, v, do) -> (out, dq, dk, dv), cached so both gradient tests compile each shape once."""

    def attn(q, k, v):
        return flashlib.attention(q, k, v, causal=causal, scale=SCALE, impl=impl, **blocks.options(impl))

    def run(q, k, v, do):
        out, pullback = jax.vjp(attn, q, k, v)
        return (out, *pullback(do))

    return jax.jit(run)




@pytest.mark.parametrize(("case", "impl"), params(CASES, IMPLS, KNOWN_FAILURES))
def test_splash_attention_bwd(case, impl):
    """Peer: tpu_splash_attention_kernel_test.py, ``SplashAttentionTest.test_splash_attention_bwd`` (MHA, full
    or causal mask, no segments/soft-cap/sinks): output within atol = rtol = 3e-3 and dq, dk, dv within
    atol=2e-2, rtol=3e-2 of the reference, for both dtypes; cotangent uniform in the output dtype."""
    q, k, v, do = inputs(case)
    out, *grads = vjp_fn(impl, case.causal, case.blocks)(q, k, v, do)
    ref = exact(case)
    assert_all(impl, case.id, [allclose_failure("out", out, ref.out, **OUT_TOL)] + [
        allclose_failure(name, got, want, **GRAD_TOL)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref.peer_backward(out), strict=True)])


@pytest.mark.parametrize(("case", "impl"), params(CASES, IMPLS))
def test_splash_attention_custom_bwd(case, impl):
    """Peer: tpu_splash_attention_kernel_test.py, ``SplashAttentionTest.test_splash_attention_custom_bwd``: a
    flash-style backward against the autodiff reference with cotangent ``uniform / 10`` and the peer's
    per-dtype tolerances (atol = rtol): float32 dv 3e-3, dq and dk 0.05; bfloat16 dv 4e-3, dq and dk 0.05.
    The peer runs one head; here the case's heads (each head is an independent instance)."""
    q, k, v, do = inputs(case)
    do = (do.astype(jnp.float32) / 10.0).astype(do.dtype)
    grads = vjp_fn(impl, case.causal, case.blocks)(q, k, v, do)[1:]
    tols = CUSTOM_BWD_TOL[case.dtype]
    assert_all(impl, case.id, [
        allclose_failure(name, got, want, atol=tols[name], rtol=tols[name])
        for name, got, want in zip(("dq", "dk", "dv"), grads, exact(case).autodiff_backward(do), strict=True)])


@pytest.mark.parametrize(("case", "impl"), params(LSE_CASES, LSE_IMPLS))
def test_splash_attention_fwd(case, impl):
    """Peer: tpu_splash_attention_kernel_test.py, ``SplashAttentionTest.test_splash_attention_fwd``
    (``save_residuals=True``): output within atol = rtol = 3e-3 and the logsumexp residual within
    atol = rtol = 1e-3. Only the implementations that return the logsumexp: ``flashlib.kernels.flash_attention``
    (impl="pallas") and ``flashlib.blockwise.blockwise_attention`` (impl="blockwise"), with ``return_lse``."""
    q, k, v, _ = inputs(case)
    fn = {"pallas": flash_attention, "blockwise": blockwise_attention}[impl]
    out, lse = jax.jit(functools.partial(fn, causal=case.causal, scale=SCALE, return_lse=True,
                                         **case.blocks.options(impl)))(q, k, v)
    ref = exact(case)
    assert_all(impl, case.id, [allclose_failure("out", out, ref.out, **OUT_TOL),
                            allclose_failure("lse", lse, ref.lse, **LSE_TOL)])
