"""``python -m flashlib.bench`` end to end on the CPU, where it must say there is no TPU and fall back.

With a libtpu that makes static estimates (the newest-jax environment) the fallback is estimates plus the
roofline; with Colab's libtpu 0.0.23, the roofline alone, and the first line says why.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashlib import bench, estimate

ESTIMATES = estimate.supports_static_profile()


def _run(capsys, tmp_path: Path, *argv: str) -> tuple[list[str], list[dict[str, str]]]:
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    with (tmp_path / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    return lines, rows


def test_quick_on_cpu_estimates_or_falls_back(capsys, tmp_path):
    lines, rows = _run(capsys, tmp_path, "--quick", "--seq", "256", "--causal", "--target", "v6e")
    assert lines[0].startswith("no TPU here (backend cpu): ")
    roofline = [r for r in rows if r["kind"] == "roofline"]
    assert len(roofline) == 1 and roofline[0]["device"] == "v6e:1x1" and float(roofline[0]["roofline_us"]) > 0
    estimates = [r for r in rows if r["kind"] == "estimate"]
    if ESTIMATES:
        assert "static estimates and the roofline for v6e" in lines[0]
        assert {r["impl"] for r in estimates} == {"pallas", "jax_flash"}
        assert all(r["status"] == "ok" and int(r["cycles"]) > 0 and r["causal"] == "True" for r in estimates)
        assert any(line.startswith("T=   256     pallas: estimate ") for line in lines)
    else:  # Colab's libtpu
        assert "static estimates unavailable (libtpu 0.0.23 predates the static profile flag" in lines[0]
        assert "roofline for v6e only" in lines[0] and not estimates
    assert not [r for r in rows if r["kind"] == "measured"]


def test_an_old_libtpu_gets_the_roofline_only(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(estimate, "supports_static_profile", lambda: False)
    monkeypatch.setattr(estimate, "libtpu_version", lambda: "0.0.23")
    lines, rows = _run(capsys, tmp_path, "--quick")
    assert lines[0] == ("no TPU here (backend cpu): static estimates unavailable (libtpu 0.0.23 predates the static "
                        "profile flag (needs >= 0.0.42)); running the roofline for v5e only, instead of timings")
    assert [(r["kind"], r["seq"]) for r in rows] == [("roofline", "256"), ("roofline", "512")]


def test_measure_times_on_the_cpu_when_asked(capsys, tmp_path):
    lines, rows = _run(capsys, tmp_path, "--quick", "--measure", "--seq", "128", "--impls", "xla,blockwise,splash")
    assert lines[0].startswith("no TPU here (backend cpu): timing on the cpu as asked (--measure)")
    measured = [r for r in rows if r["kind"] == "measured"]
    assert [r["impl"] for r in measured] == ["xla", "blockwise"]  # JAX's TPU kernels are skipped off-TPU
    assert all(r["status"] == "ok" and float(r["median_us"]) > 0 and r["runs"] == "3" for r in measured)


def test_time_call_waits_for_every_run():
    calls = []
    times = bench.time_call(lambda x: calls.append(x) or x, 1.0, warmup=2, repeats=4)
    assert len(calls) == 6 and len(times) == 4 and min(times) >= 0


def test_bad_options_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--impls", "pallas,flash3"])
    assert "unknown --impls flash3" in capsys.readouterr().err


def test_runs_as_a_module(tmp_path):
    """``python -m flashlib.bench`` (roofline only: an implementation without an estimate recipe)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, "-m", "flashlib.bench", "--quick", "--impls", "xla", "--out",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("no TPU here (backend cpu): ")
    assert (tmp_path / "bench.csv").exists() and (tmp_path / "bench.png").exists()
