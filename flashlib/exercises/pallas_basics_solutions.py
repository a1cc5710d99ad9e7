"""The teaching solutions of notebook 05's puzzles (:mod:`flashlib.exercises.pallas_basics`): the code the hints
cells show as each puzzle's last level, and what the notebook runs until the learner's version passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import flashlib

__all__ = ["add_bias_solution", "matmul_kernel_solution", "matmul_solution"]


def add_bias_solution(x, b, *, interpret=None):
    def kernel(x_ref, b_ref, o_ref):  # x_ref, o_ref: [8, 128]; b_ref: [1, 128]
        o_ref[...] = x_ref[...] + b_ref[...]  # broadcasts over the 8 rows

    if interpret is None:  # compiled on a TPU, interpreted elsewhere (the notebook's INTERPRET)
        interpret = flashlib.env.interpret_default()
    tile = pl.BlockSpec((8, 128), lambda j, i: (i, j))  # grid step (j, i) -> row block i, column block j
    bias = pl.BlockSpec((1, 128), lambda j, i: (0, j))  # the same block for every inner step i
    return pl.pallas_call(kernel, grid=(x.shape[1] // 128, x.shape[0] // 8), in_specs=[tile, bias],
                          out_specs=tile, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, b)


def matmul_kernel_solution(x_ref, y_ref, o_ref, acc_ref):  # x [bm, bk], y [bk, bn], o [bm, bn]; acc [bm, bn] f32
    k = pl.program_id(2)

    @pl.when(k == 0)
    def init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)  # on the MXU

    @pl.when(k == pl.num_programs(2) - 1)
    def finalize():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def matmul_solution(x, y, *, kernel=matmul_kernel_solution, block=128, semantics=("parallel", "parallel", "arbitrary"),
                    interpret=None):
    if interpret is None:  # compiled on a TPU, interpreted elsewhere (the notebook's INTERPRET)
        interpret = flashlib.env.interpret_default()
    (m, kk), n = x.shape, y.shape[1]
    return pl.pallas_call(
        kernel,
        grid=(m // block, n // block, kk // block),
        in_specs=[pl.BlockSpec((block, block), lambda i, j, k: (i, k)),
                  pl.BlockSpec((block, block), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((block, block), lambda i, j, k: (i, j)),  # ignores k: stays in VMEM
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        scratch_shapes=[pltpu.VMEM((block, block), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=interpret,
    )(x, y)
