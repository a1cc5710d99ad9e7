"""flashlib: flash attention built step by step, from naive softmax to a Pallas TPU kernel.

One entry point, many stages::

    import flashlib
    out = flashlib.attention(q, k, v, causal=True, impl="blockwise")   # q [batch, heads, seq, head_dim]
    flashlib.implementations()   # {"reference": "...", "blockwise": "...", "xla": "..."}
"""

from flashlib import blockwise, checks, env, reference, tpu_compile, xla  # noqa: F401  (importing registers the stages)
from flashlib.api import AttentionShape, attention, get_implementation, implementations, validate_inputs

__version__ = "0.1.0"

__all__ = [
    "AttentionShape",
    "attention",
    "blockwise",
    "checks",
    "env",
    "get_implementation",
    "implementations",
    "reference",
    "tpu_compile",
    "validate_inputs",
]
