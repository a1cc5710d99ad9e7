"""Block sizes for the Pallas TPU kernels: the (8, 128) tiling rule, per-chip defaults, the VMEM budget.

A TPU vector register holds an ``[8, 128]`` tile of 32-bit values: 8 *sublanes* by 128 *lanes*. A block
that Pallas copies into VMEM must therefore be a whole number of tiles in its last two dimensions (or span
the whole array dimension). For our kernels that means:

* ``block_q`` (rows of a ``[block_q, head_dim]`` tile) is a multiple of the sublane count, which grows as
  the dtype shrinks: 8 rows for float32, 16 for bfloat16 (two values are packed per 32-bit sublane);
* ``block_k`` is a multiple of 128 because the score tile ``[block_q, block_k]`` puts keys on lanes.

``head_dim`` is never split: every block spans the whole head dimension (the "equal to the array
dimension" exception of the rule), so any head size lowers; VMEM still pads it up to whole lanes.

The second limit is VMEM: every buffer of one grid step must fit in the compiler's *scoped* VMEM limit
(16 MiB by default on v5e, 32 MiB on v6e). :meth:`BlockSizes.vmem_bytes` counts them so flashlib can
refuse a configuration with a readable message before Mosaic refuses it with a stack trace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from flashlib import env

__all__ = [
    "GENERATIONS",
    "MASK_VALUE",
    "MIB",
    "NUM_LANES",
    "NUM_SUBLANES",
    "BlockSizes",
    "current_generation",
    "round_up",
    "sublanes",
    "vmem_limit_bytes",
]

NUM_LANES = 128  # lanes of a vector register: the minor (last) dimension of a tile
NUM_SUBLANES = 8  # sublanes of a vector register for 32-bit values: the second-minor dimension
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite, so `s - m` never computes -inf - (-inf)
MIB = 1 << 20

# The compiler's default scoped-VMEM limit per chip generation (a kernel needing more fails to compile
# unless it raises ``vmem_limit_bytes``), and the (block_q, block_k) a kernel starts from there.
_SCOPED_VMEM_BYTES: dict[str, int] = {"v5e": 16 * MIB, "v6e": 32 * MIB}
_PREFERRED_BLOCKS: dict[str, tuple[int, int]] = {"v5e": (512, 512), "v6e": (1024, 512)}
GENERATIONS: tuple[str, ...] = tuple(_SCOPED_VMEM_BYTES)
_DEVICE_KINDS: dict[str, str] = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}
_F32_BYTES = 4  # m, l, the accumulator and the score tile are float32 whatever the input dtype
# f32 [block_q, block_k] tiles the body keeps in VMEM at once. Calibrated on v5e by bisecting
# vmem_limit_bytes: beyond the buffers counted in `vmem_bytes`, libtpu 0.0.23 (Colab's) allocates up to
# 3.2 such tiles, libtpu 0.0.50 up to 2.
_SCORE_TILES = 3


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``x``."""
    return -(-x // multiple) * multiple


def sublanes(dtype) -> int:
    """Rows of one ``[rows, 128]`` register tile for ``dtype``: 8 for float32, 16 for bfloat16."""
    return NUM_SUBLANES * _F32_BYTES // np.dtype(dtype).itemsize


def current_generation() -> str:
    """The TPU generation we run on (``"v5e"``, ``"v6e"``); ``"v5e"``, the smallest VMEM budget, elsewhere."""
    if env.backend() == "tpu":
        return _DEVICE_KINDS.get(env.device_kind(), "v5e")
    return "v5e"


def vmem_limit_bytes(generation: str | None = None) -> int:
    """The default scoped-VMEM limit of ``generation`` (None: :func:`current_generation`)."""
    generation = current_generation() if generation is None else generation
    if generation not in _SCOPED_VMEM_BYTES:
        raise ValueError(f"generation must be one of {', '.join(GENERATIONS)} (or None), got {generation!r}")
    return _SCOPED_VMEM_BYTES[generation]


def _check_block(field: str, value: object, multiple: int, why: str) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        example = round_up(4 * NUM_LANES, multiple)
        raise ValueError(f"{field} must be a positive int, got {value!r}; e.g. {field}={example}")
    if value % multiple:
        raise ValueError(
            f"{field} must be a multiple of {multiple} ({why}), got {value}; "
            f"try {field}={round_up(int(value), multiple)}"
        )


@dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the flash-attention kernels; validates the dtype-independent tiling rule on creation.

    Attributes:
      block_q: query rows per grid step (a multiple of 8; of 16 for bfloat16, see :meth:`validate`).
      block_k: keys per grid step, a multiple of 128 (keys lie along lanes in the score tile).
      generation: the TPU generation these sizes target (``"v5e"``, ``"v6e"``); it sets the VMEM budget
        they are checked against. None: the chip we run on (``"v5e"`` off-TPU, the smallest budget).
      block_q_dkv, block_k_dkv, block_q_dq, block_k_dq: reserved for the backward kernels (None: reuse
        the forward sizes).
    """

    block_q: int = 512
    block_k: int = 512
    generation: str | None = None
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None
    block_q_dq: int | None = None
    block_k_dq: int | None = None

    def __post_init__(self) -> None:
        rows_why = f"the {NUM_SUBLANES} sublanes of a TPU register tile"
        lanes_why = f"keys lie along the {NUM_LANES} lanes of a TPU register tile"
        _check_block("block_q", self.block_q, NUM_SUBLANES, rows_why)
        _check_block("block_k", self.block_k, NUM_LANES, lanes_why)
        for name in ("block_q_dkv", "block_q_dq"):
            if getattr(self, name) is not None:
                _check_block(name, getattr(self, name), NUM_SUBLANES, rows_why)
        for name in ("block_k_dkv", "block_k_dq"):
            if getattr(self, name) is not None:
                _check_block(name, getattr(self, name), NUM_LANES, lanes_why)
        if self.generation is not None:
            vmem_limit_bytes(self.generation)  # raises for an unknown generation

    @classmethod
    def default(cls, q_len: int, kv_len: int, head_dim: int, dtype, generation: str | None = None) -> BlockSizes:
        """Good sizes for ``generation``: its preferred blocks, clamped to the (padded) sequence lengths and
        halved while they would overflow its VMEM budget."""
        generation = current_generation() if generation is None else generation
        limit = vmem_limit_bytes(generation)  # also rejects an unknown generation
        sizes = cls(*_PREFERRED_BLOCKS[generation], generation=generation).fit(q_len, kv_len, dtype)
        return sizes.shrunk_to(limit, head_dim, dtype)

    def fit(self, q_len: int, kv_len: int, dtype) -> BlockSizes:
        """Clamp the blocks to the sequence lengths, rounded up to whole tiles: a 37-token sequence is one
        block of 40 (f32) or 48 (bf16) rows and 128 keys, not a 512-row block of padding."""
        return dataclasses.replace(
            self,
            block_q=min(self.block_q, round_up(q_len, sublanes(dtype))),
            block_k=min(self.block_k, round_up(kv_len, NUM_LANES)),
        )

    def shrunk_to(self, limit: int, head_dim: int, dtype) -> BlockSizes:
        """Halve the larger block (keeping whole tiles) until the VMEM estimate is within ``limit`` bytes."""
        sizes, rows = self, sublanes(dtype)
        while sizes.vmem_bytes(head_dim, dtype) > limit:
            if sizes.block_k >= max(sizes.block_q, 2 * NUM_LANES):
                sizes = dataclasses.replace(sizes, block_k=round_up(sizes.block_k // 2, NUM_LANES))
            elif sizes.block_q >= 2 * rows:
                sizes = dataclasses.replace(sizes, block_q=round_up(sizes.block_q // 2, rows))
            else:
                raise ValueError(f"head_dim={head_dim} is too large: even the smallest blocks overflow VMEM")
        return sizes

    def vmem_bytes(self, head_dim: int, dtype) -> int:
        """Estimated scoped VMEM of one forward grid step, in bytes.

        * q, k, v and out blocks, double-buffered (the pipeline fetches step ``i + 1`` while computing ``i``);
        * the lse output block ``[block_q, 128]`` f32, double-buffered;
        * f32 scratch: running max ``m`` and sum ``l`` as lane-replicated ``[block_q, 128]`` tiles, and the
          accumulator ``[block_q, head_dim]``;
        * the body's f32 temporaries, far larger than the 64 vector registers: three ``[block_q, block_k]``
          tiles (scores, their max-shifted copy, probabilities; the mask and the bf16 matmul operand reuse
          their space) and one ``[block_q, head_dim]`` tile (``p @ v`` before it joins the accumulator).

        ``head_dim`` is padded to whole lanes (VMEM may store ``[rows, 64]`` as ``[rows, 128]``). The count
        errs on the safe side: it is never below what Mosaic allocates in ``tests/test_block_sizes.py``'s
        sweep, for the old and the new compiler, and newer compilers need up to a tile or two less (so some
        configurations near the limit are refused although a new compiler would take them).
        """
        itemsize = np.dtype(dtype).itemsize
        lanes = round_up(head_dim, NUM_LANES)
        double_buffered = 2 * (
            self.block_q * lanes * itemsize  # q
            + 2 * self.block_k * lanes * itemsize  # k, v
            + self.block_q * lanes * itemsize  # out
            + self.block_q * NUM_LANES * _F32_BYTES  # lse
        )
        scratch = (2 * self.block_q * NUM_LANES + self.block_q * lanes) * _F32_BYTES  # m, l, acc
        temporaries = (_SCORE_TILES * self.block_q * self.block_k + self.block_q * lanes) * _F32_BYTES
        return double_buffered + scratch + temporaries

    def validate(self, dtype, head_dim: int) -> None:
        """Check the dtype-dependent rules: ``block_q`` a multiple of the dtype's sublane tile, and the VMEM
        estimate within the target's scoped limit. Raises ``ValueError`` naming the field and a fix."""
        rows = sublanes(dtype)
        name = np.dtype(dtype).name
        _check_block("block_q", self.block_q, rows, f"a {name} register tile has {rows} rows")
        need, limit = self.vmem_bytes(head_dim, dtype), vmem_limit_bytes(self.generation)
        if need > limit:
            smaller = self.shrunk_to(limit, head_dim, dtype)
            raise ValueError(
                f"block_q={self.block_q}, block_k={self.block_k} need about {need / MIB:.1f} MiB of VMEM for "
                f"head_dim={head_dim} {name}, over the {limit // MIB} MiB scoped limit of "
                f"{self.generation or current_generation()}; try block_q={smaller.block_q}, block_k={smaller.block_k}"
            )

