"""Attention on a device mesh, sharded over batch and heads: any implementation, no communication.

Attention never mixes batch rows or heads, so a mesh that splits ``batch`` and ``heads`` needs no
communication at all: each device runs the whole attention of its own rows and heads. Pallas (Mosaic)
kernels are not partitioned by XLA's SPMD partitioner, so a kernel under ``jax.jit`` on sharded arrays
would be gathered onto every device (or refused); :func:`sharded_attention` says instead, with
``jax.shard_map``, "each device runs this on its block", which works for every registered ``impl=``::

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    out = sharded_attention(q, k, v, mesh=mesh, batch_axis="data", head_axis="model", impl="pallas")
    # q [batch, heads, seq, d] -> each device: q [batch / 2, heads / 4, seq, d]

Grouped-query attention: query head ``h`` reads kv head ``h // group``. Splitting q's heads and k/v's
heads into the same number of contiguous blocks keeps every group on one device (device ``i`` holds query
heads ``[i h/n, (i+1) h/n)`` and kv heads ``[i hk/n, (i+1) hk/n)``), so the split needs ``n`` to divide
``kv_heads`` as well as ``heads``. The sequence is not split here: that is :mod:`flashlib.ring`.

Meshes with Explicit axes (``jax.make_mesh``'s default in the newest jax; jax 0.7.2's is Auto). JAX types an
array sharded on Explicit axes by its sharding, and differentiating such a computation eagerly needs the mesh as
context (``with jax.set_mesh(mesh):``) — even ``jax.grad`` of ``out.sum()`` fails without it, for any JAX code.
So outside a mesh context, with inputs not already sharded on Explicit axes, :func:`working_mesh` runs the work on
the mesh's Auto twin (the same devices, the same axes): forward and ``jax.grad`` both work, and the output is
sharded as asked, untyped. Inside ``jax.set_mesh(mesh)``, or with inputs already sharded on its Explicit axes,
the mesh is used as given (and JAX's own rule applies: differentiate those inside ``jax.set_mesh`` or under
``jax.jit``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from flashlib.api import AttentionShape, attention, check_layout, validate_inputs, validate_variants
from flashlib.arguments import check_causal

__all__ = ["axis_size", "check_mesh_axis", "place", "sharded_attention", "working_mesh"]

_SWAP_SEQ_AND_HEADS = (0, 2, 1, 3)  # bshd <-> bhsd (its own inverse)


def axis_size(mesh: Mesh, axis: str | None) -> int:
    """The number of devices along ``axis`` of ``mesh`` (1 for None: not split)."""
    return 1 if axis is None else int(mesh.shape[axis])


def place(x: Any, mesh: Mesh, spec: PartitionSpec) -> Any:
    """``x`` laid out as ``spec`` where ``mesh`` has Explicit axes (the newest jax's default for
    ``jax.make_mesh``: there ``shard_map`` takes only arrays already sharded as its ``in_specs``). On Auto
    axes (jax 0.7.2's default) ``x`` is returned as is and ``shard_map`` places it."""
    if not _has_explicit_axes(mesh):
        return x
    # spec may be one PartitionSpec for every leaf of x, or a matching structure of them (segment ids' pair)
    def put(a: Any, s: PartitionSpec) -> Any:  # concrete: device_put (jax 0.7.2's eager reshard of an
        # unplaced array asks for a mesh context); traced: reshard, which types it on the Explicit axes
        sharding = NamedSharding(mesh, s)
        return jax.sharding.reshard(a, sharding) if isinstance(a, jax.core.Tracer) else jax.device_put(a, sharding)

    if isinstance(spec, PartitionSpec):
        return jax.tree.map(lambda a: put(a, spec), x)
    return jax.tree.map(put, x, spec, is_leaf=lambda node: isinstance(node, PartitionSpec))


def _has_explicit_axes(mesh: Any) -> bool:
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()) or ())


