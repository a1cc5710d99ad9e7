"""The Pallas TPU flash-attention forward (stage 5 of the series), the forward of ``impl="pallas"``: the grid,
BlockSpecs, tables and scratch around :func:`flashlib.kernels.forward_kernel.forward_kernel`, whose module
docstring walks through the kernel (init, body, finalize; causal compaction; the variants; GQA's heads per step).

* :func:`flash_attention_forward` — the kernel alone, on user-facing arguments;
* :func:`forward` — the kernel on resolved, static settings (what the custom VJP, the ring workers and the
  estimate recipes call): full or compacted causal grid (:func:`flashlib.geometry.compacted_schedule`), segment
  tables by scalar prefetch, GQA's query heads per step (:func:`heads_per_step`);
* :func:`natural_lse` — the kernel's base-2 log-sum-exp back in natural log.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib import cost, geometry
from flashlib.kernels.block_sizes import BlockSizes, vmem_limit_bytes
from flashlib.kernels.forward_kernel import forward_kernel
from flashlib.kernels.options import resolve_call
from flashlib.kernels.scores import LN_2
from flashlib.kernels.variants import (
    PLAIN,
    KernelVariants,
    segment_blocks,
    segment_layouts,
    sinks_tiles,
    with_tables,
)
from flashlib.tiling import NUM_LANES, NUM_SUBLANES, pad_to_multiple

__all__ = ["flash_attention_forward", "forward", "heads_per_step", "natural_lse"]


def flash_attention_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | pltpu.InterpretParams | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Flash attention forward as one Pallas TPU kernel; any ``q_len``/``kv_len``, head_dim, f32 or bf16.

    Args:
      q: ``[batch, heads, q_len, head_dim]``; k, v: ``[batch, heads, kv_len, head_dim]``, same dtype.
      causal: bottom-right aligned causal mask (query ``i`` sees keys ``j <= i + kv_len - q_len``).
      scale: softmax temperature, default ``1/sqrt(head_dim)``.
      block_sizes: tile sizes; None picks :meth:`BlockSizes.default` for the chip. Blocks longer than the
        (tile-rounded) sequences are clamped to them.
      interpret: None: compiled on a TPU, interpreted elsewhere (:func:`flashlib.env.interpret_default`);
        False forces the compiled path (to lower or compile for a TPU from any machine); True, or a
        ``pltpu.InterpretParams`` for TPU-semantics emulation (e.g. race detection), interprets.
      return_lse: also return the row log-sum-exp ``[batch, heads, q_len]`` f32 (``-inf`` for a row that
        sees no key), the residual the backward pass needs.

    Returns:
      ``out`` like ``q`` (and ``lse`` when asked).

    This is the forward kernel alone; :func:`flashlib.kernels.flash_attention` (``impl="pallas"``) joins it
    with the backward kernels so that ``jax.grad`` works.
    """
    _, sizes, scale, interpret = resolve_call(q, k, v, causal=causal, scale=scale, block_sizes=block_sizes,
                                              interpret=interpret)
    result = forward(q, k, v, causal=bool(causal), scale=scale, sizes=sizes, interpret=interpret,
                      return_lse=return_lse)
    return natural_lse(result) if return_lse else result


