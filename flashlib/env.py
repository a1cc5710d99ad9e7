"""Where are we running? Backend, interpret mode, Colab, and the one-line banner notebooks print first."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import jax

__all__ = ["backend", "banner", "device_kind", "has_libtpu", "interpret_default", "on_colab"]


def backend() -> str:
    """``"tpu"``, ``"gpu"`` or ``"cpu"``: the platform of JAX's default device."""
    return jax.default_backend()


def device_kind() -> str:
    """The default device's kind as JAX reports it, e.g. ``"TPU v5 lite"`` or ``"cpu"``."""
    return jax.devices()[0].device_kind


def interpret_default() -> bool:
    """Pallas TPU kernels run compiled on a TPU and interpreted (same kernel code, on the CPU) elsewhere."""
    return backend() != "tpu"


def on_colab() -> bool:
    """True inside a Google Colab runtime."""
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


@functools.cache
def has_libtpu() -> bool:
    """Whether libtpu (``pip install 'jax[tpu]'``) is installed, so code can be compiled for a TPU target."""
    return importlib.util.find_spec("libtpu") is not None


def banner() -> str:
    """One line for the top of a notebook: jax version, backend, device, and how Pallas kernels will run."""
    mode = "interpret mode (CPU emulation)" if interpret_default() else "compiled"
    where = "Colab" if on_colab() else "local"
    aot = "libtpu: yes" if has_libtpu() else "libtpu: no"
    return (
        f"flashlib | jax {jax.__version__} | backend {backend()} ({device_kind()}) | "
        f"Pallas kernels: {mode} | {aot} | {where}"
    )
