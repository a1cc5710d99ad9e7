"""Is the decode kernel bound by reading the cache? libtpu's static estimate against the HBM floor.

Decoding reads the whole KV cache once per generated token and does about 1 FLOP per byte of it for each
query head that reads it (bf16: 4 FLOPs for each element pair of K and V, against their 4 bytes; 8 under GQA
8:1): far below any TPU's ridge point, so the floor is the cache's bytes over the HBM bandwidth,
``2 * batch * kv_heads * kv_len * head_dim * itemsize / bandwidth``, in cycles at the chip's derived clock
(:mod:`flashlib.hardware`).
:func:`estimate_decode` compiles one decode call for a TPU target in a fresh subprocess
(:func:`flashlib.estimate.estimate_cycles`) and returns its cycles beside that floor; :func:`decode_table`
sweeps cache lengths, batches and split counts, with today's forward kernel for comparison.

How the estimate is made honest. libtpu's static profiler treats code under a ``pl.when`` whose condition
reads SMEM (here: the scalar-prefetched ``lengths``) as never run, so the real kernel looks nearly free. The
recipes here run the *same kernel* with ``static_length = max_len`` (every sequence full): its guards and
index-map clamps then read program ids only, which the profiler credits step by step, and every block is
live — the work of a cache full to the brim. ``kind="guarded"`` estimates the kernel as it runs in serving,
to show the artefact. The forward kernel cannot be profiled at ``q_len = 1``: its query is padded to a 16-row
block (``jnp.pad``), and libtpu 0.0.50's profiler crashes on that bf16 kernel; it is estimated at ``q_len =
16``, one whole block, which it pads ``q_len = 1`` to anyway (the same copies and matmuls).

What the model does not bound: the HBM bandwidth of several copies in flight at once. A paged step copies
``pages_per_step`` pages concurrently, and probing a contiguous kernel that copied four 512-key blocks per step
(four operands, as the paged kernel does) gave 0.86x the floor at 4k keys and 0.70x at 64k: faster than the
HBM allows. A row with ``pages_per_step > 1`` is therefore a lower bound on the kernel's cost against the floor
(real time >= max(estimate, floor)); the one-copy-per-step contiguous rows are the honest ones.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from flashlib import estimate, hardware
from flashlib.kernels import decoding, tpu_decode
from flashlib.reference import default_scale

__all__ = ["KINDS", "cache_bytes", "decode_table", "estimate_decode", "hbm_floor_cycles"]

KINDS = ("contiguous", "paged", "guarded", "forward", "jax_paged")
FORWARD_Q_LEN = 16  # the forward's smallest bf16 query block: q_len = 1 is padded to it


def cache_bytes(batch: int, kv_heads: int, kv_len: int, head_dim: int, dtype: str = "bfloat16") -> int:
    """Bytes of K and V that one decode step reads: ``2 * batch * kv_heads * kv_len * head_dim * itemsize``."""
    return 2 * batch * kv_heads * kv_len * head_dim * np.dtype(dtype).itemsize


def hbm_floor_cycles(nbytes: float, chip: hardware.TpuChip | str) -> float:
    """Cycles to stream ``nbytes`` from HBM at the chip's bandwidth, at its derived clock."""
    chip = hardware.CHIPS[chip] if isinstance(chip, str) else chip
    return nbytes / chip.hbm_bandwidth * chip.clock_hz


# Recipes: module-level, so estimate_cycles' subprocess can import them.


def contiguous_full(q, k, v, lengths, *, block_k: int, num_splits: int):
    """The contiguous-cache kernel with every sequence full (guards on program ids only)."""
    return tpu_decode.decode_contiguous(q, k, v, lengths, block_k=block_k, num_splits=num_splits,
                                        scale=default_scale(q.shape[-1]), interpret=False, static_length=k.shape[2])


