"""FLOPs, transcendentals and HBM bytes of attention: the ideal count, and what the Pallas kernel does.

Two views, one set of functions:

* ``block_sizes=None`` — the algorithm: every visible (query, key) pair costs two multiply-adds per head
  dimension (``q·k`` and ``p·v``) and one ``exp``; q, k, v and out cross HBM once. This is the yardstick of
  a roofline plot.
* ``block_sizes=BlockSizes(...)`` — the kernel as it runs: whole padded blocks, causal blocks above the
  diagonal skipped, and a k/v block fetched only when its block index changes between grid steps. This is
  the ``pl.CostEstimate`` the kernel hands to XLA, so ``compiled.cost_analysis()`` reports it.

The backward pass has the same two views (``attention_backward_*``). The algorithm recomputes ``P`` from
q, k and the saved log-sum-exp and needs five matmuls per score (``s``, ``dP``, ``dV``, ``dQ``, ``dK``):
2.5x the forward's two. flashlib's kernels come in two layouts (:data:`BACKWARD_KERNELS`). By default ONE
``"fused"`` kernel iterates over query blocks per key block and keeps a whole head's dQ^T in VMEM: the five
matmuls, no more. When dQ^T does not fit, the work is split so that each output has one owner — ``"dkv"``
iterates over query blocks, ``"dq"`` over key blocks — and both recompute ``s`` and ``dP``: 4 + 3 = 7
matmuls, 3.5x the forward, in exchange for no cross-step accumulation of dQ.

The block geometry these counts walk (which blocks a causal grid visits, where its index maps clamp) is
:mod:`flashlib.geometry`'s, the very functions the kernels' ``pl.when`` guards call: a count cannot drift
from what the kernel does, and editing a count cannot change what the kernel computes. Block sizes are read,
not imported: anything with the fields of :class:`KernelBlocks` (a ``flashlib.kernels.BlockSizes``) will do.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from flashlib.geometry import first_query_blocks, forward_tiles, last_kv_blocks, visited_blocks
from flashlib.tiling import F32_BYTES, KERNELS, NUM_LANES, NUM_SUBLANES, round_up

__all__ = [
    "BACKWARD_KERNELS",
    "attention_backward_bytes",
    "attention_backward_flops",
    "attention_backward_transcendentals",
    "attention_bytes",
    "attention_flops",
    "attention_transcendentals",
    "KernelBlocks",
    "kv_block_fetches",
    "q_block_fetches",
    "visible_pairs",
    "visited_blocks",
]

_MATMULS = 2  # s = q k^T and o = p v
_FLOPS_PER_MAC = 2
BACKWARD_KERNELS: tuple[str, ...] = KERNELS[1:]  # "dkv", "dq": the split pair; "fused": dK/dV doing dQ too
_SPLIT_KERNELS = ("dkv", "dq")  # what kernel=None counts
_BACKWARD_MATMULS = 5  # the algorithm: s = q k^T, dP = dO v^T, dV = P^T dO, dQ = dS k, dK = dS^T q
_KERNEL_MATMULS = {"dkv": 4, "dq": 3, "fused": 5}  # dK/dV: s, dP, dV, dK; dQ: s, dP, dQ; fused: all five
_ROW_STATS = 2  # lse and D, each an f32 [8, block_q] row block in the backward kernels


class KernelBlocks(Protocol):
    """What the counts read of a kernel's block sizes (:class:`flashlib.kernels.BlockSizes` has it)."""

    block_q: int
    block_k: int

    @property
    def kv_step(self) -> int: ...  # keys per grid step of the forward kernel

    def blocks(self, kernel: str = "forward") -> tuple[int, int]: ...  # (block_q, block_k) of a kernel


def kv_block_fetches(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool) -> int:
    """HBM→VMEM copies of a k (or v) block for one (batch, head).

    Pallas copies a block only when its index differs from the previous grid step's. Query block ``i``
    walks key blocks ``0 .. last[i]`` and then stays on ``last[i]`` (the clamped index map), so it costs
    ``last[i]`` changes, plus one when it starts from block 0 and the previous query block ended elsewhere.
    """
    last = last_kv_blocks(q_len, kv_len, block_q, block_k, causal)  # [nq]
    return int(last.sum() + 1 + np.count_nonzero(last[:-1] != 0))


def q_block_fetches(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool) -> int:
    """HBM→VMEM copies of a q (or dO, lse, D) block for one (batch, head) in the dK/dV kernel.

    Its grid walks query blocks innermost: key block ``j`` visits ``first[j] .. last`` (the steps before
    ``first[j]`` hold block ``first[j]``, clamped), so it costs ``last - first[j]`` changes, plus one when
    it starts elsewhere than where the previous key block ended (always at the last query block).
    """
    first = first_query_blocks(q_len, kv_len, block_q, block_k, causal)  # [nk]
    last = round_up(q_len, block_q) // block_q - 1
    return int((last - first).sum() + 1 + np.count_nonzero(first[1:] != last))


