"""JAX's ``jax.nn.dot_product_attention`` tests, reproduced against every implementation behind ``flashlib.attention``.

Peer: ``jax-ml/jax`` ``tests/nn_test.py``, class ``NNFunctionsTest`` (read at the repository's head, July
2026): ``testDotProductAttention`` and ``testDotProductAttentionMask``. What they do, and what is kept here:

* Shapes: ``B, S, T, N, H = 2, 128, 128, 4, 32`` in JAX's ``[batch, seq, heads, head_dim]`` layout
  (``layout="bshd"`` here); q, k, v and the output cotangent ``random.normal`` directly in the dtype, from
  ``random.split(random.PRNGKey(0), 5)`` (``4`` in the mask test); default scale ``1/sqrt(H)``.
* ``testDotProductAttention``: dtype {bfloat16, float16}, ``group_num`` {1, 2, 4}, ``use_vmap`` {False, True},
  impl {cudnn, xla}; output and dq, dk, dv within ``atol = rtol = 0.01`` (``assertAllClose``). ``use_vmap``
  maps the implementation over the batch axis (``in_axes=0``) while the reference runs unmapped.
* ``testDotProductAttentionMask``: bfloat16 only; ``mask_mode`` ``causal`` (and ``custom``, a ``jnp.tril``
  mask, which with T == S is the same causal mask) within output ``0.01``, dq ``0.02``, dk ``0.02``, dv
  ``0.01`` (atol = rtol). With T == S JAX's top-left ``is_causal`` and flashlib's bottom-right causal agree.
* Reference: ``jax.nn.dot_product_attention(..., implementation=None)`` in the *same* dtype, differentiated
  by ``jax.vjp``. Here every case is checked against that reference, as the peer does, and against
  flashlib's float64 oracle on the same rounded inputs, both with the peer's tolerances.
* The peer runs eagerly (no ``jax.jit``), and so does every case here; the unmapped bfloat16 cases run under
  ``jax.jit`` as well (flashlib's "xla" implementation had a bfloat16-under-jit accuracy defect).

float16 (flashlib has none) maps to float32, with the peer's tolerance (the same 0.01 for both its dtypes).
``use_vmap`` maps ``flashlib.attention`` over an extra leading axis: the arrays become ``[B, 1, T, N, H]`` and
each mapped call sees one ``[1, T, N, H]`` batch, the peer's per-example call.

Cut, and why:

* ``group_num`` 2 and 4 (grouped-query attention): flashlib needs the same number of heads for q, k, v.
* ``return_residual`` (the logsumexp and its cotangent): ``flashlib.attention`` returns the output only.
* Mask modes ``bias``, ``padding``, ``sliding_window`` and their combinations, and the bias-gradient test:
  flashlib takes no bias, mask arrays, sequence lengths or local windows. ``custom`` is the causal case.
* The cuDNN backend checks: no GPU here.

Smoke environment (``tests/conftest.py``, marker ``rotate_jnp_impls``): under ``make test-colab`` each fixed case
here runs on pallas and on one of reference, blockwise and xla (chosen per case); ``make test`` runs every
case on every impl.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashlib
from flashlib.reference import attention_oracle, attention_vjp_oracle
from peers.rules import IMPLS, allclose_failure

pytestmark = pytest.mark.rotate_jnp_impls

B, S, T, N, H = 2, 128, 128, 4, 32
NAMES = ("out", "dq", "dk", "dv")
TOL = dict.fromkeys(NAMES, 0.01)  # testDotProductAttention: atol = rtol = .01 for all four
MASK_TOL = {"out": 0.01, "dq": 0.02, "dk": 0.02, "dv": 0.01}  # testDotProductAttentionMask (atol = rtol)
BHSD = (0, 2, 1, 3)  # [b, t, n, h] <-> [b, n, t, h]


@functools.cache
def inputs(dtype: str, num_keys: int):
    """Q, K, V and the output cotangent, drawn as the peer draws them."""
    keys = jax.random.split(jax.random.PRNGKey(0), num_keys)
    dtype = jnp.dtype(dtype)
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k = jax.random.normal(keys[1], (B, S, N, H), dtype)
    v = jax.random.normal(keys[2], (B, S, N, H), dtype)
    grad = jax.random.normal(keys[3], (B, T, N, H), dtype)
    return q, k, v, grad


@functools.cache
def references(dtype: str, num_keys: int, causal: bool):
    """``{"peer": (out, dq, dk, dv), "oracle": (...)}``: the peer's same-dtype ``jax.nn.dot_product_attention``
    (``implementation=None``, eager ``jax.vjp``) and flashlib's float64 oracle, in ``[b, t, n, h]``."""
    q, k, v, grad = inputs(dtype, num_keys)
    out, pullback = jax.vjp(
        functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation=None), q, k, v)
    peer = (out, *pullback(grad))
    q64, k64, v64, g64 = (np.asarray(x, np.float64).transpose(BHSD) for x in (q, k, v, grad))
    exact = (attention_oracle(q64, k64, v64, causal=causal),
             *attention_vjp_oracle(q64, k64, v64, g64, causal=causal))
    return {"peer": peer, "oracle": tuple(x.transpose(BHSD) for x in exact)}