def natural_lse(result: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(out, lse2)`` from :func:`forward` as ``(out, lse)``: the base-2 log-sum-exp back in natural log."""
    out, lse2 = result
    return out, lse2 * LN_2

def heads_per_step(group: int, sizes: BlockSizes, head_dim: int, dtype) -> int:
    """How many query heads of a GQA group one grid step of the forward computes against its k/v block: the
    largest divisor of ``group`` (query heads per kv head; 1 for MHA) whose q, out, lse and scratch fit the
    VMEM budget beside the step's k/v (:meth:`BlockSizes.vmem_bytes`). All ``group`` heads, when they fit: k
    and v then cross HBM once per group instead of once per query head (``1/group`` of MHA's reads)."""
    limit = vmem_limit_bytes(sizes.generation)
    fitting = [p for p in range(group, 0, -1) if group % p == 0
               and sizes.vmem_bytes(head_dim, dtype, heads_per_step=p) <= limit]
    return fitting[0] if fitting else 1


@functools.partial(jax.jit, static_argnames=("causal", "scale", "sizes", "interpret", "return_lse", "out_dtype",
                                             "variants", "compact", "estimate_as", "separate_heads"))
def forward(q, k, v, segment_ids=None, sinks=None, *, causal: bool, scale: float, sizes: BlockSizes, interpret,
            return_lse: bool, out_dtype=None, variants: KernelVariants = PLAIN, compact: bool | None = None,
            estimate_as: str | None = None, separate_heads: bool = False):
    """The forward kernel on resolved, static settings: ``out``, and with ``return_lse`` the row
    log-sum-exp of the base-2 scores, ``lse2 = lse * log2(e)`` ``[b, h, q_len]`` f32 — the residual the
    backward kernels take as it is (:func:`natural_lse` converts it for a caller). ``out_dtype`` (None: q's)
    f32 keeps the unrounded output for the backward's ``D = rowsum(dO * out)``. ``variants`` says which of
    ``segment_ids`` (a pair of int arrays) and ``sinks`` (``[heads]``) are given, and the window and soft-cap.

    ``compact``: walk only the live (query block, key step) pairs of a causal grid, from scalar-prefetched
    tables (None: where that drops a step; :func:`flashlib.geometry.compacted_schedule`). ``estimate_as``:
    estimate-only variants of the compacted kernel (:func:`flashlib.estimate.flashlib_forward` says which;
    ``"auto"``: ``"program_ids"`` where the grid compacts, else the kernel as shipped).

    GQA: a grid step computes :func:`heads_per_step` query heads of a group against one k/v copy. Their q, out
    and lse travel as one ``[heads, block_q, ...]`` block; ``separate_heads`` passes them as one 2-D block per
    head instead (the same copies and compute, plus a stack of the outputs afterwards): libtpu's static
    profiler reports 0 cycles for any kernel whose blocks have a third non-squeezed dimension, so estimates
    measure this layout (:func:`flashlib.estimate.flashlib_forward`)."""
    out_dtype = q.dtype if out_dtype is None else out_dtype
    batch, heads, q_len, head_dim = q.shape
    v_head_dim = v.shape[3]
    kv_len, group = k.shape[2], heads // k.shape[1]  # query heads per kv head (GQA; 1 for MHA)
    block_q, block_k, kv_step = sizes.block_q, sizes.block_k, sizes.kv_step
    pack = heads_per_step(group, sizes, max(head_dim, v_head_dim), q.dtype)  # q heads sharing a k/v copy
    q_padded = pad_to_multiple(q, 2, block_q)  # [b, h, Tq, d]
    k_padded = pad_to_multiple(k, 2, kv_step)  # [b, h, Tk, d]
    v_padded = pad_to_multiple(v, 2, kv_step)  # [b, h, Tk, dv]
    num_q_blocks, num_kv_steps = q_padded.shape[2] // block_q, k_padded.shape[2] // kv_step
    live = dict(outer_block=block_q, inner_block=kv_step, num_inner=num_kv_steps, q_len=q_len, kv_len=kv_len,
                causal=causal, window=variants.window)
    # the key axis: the most steps any query block needs (all of them, unless a window bounds both sides)
    grid_kv_steps = geometry.live_steps(num_q_blocks, **live)

    # Causal compaction: the grid walks the live (q block, key step) pairs alone, tables scalar-prefetched;
    # None or geometry.live_schedule's (q_block, kv_step, first, last), each [num_live] int32
    schedule = geometry.compacted_schedule(compact, num_q_blocks, num_kv_steps, block_q=block_q, kv_step=kv_step,
                                           q_len=q_len, kv_len=kv_len, causal=causal, window=variants.window,
                                           segments=variants.segments)
    if estimate_as == "auto":  # what a static estimate can count: the program-id form wherever the grid compacts
        estimate_as = None if schedule is None else "program_ids"
    if estimate_as not in (None, "plain", "masked", "program_ids") or (estimate_as and schedule is None):
        raise ValueError(f"estimate_as must be None, 'auto', 'program_ids', 'plain' or 'masked' (these three only "
                         f"compacted); got {estimate_as!r}")
    starts = () if schedule is None else tuple(np.flatnonzero(schedule[2]).tolist())  # each q block's first step

    prefetch = []  # segment ids: the block tables, scalar-prefetched into SMEM; every index map receives them
    if variants.segments:
        ids = segment_layouts(segment_ids, q_padded.shape[2], k_padded.shape[2])
    if variants.uses_tables:
        band = np.broadcast_to(geometry.block_is_visible(
            np.arange(num_q_blocks)[:, None], np.arange(num_kv_steps)[None, :], block_q=block_q, block_k=kv_step,
            q_len=q_len, kv_len=kv_len, causal=causal, window=variants.window), (num_q_blocks, num_kv_steps))
        blocks = segment_blocks(ids["q_columns"][:, :, 0], ids["kv_rows"][:, 0, :], outer_len=q_len, inner_len=kv_len,
                                outer_block=block_q, inner_block=kv_step, band_visible=band)
        prefetch = [blocks.live, blocks.fetch]
    if schedule is not None:  # 16 bytes of SMEM per live step
        prefetch = [jnp.asarray(table) for table in schedule]

    # An index map receives (b, h, *ids): ids is the grid position (i, j) then the tables, or compacted (t, *schedule)
    def q_block_of(ids):
        """The query block of grid position ``ids``: ``i``, or compacted the schedule's at live step ``t``."""
        if estimate_as == "program_ids":
            return geometry.scheduled_pair(ids[0], starts, schedule[0].size)[0]
        return ids[1][ids[0]] if schedule is not None else ids[0]

    def q_index_map(b, h, *ids):
        return b, h, q_block_of(ids), 0

    def kv_step_of(b, ids):
        """The key step grid step ``j`` of query block ``i`` reads (geometry.fetched_block, then with segment
        ids the block table's): past the last one it needs, the same index again, so no new HBM -> VMEM copy.
        Compacted, the schedule's key step at live step ``t``."""
        if estimate_as == "program_ids":
            return geometry.scheduled_pair(ids[0], starts, schedule[0].size)[1]
        if schedule is not None:
            return ids[2][ids[0]]
        i, j, *tables = ids
        step = geometry.fetched_block(i, j, **live)
        if tables:
            step = tables[1][(b * num_q_blocks + i) * num_kv_steps + step]
        return step

    def kv_index_map(b, h, *ids):  # h: the step's first query head is h * pack; GQA: its group's kv head
        return b, (h if group == pack else lax.div(h, group // pack)), kv_step_of(b, ids), 0

    squeezed = pl.squeezed
    # The step's query heads: one [pack, ...] block per operand, or (separate_heads) `pack` operands of one head each.
    heads_block = pack if pack > 1 and not separate_heads else squeezed
    operands = pack if separate_heads else 1

    def of_head(index_map, nth: int):  # separate_heads: operand `nth` holds query head h * pack + nth
        if not separate_heads:
            return index_map

        def head_nth(b, h, *ids):
            _, _, *rest = index_map(b, h, *ids)
            return (b, h * pack + nth, *rest)
        return head_nth

    k_spec = pl.BlockSpec((squeezed, squeezed, kv_step, head_dim), kv_index_map)
    v_spec = pl.BlockSpec((squeezed, squeezed, kv_step, v_head_dim), kv_index_map)
    in_specs = [pl.BlockSpec((squeezed, heads_block, block_q, head_dim), of_head(q_index_map, n))
                for n in range(operands)] + [k_spec, v_spec]
    inputs = [q_padded] * operands + [k_padded, v_padded]
    if variants.segments:
        in_specs += [pl.BlockSpec((squeezed, block_q, NUM_LANES), lambda b, h, *ids: (b, q_block_of(ids), 0)),
                     pl.BlockSpec((squeezed, NUM_SUBLANES, kv_step), lambda b, h, *ids: (b, 0, kv_step_of(b, ids)))]
        inputs += [ids["q_columns"], ids["kv_rows"]]
    if variants.sinks:
        in_specs += [pl.BlockSpec((heads_block, NUM_SUBLANES, NUM_LANES),
                                  (lambda b, h, *ids, n=n: (h * pack + n, 0, 0)) if separate_heads
                                  else (lambda b, h, *ids: (h, 0, 0))) for n in range(operands)]
        inputs += [sinks_tiles(sinks)] * operands
    out_heads = heads // operands  # separate_heads: each output holds one head of every step
    out_shape = [jax.ShapeDtypeStruct((batch, out_heads, q_padded.shape[2], v_head_dim), out_dtype)] * operands
    out_specs = [pl.BlockSpec((squeezed, heads_block, block_q, v_head_dim), q_index_map)] * operands
    if return_lse:  # lane-replicated like m and l: a lane-dense [block_q, 128] store
        out_shape += [jax.ShapeDtypeStruct((batch, out_heads, q_padded.shape[2], NUM_LANES), jnp.float32)] * operands
        out_specs += [pl.BlockSpec((squeezed, heads_block, block_q, NUM_LANES), q_index_map)] * operands

    dims = (batch, heads, q_len, kv_len, head_dim, causal)
    kernel = functools.partial(
        forward_kernel, causal=causal, scale=scale, block_k=block_k, q_len=q_len, kv_len=kv_len,
        has_padding=k_padded.shape[2] != kv_len, return_lse=return_lse, variants=variants,
        num_kv_steps=num_kv_steps, heads=pack, separate_heads=separate_heads, compact=schedule is not None,
        estimate_as=estimate_as, starts=starts,
    )
    grid = dict(
        # compacted: (b, h / pack, num_live), the live pairs in the schedule's order; else (b, h / pack, nq, key steps)
        grid=((batch, heads // pack, schedule[0].size) if schedule is not None
              else (batch, heads // pack, num_q_blocks, grid_kv_steps)),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=(  # one of each per query head of the step
            [pltpu.VMEM((block_q, NUM_LANES), jnp.float32)] * pack  # m: running max (base 2), lane-replicated
            + [pltpu.VMEM((block_q, NUM_LANES), jnp.float32)] * pack  # l: running sum, lane-replicated
            + [pltpu.VMEM((block_q, v_head_dim), jnp.float32)] * pack  # acc: unnormalised output
        ),
    )
    outputs = pl.pallas_call(
        kernel,
        **with_tables(grid, len(prefetch)),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=(
            ("parallel", "parallel", "arbitrary") if schedule is not None else
            ("parallel", "parallel", "parallel", "arbitrary"))),
        cost_estimate=pl.CostEstimate(  # the band's blocks and copies (cost.py); with segment ids, the band's (a bound)
            flops=cost.attention_flops(*dims, block_sizes=sizes, window=variants.window, segments=variants.segments),
            transcendentals=cost.attention_transcendentals(*dims, block_sizes=sizes, with_lse=return_lse,
                                                           window=variants.window, segments=variants.segments),
            bytes_accessed=cost.attention_bytes(*dims, q.dtype, block_sizes=sizes, with_lse=return_lse,
                                                window=variants.window, heads_per_step=pack),
        ),
        interpret=interpret,
        name="flash_attention_forward" + ("_causal" if causal else ""),
    )(*prefetch, *inputs)
    if separate_heads:  # [b, h / pack, T, x] per head of a step -> [b, h, T, x]: head h * pack + n is output n's
        outputs = [jnp.stack(outputs[n:n + operands], axis=2).reshape(batch, heads, *outputs[n].shape[2:])
                   for n in range(0, len(outputs), operands)]
    out = outputs[0][:, :, :q_len]  # [b, h, q_len, dv]
    if not return_lse:
        return out
    return out, outputs[1][:, :, :q_len, 0]  # [b, h, q_len]
