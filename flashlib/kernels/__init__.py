"""``impl="pallas"``, the Pallas TPU backend, with everything it owns, bottom up:

* ``tuned_table``: the committed table of tuned block sizes, read (the sweep that writes it is
  :mod:`flashlib.tuning`, above the kernels);
* ``block_sizes``: :class:`BlockSizes`, its tiling rule, per-chip defaults (the table first) and VMEM budget;
* ``options``: the backend's options, checked and resolved once per call;
* ``candidates``: its search space, the configurations a tuner should try (the tuner asks, never decides);
* ``scores``: what every kernel makes its scores and row statistics with;
* ``forward_kernel``: the forward kernel's body; ``tpu_forward``: the forward pass around it (grid, BlockSpecs,
  tables, GQA's heads per step); ``backward_kernels``: the dK/dV, fused dK/dV/dQ and dQ kernels;
  ``tpu_backward``: the backward pass that runs them (D, padding, which kernels);
* ``attention``: their differentiable union, registered as ``impl="pallas"`` on import;
* ``tpu_decode``: the decode kernels (split-KV over a contiguous or paged KV cache); ``decoding``:
  :func:`decode_attention`, decoding's entry point (kernels or :mod:`flashlib.decode`'s pure-JAX stages).

The tiling rule's numbers and the causal geometry are the ground's (:mod:`flashlib.tiling`,
:mod:`flashlib.geometry`); they are re-exported here for the notebooks."""

from flashlib.geometry import MASK_VALUE
from flashlib.kernels.attention import HIGHER_ORDER_MESSAGE, flash_attention
from flashlib.kernels.block_sizes import BlockSizes
from flashlib.kernels.decoding import decode_attention
from flashlib.kernels.tpu_backward import flash_attention_backward
from flashlib.kernels.tpu_forward import flash_attention_forward
from flashlib.tiling import NUM_LANES, NUM_SUBLANES

__all__ = [
    "HIGHER_ORDER_MESSAGE",
    "MASK_VALUE",
    "NUM_LANES",
    "NUM_SUBLANES",
    "BlockSizes",
    "decode_attention",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_forward",
]
