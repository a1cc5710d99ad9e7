"""The teaching solutions of notebook 05's puzzles and exercises (:mod:`flashlib.exercises.pallas_basics`): the code
the hints cells show as each one's last level, and what the notebook runs until the learner's version passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import flashlib

__all__ = ["add_bias_solution", "count_copies_solution", "matmul_bias_solution", "matmul_kernel_solution",
           "matmul_solution", "row_sum_fixed_solution"]


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


# -- the exercises' solutions -------------------------------------------------------------------------------------


def matmul_bias_solution(x, y, bias, *, interpret=None):
    def kernel(x_ref, y_ref, b_ref, o_ref, acc_ref):  # b_ref: [1, 128], the bias above output block (i, j)
        k = pl.program_id(2)

        @pl.when(k == 0)
        def init():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(k == pl.num_programs(2) - 1)
        def finalize():
            o_ref[...] = acc_ref[...] + b_ref[...]  # once per output block; the row broadcasts over the rows

    if interpret is None:  # compiled on a TPU, interpreted elsewhere (the notebook's INTERPRET)
        interpret = flashlib.env.interpret_default()
    (m, kk), n, block = x.shape, y.shape[1], 128
    return pl.pallas_call(
        kernel,
        grid=(m // block, n // block, kk // block),
        in_specs=[pl.BlockSpec((block, block), lambda i, j, k: (i, k)),
                  pl.BlockSpec((block, block), lambda i, j, k: (k, j)),
                  pl.BlockSpec((1, block), lambda i, j, k: (0, j))],  # the bias's only row of blocks, column j
        out_specs=pl.BlockSpec((block, block), lambda i, j, k: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        scratch_shapes=[pltpu.VMEM((block, block), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(x, y, bias)


def count_copies_solution(visits, index_map):
    blocks = [index_map(*point) for point in visits]  # the block each step needs, in the order visited
    return 1 + sum(a != b for a, b in zip(blocks, blocks[1:], strict=False))  # the first copy, then each change


def row_sum_fixed_solution(x, *, interpret=None):
    def kernel(x_ref, o_ref, acc_ref):  # x [8, 128] -> o, acc [8, 1]
        @pl.when(pl.program_id(1) == 0)  # bug 1: scratch starts as garbage; zero it at each row's first column block
        def init():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        acc_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True)
        o_ref[...] = acc_ref[...]

    if interpret is None:  # compiled on a TPU, interpreted elsewhere (the notebook's INTERPRET)
        interpret = flashlib.env.interpret_default()
    return pl.pallas_call(
        kernel,
        grid=(x.shape[0] // 8, x.shape[1] // 128),
        in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((8, 1), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], 1), jnp.float32),
        scratch_shapes=[pltpu.VMEM((8, 1), jnp.float32)],
        # bug 2: the column axis carries the running sum from step to step, so it is "arbitrary", not "parallel"
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(x)
