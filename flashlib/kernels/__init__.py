"""Pallas TPU kernels: block sizes and the flash-attention forward (importing registers ``impl="pallas"``)."""

from flashlib.kernels.block_sizes import MASK_VALUE, NUM_LANES, NUM_SUBLANES, BlockSizes
from flashlib.kernels.tpu_forward import flash_attention_forward

__all__ = ["MASK_VALUE", "NUM_LANES", "NUM_SUBLANES", "BlockSizes", "flash_attention_forward"]
