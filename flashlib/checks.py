"""Checks that notebooks and exercises call: each prints one short, machine-independent line or raises.

The attention check applies FlashAttention's correctness rule: measured against a float64 oracle, an
implementation's error may be at most twice the error of the naive implementation in the same dtype
(plus a tiny floor, so exact zeros do not make the rule impossible).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np

from flashlib.reference import attention_naive, attention_oracle, attention_vjp_oracle

__all__ = [
    "AttentionCheck",
    "CheckFailed",
    "check",
    "check_attention",
    "check_attention_and_grads",
    "check_attention_grads",
    "check_close",
    "reset_interpreter",
    "tolerance",
]

# Absolute floors per dtype: the error a single rounding of O(1) values can make.
_FLOOR = {"float32": 1e-6, "bfloat16": 1e-2, "float16": 2e-3, "float64": 1e-12}


class CheckFailed(AssertionError):
    """Raised by every checker when a result is wrong; the message says what was expected."""


def tolerance(dtype) -> float:
    """The absolute error floor used for ``dtype`` (float32 1e-6, bfloat16 1e-2)."""
    return _FLOOR[np.dtype(dtype).name]


def check(condition: bool, name: str, hint: str = "") -> None:
    """Say ``passed: name`` when ``condition`` holds, otherwise raise :class:`CheckFailed` with ``hint``."""
    if not bool(condition):
        raise CheckFailed(f"failed: {name}" + (f" — {hint}" if hint else ""))
    print(f"passed: {name}")


def check_close(actual, expected, name: str, *, atol: float | None = None, rtol: float = 0.0) -> None:
    """``max |actual - expected| <= atol + rtol * |expected|`` (atol defaults to the dtype's floor x 10)."""
    actual_np = np.asarray(actual, dtype=np.float64)
    expected_np = np.asarray(expected, dtype=np.float64)
    if actual_np.shape != expected_np.shape:
        raise CheckFailed(f"failed: {name} — shape {actual_np.shape}, expected {expected_np.shape}")
    if atol is None:
        atol = 10 * tolerance(np.asarray(actual).dtype) if np.asarray(actual).dtype.kind == "f" else 1e-6
    err = np.abs(actual_np - expected_np)
    bad = ~(err <= atol + rtol * np.abs(expected_np))  # also catches NaN
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CheckFailed(
            f"failed: {name} — {int(bad.sum())} of {bad.size} values off, first at index {where}: "
            f"got {actual_np[where]:.6g}, expected {expected_np[where]:.6g} (atol {atol:g}, rtol {rtol:g})"
        )
    print(f"passed: {name}")


@dataclass(frozen=True)
class AttentionCheck:
    """The numbers behind a passed attention check (errors are max-abs against the float64 oracle)."""

    error: float
    naive_error: float
    allowed: float

    @property
    def ratio(self) -> float:
        """``error / naive_error`` (FlashAttention's rule asks for at most 2)."""
        return self.error / max(self.naive_error, 1e-30)


def check_attention(
    out, q, k, v, *, causal: bool = False, scale: float | None = None, name: str = "attention", quiet: bool = False,
    **variants,
) -> AttentionCheck:
    """Check an attention output against the float64 oracle with FlashAttention's 2x-naive rule.

    ``variants`` (``window``, ``softcap``, ``segment_ids``, ``sinks``) go to the oracle and the naive
    implementation alike. Raises :class:`CheckFailed` naming the worst element when the output has the wrong
    shape or dtype, contains NaN/inf, or is off by more than ``2 * naive_error + floor(dtype)``.
    """
    _check_output_form(out, q, v, name)
    if variants.get("window") is not None:
        variants = {**variants, "window": tuple(variants["window"])}
    naive = _naive_output(q, k, v, causal=bool(causal), scale=scale, **variants)
    result = _output_rule(out, naive, q, k, v, causal=causal, scale=scale, name=name, variants=variants)
    if not quiet:
        print(f"passed: {name} matches the float64 oracle (within 2x the naive {np.dtype(q.dtype).name} error)")
    return result


def _check_output_form(out, q, v, name: str) -> None:
    out_np = np.asarray(out)
    want_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    if out_np.shape != want_shape:
        raise CheckFailed(f"failed: {name} — output shape {out_np.shape}, expected {want_shape} (q's, with v's "
                          "head_dim)")
    if out_np.dtype != np.dtype(q.dtype):
        raise CheckFailed(f"failed: {name} — output dtype {out_np.dtype}, expected q's dtype {np.dtype(q.dtype)}")
    if not np.isfinite(out_np.astype(np.float64)).all():
        raise CheckFailed(f"failed: {name} — output contains NaN or inf")


def _output_rule(out, naive, q, k, v, *, causal, scale, name: str, variants: dict) -> AttentionCheck:
    """FlashAttention's rule for an output whose form :func:`_check_output_form` passed, given the naive
    implementation's output at the same inputs."""
    expected = attention_oracle(q, k, v, causal=causal, scale=scale,
                                **{key: value for key, value in variants.items() if value is not None})
    naive_error = float(np.max(np.abs(np.asarray(naive, dtype=np.float64) - expected), initial=0.0))
    err = np.abs(np.asarray(out).astype(np.float64) - expected)
    error = float(np.max(err, initial=0.0))
    allowed = 2.0 * naive_error + tolerance(q.dtype)
    if error > allowed:
        where = tuple(int(i) for i in np.unravel_index(np.argmax(err), err.shape))
        raise CheckFailed(
            f"failed: {name} — max error {error:.3g} at [b, h, q, d] = {where} exceeds the allowed {allowed:.3g} "
            f"(2 x naive {np.dtype(q.dtype).name} error {naive_error:.3g} + floor {tolerance(q.dtype):g})"
        )
    return AttentionCheck(error=error, naive_error=naive_error, allowed=allowed)


# The naive implementation as one compiled program: 2-3x faster to build than its op-by-op dispatch at each new
# shape (measured on 2 cores, bf16, 1-12 tokens: 0.6-0.8 s against 1.5-2.2 s a call), the same operations.
_naive_output = jax.jit(attention_naive, static_argnames=("causal", "scale", "window", "softcap"))


@functools.partial(jax.jit, static_argnames=("causal", "scale", "window", "softcap"))
def _naive_vjp(q, k, v, do, segment_ids, sinks, causal: bool, scale: float | None, window, softcap):
    """``(out, (dq, dk, dv[, dsinks]))``: the naive implementation's output and its autodiff VJP for ``do``,
    in the inputs' dtype, as one compiled program (much faster to build than the op-by-op dispatch of an eager
    VJP; the output comes free with the VJP, so a caller checking both compiles one program, not two)."""
    fixed = dict(causal=causal, scale=scale, window=window, softcap=softcap, segment_ids=segment_ids)
    if sinks is None:
        out, vjp = jax.vjp(lambda q, k, v: attention_naive(q, k, v, **fixed), q, k, v)
    else:
        out, vjp = jax.vjp(lambda q, k, v, sinks: attention_naive(q, k, v, sinks=sinks, **fixed), q, k, v, sinks)
    return out, vjp(do)


def check_attention_grads(
    grads,
    q,
    k,
    v,
    do,
    *,
    causal: bool = False,
    scale: float | None = None,
    name: str = "attention gradients",
    quiet: bool = False,
    window=None,
    softcap: float | None = None,
    segment_ids=None,
    sinks=None,
) -> dict[str, AttentionCheck]:
    """Check ``grads = (dq, dk, dv)``, the VJP of attention at ``(q, k, v)`` for the output cotangent ``do``,
    against the float64 oracle (:func:`~flashlib.reference.attention_vjp_oracle`) with FlashAttention's rule:
    each gradient's max error at most twice that of autodiff through the naive implementation in the same
    dtype, plus a floor.

    The floor is the dtype's (:func:`tolerance`) times the largest oracle gradient (when above 1): a
    gradient that is exactly 0 in float64 (``dk`` with a single key: ``dS = P (dP - D) = 0``) is computed
    as a difference of terms as large as the other gradients, so one rounding of those is the fair floor.

    With ``sinks`` given, ``grads`` has a fourth member, ``dsinks`` (like ``sinks``).

    Raises :class:`CheckFailed` naming the gradient and its worst element when one has the wrong shape or
    dtype, contains NaN/inf, or is off by more than ``2 * naive_error + floor``. Returns the numbers per
    gradient, ``{"dq": AttentionCheck, "dk": ..., "dv": ...[, "dsinks": ...]}``.
    """
    _check_grads_count(grads, sinks, name)
    variants, (_, naive) = _naive_for(q, k, v, do, causal, scale, window, softcap, segment_ids, sinks)
    results = _grads_rule(grads, naive, q, k, v, do, causal=causal, scale=scale, name=name, variants=variants)
    if not quiet:
        dtype = np.dtype(q.dtype).name
        print(f"passed: {name} match the float64 oracle (dq, dk, dv within 2x the naive {dtype} error)")
    return results


def check_attention_and_grads(
    out,
    grads,
    q,
    k,
    v,
    do,
    *,
    causal: bool = False,
    scale: float | None = None,
    name: str = "attention",
    quiet: bool = False,
    window=None,
    softcap: float | None = None,
    segment_ids=None,
    sinks=None,
) -> dict[str, AttentionCheck]:
    """:func:`check_attention` of ``out`` and :func:`check_attention_grads` of ``grads`` together, the same two
    rules, with the naive implementation's output and gradients from one compiled program (where the two
    checks called one after the other compile two). Returns ``{"out": ..., "dq": ..., "dk": ..., "dv": ...
    [, "dsinks": ...]}``."""
    _check_output_form(out, q, v, name)
    _check_grads_count(grads, sinks, name)
    variants, (naive_out, naive_grads) = _naive_for(q, k, v, do, causal, scale, window, softcap, segment_ids, sinks)
    results = {"out": _output_rule(out, naive_out, q, k, v, causal=causal, scale=scale, name=name,
                                   variants=variants)}
    results.update(_grads_rule(grads, naive_grads, q, k, v, do, causal=causal, scale=scale,
                               name=f"{name} gradients", variants=variants))
    if not quiet:
        dtype = np.dtype(q.dtype).name
        print(f"passed: {name} and its gradients match the float64 oracle (within 2x the naive {dtype} error)")
    return results


def _naive_for(q, k, v, do, causal, scale, window, softcap, segment_ids, sinks):
    """``(variants, (naive_out, naive_grads))``: the variants as the oracle and the rules take them (``window`` a
    tuple) and :func:`_naive_vjp` at them."""
    variants = dict(window=None if window is None else tuple(window), softcap=softcap, segment_ids=segment_ids,
                    sinks=sinks)
    return variants, _naive_vjp(q, k, v, do, segment_ids, sinks, causal=bool(causal), scale=scale,
                                window=variants["window"], softcap=softcap)


def _grad_labels(sinks) -> tuple[str, ...]:
    return ("dq", "dk", "dv") if sinks is None else ("dq", "dk", "dv", "dsinks")


def _check_grads_count(grads, sinks, name: str) -> None:
    labels = _grad_labels(sinks)
    if len(grads) != len(labels):
        raise CheckFailed(f"failed: {name} — expected {len(labels)} gradients ({', '.join(labels)}), got {len(grads)}")


def _grads_rule(grads, naive, q, k, v, do, *, causal, scale, name: str, variants: dict) -> dict[str, AttentionCheck]:
    """FlashAttention's rule for each gradient, given the naive implementation's gradients at the same inputs."""
    sinks = variants.get("sinks")
    labels = _grad_labels(sinks)
    primals = (q, k, v) if sinks is None else (q, k, v, sinks)
    expected = attention_vjp_oracle(q, k, v, do, causal=causal, scale=scale,
                                    **{key: value for key, value in variants.items() if value is not None})
    naive = [np.asarray(g, dtype=np.float64) for g in naive]
    magnitude = max(1.0, *(float(np.max(np.abs(g), initial=0.0)) for g in expected))
    results = {}
    for label, got, primal, want, naive_grad in zip(labels, grads, primals, expected, naive, strict=True):
        got_np = np.asarray(got)
        if got_np.shape != tuple(primal.shape) or got_np.dtype != np.dtype(primal.dtype):
            raise CheckFailed(
                f"failed: {name} — {label} is {got_np.dtype}{list(got_np.shape)}, expected "
                f"{np.dtype(primal.dtype)}{list(primal.shape)} like {label[1:]}"
            )
        got64 = got_np.astype(np.float64)
        if not np.isfinite(got64).all():
            raise CheckFailed(f"failed: {name} — {label} contains NaN or inf")
        naive_error = float(np.max(np.abs(naive_grad - want), initial=0.0))
        err = np.abs(got64 - want)
        error = float(np.max(err, initial=0.0))
        floor = tolerance(primal.dtype) * magnitude
        allowed = 2.0 * naive_error + floor
        if error > allowed:
            where = tuple(int(i) for i in np.unravel_index(np.argmax(err), err.shape))
            raise CheckFailed(
                f"failed: {name} — {label} max error {error:.3g} at {'[h]' if label == 'dsinks' else '[b, h, seq, d]'} "
                f"= {where} exceeds the allowed "
                f"{allowed:.3g} (2 x naive {np.dtype(primal.dtype).name} error {naive_error:.3g} + floor {floor:.3g})"
            )
        results[label] = AttentionCheck(error=error, naive_error=naive_error, allowed=allowed)
    return results


def reset_interpreter() -> None:
    """Clear TPU interpret mode's simulated memory. jax 0.7.2 (Colab's) keeps it after a kernel that raised, and
    every later interpreted kernel in the process then fails ("Revisited block"); newer versions reset it."""
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415 - only when a kernel may have failed

    reset = getattr(pltpu, "reset_tpu_interpret_mode_state", None)
    if reset is not None:
        reset()

