"""The configurations of the Pallas kernels worth trying for one shape: the backend's own search space.

The tuner (:mod:`flashlib.tuning`) asks for them and compiles each one; it never decides what a valid
configuration is. Every candidate obeys the tiling rule and fits the generation's VMEM budget as
:class:`~flashlib.kernels.BlockSizes` counts it; a refused one comes back with the reason, so the tuned
table records it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from flashlib.kernels.block_sizes import GENERATIONS, BlockSizes

__all__ = ["BLOCK_CHOICES", "MAJOR_CHOICES", "candidates", "screen"]

BLOCK_CHOICES: tuple[int, ...] = (256, 512, 1024)  # tried for block_q and for block_k
MAJOR_CHOICES: tuple[int, ...] = (2048, 4096)  # block_k_major (keys per k/v copy) tried on top of one block_k


def screen(seq_q: int, seq_k: int, head_dim: int, dtype, generation: str, choices: Iterable[int],
           majors: Iterable[int] = ()) -> tuple[list[BlockSizes], list[tuple[BlockSizes, str]]]:
    """``(accepted, [(refused, why)])``: every pair of ``choices`` (each alone and with every larger copy size
    of ``majors``), clamped to the sequence, deduplicated."""
    if generation not in GENERATIONS:
        raise ValueError(f"generation must be one of {', '.join(GENERATIONS)}, got {generation!r}")
    accepted: list[BlockSizes] = []
    refused: list[tuple[BlockSizes, str]] = []
    seen: set[tuple[int, int, int | None]] = set()
    choices, majors = list(choices), list(majors)
    for block_q, block_k in itertools.product(choices, choices):
        for major in [None, *(m for m in majors if m > block_k and m % block_k == 0)]:
            sizes = BlockSizes(block_q, block_k, generation=generation, block_k_major=major).fit(seq_q, seq_k, dtype)
            if (sizes.block_q, sizes.block_k, sizes.block_k_major) in seen:
                continue
            seen.add((sizes.block_q, sizes.block_k, sizes.block_k_major))
            try:
                sizes.validate(dtype, head_dim)
            except ValueError as err:
                refused.append((sizes, str(err)))
            else:
                accepted.append(sizes)
    return accepted, refused


def candidates(seq_q: int, seq_k: int, head_dim: int, dtype, generation: str,
               choices: Iterable[int] = BLOCK_CHOICES, majors: Iterable[int] = MAJOR_CHOICES) -> list[BlockSizes]:
    """The forward ``BlockSizes`` worth compiling for one shape on ``generation`` (``"v5e"``, ``"v6e"``).

    Every ``block_q x block_k`` of ``choices``, alone and with each ``block_k_major`` of ``majors`` that holds
    whole ``block_k`` sub-blocks, clamped to the tile-rounded sequences and deduplicated, that obeys the
    dtype's tiling rule and fits flashlib's VMEM estimate for the generation's scoped limit.
    """
    return screen(seq_q, seq_k, head_dim, dtype, generation, choices, majors)[0]