def working_mesh(mesh: Mesh, *arrays: Any) -> Mesh:
    """The mesh the work runs on: ``mesh`` itself, or — where it has Explicit axes, no mesh is set as context
    (``jax.set_mesh``) and none of ``arrays`` is already sharded on Explicit axes — its Auto twin (same devices and
    axis names), on which eager gradients work outside a mesh context (see the module docstring)."""
    if not _has_explicit_axes(mesh) or not jax.sharding.get_abstract_mesh().empty:
        return mesh
    for leaf in jax.tree.leaves(arrays):
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        if _has_explicit_axes(getattr(sharding, "mesh", None)):
            return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def check_mesh_axis(mesh: Any, name: str, axis: Any) -> None:
    """``axis`` (the argument called ``name``) is None or one of ``mesh``'s axis names; ``mesh`` is a Mesh."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; "
                         "e.g. mesh=jax.make_mesh((2, 4), ('data', 'model'))")
    if axis is not None and axis not in mesh.axis_names:
        raise ValueError(f"{name}={axis!r} is not an axis of the mesh; its axes are {tuple(mesh.axis_names)} "
                         "(or pass None not to split that dimension)")


def check_divides(mesh: Mesh, shape: AttentionShape, *, batch_axis: str | None, head_axis: str | None) -> None:
    """Every split dimension divides evenly by its mesh axis (GQA: kv heads too), else a ValueError."""
    if len({a for a in (batch_axis, head_axis) if a is not None}) < len([a for a in (batch_axis, head_axis) if a]):
        raise ValueError(f"batch_axis and head_axis must be different mesh axes, got {batch_axis!r} twice")
    for arg, axis, size, what in (("batch_axis", batch_axis, shape.batch, "batch"),
                                  ("head_axis", head_axis, shape.heads, "heads (of q)"),
                                  ("head_axis", head_axis, shape.kv_heads, "kv_heads (of k and v)")):
        n = axis_size(mesh, axis)
        if size % n:
            raise ValueError(
                f"{arg}={axis!r} splits {what} = {size} over {n} devices, which does not divide evenly; use a "
                f"mesh axis whose size divides {size}" + (" (with GQA each device must hold whole groups: the "
                                                          "axis must divide kv_heads)" if "kv" in what else ""))


def sharded_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    batch_axis: str | None = None,
    head_axis: str | None = None,
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
    """:func:`flashlib.attention` on every device of ``mesh``, each on its own block of batch and heads.

    Args:
      q: ``[batch, heads, q_len, head_dim]``; k, v: ``[batch, kv_heads, kv_len, head_dim / v_head_dim]``
        (the contract of :mod:`flashlib.api`).
      mesh: a ``jax.sharding.Mesh``; axes not named below replicate the work (every device on them computes
        the same block).
      batch_axis, head_axis: the mesh axes that split ``batch`` and the heads (None: not split). Their sizes
        must divide ``batch``, ``heads`` and ``kv_heads``.
      causal, scale, window, softcap, segment_ids, sinks, impl, **options: as :func:`flashlib.attention`
        (checked here, once, before anything is traced); segment ids are split with the batch, sinks with the
        heads.
      layout: ``"bhsd"`` (as above) or ``"bshd"`` (``[batch, seq, heads, head_dim]`` arrays, and the output):
        handled here, so ``head_axis`` splits the heads whatever the layout.

    Returns:
      ``out [batch, heads, q_len, v_head_dim]`` (in ``layout``), sharded as ``PartitionSpec(batch_axis,
      head_axis)`` over the batch and heads axes. Differentiable whenever ``impl`` is (each device differentiates
      its own block), on Auto and Explicit meshes; on Explicit axes with inputs already sharded on them,
      differentiate inside ``with jax.set_mesh(mesh):`` (JAX's rule, see the module docstring).
    """
    causal = check_causal(causal)
    shape = validate_inputs(q, k, v, scale=scale, layout=check_layout(layout))
    check_mesh_axis(mesh, "batch_axis", batch_axis)
    check_mesh_axis(mesh, "head_axis", head_axis)
    check_divides(mesh, shape, batch_axis=batch_axis, head_axis=head_axis)
    # the variants checked once, here, where their values are concrete (inside shard_map they are traced)
    given, _ = validate_variants(shape, segment_ids=segment_ids, sinks=sinks)
    spec = PartitionSpec(batch_axis, head_axis)  # [batch, heads, ...]: the rest of each array is whole
    extras, extra_specs = {}, {}
    if segment_ids is not None:
        extras["segment_ids"], extra_specs["segment_ids"] = given["segment_ids"], (PartitionSpec(batch_axis),) * 2
    if sinks is not None:
        extras["sinks"], extra_specs["sinks"] = given["sinks"], PartitionSpec(head_axis)

    def per_device(q, k, v, extras):  # [batch / nb, heads / nh, ...] each
        return attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, impl=impl,
                         **extras, **options)

    if layout == "bshd":
        q, k, v = (jnp.asarray(x).transpose(_SWAP_SEQ_AND_HEADS) for x in (q, k, v))
    mesh = working_mesh(mesh, q, k, v, extras)
    # Pallas calls carry no varying-axes annotations (check_vma off). Compiled as one program, eagerly too: op by
    # op, jax 0.7.2 refuses the body's einsum on Explicit axes inside jax.set_mesh (a gather's sharding rule)
    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec, spec, extra_specs), out_specs=spec,
                                check_vma=False))
    extras = {name: place(value, mesh, extra_specs[name]) for name, value in extras.items()}
    out = run(*(place(x, mesh, spec) for x in (q, k, v)), extras)
    return out.transpose(_SWAP_SEQ_AND_HEADS) if layout == "bshd" else out
