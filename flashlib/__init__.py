"""flashlib: flash attention built step by step, from naive softmax to a Pallas TPU kernel.

One entry point, many stages::

    import flashlib
    out = flashlib.attention(q, k, v, causal=True, impl="blockwise")   # q [batch, heads, seq, head_dim]
    flashlib.implementations()   # {"reference": "...", "blockwise": "...", "pallas": "...", "xla": "..."}

Modules, one concept each, in layers (a module imports only from its layer or below; no cycles —
``tests/test_architecture.py`` checks it, README.md draws it):

* ground — ``api`` (the contract, the registry), ``tiling`` (the (8, 128) rule, padding, kernel names),
  ``geometry`` (the causal mask at element, block and grid grain), ``masks`` (the variants: window, segment
  ids, the features an implementation declares), ``hardware`` (TPU facts with sources),
  ``env``, ``data``, ``release``, ``tpu_compile``, ``provenance``, ``progress``, ``llo_dump``, ``viz``;
* algorithms — ``reference`` (naive, float64 oracle), ``blockwise`` (+ ``blockwise_backward``), ``xla``,
  ``checks``, ``cost``, ``decode``;
* the Pallas backend — ``kernels`` (``tuned_table``, ``block_sizes``, ``options``, ``candidates``, ``scores``,
  ``forward_kernel``, ``tpu_forward``, ``backward_kernels``, ``tpu_backward``, ``attention``, ``tpu_decode``,
  ``decoding``);
* beyond one chip — ``sharded`` (batch/head sharding of any impl with ``shard_map``), ``ring_plan`` (the
  ring's layout, schedule and cost), ``ring_workers`` and ``ring`` (ring attention over a sequence axis:
  ``ppermute``, the merge identity, zig-zag load balance), ``slice_compile`` (in the ground layer: compile for
  a multi-chip TPU slice, read its collectives);
* this package (the public surface);
* measurement — ``estimate``, ``perf_data``, ``decode_estimate``;
* top — ``tuning``, ``bench``, ``perf_plots``, ``widgets`` (``viz`` and ``widgets`` need the notebook extras,
  matplotlib and ipywidgets, and are imported on demand: ``from flashlib import viz``), ``exercises`` (the
  learner's puzzles and exercises, one module per notebook; nothing in the library imports them).
"""

# Importing the stage modules registers them with the entry point.
from flashlib import blockwise, checks, data, env, kernels, reference, release, ring, sharded, tpu_compile, xla
from flashlib.api import AttentionShape, attention, get_implementation, implementations, validate_inputs
from flashlib.kernels import BlockSizes

__version__ = release.version()  # pyproject.toml's, the one source

__all__ = [
    "AttentionShape",
    "BlockSizes",
    "attention",
    "blockwise",
    "checks",
    "data",
    "env",
    "get_implementation",
    "implementations",
    "kernels",
    "reference",
    "release",
    "ring",
    "sharded",
    "tpu_compile",
    "validate_inputs",
    "xla",
]
