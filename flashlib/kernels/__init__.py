"""Pallas TPU kernels: block sizes, the flash-attention forward and backward, and ``impl="pallas"`` (their
differentiable union, registered on import)."""

from flashlib.kernels.attention import HIGHER_ORDER_MESSAGE, flash_attention
from flashlib.kernels.block_sizes import MASK_VALUE, NUM_LANES, NUM_SUBLANES, BlockSizes
from flashlib.kernels.tpu_backward import flash_attention_backward
from flashlib.kernels.tpu_forward import flash_attention_forward

__all__ = [
    "HIGHER_ORDER_MESSAGE",
    "MASK_VALUE",
    "NUM_LANES",
    "NUM_SUBLANES",
    "BlockSizes",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_forward",
]
