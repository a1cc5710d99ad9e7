"""The peers' error rules, written for flashlib: what "correct" means in FlashAttention's and JAX's own tests.

FlashAttention (``Dao-AILab/flash-attention``, ``tests/test_flash_attn.py``) does not compare a kernel with
a fixed tolerance. It measures three things on the same inputs: the kernel, an *upcast* reference (every
input cast to f32, ``attention_ref(..., upcast=True)``) and a *naive same-dtype* implementation
(``attention_ref(..., upcast=False, reorder_ops=True)``: PyTorch ops in the input dtype, so every
intermediate — the scores, the probabilities, the output and each gradient — is rounded to that dtype), and
asserts ``max|kernel - ref| <= mult * max|naive - ref| + atol``: a kernel may be at most ``mult`` times as
wrong as the obvious implementation in the same precision. Here the reference is flashlib's float64 oracle
(stricter than f32) and :func:`naive_same_dtype` is ``attention_ref(upcast=False, reorder_ops=True)``
transcribed to JAX: each op computes in f32 (as a GPU's f32 accumulators do) and rounds its result to the
input dtype; its gradients round at the same places, by ``jax.vjp``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import flashlib
from flashlib.masks import element_visible, segments_visible
from flashlib.reference import attention_oracle, attention_vjp_oracle, default_scale

NAMES = ("out", "dq", "dk", "dv")
# With sinks= the gradients have a fourth: the sinks' (one per query head).
NAMES_WITH_SINKS = (*NAMES, "dsinks")
# Every implementation behind flashlib.attention that the peers' cases run against. "pallas" runs in
# interpret mode on the CPU.
IMPLS = ("reference", "blockwise", "pallas", "xla")


def naive_same_dtype(q, k, v, *, causal: bool = False, scale: float | None = None, window=None,
                     softcap: float | None = None, segment_ids=None, sinks=None) -> jax.Array:
    """FlashAttention's ``attention_ref(q, k, v, causal=causal, upcast=False, reorder_ops=True)`` in the
    flashlib layout ``[b, h, s, d]``: the scale on k (reorder_ops), scores, softmax and output each rounded
    to the input dtype. A row that sees no key gives zeros, as in FlashAttention's reference.

    The variants round where the peer's references round them. GQA/MQA: k and v (fewer heads, v with a
    head_dim of its own) are repeated to q's heads in the input dtype (``repeat(k, "b s h d -> b s (h g) d")``),
    so a group's dk and dv are rounded per query head and once more when the group is summed. ``softcap``:
    ``scores / c``, ``tanh`` and ``* c`` each rounded. ``window`` and ``segment_ids`` mask the scores (-inf).
    ``sinks`` (FlashAttention's ``learnable_sink``, tests/cute): the softmax runs in f32 on the rounded
    scores with the sink logit in its denominator, then the probabilities are rounded."""
    dtype = q.dtype
    scale = default_scale(q.shape[-1]) if scale is None else scale

    def rounded(x):
        return x.astype(dtype)

    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    k_scaled = rounded(k.astype(jnp.float32) * scale)
    scores = rounded(jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k_scaled.astype(jnp.float32)))
    if softcap is not None:
        scores = rounded(jnp.tanh(rounded(scores.astype(jnp.float32) / softcap)).astype(jnp.float32))
        scores = rounded(scores.astype(jnp.float32) * softcap)
    scores = scores.astype(jnp.float32)
    visible = None
    if causal or window is not None:
        rows, cols = jnp.arange(q.shape[2])[:, None], jnp.arange(k.shape[2])[None, :]
        visible = jnp.broadcast_to(element_visible(rows, cols, q_len=q.shape[2], kv_len=k.shape[2], causal=causal,
                                                   window=window), (q.shape[2], k.shape[2]))[None, None]
    if segment_ids is not None:
        same = segments_visible(jnp.asarray(segment_ids[0]), jnp.asarray(segment_ids[1]))[:, None]  # [b, 1, q, k]
        visible = same if visible is None else visible & same
    if sinks is not None:
        sink = sinks.astype(jnp.float32)[None, :, None, None]  # [1, h, 1, 1]
        if visible is not None:
            scores = jnp.where(visible, scores, -jnp.inf)
        top = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink))
        e = jnp.exp(scores - top)
        probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))
    elif visible is not None:
        scores = jnp.where(visible, scores, -jnp.inf)
        sees_a_key = jnp.any(visible, axis=-1, keepdims=True)
        probs = jnp.where(sees_a_key, jax.nn.softmax(jnp.where(sees_a_key, scores, 0.0), axis=-1), 0.0)
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    probs = rounded(probs)
    return rounded(jnp.einsum("bhqk,bhkd->bhqd", probs.astype(jnp.float32), v.astype(jnp.float32)))


@functools.cache
def _normal_draw(size: int):
    """``key -> jax.random.normal(key, (size,), float32)``, compiled once per size."""
    return jax.jit(lambda key: jax.random.normal(key, (size,), jnp.float32))


def standard_normal(key, shape: tuple[int, ...]) -> np.ndarray:
    """``jax.random.normal(key, shape, float32)``, bit for bit, as NumPy, without a compile per shape: with
    ``jax_threefry_partitionable`` (the default since jax 0.5; both environments) element ``i``'s bits depend on
    ``i`` alone, so the draw is the first elements of a draw whose size is the next power of two (one compiled
    program per size class; op by op each new shape compiled its own, ~0.3 s a draw, a third of a search example)."""
    if not jax.config.jax_threefry_partitionable:
        return np.asarray(jax.random.normal(key, shape, jnp.float32))
    n = math.prod(shape)
    return np.asarray(_normal_draw(1 << max(n - 1, 0).bit_length())(key))[:n].reshape(shape)


def normal_as(key, shape: tuple[int, ...], dtype, scale: float = 1.0) -> jax.Array:
    """``(scale * jax.random.normal(key, shape, float32)).astype(dtype)``, the same bits (NumPy's float32 product
    and round-to-nearest-even cast are jax's), from :func:`standard_normal`."""
    return jnp.asarray((np.float32(scale) * standard_normal(key, shape)).astype(jnp.dtype(dtype)))


def random_inputs(key, *, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, dtype,
                  q_scale: float = 1.0, kv_scale: float = 1.0, layout: str = "bhsd"):
    """q, k, v, dO drawn N(0, 1) (q times ``q_scale``, k and v times ``kv_scale``), rounded to ``dtype``: the
    bits of ``(q_scale * jax.random.normal(kq, shape, float32)).astype(dtype)`` and so on (:func:`normal_as`)."""
    kq, kk, kv, kd = jax.random.split(key, 4)

    def shape(seq):
        return (batch, heads, seq, head_dim) if layout == "bhsd" else (batch, seq, heads, head_dim)

    q = normal_as(kq, shape(q_len), dtype, q_scale)
    k = normal_as(kk, shape(kv_len), dtype, kv_scale)
    v = normal_as(kv, shape(kv_len), dtype, kv_scale)
    do = normal_as(kd, shape(q_len), dtype)
    return q, k, v, do


def output_and_grads(fn, *primals_and_do) -> tuple[jax.Array, ...]:
    """``(out, *grads)`` of ``fn(*primals)`` with cotangent ``do``, the last argument, from one ``jax.vjp``:
    ``(out, dq, dk, dv)`` of ``fn(q, k, v)``, and ``dsinks`` too of ``fn(q, k, v, sinks)``. Under
    ``jax.jit(output_and_grads, static_argnums=0)`` the forward and the VJP are one compiled program."""
    *primals, do = primals_and_do
    out, vjp = jax.vjp(fn, *primals)
    return (out, *vjp(do))


def max_errors(values, oracle) -> dict[str, float]:
    """``{name: max |value - oracle|}`` for out, dq, dk, dv (and dsinks, when given; NaN if a value is not
    finite)."""
    errors = {}
    for name, value, exact in zip(NAMES_WITH_SINKS, values, oracle, strict=False):
        value = np.asarray(value, np.float64)
        errors[name] = float(np.max(np.abs(value - exact))) if np.all(np.isfinite(value)) else float("nan")
    return errors


@dataclasses.dataclass(frozen=True)
class Rule:
    """``error(impl) <= mult * error(naive same-dtype) + atol``, per quantity (FlashAttention's form)."""

    mult_out: float = 2.0
    mult_grad: float = 2.0
    atol_out: float = 0.0
    atol_grad: float = 0.0

    def bound(self, name: str, naive_error: float) -> float:
        mult, atol = (self.mult_out, self.atol_out) if name == "out" else (self.mult_grad, self.atol_grad)
        return mult * naive_error + atol


@dataclasses.dataclass
class Comparison:
    """The errors of one implementation and of the naive same-dtype one, against the float64 oracle."""

    impl: str
    errors: dict[str, float]
    naive_errors: dict[str, float]

    def check(self, rule: Rule, names: tuple[str, ...] = NAMES) -> None:
        """Assert the rule for every quantity in ``names``, with every number in the message."""
        failures = []
        for name in names:
            bound = rule.bound(name, self.naive_errors[name])
            if not self.errors[name] <= bound:  # NaN fails too
                failures.append(f"{name}: error {self.errors[name]:.3g} > bound {bound:.3g} "
                                f"(naive same-dtype error {self.naive_errors[name]:.3g})")
        assert not failures, f"impl={self.impl!r} breaks the peer's rule: " + "; ".join(failures)


def compare(impl: str, q, k, v, do, *, causal: bool = False, scale: float | None = None,
            with_grads: bool = True, jit: bool = True, **options) -> Comparison:
    """Run ``impl`` (and the naive same-dtype implementation) on ``[b, h, s, d]`` inputs; errors of the
    output (and gradients) against the float64 oracle. ``jit``: under ``jax.jit``, as models run it."""

    def fn(q, k, v):
        return flashlib.attention(q, k, v, causal=causal, scale=scale, impl=impl, **options)

    def naive(q, k, v):
        return naive_same_dtype(q, k, v, causal=causal, scale=scale)

    oracle = [attention_oracle(q, k, v, causal=causal, scale=scale)]
    if with_grads:
        oracle += list(attention_vjp_oracle(q, k, v, do, causal=causal, scale=scale))

        def run(f):
            g = jax.jit(output_and_grads, static_argnums=0) if jit else output_and_grads
            return g(f, q, k, v, do)
    else:
        def run(f):
            return ((jax.jit(f) if jit else f)(q, k, v),)
    return Comparison(impl, max_errors(run(fn), oracle), max_errors(run(naive), oracle))


def allclose_failure(name: str, actual, desired, *, atol: float, rtol: float) -> str | None:
    """``np.testing.assert_allclose``'s rule ``|actual - desired| <= atol + rtol * |desired|`` (JAX's peers'
    form); a line with the numbers where it fails (a non-finite value fails), None where it holds."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    error = np.abs(actual - desired)
    excess = np.where(np.isfinite(actual), error - (atol + rtol * np.abs(desired)), np.inf)
    if np.max(excess) <= 0:
        return None
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    return (f"{name}: max |err| {np.max(error):.3g}; worst element err {error[worst]:.3g} > "
            f"atol {atol:g} + rtol {rtol:g} * |ref| {abs(desired[worst]):.3g}; "
            f"{int(np.sum(excess > 0))} of {excess.size} elements out")


def assert_all(impl: str, case_id: str, failures) -> None:
    """Assert that every line in ``failures`` is None (the :func:`allclose_failure` of each quantity), all
    failing lines in one message."""
    failures = [f for f in failures if f]
    assert not failures, f"impl={impl!r} {case_id}: " + "; ".join(failures)


def rounding_atol(oracle, dtype) -> float:
    """FlashAttention's tests/cute atol, ``2 * max|(ref + 0.3 - 0.3) - ref|`` with ``ref`` in the input dtype:
    twice the rounding error of one add at the reference's magnitude (the peer's ``ref`` is rounded to the
    input dtype, and so is each op on it)."""
    ref = np.asarray(oracle, np.float32).astype(dtype).astype(np.float32)  # NumPy (ml_dtypes): no compile
    shifted = (ref + np.float32(0.3)).astype(dtype).astype(np.float32)  # each op in f32, rounded to the dtype
    back = (shifted - np.float32(0.3)).astype(dtype).astype(np.float32)
    return float(2 * np.max(np.abs(back - ref)))


def dsinks_failure(dsinks, oracle, naive_error: float, *, mult: float, atol: float, dtype) -> str | None:
    """FlashAttention's tests/cute ``check_dsink_vs_ref``, per sink: ``|dsink - ref| <= mult * max|naive - ref|
    + 2 ulp(ref) + atol``, the ulp in the input dtype; a line with the numbers where it fails, else None."""
    got, want = np.asarray(dsinks, np.float64), np.asarray(oracle, np.float64)
    info = jnp.finfo(dtype)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), float(info.tiny)))) - info.nmant)
    bound = mult * naive_error + 2 * ulp + atol
    error = np.abs(got - want)
    if np.all(error <= bound):  # NaN fails
        return None
    worst = int(np.argmax(np.where(np.isfinite(error), error - bound, np.inf)))
    return (f"dsinks: head {worst} error {error[worst]:.3g} > bound {bound[worst]:.3g} (naive same-dtype max error "
            f"{naive_error:.3g}, mult {mult:g}, atol {atol:.3g})")
