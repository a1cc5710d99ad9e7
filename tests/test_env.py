"""flashlib.env: backend, interpret mode, banner."""

from __future__ import annotations

import jax

from flashlib import env


def test_backend_and_interpret_mode_agree():
    assert env.backend() == jax.default_backend()
    assert env.interpret_default() == (env.backend() != "tpu")


def test_banner_is_one_informative_line():
    line = env.banner()
    assert "\n" not in line
    assert f"jax {jax.__version__}" in line and f"backend {env.backend()}" in line
    assert ("interpret mode" in line) == env.interpret_default()


def test_colab_detection(monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert env.on_colab() is False
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_2026")
    assert env.on_colab() is True
