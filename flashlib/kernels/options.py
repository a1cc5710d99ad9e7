"""``impl="pallas"``'s options — ``block_sizes`` and ``interpret`` — checked and resolved once per call.

:func:`resolve_options` is the hook :func:`flashlib.attention` calls with the shape it has already
validated: it picks the default block sizes (with the call's causality, so the tuned table's causal entry),
or clamps and checks the ones given, resolves the scale and the interpret mode, and hands the kernels a
:class:`ResolvedCall` they trust as is. Calling the kernels directly (``flashlib.kernels.flash_attention``
and friends) goes through :func:`resolve_call`, which validates the arrays first: either way, once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

from flashlib import env
from flashlib.api import AttentionShape, validate_inputs
from flashlib.arguments import check_causal, check_interpret
from flashlib.kernels.block_sizes import BlockSizes
from flashlib.reference import default_scale

__all__ = ["ResolvedCall", "resolve_block_sizes", "resolve_call", "resolve_options"]


class ResolvedCall(NamedTuple):
    """What a kernel call runs with, checked before anything is traced."""

    shape: AttentionShape
    sizes: BlockSizes
    scale: float
    interpret: Any  # bool | pltpu.InterpretParams


def resolve_block_sizes(shape: AttentionShape, block_sizes: BlockSizes | None, causal: bool = False) -> BlockSizes:
    """The block sizes the kernel will run for ``shape``: the default, or ``block_sizes`` clamped to the
    sequence lengths (:meth:`BlockSizes.fit`), checked against the dtype's tiling rule and the VMEM budget."""
    if block_sizes is None:
        return BlockSizes.default(shape.q_len, shape.kv_len, shape.head_dim, shape.dtype, causal=causal)
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(
            f"block_sizes must be a flashlib.kernels.BlockSizes or None, got {type(block_sizes).__name__}; "
            "e.g. block_sizes=BlockSizes(block_q=256, block_k=512)"
        )
    fitted = block_sizes.fit(shape.q_len, shape.kv_len, shape.dtype)
    fitted.validate(shape.dtype, shape.head_dim)
    return fitted


def _check_interpret(interpret: Any) -> Any:
    interpret = check_interpret(interpret)  # the one check every entry point shares
    return env.interpret_default() if interpret is None else interpret


def _resolve(shape: AttentionShape, *, causal: bool, scale: float | None, block_sizes: BlockSizes | None,
             interpret: Any, backward: bool) -> ResolvedCall:
    sizes = resolve_block_sizes(shape, block_sizes, causal)
    interpret = _check_interpret(interpret)
    if backward:
        sizes = sizes.for_backward(shape.q_len, shape.kv_len, shape.head_dim, shape.dtype)
    scale = default_scale(shape.head_dim) if scale is None else float(scale)
    return ResolvedCall(shape, sizes, scale, interpret)


def resolve_call(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, scale: float | None,
                 block_sizes: BlockSizes | None, interpret: Any, backward: bool = False) -> ResolvedCall:
    """Validate ``q, k, v`` and resolve a direct kernel call's options: the block sizes
    (:func:`resolve_block_sizes`, and with ``backward`` their backward fields, :meth:`BlockSizes.for_backward`),
    the scale (None: 1/sqrt(d)) and the interpret mode (None: :func:`flashlib.env.interpret_default`)."""
    shape = validate_inputs(q, k, v, scale=scale)
    return _resolve(shape, causal=check_causal(causal), scale=scale, block_sizes=block_sizes, interpret=interpret,
                    backward=backward)


def resolve_options(shape: AttentionShape, *, causal: bool, scale: float | None,
                    options: Mapping[str, Any]) -> dict[str, Any]:
    """The registry's hook: ``{"call": ResolvedCall}`` for a shape :func:`flashlib.attention` validated, the
    backward fields resolved too (so a bad backward block is refused before anything is traced)."""
    call = _resolve(shape, causal=causal, scale=scale, block_sizes=options.get("block_sizes"),
                    interpret=options.get("interpret"), backward=True)
    return {"call": call}
