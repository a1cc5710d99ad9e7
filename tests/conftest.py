"""Shared test set-up: CPU only, deterministic keys, hypothesis profiles, the ``tpu`` marker, the
picture tests' fixtures and marks."""

from __future__ import annotations

import gc
import importlib
import os

# Before jax is imported anywhere: run on the CPU even where libtpu is installed (it is, for the AOT
# compile checks), and let several processes load libtpu at once.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from flashlib import env  # noqa: E402

settings.register_profile(
    "default", deadline=None, max_examples=12, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=100, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. Each program compiled for the CPU holds a few
    memory mappings until it is freed; the whole suite compiles tens of thousands, and jax 0.7.2's CPU
    backend (the Colab mirror's) segfaults inside the compiler once the process reaches Linux's
    ``vm.max_map_count`` (65,530 by default): measured 41k mappings two thirds of the way through, a crash
    at the next compile after that. Cleared per module, the count stays at a few thousand."""
    yield
    jax.clear_caches()
    gc.collect()


def make_qkv(
    batch: int = 1,
    heads: int = 2,
    q_len: int = 64,
    kv_len: int | None = None,
    head_dim: int = 32,
    dtype=jnp.float32,
    seed: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Random normal q, k, v in the flashlib layout."""
    kv_len = q_len if kv_len is None else kv_len
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, heads, q_len, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (batch, heads, kv_len, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (batch, heads, kv_len, head_dim), jnp.float32).astype(dtype)
    return q, k, v


def tpu_race_state():
    """TPU interpret mode's race detector (``.races_found``, ``.reads``): private, and its module moved
    between jax versions; None where this jax has none we can read."""
    for name in ("jax._src.pallas.mosaic.interpret.interpret_pallas_call", "jax._src.pallas.mosaic.interpret"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "races"):
            return module.races
    return None


def assert_no_races() -> None:
    """After a run with ``pltpu.InterpretParams(detect_races=True)``: its race detector found no race (skips
    where this jax has no race-detector state we can read)."""
    races = tpu_race_state()
    if races is None or not hasattr(races, "races_found"):
        pytest.skip("this jax has no readable race-detector state (jax._src.pallas.mosaic.interpret.races)")
    assert not races.races_found


@pytest.fixture
def qkv():
    """The factory :func:`make_qkv` as a fixture."""
    return make_qkv


@pytest.fixture
def no_open_figures():
    """Every function leaves pyplot's registry as it found it (figures are closed once made)."""
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    yield
    assert plt.get_fignums() == before


@pytest.fixture
def shown(monkeypatch) -> list:
    """The figures the widgets hand to ``display``, in order."""
    from flashlib import widgets

    figures: list = []
    monkeypatch.setattr(widgets, "_show", figures.append)
    return figures


# The marks of a module that draws: every test leaves no figure open, and third-party noise on the Colab
# pins (matplotlib 3.10 + new pyparsing, ipywidgets 7 + new ipykernel) is not an error.
PICTURE_TEST_MARKS = [
    pytest.mark.usefixtures("no_open_figures"),
    pytest.mark.filterwarnings("ignore:.*deprecated.*use '.*':DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ipywidgets.*"),
]


def pytest_collection_modifyitems(config, items):
    if env.has_libtpu():
        return
    if os.environ.get("FLASHLIB_REQUIRE_LIBTPU") == "1":  # set by `make test`: CI must really compile
        raise pytest.UsageError("FLASHLIB_REQUIRE_LIBTPU=1 but libtpu is not installed: pip install 'jax[tpu]'")
    skip = pytest.mark.skip(reason="libtpu is not installed (pip install 'jax[tpu]'): no TPU target to compile for")
    for item in items:
        if "tpu" in item.keywords:
            item.add_marker(skip)