def visible_pairs(q_len: int, kv_len: int, causal: bool) -> int:
    """(query, key) pairs that enter the softmax: ``q_len * kv_len``, or the causal staircase."""
    if not causal:
        return q_len * kv_len
    keys_per_row = np.clip(np.arange(q_len) + (kv_len - q_len) + 1, 0, kv_len)  # [q_len]
    return int(keys_per_row.sum())


# ---------------------------------------------------------------------------------------------------
# The counts
# ---------------------------------------------------------------------------------------------------


def attention_flops(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    causal: bool,
    block_sizes: KernelBlocks | None = None,
) -> int:
    """Matmul FLOPs (the MXU work): ``2 matmuls x 2 flops x head_dim`` per score; elementwise ops not counted.

    With ``block_sizes`` (as the kernel runs them, i.e. after :meth:`BlockSizes.fit`): every visited
    ``[block_q, block_k]`` block in full, padding included (a ``block_k_major`` copy is walked in ``block_k``
    sub-blocks, each skipped or computed on its own), except that a diagonal sub-block split into row chunks
    counts only the chunks it runs (:func:`flashlib.geometry.forward_tiles`).
    """
    if block_sizes is None:
        scores = visible_pairs(q_len, kv_len, causal)
    else:
        bq, bk = block_sizes.block_q, block_sizes.block_k
        whole, chunks = forward_tiles(q_len, kv_len, bq, bk, causal)
        scores = whole * bq * bk + chunks * bk * bk
    return batch * heads * scores * _MATMULS * _FLOPS_PER_MAC * head_dim


def attention_transcendentals(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    causal: bool,
    block_sizes: KernelBlocks | None = None,
    with_lse: bool = False,
) -> int:
    """``exp``/``log`` evaluations: one ``exp`` per score (+ one ``log`` per row for the lse).

    The kernel also exponentiates the rescale factor ``exp(m_old - m_new)`` once per visited block on a
    lane-replicated ``[block_q, 128]`` tile, and takes the lse's ``log`` on that layout too.
    """
    del head_dim  # same signature as the other counts
    if block_sizes is None:
        return batch * heads * (visible_pairs(q_len, kv_len, causal) + (q_len if with_lse else 0))
    bq, bk = block_sizes.block_q, block_sizes.block_k
    whole, chunks = forward_tiles(q_len, kv_len, bq, bk, causal)
    q_rows = round_up(q_len, bq)
    per_head = (whole * (bq * bk + bq * NUM_LANES) + chunks * (bk * bk + bk * NUM_LANES)
                + (q_rows * NUM_LANES if with_lse else 0))
    return batch * heads * per_head


def attention_bytes(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    causal: bool,
    dtype,
    block_sizes: KernelBlocks | None = None,
    with_lse: bool = False,
) -> int:
    """HBM bytes read and written: q, k, v in, out (and the f32 lse) back.

    Ideally each crosses HBM once. The kernel reads each q block once, re-reads k and v once per query
    block (:func:`kv_block_fetches`, in copies of ``block_k_major`` keys when set), and writes out — and the
    lane-replicated ``[q, 128]`` f32 lse — once.
    """
    itemsize = np.dtype(dtype).itemsize
    if block_sizes is None:
        elements = (2 * q_len + 2 * kv_len) * head_dim  # q, out; k, v
        return batch * heads * (elements * itemsize + (q_len * F32_BYTES if with_lse else 0))
    bq, kv_step = block_sizes.block_q, block_sizes.kv_step  # k and v are copied kv_step keys at a time
    q_rows = round_up(q_len, bq)
    kv_rows = kv_block_fetches(q_len, kv_len, bq, kv_step, causal) * kv_step
    per_head = (2 * q_rows + 2 * kv_rows) * head_dim * itemsize + (q_rows * NUM_LANES * F32_BYTES if with_lse else 0)
    return batch * heads * per_head


# ---------------------------------------------------------------------------------------------------
# The backward pass: the algorithm (block_sizes=None), or the dK/dV and dQ kernels as they run
# ---------------------------------------------------------------------------------------------------


def _backward_kernels(block_sizes: KernelBlocks | None, kernel: str | None) -> tuple[str, ...]:
    """The kernels to count: the split pair (None), or the one named; ``kernel`` needs ``block_sizes``."""
    if kernel is None:
        return _SPLIT_KERNELS
    if kernel not in BACKWARD_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(BACKWARD_KERNELS)} or None (dkv + dq), got {kernel!r}")
    if block_sizes is None:
        raise ValueError(f"kernel={kernel!r} counts a kernel as it runs: pass its block_sizes too")
    return (kernel,)


