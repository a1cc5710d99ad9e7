"""flashlib: flash attention built step by step, from naive softmax to a Pallas TPU kernel.

One entry point, many stages::

    import flashlib
    out = flashlib.attention(q, k, v, causal=True, impl="blockwise")   # q [batch, heads, seq, head_dim]
    flashlib.implementations()   # {"reference": "...", "blockwise": "...", "pallas": "...", "xla": "..."}

Modules: ``api`` (contract, registry), ``reference`` (naive, float64 oracle, softmax, state merge),
``blockwise`` (pure-JAX flash attention), ``kernels`` (Pallas TPU kernels), ``xla``, ``env``, ``checks``,
``tpu_compile``, ``data`` (real attention data). ``viz`` and ``widgets`` need the notebook extras
(matplotlib, ipywidgets) and are imported on demand: ``from flashlib import viz``.
"""

# Importing the stage modules registers them with the entry point.
from flashlib import blockwise, checks, data, env, kernels, reference, tpu_compile, xla
from flashlib.api import AttentionShape, attention, get_implementation, implementations, validate_inputs
from flashlib.kernels import BlockSizes

__version__ = "0.1.0"

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
    "tpu_compile",
    "validate_inputs",
    "xla",
]