def contiguous_guarded(q, k, v, lengths, *, block_k: int, num_splits: int):
    """The contiguous-cache kernel as served: guards and clamps read ``lengths`` from SMEM."""
    return tpu_decode.decode_contiguous(q, k, v, lengths, block_k=block_k, num_splits=num_splits,
                                        scale=default_scale(q.shape[-1]), interpret=False)


def paged_full(q, k_pages, v_pages, block_table, lengths, *, num_splits: int, pages_per_step: int):
    """The paged kernel with every sequence full: its ``pages_per_seq * page_size`` keys all live."""
    full = block_table.shape[1] * k_pages.shape[2]
    return tpu_decode.decode_paged(q, k_pages, v_pages, block_table, lengths, num_splits=num_splits,
                                   pages_per_step=pages_per_step, scale=default_scale(q.shape[-1]), interpret=False,
                                   static_length=full)


def jax_paged(q, k_pages, v_pages, lengths, page_indices, *, pages_per_compute_block: int):
    """JAX's own ``jax.experimental.pallas.ops.tpu.paged_attention`` (q ``[batch, heads, head_dim]``, pages
    ``[kv_heads, total_pages, page_size, head_dim]``), scaled like flashlib (JAX's kernel takes q pre-scaled)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    return paged_attention(q * default_scale(q.shape[-1]), k_pages, v_pages, lengths, page_indices,
                           pages_per_compute_block=pages_per_compute_block)


def estimate_decode(kind: str = "contiguous", *, batch: int = 1, kv_len: int = 4096, heads: int = 32,
                    kv_heads: int = 4, head_dim: int = 128, dtype: str = "bfloat16", num_splits: int = 1,
                    block_k: int = 2048, page_size: int = 512, pages_per_step: int | None = None,
                    topology: str = "v5e:1x1",
                    timeout: float = 600.0) -> dict[str, Any]:
    """One row: libtpu's static cycles of a decode step (one new token per sequence) against the HBM floor.

    ``kind``: ``"contiguous"`` and ``"paged"`` (``pages_per_step`` pages of ``page_size`` keys per grid step,
    None: :func:`~flashlib.kernels.decoding.default_pages_per_step`; the pool holds exactly the batch's pages)
    are the decode kernels at full length; ``"guarded"`` the contiguous kernel reading
    ``lengths`` (the profiler's artefact); ``"forward"`` flashlib's attention forward at ``q_len =``
    :data:`FORWARD_Q_LEN` (``block_k`` keys per copy in sub-blocks of 512; ``num_splits`` ignored);
    ``"jax_paged"`` JAX's ``paged_attention`` (``pages_per_step`` pages per compute block; its copies and
    compute all sit under guards reading ``lengths`` from SMEM, so the profiler credits them as never run:
    it looks faster than the HBM allows, which says nothing about the kernel). The row's
    ``cycles`` are the total of every op compiled (the split merge included); ``kernel_cycles`` the Pallas
    kernel's alone; ``vs_floor`` is ``cycles / floor_cycles``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    s = jax.ShapeDtypeStruct
    lengths = s((batch,), np.int32)
    q = s((batch, heads, FORWARD_Q_LEN if kind == "forward" else 1, head_dim), dtype)
    kv = s((batch, kv_heads, kv_len, head_dim), dtype)
    if kind == "paged":
        pages = kv_len // page_size
        if pages_per_step is None:
            pages_per_step = decoding.default_pages_per_step(page_size, pages)
        pool = s((batch * pages, kv_heads, page_size, head_dim), dtype)
        result = estimate.estimate_cycles(paged_full, q, pool, pool, s((batch, pages), np.int32), lengths,
                                          topology=topology, timeout=timeout, num_splits=num_splits,
                                          pages_per_step=pages_per_step)
        block_k = page_size
    elif kind == "jax_paged":  # its guards and copies read lengths from SMEM: see the module's caveat
        pages = kv_len // page_size
        pages_per_step = pages_per_step or decoding.default_pages_per_step(page_size, pages)
        pool = s((kv_heads, batch * pages, page_size, head_dim), dtype)
        result = estimate.estimate_cycles(jax_paged, s((batch, heads, head_dim), dtype), pool, pool, lengths,
                                          s((batch, pages), np.int32), topology=topology, timeout=timeout,
                                          pages_per_compute_block=pages_per_step)
        block_k = page_size
    elif kind == "forward":
        num_splits = 1
        result = estimate.estimate_cycles(estimate.flashlib_forward, q, kv, kv, topology=topology, timeout=timeout,
                                          causal=False, block_q=FORWARD_Q_LEN, block_k=min(512, block_k),
                                          block_k_major=block_k)
    else:
        recipe = contiguous_full if kind == "contiguous" else contiguous_guarded
        result = estimate.estimate_cycles(recipe, q, kv, kv, lengths, topology=topology, timeout=timeout,
                                          block_k=block_k, num_splits=num_splits)
    floor = hbm_floor_cycles(cache_bytes(batch, kv_heads, kv_len, head_dim, dtype), result.chip)
    kernel = sum(c for name, c in result.kernels.items() if name.startswith(("flash_decode", "flash_attention",
                                                                             "paged_attention")))
    return dict(kind=kind, topology=topology, batch=batch, kv_len=kv_len, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim, dtype=dtype, num_splits=num_splits, block_k=block_k,
                pages_per_step=pages_per_step if kind in ("paged", "jax_paged") else None, cycles=result.total_cycles,
                kernel_cycles=kernel, floor_cycles=round(floor),
                vs_floor=round(result.total_cycles / floor, 3), libtpu=result.libtpu_version)


def decode_table(kv_lens=(4096, 16384, 65536), batches=(1, 8), splits=(1, 2, 4, 8), *, block_k: int = 2048,
                 topology: str = "v5e:1x1", extra: bool = True, progress=None,
                 kinds: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """:func:`estimate_decode` over ``kv_lens x batches x splits`` (contiguous, ``block_k``), and with ``extra``
    per (kv_len, batch) the forward kernel, plus a key-block sweep, the paged kernel, JAX's paged_attention and
    the guarded artefact at the first shape (``kinds``: only the rows of those kinds). A configuration the
    toolchain refuses is a row with its ``status`` and no cycles."""
    plan: list[dict[str, Any]] = []
    for kv_len in kv_lens:
        for batch in batches:
            plan += [dict(kind="contiguous", kv_len=kv_len, batch=batch, num_splits=n, block_k=block_k)
                     for n in splits if kv_len // block_k >= n]
            if extra:
                plan.append(dict(kind="forward", kv_len=kv_len, batch=batch, block_k=block_k))
    if extra:
        first = dict(kv_len=kv_lens[0], batch=batches[0])
        plan += [dict(kind="contiguous", num_splits=1, block_k=b, **first) for b in (512, 1024, 4096) if b != block_k]
        plan += [dict(kind="paged", num_splits=1, page_size=p, pages_per_step=n, **first)
                 for p, n in ((128, 1), (128, 16), (512, 1), (512, 4))]
        plan += [dict(kind="jax_paged", num_splits=1, page_size=p, pages_per_step=n, **first)
                 for p, n in ((128, 16), (512, 4))]
        plan.append(dict(kind="guarded", num_splits=1, block_k=block_k, **first))
    if kinds is not None:
        plan = [options for options in plan if options["kind"] in kinds]
    rows = []
    for i, options in enumerate(plan):
        try:
            row = dict(estimate_decode(topology=topology, **options), status="ok")
        except estimate.EstimateError as err:
            if estimate.failure_status(err) is None:
                raise
            row = dict(options, topology=topology, cycles=math.nan, status=estimate.failure_status(err),
                       note=estimate.one_line(err))
        rows.append(row)
        if progress is not None:
            progress(i + 1, len(plan), row)
    return rows
