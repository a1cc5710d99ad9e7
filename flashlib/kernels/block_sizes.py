"""Block sizes for the Pallas TPU kernels: the (8, 128) tiling rule, per-chip defaults, the VMEM budget.

A TPU vector register holds an ``[8, 128]`` tile of 32-bit values: 8 *sublanes* by 128 *lanes*. A block
that Pallas copies into VMEM must therefore be a whole number of tiles in its last two dimensions (or span
the whole array dimension). A block size that lies along *rows* (sublanes) is a multiple of the sublane
count, which grows as the dtype shrinks: 8 rows for float32, 16 for bfloat16 (two values are packed per
32-bit sublane); one that lies along *lanes* is a multiple of 128. Which is which depends on the kernel:

* forward: the score tile ``[block_q, block_k]`` puts queries on rows and keys on lanes;
* dK/dV (``block_q_dkv``, ``block_k_dkv``): the *transposed* score tile ``[block_k_dkv, block_q_dkv]`` puts
  keys on rows and queries on lanes, so every matmul of that kernel needs no transpose and the queries'
  row statistics (lse, D) arrive as compact ``[8, block_q_dkv]`` rows;
* dQ (``block_q_dq``, ``block_k_dq``): the score tile ``[block_q_dq, block_k_dq]`` puts keys on lanes, and
  the same ``[8, block_q_dq]`` row statistics put queries on lanes too: both are multiples of 128.

``head_dim`` is never split: every block spans the whole head dimension (the "equal to the array
dimension" exception of the rule), so any head size lowers; VMEM still pads it up to whole lanes.

The second limit is VMEM: every buffer of one grid step must fit in the compiler's *scoped* VMEM limit
(16 MiB by default on v5e, 32 MiB on v6e). :meth:`BlockSizes.vmem_bytes` counts them so flashlib can
refuse a configuration with a readable message before Mosaic refuses it with a stack trace; the backward
kernels have their own counts (``vmem_bytes(..., kernel="dkv")``, ``kernel="dq"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from flashlib import env, hardware
from flashlib.hardware import MIB
from flashlib.kernels.tuned_table import TableKey, TuningResult, nearest_entry
from flashlib.tiling import F32_BYTES, KERNELS, NUM_LANES, NUM_SUBLANES, round_up, sublanes

__all__ = [
    "GENERATIONS",
    "KERNELS",
    "BlockSizes",
    "current_generation",
    "entry_block_sizes",
    "lookup",
    "vmem_limit_bytes",
]

# The (block_q, block_k) a kernel starts from on each generation it has defaults for; the generation's
# scoped-VMEM limit, which every configuration is checked against, is hardware.CHIPS[generation]'s.
_PREFERRED_BLOCKS: dict[str, tuple[int, int]] = {"v5e": (512, 512), "v6e": (1024, 512)}
GENERATIONS: tuple[str, ...] = tuple(_PREFERRED_BLOCKS)
_DEVICE_KINDS: dict[str, str] = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}
# f32 [block_q, block_k] tiles the body keeps in VMEM at once. Calibrated on v5e by bisecting
# vmem_limit_bytes: beyond the buffers counted in `vmem_bytes`, libtpu 0.0.23 (Colab's) allocates up to
# 3.2 such tiles, libtpu 0.0.50 up to 2.
_SCORE_TILES = 3
# With block_k_major, the kernel's sub-block loop is unrolled, and libtpu 0.0.23 keeps about one score tile
# per sub-block live (1024/4096/512 bf16 on v5e: 24.5 MiB; libtpu 0.0.50 reuses them): half a tile more than
# one per sub-block is counted when that exceeds _SCORE_TILES.
_HALF_TILES_PER_SUB_BLOCK, _EXTRA_HALF_TILES = 2, 1
# The same count for the backward kernels' [rows, lanes] score tiles (s, p, dp, ds, bf16 matmul operands),
# bisected the same way: libtpu 0.0.23 holds up to 2.7 of them in dK/dV and 3.5 in dQ (when block_k >= 1024),
# libtpu 0.0.50 about 2 and 1. See tests/test_block_sizes.py's backward sweep.
_DKV_SCORE_TILES = 3
_DQ_SCORE_TILES = 4
_ROW_STAT_ROWS = NUM_SUBLANES  # lse and D reach the backward kernels as sublane-replicated [8, block_q] rows

# (query field, key field) of each kernel of tiling.KERNELS (the fused kernel runs on the dK/dV grid), and
# which of the fields lie along lanes (the others lie along rows).
_KERNEL_FIELDS: dict[str, tuple[str, str]] = {
    "forward": ("block_q", "block_k"),
    "dkv": ("block_q_dkv", "block_k_dkv"),
    "dq": ("block_q_dq", "block_k_dq"),
    "fused": ("block_q_dkv", "block_k_dkv"),
}
_LANE_FIELDS: frozenset[str] = frozenset({"block_k", "block_q_dkv", "block_q_dq", "block_k_dq"})
_KERNEL_NAMES: dict[str, str] = {"forward": "forward", "dkv": "dK/dV", "dq": "dQ", "fused": "fused dK/dV/dQ"}


def current_generation() -> str:
    """The TPU generation we run on (``"v5e"``, ``"v6e"``); ``"v5e"``, the smallest VMEM budget, elsewhere."""
    if env.backend() == "tpu":
        return _DEVICE_KINDS.get(env.device_kind(), "v5e")
    return "v5e"


def vmem_limit_bytes(generation: str | None = None) -> int:
    """The default scoped-VMEM limit of ``generation`` (None: :func:`current_generation`), from
    :data:`flashlib.hardware.CHIPS`."""
    generation = current_generation() if generation is None else generation
    if generation not in GENERATIONS:
        raise ValueError(f"generation must be one of {', '.join(GENERATIONS)} (or None), got {generation!r}")
    return hardware.CHIPS[generation].scoped_vmem_bytes


def _check_block(field: str, value: object, multiple: int, why: str) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        example = round_up(4 * NUM_LANES, multiple)
        raise ValueError(f"{field} must be a positive int, got {value!r}; e.g. {field}={example}")
    if value % multiple:
        raise ValueError(
            f"{field} must be a multiple of {multiple} ({why}), got {value}; "
            f"try {field}={round_up(int(value), multiple)}"
        )


def _tile_rule(field: str, rows: int) -> tuple[int, str]:
    """``(multiple, why)`` of the tiling rule for ``field``: 128 where it lies along lanes, else ``rows``."""
    if field in _LANE_FIELDS:
        what = "keys" if field.startswith("block_k") else "queries"
        return NUM_LANES, f"{what} lie along the {NUM_LANES} lanes of a TPU register tile"
    return rows, f"the {rows} sublanes of a TPU register tile"


@dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the flash-attention kernels; validates the dtype-independent tiling rule on creation.

    Attributes:
      block_q: query rows per grid step (a multiple of 8; of 16 for bfloat16, see :meth:`validate`).
      block_k: keys per score tile, a multiple of 128 (keys lie along lanes in the score tile).
      block_k_major: keys copied into VMEM per grid step of the forward kernel, a multiple of ``block_k``;
        the kernel walks it in ``block_k`` sub-blocks. Fewer, larger copies mean fewer grid steps, each
        of which has a fixed cost. None: ``block_k`` (one sub-block per step).
      generation: the TPU generation these sizes target (``"v5e"``, ``"v6e"``); it sets the VMEM budget
        they are checked against. None: the chip we run on (``"v5e"`` off-TPU, the smallest budget).
      block_q_dkv, block_k_dkv: query and key blocks of the dK/dV kernel; ``block_q_dkv`` lies along lanes
        (a multiple of 128), ``block_k_dkv`` along rows (a multiple of 8; 16 for bfloat16).
      block_q_dq, block_k_dq: query and key blocks of the dQ kernel, both multiples of 128.
        None for any backward field: derived from the forward sizes when gradients are taken
        (:meth:`for_backward`), and shrunk until that kernel fits the VMEM budget.
    """

    block_q: int = 512
    block_k: int = 512
    generation: str | None = None
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None
    block_q_dq: int | None = None
    block_k_dq: int | None = None
    block_k_major: int | None = None

    def __post_init__(self) -> None:
        for kernel, fields in _KERNEL_FIELDS.items():
            for name in fields:
                value = getattr(self, name)
                if value is not None or kernel == "forward":
                    _check_block(name, value, *_tile_rule(name, NUM_SUBLANES))
        if self.block_k_major is not None:
            _check_block("block_k_major", self.block_k_major, self.block_k,
                         f"the kernel walks it in sub-blocks of block_k={self.block_k}")
        if self.generation is not None:
            vmem_limit_bytes(self.generation)  # raises for an unknown generation

    @classmethod
    def default(cls, q_len: int, kv_len: int, head_dim: int, dtype, generation: str | None = None,
                causal: bool = False) -> BlockSizes:
        """Good sizes for ``generation``: the tuned table's choice for the nearest tuned shape
        (:func:`lookup`, picked by the TPU compiler's cycle estimate), else the generation's
        preferred blocks; clamped to the (padded) sequence lengths and halved while they would overflow
        its VMEM budget."""
        generation = current_generation() if generation is None else generation
        limit = vmem_limit_bytes(generation)  # also rejects an unknown generation
        tuned = lookup(q_len, kv_len, head_dim, dtype, causal, generation)
        if tuned is None:
            return cls.preferred(q_len, kv_len, head_dim, dtype, generation)
        return dataclasses.replace(tuned, generation=generation).fit(q_len, kv_len, dtype).shrunk_to(
            limit, head_dim, dtype)

    @classmethod
    def preferred(cls, q_len: int, kv_len: int, head_dim: int, dtype, generation: str | None = None) -> BlockSizes:
        """The generation's preferred blocks, without the tuned table: clamped to the (padded) sequence
        lengths and halved while they would overflow its VMEM budget (what :meth:`default` falls back to)."""
        generation = current_generation() if generation is None else generation
        limit = vmem_limit_bytes(generation)  # also rejects an unknown generation
        sizes = cls(*_PREFERRED_BLOCKS[generation], generation=generation).fit(q_len, kv_len, dtype)
        return sizes.shrunk_to(limit, head_dim, dtype)

    @property
    def kv_step(self) -> int:
        """Keys per grid step of the forward kernel: ``block_k_major``, else ``block_k``."""
        return self.block_k if self.block_k_major is None else self.block_k_major

    def fit(self, q_len: int, kv_len: int, dtype) -> BlockSizes:
        """Clamp the blocks to the sequence lengths, rounded up to whole tiles: a 37-token sequence is one
        block of 40 (f32) or 48 (bf16) rows and 128 keys, not a 512-row block of padding. ``block_k_major``
        is clamped to whole ``block_k`` sub-blocks of the sequence (None once it equals ``block_k``)."""
        block_k = min(self.block_k, round_up(kv_len, NUM_LANES))
        major = None if self.block_k_major is None else min(self.block_k_major, round_up(kv_len, block_k))
        return dataclasses.replace(
            self,
            block_q=min(self.block_q, round_up(q_len, sublanes(dtype))),
            block_k=block_k,
            block_k_major=None if major == block_k else major,
        )

    def for_backward(self, q_len: int, kv_len: int, head_dim: int, dtype) -> BlockSizes:
        """These sizes with every backward field resolved for one shape, as the backward kernels will run.

        A field left None starts from the forward block on the same axis (rounded up to a whole number of
        lanes where the backward kernel puts it on lanes); every field is clamped to the tile-rounded
        sequence length. A kernel whose sizes are all derived is then shrunk until it fits the VMEM
        budget; a kernel with a size you set is checked instead (``ValueError`` with a fix if it won't fit).
        """
        rows = sublanes(dtype)
        q_lanes = round_up(self.block_q, NUM_LANES)
        start = {"block_q_dkv": q_lanes, "block_k_dkv": self.block_k, "block_q_dq": q_lanes, "block_k_dq": self.block_k}
        longest = {
            "block_q_dkv": round_up(q_len, NUM_LANES),
            "block_k_dkv": round_up(kv_len, rows),
            "block_q_dq": round_up(q_len, NUM_LANES),
            "block_k_dq": round_up(kv_len, NUM_LANES),
        }
        chosen = {name: start[name] if getattr(self, name) is None else getattr(self, name) for name in start}
        sizes = dataclasses.replace(self, **{name: min(chosen[name], longest[name]) for name in start})
        limit = vmem_limit_bytes(self.generation)
        for kernel in ("dkv", "dq"):
            if all(getattr(self, name) is None for name in _KERNEL_FIELDS[kernel]):
                sizes = sizes.shrunk_to(limit, head_dim, dtype, kernel=kernel)
            else:
                sizes.validate(dtype, head_dim, kernel=kernel)
        return sizes

    def blocks(self, kernel: str = "forward") -> tuple[int, int]:
        """``(block_q, block_k)`` of ``kernel`` (``"forward"``, ``"dkv"``, ``"dq"``); a backward kernel's
        must have been resolved (:meth:`for_backward`)."""
        if kernel not in _KERNEL_FIELDS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        block_q, block_k = (getattr(self, name) for name in _KERNEL_FIELDS[kernel])
        if block_q is None or block_k is None:
            raise ValueError(
                f"the {_KERNEL_NAMES[kernel]} block sizes are unresolved (None); "
                "call sizes.for_backward(q_len, kv_len, head_dim, dtype) first"
            )
        return block_q, block_k

    def named_blocks(self, kernel: str = "forward") -> dict[str, int | None]:
        """``{field: value}`` of ``kernel``'s blocks (the forward's ``block_k_major`` too, when set)."""
        named = dict(zip(_KERNEL_FIELDS[kernel], self.blocks(kernel), strict=True))
        if kernel == "forward" and self.block_k_major is not None:
            named["block_k_major"] = self.block_k_major
        return named

    def shrunk_to(self, limit: int, head_dim: int, dtype, kernel: str = "forward") -> BlockSizes:
        """Halve ``kernel``'s larger block (keeping whole tiles) until its VMEM estimate is within ``limit``."""
        q_field, k_field = _KERNEL_FIELDS[kernel]
        q_multiple, k_multiple = (_tile_rule(name, sublanes(dtype))[0] for name in (q_field, k_field))
        sizes = self
        while sizes.vmem_bytes(head_dim, dtype, kernel=kernel) > limit:
            block_q, block_k = sizes.blocks(kernel)
            if kernel == "forward" and sizes.block_k_major is not None:  # first fewer keys per copy
                major = round_up(sizes.block_k_major // 2, block_k)
                shrunk = major if block_k < major < sizes.block_k_major else None
                sizes = dataclasses.replace(sizes, block_k_major=shrunk)
            elif block_k >= max(block_q, 2 * k_multiple):
                sizes = dataclasses.replace(sizes, **{k_field: round_up(block_k // 2, k_multiple)})
            elif block_q >= 2 * q_multiple:
                sizes = dataclasses.replace(sizes, **{q_field: round_up(block_q // 2, q_multiple)})
            else:
                raise ValueError(f"head_dim={head_dim} is too large: even the smallest blocks overflow VMEM")
        return sizes

    def vmem_bytes(self, head_dim: int, dtype, kernel: str = "forward", heads_per_step: int = 1) -> int:
        """Estimated scoped VMEM of one grid step of ``kernel`` (``"forward"``, ``"dkv"``, ``"dq"``), in bytes.

        Forward:

        * q and out ``[block_q, head_dim]``, k and v ``[block_k_major, head_dim]`` blocks, double-buffered
          (the pipeline fetches step ``i + 1`` while computing ``i``);
        * the lse output block ``[block_q, 128]`` f32, double-buffered;
        * scratch: f32 running max ``m`` and sum ``l`` as lane-replicated ``[block_q, 128]`` tiles, and the
          accumulator ``[block_q, head_dim]``;
        * the body's f32 temporaries, far larger than the 64 vector registers: three ``[block_q, block_k]``
          tiles (scores, their max-shifted copy, probabilities; the mask and the bf16 matmul operand reuse
          their space) and one ``[block_q, head_dim]`` tile (``p @ v`` before it joins the accumulator);
          with ``block_k_major``, ``n + 1/2`` tiles for ``n`` sub-blocks when that is more (the old compiler
          keeps one per unrolled sub-block).

        ``heads_per_step`` (forward only): the query heads of a GQA group one grid step computes against one
        k/v block (:func:`flashlib.kernels.tpu_forward.heads_per_step`): q, out, lse, the scratch and the
        ``p @ v`` tile are per head; k, v and the score tiles (the heads run one after another) are not.

        The backward kernels (:meth:`_backward_vmem_bytes`) count the same kinds of buffer.

        ``head_dim`` is padded to whole lanes (VMEM may store ``[rows, 64]`` as ``[rows, 128]``). The count
        errs on the safe side: it is never below what Mosaic allocates in ``tests/test_block_sizes.py``'s
        sweep, for the old and the new compiler, and newer compilers need up to a tile or two less (so some
        configurations near the limit are refused although a new compiler would take them).
        """
        if kernel != "forward":
            return self._backward_vmem_bytes(head_dim, dtype, kernel)
        itemsize = np.dtype(dtype).itemsize
        lanes = round_up(head_dim, NUM_LANES)
        rows = heads_per_step * self.block_q  # query rows of all the step's heads
        double_buffered = 2 * (
            rows * lanes * itemsize  # q
            + 2 * self.kv_step * lanes * itemsize  # k, v
            + rows * lanes * itemsize  # out
            + rows * NUM_LANES * F32_BYTES  # lse
        )
        scratch = (2 * rows * NUM_LANES + rows * lanes) * F32_BYTES  # m, l, acc
        sub_blocks = self.kv_step // self.block_k
        half_tiles = max(2 * _SCORE_TILES, _HALF_TILES_PER_SUB_BLOCK * sub_blocks + _EXTRA_HALF_TILES)
        temporaries = (half_tiles * self.block_q * self.block_k // 2 + rows * lanes) * F32_BYTES
        return double_buffered + scratch + temporaries

    def _backward_vmem_bytes(self, head_dim: int, dtype, kernel: str) -> int:
        """The backward kernels' VMEM per grid step, counted like the forward's:

        * double-buffered blocks: q and dO ``[block_q, head_dim]``, k and v ``[block_k, head_dim]``, the f32
          row statistics lse and D as ``[8, block_q]`` rows, and the outputs (dK and dV ``[block_k,
          head_dim]``; or dQ ``[block_q, head_dim]``);
        * f32 scratch: the accumulators (dK and dV; or dQ), and for dQ the lane-replicated ``[block_q, 128]``
          copies of lse and D it builds once per query block;
        * temporaries: f32 score tiles (``s``, ``p``, ``dp``, ``ds`` and the bf16 matmul operands share
          three in dK/dV, four in dQ: see the calibration note at ``_DKV_SCORE_TILES``) and one
          ``[block, head_dim]`` f32 matmul result.
        """
        block_q, block_k = self.blocks(kernel)
        itemsize = np.dtype(dtype).itemsize
        lanes = round_up(head_dim, NUM_LANES)
        inputs = (2 * block_q + 2 * block_k) * lanes * itemsize + 2 * _ROW_STAT_ROWS * block_q * F32_BYTES
        if kernel in ("dkv", "fused"):
            outputs = 2 * block_k * lanes * itemsize  # dk, dv
            scratch = 2 * block_k * lanes * F32_BYTES  # dk, dv accumulators
            temporaries = (_DKV_SCORE_TILES * block_k * block_q + block_k * lanes) * F32_BYTES
        else:
            outputs = block_q * lanes * itemsize  # dq
            scratch = (block_q * lanes + 2 * block_q * NUM_LANES) * F32_BYTES  # dq accumulator; lse, D columns
            temporaries = (_DQ_SCORE_TILES * block_q * block_k + block_q * lanes) * F32_BYTES
        return 2 * (inputs + outputs) + scratch + temporaries

    def validate(self, dtype, head_dim: int, kernel: str = "forward") -> None:
        """Check the dtype-dependent rules for ``kernel``: its row blocks a multiple of the dtype's sublane
        tile, and its VMEM estimate within the target's scoped limit. Raises ``ValueError`` naming the
        field and a fix."""
        rows = sublanes(dtype)
        name = np.dtype(dtype).name
        q_field, k_field = _KERNEL_FIELDS[kernel]
        for field, value in zip((q_field, k_field), self.blocks(kernel), strict=True):
            if field not in _LANE_FIELDS:
                _check_block(field, value, rows, f"a {name} register tile has {rows} rows")
        need, limit = self.vmem_bytes(head_dim, dtype, kernel=kernel), vmem_limit_bytes(self.generation)
        if need > limit:
            smaller = self.shrunk_to(limit, head_dim, dtype, kernel=kernel)
            where = "" if kernel == "forward" else f" in the {_KERNEL_NAMES[kernel]} kernel"
            have, fix = (", ".join(f"{f}={v}" for f, v in s.named_blocks(kernel).items()) for s in (self, smaller))
            raise ValueError(
                f"{have} need about {need / MIB:.1f} MiB of VMEM{where} for head_dim={head_dim} {name}, over the "
                f"{limit // MIB} MiB scoped limit of {self.generation or current_generation()}; try {fix}"
            )


def entry_block_sizes(entry: TuningResult) -> BlockSizes | None:
    """A tuned table entry's best configuration as ``BlockSizes`` for its generation (None: it has none)."""
    best = entry.best
    return None if best is None else BlockSizes(**best.blocks, generation=entry.generation)


def lookup(q_len: int, kv_len: int, head_dim: int, dtype, causal: bool, generation: str,
           table: Mapping[TableKey, TuningResult] | None = None) -> BlockSizes | None:
    """The tuned forward ``BlockSizes`` for a call: the entry the nearest-entry rule picks
    (:func:`flashlib.kernels.tuned_table.nearest_entry`), clamped to the call and validated; None when the
    table has no answer (then :meth:`BlockSizes.default` keeps the generation's preferred blocks)."""
    entry = nearest_entry(q_len, kv_len, head_dim, jnp.dtype(dtype).name, causal, generation, table)
    if entry is None:
        return None
    sizes = entry_block_sizes(entry).fit(q_len, kv_len, dtype)
    try:
        sizes.validate(dtype, head_dim)
    except ValueError:
        return None
    return sizes
