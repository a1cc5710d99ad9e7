"""flashlib._compat: the same call works on jax 0.7.2 and the newest jax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flashlib._compat import grid_point_recorder


def test_grid_point_recorder_accepts_both_calling_conventions():
    seen = []
    recorder = grid_point_recorder(lambda point, core: seen.append((point, core)))
    assert recorder((np.int32(1), np.int32(2)), np.int32(0)) is None  # jax 0.7.2
    token = np.int32(7)
    assert recorder(token, np.array([3, 4], np.int32), np.int32(1)) is token  # newer jax: the token comes back
    assert seen == [((1, 2), 0), ((3, 4), 1)]
    assert all(isinstance(x, int) for point, core in seen for x in (*point, core))
    with pytest.raises(TypeError, match="2 or 3 arguments"):
        recorder(1)


def _add_one_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def _record(semantics: tuple[str, str], grid=(3, 4)) -> list[tuple[int, ...]]:
    visits: list[tuple[int, ...]] = []
    block = (8, 128)
    x = jnp.arange(grid[0] * 8 * grid[1] * 128, dtype=jnp.float32).reshape(grid[0] * 8, grid[1] * 128)
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    params = pltpu.InterpretParams(grid_point_recorder=grid_point_recorder(lambda point, core: visits.append(point)))
    out = pl.pallas_call(
        _add_one_kernel,
        grid=grid,
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=params,
    )(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) + 1.0)
    return visits


def test_records_a_real_kernel_in_row_major_order():
    assert _record(("arbitrary", "arbitrary")) == [(i, j) for i in range(3) for j in range(4)]


def test_parallel_axes_are_visited_once_each_with_the_arbitrary_axis_innermost():
    visits = _record(("parallel", "arbitrary"))
    assert sorted(visits) == [(i, j) for i in range(3) for j in range(4)]
    rows = [visits[n][0] for n in range(0, len(visits), 4)]
    assert sorted(rows) == [0, 1, 2]  # the parallel axis may be permuted ...
    assert visits == [(i, j) for i in rows for j in range(4)]  # ... the arbitrary one runs 0..3 for each row
