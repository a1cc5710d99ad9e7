"""flashlib.tpu_compile: the TPU toolchain's answers, in plain words, from a CPU machine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from flashlib import tpu_compile


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def tiled_copy(block: tuple[int, int]):
    """A Pallas copy kernel over ``block``-sized tiles, compiled (not interpreted)."""

    def index_map(i, j):
        return i, j

    def fn(x):
        grid = (x.shape[0] // block[0], x.shape[1] // block[1])
        spec = pl.BlockSpec(block, index_map)
        return pl.pallas_call(_copy_kernel, grid=grid, in_specs=[spec], out_specs=spec,
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name="tiled_copy")(x)

    return fn


X = jax.ShapeDtypeStruct((512, 2048), jnp.float32)


def test_lowering_accepts_a_well_tiled_kernel():
    result = tpu_compile.lower_for_tpu(tiled_copy((8, 128)), X)
    assert result.ok and not result.skipped
    assert str(result) == "tpu lowering: accepted — lowers to Mosaic for TPU"


@pytest.mark.parametrize("block", [(4, 128), (8, 100)])
def test_lowering_rejects_the_tiling_rule_in_plain_words(block):
    result = tpu_compile.lower_for_tpu(tiled_copy(block), X)
    assert not result.ok
    assert result.summary.startswith("block shape breaks the TPU tiling rule")
    assert f"block {block}" in result.summary
    assert "divisible by 8 and 128" in result.compiler_message


@pytest.mark.tpu
@pytest.mark.parametrize("topology", ["v5e:1x1", "v6e:1x1"])
def test_aot_compile_accepts_a_small_kernel(topology):
    result = tpu_compile.compile_for_tpu(tiled_copy((256, 512)), X, topology=topology)
    assert result.ok, result.compiler_message
    assert result.target == topology


@pytest.mark.tpu
def test_aot_compile_reports_vmem_overflow():
    big = jax.ShapeDtypeStruct((2048, 4096), jnp.float32)  # one 32 MiB block, double-buffered in and out
    result = tpu_compile.compile_for_tpu(tiled_copy((2048, 4096)), big, topology="v5e:1x1")
    assert not result.ok
    assert result.summary.startswith("does not fit in VMEM"), result.summary
    assert "16.00MB" in result.summary


@pytest.mark.tpu
def test_aot_compile_reports_cost_analysis():
    result = tpu_compile.compile_for_tpu(lambda a, b: a @ b, X, X.update(shape=(2048, 256)))
    assert result.ok
    assert result.flops == pytest.approx(2 * 512 * 2048 * 256)


def test_compile_skips_clearly_without_libtpu(monkeypatch):
    monkeypatch.setattr(tpu_compile.env, "has_libtpu", lambda: False)
    result = tpu_compile.compile_for_tpu(tiled_copy((8, 128)), X)
    assert result.skipped and not result.ok
    assert "libtpu is not installed" in str(result)


def test_explain_falls_back_to_the_first_line():
    assert tpu_compile.explain_compiler_error("\n  Something odd\nmore") == "Something odd"
