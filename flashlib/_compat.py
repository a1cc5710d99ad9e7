"""The few places where jax 0.7.2 (Colab's TPU runtime) and the newest jax differ, hidden in one module."""

from __future__ import annotations

from typing import Any


def cost_analysis_dict(compiled: Any) -> dict[str, float]:
    """``compiled.cost_analysis()`` as one dict: older jax returned a list with one dict per program."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return dict(cost or {})
