"""``decode_attention``: decoding's entry point — the Pallas decode kernels (:mod:`flashlib.kernels.tpu_decode`)
or the pure-JAX stages of :mod:`flashlib.decode`, on one contract, with the split count and key block chosen
from the shapes (both overridable) and every argument checked before anything is traced.

The split count. A TensorCore runs a kernel's grid one step at a time, so splitting the keys buys parallel
work only where a device has more than one core to share the grid's parallel axes among (megacore: v4,
v5p); elsewhere (v5e, v6e, the CPU) a split only adds a partial-state write and the merge, and libtpu's
static estimate agrees (``data/estimates/decode_v5e.csv``). :func:`default_num_splits` therefore asks for
just enough splits that ``batch * kv_heads * num_splits`` covers the device's cores, and a single split —
the kernel normalises in place, no merge — whenever the cache is short (one key block per split at most).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flashlib import decode, env
from flashlib.arguments import check_interpret, check_options, check_scale, given_options
from flashlib.kernels.tpu_decode import decode_contiguous, decode_paged
from flashlib.reference import default_scale
from flashlib.tiling import NUM_LANES, pad_to_multiple

__all__ = ["DECODE_IMPLS", "DECODE_OPTIONS", "MAX_BLOCK_K", "MAX_PAGES_PER_STEP", "NO_GRADIENT_MESSAGE",
           "decode_attention", "default_block_k", "default_num_splits", "default_pages_per_step"]

DECODE_IMPLS = ("pallas", "split_kv", "reference")
# The options each impl reads; giving one it does not read is refused rather than ignored (``interpret``, shared
# with the attention kernels, is checked and accepted by every impl: only "pallas" runs a kernel).
DECODE_OPTIONS = {"pallas": ("num_splits", "block_k", "pages_per_step"), "split_kv": ("num_splits",),
                  "reference": ()}
NO_GRADIENT_MESSAGE = (
    "decode_attention(impl='pallas') has no gradient: the decode kernels are for inference; train with "
    "flashlib.attention (differentiable on every impl), or differentiate impl='split_kv' or 'reference' (plain JAX)"
)
# The largest default key block of a contiguous cache: the bigger the copy per grid step, the smaller the
# step's fixed cost against the HBM time (libtpu's estimate: 2048 keys of bf16 head_dim 128 per step come within
# a few percent of the HBM floor on v5e; data/estimates/decode_v5e.csv).
MAX_BLOCK_K = 2048
MAX_PAGES_PER_STEP = 16  # a paged step's pages are operands of their own and unrolled bodies: keep the kernel small


def default_block_k(max_len: int) -> int:
    """The contiguous cache's key block: the largest multiple of 128 up to :data:`MAX_BLOCK_K` dividing
    ``max_len`` (so the cache is never padded), else ``max_len`` rounded up to 128 when that is smaller, else
    :data:`MAX_BLOCK_K` (and the cache is padded: allocate caches in multiples of 128 keys to avoid the copy)."""
    for block in range(min(MAX_BLOCK_K, max_len) // NUM_LANES * NUM_LANES, 0, -NUM_LANES):
        if max_len % block == 0:
            return block
    return min(MAX_BLOCK_K, -(-max_len // NUM_LANES) * NUM_LANES)


def default_pages_per_step(page_size: int, pages_per_seq: int) -> int:
    """Pages a paged cache copies per grid step: enough for :data:`MAX_BLOCK_K` keys, at most
    :data:`MAX_PAGES_PER_STEP` (each page is an operand of its own, its body unrolled) and ``pages_per_seq``."""
    return max(1, min(MAX_BLOCK_K // page_size, MAX_PAGES_PER_STEP, pages_per_seq))


def default_num_splits(batch: int, kv_heads: int, num_blocks: int, cores: int | None = None) -> int:
    """Splits for a cache of ``num_blocks`` key blocks: the fewest that give each of the device's ``cores``
    (None: the TPU device's ``num_cores``, 2 on a megacore v4 or v5p, else 1 — see
    :attr:`flashlib.hardware.TpuChip.cores_per_device`; 1 off a TPU) at least one ``(batch, kv_head, split)``
    unit of work, and 1 for a short cache (fewer than two blocks per split)."""
    if cores is None:
        cores = int(getattr(jax.devices()[0], "num_cores", 1) or 1) if env.backend() == "tpu" else 1
    wanted = -(-cores // (batch * kv_heads))
    return max(1, min(wanted, num_blocks // 2))


def _check_int(name: str, value: Any, low: int, high: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int from {low} to {high} ({hint}), got {value!r}")
    return value


@jax.custom_jvp
def _no_gradient(x: jax.Array) -> jax.Array:
    """The identity, whose derivative refuses with :data:`NO_GRADIENT_MESSAGE` (instead of Pallas's empty
    ``NotImplementedError``)."""
    return x


@_no_gradient.defjvp
def _refuse_gradient(primals, tangents):
    del primals, tangents
    raise NotImplementedError(NO_GRADIENT_MESSAGE)


def _check_concrete_lengths(cache: decode.KVCache | decode.PagedKVCache) -> None:
    """Where ``lengths`` (and the block table) are concrete — not traced under ``jit`` — each length must fit
    the cache, and a paged sequence's live pages must exist in the pool; traced values are trusted."""
    if isinstance(cache.lengths, jax.core.Tracer):
        return
    lengths = np.asarray(cache.lengths)
    paged = isinstance(cache, decode.PagedKVCache)
    page_size = cache.k_pages.shape[2] if paged else 1
    capacity = cache.block_table.shape[1] * page_size if paged else cache.k.shape[2]
    if lengths.size and (lengths.min() < 0 or lengths.max() > capacity):
        raise ValueError(f"lengths must be from 0 to the cache's capacity {capacity}, got {lengths.tolist()}")
    if not paged or isinstance(cache.block_table, jax.core.Tracer):
        return
    table, num_pages = np.asarray(cache.block_table), cache.k_pages.shape[0]
    for b, length in enumerate(lengths.tolist()):
        live = table[b, : -(-length // page_size)]
        if live.size and (live.min() < 0 or live.max() >= num_pages):
            raise ValueError(f"block_table[{b}] names pages {live.tolist()} for its {length} keys, but the pool has "
                             f"pages 0 to {num_pages - 1}")


def decode_attention(q: jax.Array, cache: decode.KVCache | decode.PagedKVCache, *, impl: str = "pallas",
                     num_splits: int | None = None, block_k: int | None = None, pages_per_step: int | None = None,
                     scale: float | None = None, interpret: Any = None, softcap: float | None = None,
                     window=None) -> jax.Array:
    """Decoding attention: ``q [batch, heads, q_len, head_dim]`` (the newest tokens, already in the cache)
    against ``cache`` (:class:`flashlib.decode.KVCache` or :class:`~flashlib.decode.PagedKVCache`), bottom-right
    causal; ``[batch, heads, q_len, v_head_dim]`` in q's dtype (:mod:`flashlib.decode` states the contract).

    Args:
      impl: ``"pallas"`` (the Pallas TPU kernels), ``"split_kv"`` (:func:`flashlib.decode.decode_split_kv`, pure
        JAX) or ``"reference"`` (:func:`flashlib.decode.decode_reference`).
      num_splits: key splits, each a partial state merged at the end; None: :func:`default_num_splits` (for
        ``"split_kv"``: 1). A paged cache splits its grid steps of ``pages_per_step`` pages, a contiguous one
        its key blocks.
      block_k: keys per grid step of a contiguous cache, a multiple of 128 (None: :func:`default_block_k`);
        None for a paged cache, whose block is its page.
      pages_per_step: pages a paged cache copies per grid step (None: :func:`default_pages_per_step`); None
        for a contiguous cache.
      scale: softmax temperature, default ``1/sqrt(head_dim)``.
      interpret: as for the attention kernels: None compiles on a TPU and interprets elsewhere; False forces
        the compiled path (for an ahead-of-time compile); True or a ``pltpu.InterpretParams`` interprets. Checked
        for every impl (:mod:`flashlib.arguments`), read by ``"pallas"`` only.
      softcap: scores become ``softcap * tanh(s / softcap)`` (Gemma-2).
      window: ``(left, right)``: a query at position ``p`` sees keys ``p - left .. p`` (decoding is causal, so the
        right side changes nothing); the kernels neither copy nor compute the blocks before the window.

    ``num_splits``, ``block_k`` and ``pages_per_step`` are refused by the impls that do not read them
    (:data:`DECODE_OPTIONS`); ``scale``, ``interpret``, ``softcap`` and ``window`` are checked as
    :func:`flashlib.attention` checks them, for every impl. ``impl="pallas"`` has no gradient (a
    ``NotImplementedError`` saying so under ``jax.grad``): train with :func:`flashlib.attention`.
    """
    if impl not in DECODE_IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, DECODE_IMPLS))}, got {impl!r}")
    check_options(impl, given_options({"num_splits": num_splits, "block_k": block_k,
                                       "pages_per_step": pages_per_step}), DECODE_OPTIONS[impl])
    scale = check_scale(scale)
    interpret = check_interpret(interpret)
    decode.check_cache(q, cache)
    softcap, left = decode.check_variants(softcap, window)
    variants = {"softcap": softcap, "window": None if left is None else (left, 0)}
    if jnp.dtype(q.dtype) not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    paged = isinstance(cache, decode.PagedKVCache)
    k = cache.k_pages if paged else cache.k
    if k.dtype != q.dtype or (cache.v_pages if paged else cache.v).dtype != q.dtype:
        raise ValueError(f"the cache's k and v must have q's dtype {q.dtype}: cast the cache, or q")
    _check_concrete_lengths(cache)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if impl == "reference":
        return decode.decode_reference(q, cache, scale=scale, **variants)
    if impl == "split_kv":
        keys = cache.block_table.shape[1] * k.shape[2] if paged else k.shape[2]
        splits = 1 if num_splits is None else _check_int("num_splits", num_splits, 1, keys, "at most one per key")
        return decode.decode_split_kv(q, cache, num_splits=splits, scale=scale, **variants)
    batch, kv_heads = q.shape[0], k.shape[1]
    if paged:
        if block_k is not None:
            raise ValueError(f"block_k must be None for a paged cache: its key block is the page ({k.shape[2]} "
                             f"keys); set pages_per_step for more keys per grid step; got block_k={block_k!r}")
        block_k, pages_per_seq = k.shape[2], cache.block_table.shape[1]
        if pages_per_step is None:
            pages_per_step = default_pages_per_step(block_k, pages_per_seq)
        _check_int("pages_per_step", pages_per_step, 1, pages_per_seq, "pages copied per grid step")
        num_blocks = -(-pages_per_seq // pages_per_step)  # grid steps per sequence
    else:
        if pages_per_step is not None:
            raise ValueError(f"pages_per_step is for a paged cache; a contiguous one sets block_k, got "
                             f"pages_per_step={pages_per_step!r}")
        max_len = k.shape[2]
        if block_k is None:
            block_k = default_block_k(max_len)
        elif isinstance(block_k, bool) or not isinstance(block_k, int) or block_k <= 0 or block_k % NUM_LANES:
            raise ValueError(f"block_k must be a positive multiple of {NUM_LANES} (keys per grid step), got "
                             f"{block_k!r}; e.g. block_k=512")
        num_blocks = -(-max_len // block_k)
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, num_blocks)
    unit = f"grid steps of {pages_per_step} page(s)" if paged else f"key blocks of {block_k}"
    _check_int("num_splits", num_splits, 1, num_blocks, f"at most one per grid step: the cache has {num_blocks} {unit}")
    interpret = env.interpret_default() if interpret is None else interpret
    q = _no_gradient(q)
    if paged:
        k_pages, v_pages = _no_gradient(cache.k_pages), _no_gradient(cache.v_pages)
        return decode_paged(q, k_pages, v_pages, cache.block_table, cache.lengths,
                            num_splits=num_splits, pages_per_step=pages_per_step, scale=scale, interpret=interpret,
                            softcap=softcap, left=left)
    k_cache = pad_to_multiple(_no_gradient(cache.k), 2, block_k)  # a copy only when max_len is not a multiple
    v_cache = pad_to_multiple(_no_gradient(cache.v), 2, block_k)  # of block_k
    return decode_contiguous(q, k_cache, v_cache, cache.lengths, block_k=block_k, num_splits=num_splits,
                             scale=scale, interpret=interpret, softcap=softcap, left=left)