def _kernel_blocks(block_sizes: KernelBlocks, kernel: str) -> tuple[int, int]:
    """``(block_q, block_k)`` a backward kernel runs on (the fused kernel's are the dK/dV kernel's)."""
    return block_sizes.blocks(kernel)


def _visited_scores(q_len: int, kv_len: int, causal: bool, block_sizes: KernelBlocks, kernel: str) -> int:
    """Scores one head's ``kernel`` computes: every visited block in full."""
    block_q, block_k = _kernel_blocks(block_sizes, kernel)
    return visited_blocks(q_len, kv_len, block_q, block_k, causal) * block_q * block_k


def attention_backward_flops(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    causal: bool,
    block_sizes: KernelBlocks | None = None,
    kernel: str | None = None,
) -> int:
    """Backward matmul FLOPs: ``5 matmuls x 2 flops x head_dim`` per visible score (2.5x the forward).

    With ``block_sizes`` (resolved, :meth:`BlockSizes.for_backward`): the kernels as they run, every
    visited block in full — dK/dV does 4 matmuls per score, dQ 3, the fused kernel 5 (``kernel=`` picks one;
    None sums the split pair).
    """
    kernels = _backward_kernels(block_sizes, kernel)
    if block_sizes is None:
        return batch * heads * visible_pairs(q_len, kv_len, causal) * _BACKWARD_MATMULS * _FLOPS_PER_MAC * head_dim
    return sum(batch * heads * _visited_scores(q_len, kv_len, causal, block_sizes, name) * _KERNEL_MATMULS[name]
               * _FLOPS_PER_MAC * head_dim for name in kernels)


def attention_backward_transcendentals(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    causal: bool,
    block_sizes: KernelBlocks | None = None,
    kernel: str | None = None,
) -> int:
    """``exp`` evaluations: recomputing ``P = exp(s - lse)`` costs one per score — once in the algorithm,
    once in each kernel as they run (visited blocks in full)."""
    del head_dim  # same signature as the other counts
    kernels = _backward_kernels(block_sizes, kernel)
    if block_sizes is None:
        return batch * heads * visible_pairs(q_len, kv_len, causal)
    return sum(batch * heads * _visited_scores(q_len, kv_len, causal, block_sizes, name) for name in kernels)


def attention_backward_bytes(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    causal: bool,
    dtype,
    block_sizes: KernelBlocks | None = None,
    kernel: str | None = None,
) -> int:
    """HBM bytes of the backward: q, k, v, out, dO and the f32 lse in; dQ, dK, dV out.

    As the kernels run (``D = rowsum(dO * out)`` is computed before them and reaches them with lse as
    ``[8, block_q]`` f32 rows):

    * dK/dV reads k and v once and writes dK and dV once; it re-reads q, dO, lse and D once per key block
      (:func:`q_block_fetches`);
    * dQ reads q, dO, lse and D once and writes dQ once; it re-reads k and v once per query block
      (:func:`kv_block_fetches`);
    * the fused kernel moves what dK/dV does, and reads k^T once and writes dQ^T once (the transposes
      around it are XLA ops outside the kernel).
    """
    itemsize = np.dtype(dtype).itemsize
    kernels = _backward_kernels(block_sizes, kernel)
    if block_sizes is None:
        elements = (4 * q_len + 4 * kv_len) * head_dim  # q, out, dO, dQ; k, v, dK, dV
        return batch * heads * (elements * itemsize + q_len * F32_BYTES)
    total = 0
    for name in kernels:
        bq, bk = _kernel_blocks(block_sizes, name)
        if name in ("dkv", "fused"):
            q_rows = q_block_fetches(q_len, kv_len, bq, bk, causal) * bq  # q, dO, lse, D re-read
            kv_rows = round_up(kv_len, bk)  # k, v read and dK, dV written once
            per_head = (2 * q_rows + 4 * kv_rows) * head_dim * itemsize
            if name == "fused":
                per_head += (kv_rows + round_up(q_len, bq)) * head_dim * itemsize  # k^T read, dQ^T written
        else:
            q_rows = round_up(q_len, bq)  # q, dO, lse, D read and dQ written once
            kv_rows = kv_block_fetches(q_len, kv_len, bq, bk, causal) * bk  # k, v re-read
            per_head = (3 * q_rows + 2 * kv_rows) * head_dim * itemsize
        per_head += _ROW_STATS * q_rows * NUM_SUBLANES * F32_BYTES
        total += batch * heads * per_head
    return total
