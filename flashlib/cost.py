"""FLOPs, transcendentals and HBM bytes of attention: the ideal count, and what the Pallas kernel does.

Two views, one set of functions:

* ``block_sizes=None`` — the algorithm: every visible (query, key) pair costs two multiply-adds per head
  dimension (``q·k`` and ``p·v``) and one ``exp``; q, k, v and out cross HBM once. This is the yardstick of
  a roofline plot.
* ``block_sizes=BlockSizes(...)`` — the kernel as it runs: whole padded blocks, the blocks outside the band
  (above a causal diagonal, outside a sliding window) skipped, and a k/v block fetched only when its block
  index changes between grid steps. This is the ``pl.CostEstimate`` the kernel hands to XLA, so
  ``compiled.cost_analysis()`` reports it.

Every count takes ``window=(left, right)`` (``None`` per side: unbounded; :func:`flashlib.geometry.band`), the
band the kernels walk: with a left side they compact their inner grid axis to each outer block's live range,
and the fetch counts follow the index maps' :func:`flashlib.geometry.fetched_block` exactly. Segment ids are
data: the kernel view counts the band's blocks, an upper bound of the FLOPs and exps of a kernel with segment
ids (its block tables skip more; ``segments=True`` says that such a kernel runs masked blocks whole, not in row
chunks), and the band's copies (:func:`attention_bytes` says how far those bound). With GQA the kernel view
counts k and v per query head, as the kernels copy them; ``kv_heads=`` is the algorithm's (once per kv head).

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

from flashlib.geometry import band, forward_tiles, live_range, visited_blocks
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


def kv_block_fetches(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool, window=None) -> int:
    """HBM→VMEM copies of a k (or v) block for one (batch, head).

    Pallas copies a block only when its index differs from the previous grid step's. Query block ``i``
    walks key blocks ``first[i] .. last[i]`` of its live range (:func:`flashlib.geometry.fetched_block`: from
    block 0 and clamped at the band's right side, or compacted to the window's blocks) and then stays on
    ``last[i]``, so it costs ``last[i] - first[i]`` changes, plus one when it starts elsewhere than where the
    previous query block ended.
    """
    return _fetches(q_len, kv_len, block_q, block_k, causal, window, keys_inner=True)


def q_block_fetches(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool, window=None) -> int:
    """HBM→VMEM copies of a q (or dO, lse, D) block for one (batch, head) in the dK/dV kernel.

    Its grid walks query blocks innermost: key block ``j`` visits ``first[j] .. last[j]`` (the steps before
    ``first[j]`` hold block ``first[j]``; without a left window side ``last[j]`` is the last query block), so it
    costs ``last[j] - first[j]`` changes, plus one when it starts elsewhere than where the previous key block
    ended.
    """
    return _fetches(q_len, kv_len, block_q, block_k, causal, window, keys_inner=False)


def _fetches(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool, window, keys_inner: bool) -> int:
    """Copies of the inner axis' blocks over one (batch, head) grid walked in order: each outer block's fetched
    indices run ``first .. last`` of its :func:`~flashlib.geometry.live_range` one step at a time (the index
    maps' ``fetched_block``), and a copy happens at every change, across outer blocks too."""
    num_q, num_k = round_up(q_len, block_q) // block_q, round_up(kv_len, block_k) // block_k
    outer_block, inner_block, num_outer, num_inner = ((block_q, block_k, num_q, num_k) if keys_inner
                                                      else (block_k, block_q, num_k, num_q))
    first, last = live_range(np.arange(num_outer), outer_block=outer_block, inner_block=inner_block,
                             num_inner=num_inner, q_len=q_len, kv_len=kv_len, causal=causal, window=window,
                             keys_inner=keys_inner)  # [num_outer] each
    return int((last - first).sum() + 1 + np.count_nonzero(first[1:] != last[:-1]))


def visible_pairs(q_len: int, kv_len: int, causal: bool, window=None) -> int:
    """(query, key) pairs that enter the softmax: ``q_len * kv_len``, or the band's (causal staircase, window)."""
    left, right = band(causal, window)
    if left is None and right is None:
        return q_len * kv_len
    diagonal = np.arange(q_len) + (kv_len - q_len)  # [q_len]   each query's diagonal key
    last = kv_len - 1 if right is None else np.minimum(diagonal + right, kv_len - 1)  # [q_len]
    first = 0 if left is None else np.maximum(diagonal - left, 0)  # [q_len]
    return int(np.maximum(last - first + 1, 0).sum())


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
    *,
    window=None,
    segments: bool = False,
) -> int:
    """Matmul FLOPs (the MXU work): ``2 matmuls x 2 flops x head_dim`` per score; elementwise ops not counted.

    With ``block_sizes`` (as the kernel runs them, i.e. after :meth:`BlockSizes.fit`): every visited
    ``[block_q, block_k]`` block in full, padding included (a ``block_k_major`` copy is walked in ``block_k``
    sub-blocks, each skipped or computed on its own), except that a diagonal sub-block split into row chunks
    counts only the chunks it runs (:func:`flashlib.geometry.forward_tiles`). ``window``: the band's blocks
    (pairs, without ``block_sizes``). ``segments``: the kernel runs with segment ids — the count is then the
    band's blocks, each whole, an upper bound (which blocks the ids let meet is data).
    """
    if block_sizes is None:
        scores = visible_pairs(q_len, kv_len, causal, window)
    else:
        bq, bk = block_sizes.block_q, block_sizes.block_k
        whole, chunks = forward_tiles(q_len, kv_len, bq, bk, causal, window, segments)
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
    *,
    window=None,
    segments: bool = False,
) -> int:
    """``exp``/``log`` evaluations: one ``exp`` per score (+ one ``log`` per row for the lse).

    The kernel also exponentiates the rescale factor ``exp(m_old - m_new)`` once per visited block on a
    lane-replicated ``[block_q, 128]`` tile, and takes the lse's ``log`` on that layout too. ``window`` and
    ``segments`` as in :func:`attention_flops`.
    """
    del head_dim  # same signature as the other counts
    if block_sizes is None:
        return batch * heads * (visible_pairs(q_len, kv_len, causal, window) + (q_len if with_lse else 0))
    bq, bk = block_sizes.block_q, block_sizes.block_k
    whole, chunks = forward_tiles(q_len, kv_len, bq, bk, causal, window, segments)
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
    *,
    window=None,
    kv_heads: int | None = None,
    heads_per_step: int = 1,
) -> int:
    """HBM bytes read and written: q, k, v in, out (and the f32 lse) back.

    Ideally each crosses HBM once — k and v once per kv head (``kv_heads``, GQA/MQA; None: ``heads``). The
    kernel reads each q block once, re-reads k and v once per query block and grid step's group of
    ``heads_per_step`` query heads (:func:`kv_block_fetches` of the ``window``'s band, in copies of
    ``block_k_major`` keys when set; ``kv_heads`` is not read; GQA's steps take a group's heads together,
    :func:`flashlib.kernels.tpu_forward.heads_per_step`), and writes out — and the lane-replicated ``[q, 128]``
    f32 lse — once. With segment ids this
    is the band's copies: the block tables skip copies too, but where a block sees no key the index may jump
    (at most one extra copy per query block), and the id tiles themselves are not counted.
    """
    itemsize = np.dtype(dtype).itemsize
    if block_sizes is None:
        kv_heads = heads if kv_heads is None else kv_heads
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"kv_heads must divide heads ({heads}), got {kv_heads}")
        elements = heads * 2 * q_len * head_dim + kv_heads * 2 * kv_len * head_dim  # q, out; k, v
        return batch * (elements * itemsize + (heads * q_len * F32_BYTES if with_lse else 0))
    bq, kv_step = block_sizes.block_q, block_sizes.kv_step  # k and v are copied kv_step keys at a time
    q_rows = round_up(q_len, bq)
    kv_rows = kv_block_fetches(q_len, kv_len, bq, kv_step, causal, window) * kv_step
    if heads % heads_per_step:
        raise ValueError(f"heads_per_step must divide heads ({heads}), got {heads_per_step}")
    per_head = 2 * q_rows * head_dim * itemsize + (q_rows * NUM_LANES * F32_BYTES if with_lse else 0)
    per_step_heads = 2 * kv_rows * head_dim * itemsize  # k and v, shared by the step's query heads
    return batch * (heads * per_head + heads // heads_per_step * per_step_heads)


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


def _visited_scores(q_len: int, kv_len: int, causal: bool, block_sizes: KernelBlocks, kernel: str,
                    window=None) -> int:
    """Scores one head's ``kernel`` computes: every visited block (in the band) in full."""
    block_q, block_k = _kernel_blocks(block_sizes, kernel)
    return visited_blocks(q_len, kv_len, block_q, block_k, causal, window) * block_q * block_k


def attention_backward_flops(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    causal: bool,
    block_sizes: KernelBlocks | None = None,
    kernel: str | None = None,
    *,
    window=None,
) -> int:
    """Backward matmul FLOPs: ``5 matmuls x 2 flops x head_dim`` per visible score (2.5x the forward).

    With ``block_sizes`` (resolved, :meth:`BlockSizes.for_backward`): the kernels as they run, every
    visited block in full — dK/dV does 4 matmuls per score, dQ 3, the fused kernel 5 (``kernel=`` picks one;
    None sums the split pair). ``window``: the band's blocks; with segment ids an upper bound (see the module).
    """
    kernels = _backward_kernels(block_sizes, kernel)
    if block_sizes is None:
        return (batch * heads * visible_pairs(q_len, kv_len, causal, window) * _BACKWARD_MATMULS * _FLOPS_PER_MAC
                * head_dim)
    return sum(batch * heads * _visited_scores(q_len, kv_len, causal, block_sizes, name, window)
               * _KERNEL_MATMULS[name] * _FLOPS_PER_MAC * head_dim for name in kernels)


def attention_backward_transcendentals(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    causal: bool,
    block_sizes: KernelBlocks | None = None,
    kernel: str | None = None,
    *,
    window=None,
) -> int:
    """``exp`` evaluations: recomputing ``P = exp(s - lse)`` costs one per score — once in the algorithm,
    once in each kernel as they run (visited blocks of the ``window``'s band in full)."""
    del head_dim  # same signature as the other counts
    kernels = _backward_kernels(block_sizes, kernel)
    if block_sizes is None:
        return batch * heads * visible_pairs(q_len, kv_len, causal, window)
    return sum(batch * heads * _visited_scores(q_len, kv_len, causal, block_sizes, name, window)
               for name in kernels)


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
    *,
    window=None,
    heads_per_step: int = 1,
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

    ``window``: the band's fetches (the dK/dV kernel's query axis and the dQ kernel's key axis compacted when
    it has a left side); with segment ids the band's, as in :func:`attention_bytes`. ``heads_per_step``: the
    query heads the dK/dV or fused kernel walks in turn against one key block (GQA), which share its k, v (and
    k^T) reads and its dK, dV writes.
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
            q_rows = q_block_fetches(q_len, kv_len, bq, bk, causal, window) * bq  # q, dO, lse, D re-read
            kv_rows = round_up(kv_len, bk)  # k, v read and dK, dV written once per step's heads
            shared = 1 / heads_per_step  # of the k, v (k^T) reads and dK, dV writes, per query head
            per_head = (2 * q_rows + 4 * kv_rows * shared) * head_dim * itemsize
            if name == "fused":  # k^T read, dQ^T written
                per_head += (kv_rows * shared + round_up(q_len, bq)) * head_dim * itemsize
        else:
            q_rows = round_up(q_len, bq)  # q, dO, lse, D read and dQ written once
            kv_rows = kv_block_fetches(q_len, kv_len, bq, bk, causal, window) * bk  # k, v re-read
            per_head = (3 * q_rows + 2 * kv_rows) * head_dim * itemsize
        per_head += _ROW_STATS * q_rows * NUM_SUBLANES * F32_BYTES
        total += batch * heads * per_head
    return int(round(total))
