"""The arguments every entry point shares, checked in one place: ``scale``, ``causal``, ``interpret``, the variants
(``window``, ``softcap``, ``segment_ids``, ``sinks``) and the options an implementation does not take.

:func:`flashlib.attention`, :func:`flashlib.kernels.decode_attention` (every ``impl``),
:func:`flashlib.sharded.sharded_attention` and :func:`flashlib.ring.ring_attention` all call these, so the doors
cannot drift apart: a value one refuses, every one refuses, with the same message naming the argument and the fix.

What is checked by value needs the value: ``segment_ids`` are held to int32's range and ``sinks`` refused when NaN
only where they are concrete arrays (NumPy, or JAX arrays outside ``jit``). A traced array (under ``jit``,
``vmap``, ``shard_map``) is checked by shape and dtype alone; traced int64 ids beyond int32's range wrap when
they are cast, so renumber them before tracing.

A ground module: it imports nothing from flashlib above :mod:`flashlib.masks`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashlib.masks import check_softcap, check_window

__all__ = ["INT32_RANGE", "check_causal", "check_interpret", "check_options", "check_scale", "check_segment_ids",
           "check_shared", "check_sinks", "check_window_and_softcap", "given_options", "is_concrete"]

INT32_RANGE = (int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max))


def is_concrete(x: Any) -> bool:
    """True where ``x``'s values can be read now (not a tracer under ``jit``, ``vmap``, ``grad``, ``shard_map``)."""
    return not isinstance(x, jax.core.Tracer)


def check_scale(scale: Any) -> float | None:
    """``scale`` as a float (``None`` stays ``None``: ``1/sqrt(head_dim)``): a real, positive, finite number —
    a Python or NumPy int or float, not a bool, not an array."""
    if scale is None:
        return None
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise ValueError(f"scale must be a positive finite number or None (1/sqrt(head_dim)), got {scale!r} "
                         f"({type(scale).__name__}); e.g. scale=0.125")
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number or None (1/sqrt(head_dim)), got {scale!r}")
    return float(scale)


def check_causal(causal: Any) -> bool:
    """``causal`` as a bool: ``True``/``False`` (or a NumPy bool), nothing else — ``"False"`` is a non-empty string,
    which Python would call true."""
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be True or False, got {causal!r} ({type(causal).__name__}); "
                         "e.g. causal=True for a decoder's self-attention")
    return bool(causal)


def check_interpret(interpret: Any) -> Any:
    """``interpret`` as given: None (automatic), True, False or a ``pltpu.InterpretParams``."""
    from jax.experimental.pallas import tpu as pltpu  # only where a caller passes interpret at all

    if interpret is None or isinstance(interpret, (bool, np.bool_, pltpu.InterpretParams)):
        return bool(interpret) if isinstance(interpret, np.bool_) else interpret
    raise ValueError(f"interpret must be None (automatic), True, False or a pltpu.InterpretParams, got {interpret!r}")


def check_options(impl: str, given: Iterable[str], accepted: Iterable[str]) -> None:
    """A ``ValueError`` if ``impl`` was given options it does not take (they would be ignored silently)."""
    accepted = tuple(accepted)
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise ValueError(f"impl={impl!r} does not accept option(s) {', '.join(unknown)}; it accepts: "
                         f"{', '.join(accepted) or 'none'}")


def check_window_and_softcap(window: Any = None, softcap: Any = None) -> dict[str, Any]:
    """``{"window": (left, right), "softcap": c}`` for those that were set (:mod:`flashlib.masks`' checks)."""
    given: dict[str, Any] = {}
    if window is not None:
        given["window"] = check_window(window)
    if softcap is not None:
        given["softcap"] = check_softcap(softcap)
    return given


def _int32_ids(name: str, ids: Any) -> jax.Array:
    """``ids`` cast to int32, refused first where a concrete id lies outside int32's range (the cast would wrap it
    onto another segment's id)."""
    if np.dtype(ids.dtype).kind not in "iu":
        raise ValueError(f"segment_ids' {name} must hold integers, got dtype {np.dtype(ids.dtype).name}")
    if is_concrete(ids) and np.dtype(ids.dtype).itemsize * 8 >= 32 and np.size(ids):
        values = np.asarray(ids)
        low, high = INT32_RANGE
        if values.min() < low or values.max() > high:
            raise ValueError(f"segment_ids' {name} hold ids from {values.min()} to {values.max()}, outside int32's "
                             f"range [{low}, {high}] (the kernels' ids are int32: they would wrap onto other ids); "
                             "renumber the segments into int32's range, e.g. with np.unique(ids, return_inverse=True)")
    return jnp.asarray(ids, jnp.int32)


def check_segment_ids(segment_ids: Any, *, batch: int, q_len: int, kv_len: int) -> tuple[jax.Array, jax.Array]:
    """``(q_segments [batch, q_len], kv_segments [batch, kv_len])`` as int32 arrays, checked by shape, dtype and
    (concrete ids) range."""
    if not (isinstance(segment_ids, (tuple, list)) and len(segment_ids) == 2):
        raise ValueError("segment_ids must be a pair (q_segments [batch, q_len], kv_segments [batch, kv_len]) "
                         f"of int arrays, got {type(segment_ids).__name__}")
    pair = []
    for name, ids, axis, length in (("q_segments", segment_ids[0], "q_len", q_len),
                                    ("kv_segments", segment_ids[1], "kv_len", kv_len)):
        if not hasattr(ids, "shape") or tuple(ids.shape) != (batch, length):
            got = tuple(ids.shape) if hasattr(ids, "shape") else type(ids).__name__
            raise ValueError(f"segment_ids' {name} must have shape [batch, {axis}] = {(batch, length)}, got {got}")
        pair.append(_int32_ids(name, ids))
    return pair[0], pair[1]


def check_sinks(sinks: Any, *, heads: int) -> jax.Array:
    """``sinks`` as an array of ``heads`` floats, none NaN or +inf where concrete (``-inf`` is allowed: a sink no
    row puts weight on)."""
    if not hasattr(sinks, "shape") or tuple(sinks.shape) != (heads,):
        got = tuple(sinks.shape) if hasattr(sinks, "shape") else type(sinks).__name__
        raise ValueError(f"sinks must be an array of one logit per query head, shape ({heads},), got {got}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):  # bfloat16's NumPy kind is "V", not "f"
        raise ValueError(f"sinks must be floating point, got dtype {np.dtype(sinks.dtype).name}")
    if is_concrete(sinks):
        values = np.asarray(sinks, np.float32)
        if np.isnan(values).any() or np.isposinf(values).any():
            raise ValueError(f"sinks must be finite logits (or -inf: no sink), got {values.tolist()}; a NaN or +inf "
                             "sink makes every output row NaN: replace it, e.g. with 0.0")
    return jnp.asarray(sinks)


def check_shared(*, causal: Any = False, scale: Any = None, interpret: Any = None) -> tuple[bool, float | None, Any]:
    """``(causal, scale, interpret)`` checked, as every entry point takes them."""
    return check_causal(causal), check_scale(scale), check_interpret(interpret)


def given_options(options: Mapping[str, Any]) -> list[str]:
    """The names of ``options`` that were set (not None)."""
    return [name for name, value in options.items() if value is not None]
