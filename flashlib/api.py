"""The contract every implementation shares, the registry behind ``impl=``, and ``attention()`` itself.

``q [batch, heads, q_len, head_dim]``, ``k [batch, kv_heads, kv_len, head_dim]``, ``v [batch, kv_heads, kv_len,
v_head_dim]`` → ``out [batch, heads, q_len, v_head_dim]``; ``kv_heads`` divides ``heads`` (GQA/MQA) and the
variants (window, softcap, segment ids, sinks) have the one meaning :mod:`flashlib.masks` gives them. An
implementation declares which variants it supports (``features``); asking one for a variant it lacks is a
``ValueError`` naming the implementations that have it.
Validation happens once, here, so an implementation can assume well-formed input and a reader gets a
message naming the argument and the fix instead of a stack trace from deep inside a kernel.

The layout is handled here too, once: ``layout="bshd"`` takes ``[batch, seq, heads, head_dim]`` arrays (the
layout of FlashAttention and ``jax.nn.dot_product_attention``), and every implementation still sees
``"bhsd"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashlib import env
from flashlib.arguments import (
    check_causal,
    check_options,
    check_scale,
    check_segment_ids,
    check_sinks,
    check_window_and_softcap,
)
from flashlib.masks import FEATURES

__all__ = [
    "LAYOUTS",
    "SUPPORTED_DTYPES",
    "AttentionShape",
    "Implementation",
    "attention",
    "check_positive_ints",
    "get_implementation",
    "implementations",
    "register",
    "validate_inputs",
    "validate_variants",
]

SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
# The axis order of q, k, v and out, by name: "bhsd" is the contract's own (every implementation sees it),
# "bshd" is FlashAttention's and jax.nn.dot_product_attention's.
LAYOUTS: dict[str, str] = {"bhsd": "[batch, heads, seq, head_dim]", "bshd": "[batch, seq, heads, head_dim]"}
_SWAP_SEQ_AND_HEADS = (0, 2, 1, 3)  # bshd <-> bhsd (its own inverse)
# resolve_options(shape, causal=..., scale=..., options=...) -> the options fn receives, checked and resolved
OptionResolver = Callable[..., Mapping[str, Any]]


@dataclass(frozen=True)
class AttentionShape:
    """The validated sizes of one attention call."""

    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    kv_heads: int | None = None  # None: the same as heads
    v_head_dim: int | None = None  # None: the same as head_dim

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    @property
    def group(self) -> int:
        """Query heads per kv head (1 for multi-head attention, ``heads`` for multi-query attention)."""
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class Implementation:
    """One registered stage of the series.

    ``fn(q, k, v, *, causal, scale, **options)`` computes attention; ``options`` names the extra keyword
    options a caller may pass; ``resolve_options`` (if any) checks their values against the validated shape
    and returns what ``fn`` receives instead (defaults filled in, resolved once, before ``fn`` is traced);
    ``native_on`` lists the backends where it is a compiled, first-class choice, and ``auto_priority``
    orders those candidates for ``impl="auto"``; ``features`` names the variants of :data:`~flashlib.masks.FEATURES`
    it supports (``fn`` then accepts ``window=``, ``softcap=``, ``segment_ids=``, ``sinks=`` as keywords, and
    receives only those a caller set).
    """

    name: str
    fn: Callable[..., jax.Array]
    description: str
    options: tuple[str, ...] = ()
    resolve_options: OptionResolver | None = None
    native_on: tuple[str, ...] = ()
    auto_priority: int = 0
    features: frozenset[str] = frozenset()


_REGISTRY: dict[str, Implementation] = {}


def register(
    name: str,
    *,
    description: str,
    options: tuple[str, ...] = (),
    resolve_options: OptionResolver | None = None,
    native_on: tuple[str, ...] = (),
    auto_priority: int = 0,
    features: tuple[str, ...] = (),
) -> Callable[[Callable[..., jax.Array]], Callable[..., jax.Array]]:
    """Decorator: register ``fn`` as ``impl=name``. Re-registering a name replaces it (handy in notebooks)."""
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; the variants are {', '.join(FEATURES)}")

    def decorate(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
        _REGISTRY[name] = Implementation(
            name=name,
            fn=fn,
            description=description,
            options=tuple(options),
            resolve_options=resolve_options,
            native_on=tuple(native_on),
            auto_priority=auto_priority,
            features=frozenset(features),
        )
        return fn

    return decorate


def implementations() -> dict[str, str]:
    """``{name: one-line description}`` of every registered implementation, in registration order."""
    return {name: impl.description for name, impl in _REGISTRY.items()}


def get_implementation(impl: str = "auto", features: frozenset[str] | set[str] = frozenset()) -> Implementation:
    """Resolve a name (or ``"auto"``: the best native implementation for the current backend that supports
    every variant in ``features``; with none native, the best registered one that does)."""
    if impl == "auto":
        here = env.backend()
        able = [i for i in _REGISTRY.values() if set(features) <= i.features]
        native = [i for i in able if here in i.native_on]
        if not native and not features:
            raise RuntimeError(f"no implementation is registered as native on backend {here!r}")
        if not (native or able):
            raise ValueError(f"no implementation supports {_describe(features)} together")
        return max(native or able, key=lambda i: i.auto_priority)
    if impl not in _REGISTRY:
        valid = ", ".join(repr(n) for n in ["auto", *_REGISTRY])
        raise ValueError(f"impl={impl!r} is not a registered implementation; choose one of {valid}")
    chosen = _REGISTRY[impl]
    missing = set(features) - chosen.features
    if missing:
        able = [repr(i.name) for i in _REGISTRY.values() if set(features) <= i.features]
        raise ValueError(
            f"impl={impl!r} does not support {_describe(missing)} (yet); "
            + (f"use impl={' or '.join(able)}" if able else "no implementation supports this combination")
        )
    return chosen


def _describe(features) -> str:
    return " or ".join(FEATURES[f] for f in sorted(features))


def check_layout(layout: Any) -> str:
    """``layout`` if it names one of :data:`LAYOUTS`, else a ``ValueError`` listing them."""
    if not (isinstance(layout, str) and layout in LAYOUTS):
        valid = ", ".join(f"{name!r} {axes}" for name, axes in LAYOUTS.items())
        raise ValueError(f"layout={layout!r} is not a layout flashlib knows; choose one of {valid}")
    return layout


def validate_inputs(q: Any, k: Any, v: Any, *, scale: float | None = None, layout: str = "bhsd") -> AttentionShape:
    """Check ``q, k, v`` (in ``layout``) against the contract; raise ``ValueError`` naming the argument and
    the fix. The sizes returned are by name, whatever the layout."""
    axes = LAYOUTS[check_layout(layout)]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
        if len(x.shape) != 4:
            raise ValueError(
                f"{name} must have rank 4 {axes}{'' if layout == 'bhsd' else f' (layout={layout!r})'}, "
                f"got shape {tuple(x.shape)}; "
                f"add the missing axes, e.g. {name}[None, None] for a single [seq, head_dim] matrix"
            )
        dtype = np.dtype(x.dtype).name
        if dtype not in SUPPORTED_DTYPES:
            fix = "cast to bfloat16 (TPUs have no float16 matmul path)" if dtype == "float16" else "cast to float32"
            raise ValueError(f"{name} has dtype {dtype}; supported dtypes are {', '.join(SUPPORTED_DTYPES)}: {fix}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k and v must share one dtype, got q {np.dtype(q.dtype).name}, k {np.dtype(k.dtype).name}, "
            f"v {np.dtype(v.dtype).name}; cast them to the same dtype"
        )
    order = (0, 1, 2, 3) if layout == "bhsd" else _SWAP_SEQ_AND_HEADS  # the user's axes in [b, h, s, d] order
    (b, h, q_len, d), (bk, hk, kv_len, dk), (bv, hv, v_len, dv) = (tuple(x.shape[i] for i in order) for x in (q, k, v))
    heads_axis, seq_axis = (1, 2) if layout == "bhsd" else (2, 1)
    for name, size, axis in (("batch", b, 0), ("heads of q", h, heads_axis), ("heads of k", hk, heads_axis),
                             ("heads of v", hv, heads_axis)):
        if size < 1:
            raise ValueError(f"empty input: {name} (axis {axis}) is {size}; every size must be >= 1 (skip the call "
                             "for an empty batch)")
    if not b == bk == bv:
        raise ValueError(f"q, k and v must have the same number of batch (axis 0), got q {b}, k {bk}, v {bv}")
    bshd_hint = f"; if your arrays are {LAYOUTS['bshd']}, pass layout='bshd'" if layout == "bhsd" else ""
    if hk != hv:
        raise ValueError(f"k and v must have the same number of heads (axis {heads_axis}), got k {hk}, v {hv}"
                         + bshd_hint)
    if hk < 1 or h % hk:
        raise ValueError(
            f"k and v's heads (axis {heads_axis}) must divide q's for grouped-query attention, got q {h}, k and v "
            f"{hk}; query head i reads kv head i // (q heads / kv heads)" + bshd_hint)
    if kv_len != v_len:
        raise ValueError(f"k and v must have the same sequence length (axis {seq_axis}), got k {kv_len}, v {v_len}")
    if d != dk:
        raise ValueError(f"q and k must have the same head_dim (axis 3), got q {d}, k {dk} (v's may differ)")
    if min(q_len, kv_len, d, dv) < 1:
        raise ValueError(f"empty input: q_len {q_len}, kv_len {kv_len}, head_dim {d}, v head_dim {dv}; "
                         "every size must be >= 1")
    check_scale(scale)
    return AttentionShape(b, h, q_len, kv_len, d, np.dtype(q.dtype).name, kv_heads=hk, v_head_dim=dv)


def validate_variants(
    shape: AttentionShape,
    *,
    window: Any = None,
    softcap: Any = None,
    segment_ids: Any = None,
    sinks: Any = None,
) -> tuple[dict[str, Any], frozenset[str]]:
    """Check the variant options against ``shape``; return ``(options to pass, features the call uses)``.

    Only options that were set are returned (``None`` means "not used"), checked and normalised: ``window``
    as a ``(left, right)`` tuple, ``softcap`` a float, ``segment_ids`` a pair of int32 arrays, ``sinks`` an
    array of ``heads`` floats.
    """
    given = check_window_and_softcap(window, softcap)
    if segment_ids is not None:
        given["segment_ids"] = check_segment_ids(segment_ids, batch=shape.batch, q_len=shape.q_len,
                                                 kv_len=shape.kv_len)
    if sinks is not None:
        given["sinks"] = check_sinks(sinks, heads=shape.heads)
    used = set(given)
    if shape.kv_heads != shape.heads:
        used.add("gqa")
    if shape.v_head_dim != shape.head_dim:
        used.add("value_head_dim")
    return given, frozenset(used)


def check_positive_ints(shape: AttentionShape, *, causal: bool, scale: float | None,
                        options: Mapping[str, Any]) -> Mapping[str, Any]:
    """Option resolver for integer block sizes: every given option must be a positive int; returned as given."""
    del shape, causal, scale
    for name, value in options.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}; e.g. {name}=128")
    return options


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    sinks: jax.Array | None = None,
    layout: str = "bhsd",
    impl: str = "auto",
    **options: Any,
) -> jax.Array:
    """Softmax attention ``softmax(q k^T * scale [+ causal mask]) v``, by the implementation you choose.

    Args:
      q: queries ``[batch, heads, q_len, head_dim]``, float32 or bfloat16.
      k, v: keys ``[batch, kv_heads, kv_len, head_dim]`` and values ``[batch, kv_heads, kv_len, v_head_dim]``,
        same dtype; ``kv_len`` may differ from ``q_len``, ``kv_heads`` must divide ``heads`` (query head ``h``
        reads kv head ``h // (heads // kv_heads)``: grouped-query attention, multi-query with one kv head).
      causal: mask future keys. With ``q_len != kv_len`` the mask is bottom-right aligned: query ``i``
        sees keys ``j <= i + kv_len - q_len`` (the KV-cache convention of FlashAttention >= 2.1). A query
        that sees no key at all gets an output row of zeros.
      scale: multiplies the scores; default ``1 / sqrt(head_dim)``.
      window: ``(left, right)``: query ``i`` sees keys ``i + offset - left <= j <= i + offset + right`` with
        ``offset = kv_len - q_len`` (``None`` on a side: unbounded). See :mod:`flashlib.masks`.
      softcap: scores become ``softcap * tanh(s / softcap)`` before the softmax.
      segment_ids: ``(q_segments [batch, q_len], kv_segments [batch, kv_len])`` int arrays; queries see only
        keys of their own segment (packed sequences).
      sinks: ``[heads]`` logits that join each row's softmax denominator and carry no value.
      layout: the axis order of ``q``, ``k``, ``v`` and the output: ``"bhsd"`` (the default, as above) or
        ``"bshd"`` — ``[batch, seq, heads, head_dim]``, FlashAttention's and ``jax.nn.dot_product_attention``'s.
        Passing bshd arrays without it computes attention over the wrong axis (or fails on the head count).
      impl: a name from :func:`implementations` or ``"auto"`` (the best native one for this backend).
      **options: implementation-specific, e.g. ``block_q=``/``block_k=`` for ``"blockwise"``.

    Returns:
      ``out`` with ``q``'s dtype, ``[batch, heads, q_len, v_head_dim]`` (in ``layout``).
    """
    causal = check_causal(causal)
    shape = validate_inputs(q, k, v, scale=scale, layout=layout)
    scale = check_scale(scale)
    variants, features = validate_variants(shape, window=window, softcap=softcap, segment_ids=segment_ids,
                                           sinks=sinks)
    chosen = get_implementation(impl, features)
    check_options(chosen.name, options, chosen.options)
    if chosen.resolve_options is not None:
        options = chosen.resolve_options(shape, causal=causal, scale=scale, options=options)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if layout == "bshd":
        q, k, v = (x.transpose(_SWAP_SEQ_AND_HEADS) for x in (q, k, v))
    out = chosen.fn(q, k, v, causal=causal, scale=scale, **variants, **options)  # [b, h, q_len, dv]
    return out.transpose(_SWAP_SEQ_AND_HEADS) if layout == "bshd" else out
