"""The few places where jax 0.7.2 (Colab's TPU runtime) and the newest jax differ, hidden in one module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def cost_analysis_dict(compiled: Any) -> dict[str, float]:
    """``compiled.cost_analysis()`` as one dict: older jax returned a list with one dict per program."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return dict(cost or {})


def grid_point_recorder(record: Callable[[tuple[int, ...], int], object]) -> Callable[..., Any]:
    """Adapt ``record(grid_point, core_id)`` to ``pltpu.InterpretParams(grid_point_recorder=...)``.

    TPU interpret mode calls the recorder once per grid step, in the order it visits the grid. jax 0.7.2
    calls ``recorder(grid_point, core_id)`` and ignores the result; newer jax threads an ordering token
    through it, ``recorder(token, grid_point, core_id)``, and needs the token back. ``record`` gets the grid
    point as a tuple of Python ints and the core id as an int, whichever jax calls.
    """

    def recorder(*args: Any) -> Any:
        if len(args) == 3:  # newer jax: (token, grid_point, core_id) -> token
            token, point, core = args
        elif len(args) == 2:  # jax 0.7.2: (grid_point, core_id) -> None
            (point, core), token = args, None
        else:
            raise TypeError(f"grid_point_recorder expected 2 or 3 arguments from jax, got {len(args)}")
        record(tuple(int(p) for p in np.ravel(np.asarray(point))), int(np.asarray(core)))
        return token

    return recorder