def output_and_grads(impl: str, causal: bool, dtype: str, num_keys: int, *, use_vmap: bool, jit: bool):
    """(out, dq, dk, dv) of ``flashlib.attention`` by ``jax.vjp``, mapped over an extra leading axis with
    ``use_vmap``, eagerly or under ``jax.jit``."""
    q, k, v, grad = inputs(dtype, num_keys)

    def attn(q, k, v):
        return flashlib.attention(q, k, v, causal=causal, layout="bshd", impl=impl)

    if use_vmap:
        attn = jax.vmap(attn)
        q, k, v, grad = (x[:, None] for x in (q, k, v, grad))  # [B, 1, T, N, H]: one batch per mapped call

    def run(q, k, v, grad):
        out, pullback = jax.vjp(attn, q, k, v)
        return (out, *pullback(grad))

    results = (jax.jit(run) if jit else run)(q, k, v, grad)
    return tuple(x[:, 0] for x in results) if use_vmap else results


def check(got, refs, tols, what: str) -> None:
    """Every quantity within ``tols[name]`` (atol = rtol) of both references; all failures in one message."""
    failures = [f"vs {ref_name} {line}" for ref_name, ref in refs.items()
                for name, g, r in zip(NAMES, got, ref, strict=True)
                if (line := allclose_failure(name, g, r, atol=tols[name], rtol=tols[name]))]
    assert not failures, f"{what}: " + "; ".join(failures)


# (dtype, use_vmap, jit): the peer's runs (eager, with and without vmap) in bfloat16 and in float32 for its
# float16, and bfloat16 under jit once.
VARIANTS = [("bfloat16", False, False), ("bfloat16", True, False), ("bfloat16", False, True),
            ("float32", False, False), ("float32", True, False)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("dtype", "use_vmap", "jit"), [
    pytest.param(*variant, id=f"{variant[0]}-{'vmap' if variant[1] else 'novmap'}-{'jit' if variant[2] else 'eager'}")
    for variant in VARIANTS])
def test_dot_product_attention(dtype, use_vmap, jit, impl):
    """Peer: nn_test.py, ``NNFunctionsTest.testDotProductAttention`` (``group_num=1``, no lse residual):
    output, dq, dk, dv within atol = rtol = 0.01 of the same-dtype reference (and of the float64 oracle), with
    and without ``jax.vmap``; B, T, N, H = 2, 128, 4, 32."""
    got = output_and_grads(impl, False, dtype, 5, use_vmap=use_vmap, jit=jit)
    assert got[0].dtype == jnp.dtype(dtype)
    check(got, references(dtype, 5, False), TOL, f"impl={impl!r} {dtype} use_vmap={use_vmap} jit={jit}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_dot_product_attention_mask_causal(jit, impl):
    """Peer: nn_test.py, ``NNFunctionsTest.testDotProductAttentionMask`` with ``mask_mode='causal'`` (and
    ``'custom'``, its ``jnp.tril`` mask being the same causal mask at T == S): bfloat16, output and dv within
    atol = rtol = 0.01, dq and dk within 0.02, of the same-dtype reference (and of the float64 oracle)."""
    got = output_and_grads(impl, True, "bfloat16", 4, use_vmap=False, jit=jit)
    check(got, references("bfloat16", 4, True), MASK_TOL, f"impl={impl!r} causal bfloat16 jit={jit}")
