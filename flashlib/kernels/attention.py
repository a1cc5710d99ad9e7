"""``impl="pallas"``: the forward and backward Pallas kernels joined into one differentiable function.

``jax.custom_vjp`` tells JAX how to differentiate :func:`flash_attention`: run the forward kernel, saving
only ``(q, k, v, out, lse)`` — O(N) residuals — then hand the output's cotangent to the backward kernels of
:mod:`flashlib.kernels.tpu_backward` (one fused dQ/dK/dV kernel while a head's dQ fits in VMEM, else a dK/dV
and a dQ kernel), which recompute the probabilities block by block. JAX never traces into the kernels for
derivatives, so no ``[q_len, kv_len]`` matrix is stored, ever.

The kernels inside the VJP are wrapped once more, in ``jax.custom_jvp`` rules that refuse: differentiating
them (grad of grad, a Hessian) would need derivatives of the kernels themselves, which flashlib does not
provide; the error says so and names the way out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from flashlib.api import register, validate_variants
from flashlib.kernels.block_sizes import BlockSizes
from flashlib.kernels.options import ResolvedCall, resolve_call, resolve_options
from flashlib.kernels.tpu_backward import backward
from flashlib.kernels.tpu_forward import forward, natural_lse
from flashlib.kernels.variants import KernelVariants
from flashlib.masks import FEATURES

__all__ = ["HIGHER_ORDER_MESSAGE", "flash_attention"]

HIGHER_ORDER_MESSAGE = (
    "flashlib's Pallas attention supports first-order gradients only; use impl='reference' for higher-order "
    "derivatives (or impl='blockwise', whose backward is plain JAX)"
)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | pltpu.InterpretParams | None = None,
    return_lse: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Flash attention by the Pallas TPU kernels, differentiable (first order) in ``q``, ``k``, ``v`` (and
    ``sinks``).

    Arguments are :func:`~flashlib.kernels.flash_attention_forward`'s, and the variants of
    :func:`flashlib.attention` (``window``, ``softcap``, ``segment_ids``, ``sinks``). ``block_sizes``' backward
    fields (None: derived from the forward sizes, :meth:`BlockSizes.for_backward`) are resolved and checked
    here, before anything is traced. With ``return_lse`` the log-sum-exp is differentiable too (with sinks
    it includes the sink's term of the denominator).
    """
    shape, sizes, scale, interpret = resolve_call(q, k, v, causal=causal, scale=scale, block_sizes=block_sizes,
                                                  interpret=interpret, backward=True)
    given, _ = validate_variants(shape, window=window, softcap=softcap, segment_ids=segment_ids, sinks=sinks)
    variants = KernelVariants.of(**given)
    return _attention(q, k, v, given.get("segment_ids"), given.get("sinks"), bool(causal), scale, sizes, interpret,
                      bool(return_lse), variants)


@register(
    "pallas",
    description="Pallas TPU flash attention: forward and backward kernels, online softmax, causal block skipping",
    options=("block_sizes", "interpret"),
    resolve_options=resolve_options,
    native_on=("tpu",),
    auto_priority=2,
    features=tuple(FEATURES),
)
def _attention_resolved(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, scale: float | None,
                        call: ResolvedCall, window=None, softcap: float | None = None, segment_ids=None,
                        sinks: jax.Array | None = None) -> jax.Array:
    """:func:`flash_attention` as :func:`flashlib.attention` calls it: the inputs and variants validated and the
    options resolved there, once (:func:`~flashlib.kernels.options.resolve_options`)."""
    del scale  # resolved into call.scale
    variants = KernelVariants.of(window=window, softcap=softcap, segment_ids=segment_ids, sinks=sinks)
    return _attention(q, k, v, segment_ids, sinks, bool(causal), call.scale, call.sizes, call.interpret, False,
                      variants)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _attention(q, k, v, segment_ids, sinks, causal, scale, sizes, interpret, return_lse, variants):
    """Not differentiated: the forward kernel alone (the lse only when asked for)."""
    result = forward(q, k, v, segment_ids, sinks, causal=causal, scale=scale, sizes=sizes, interpret=interpret,
                     return_lse=return_lse, variants=variants)
    return natural_lse(result) if return_lse else result


def _attention_fwd(q, k, v, segment_ids, sinks, causal, scale, sizes, interpret, return_lse, variants):
    """Differentiated: the forward kernel with its lse, and the residuals the backward needs. The residual
    is the kernel's base-2 lse as it is, so the backward subtracts exactly what the forward computed, and
    the output in f32, so the backward's ``D = rowsum(dO * out)`` is the probabilities' own ``rowsum(P *
    dP)`` (from a bfloat16-rounded out it is not: with one visible key, where dQ must be 0, the dQ error was
    10-25x the naive one). The user's output is that f32 output rounded, the same bits as the kernel's."""
    out32, lse2 = _first_order_forward(q, k, v, segment_ids, sinks, causal, scale, sizes, interpret, variants)
    out = out32.astype(q.dtype)
    return (natural_lse((out, lse2)) if return_lse else out), (q, k, v, segment_ids, sinks, out32, lse2)


def _attention_bwd(causal, scale, sizes, interpret, return_lse, variants, residuals, cotangent):
    q, k, v, segment_ids, sinks, out, lse2 = residuals
    do, dlse = cotangent if return_lse else (cotangent, None)
    grads = _first_order_backward(q, k, v, out, lse2, do, dlse, segment_ids, sinks, causal, scale, sizes, interpret,
                                  variants)
    dsinks = grads[3] if variants.sinks else None
    return (*grads[:3], None, dsinks)  # segment ids are integers: no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


# Grad of grad differentiates the residuals (through the forward kernel) and the backward kernels; Pallas
# kernels have no derivative rules worth the name, so both refuse with one clear message.


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6, 7, 8, 9))
def _first_order_forward(q, k, v, segment_ids, sinks, causal, scale, sizes, interpret, variants):
    """``(out, lse2)`` (out in f32, lse in base 2) by the forward kernel; differentiating this raises
    :data:`HIGHER_ORDER_MESSAGE`."""
    return forward(q, k, v, segment_ids, sinks, causal=causal, scale=scale, sizes=sizes, interpret=interpret,
                   return_lse=True, out_dtype=jnp.float32, variants=variants)


@functools.partial(jax.custom_jvp, nondiff_argnums=(9, 10, 11, 12, 13))
def _first_order_backward(q, k, v, out, lse2, do, dlse, segment_ids, sinks, causal, scale, sizes, interpret,
                          variants):
    """``(dq, dk, dv)`` (and ``dsinks``) by the backward kernels; differentiating this raises
    :data:`HIGHER_ORDER_MESSAGE`."""
    return backward(q, k, v, out, lse2, do, dlse, segment_ids, sinks, causal=causal, scale=scale, sizes=sizes,
                    interpret=interpret, variants=variants)


def _refuse_higher_order(*args):
    del args
    raise NotImplementedError(HIGHER_ORDER_MESSAGE)


_first_order_forward.defjvp(_refuse_higher_order)
_first_order_backward.defjvp(_refuse_higher_order)
