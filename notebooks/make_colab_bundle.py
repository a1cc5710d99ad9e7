"""Build ``dist/flashlib-colab-<version>.zip``: what a reader uploads to Colab to run the series when the
project has no published home (or they would rather not install from it).

The zip holds this checkout's wheel (``flashlib_tutorial-<version>-py3-none-any.whl``), which carries the
data the notebooks read (``flashlib.data_files``, the repository's ``data/``); every notebook's setup cell
looks for the zip in the working folder and installs the wheel. One file to upload, whose name says its
release (a browser's rename is still found).

    python3 notebooks/make_colab_bundle.py          # make colab-bundle runs this

It needs only a Python >= 3.11 with pip: it reads the version from ``pyproject.toml`` and never imports
flashlib (hence not jax), and pip builds the wheel in an isolated environment of its own.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def version() -> str:
    """The release's version, from ``pyproject.toml`` (what ``flashlib.release.version`` reads in a checkout)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def bundle_name(release: str | None = None) -> str:
    return f"flashlib-colab-{version() if release is None else release}.zip"


def build(out_dir: Path = ROOT / "dist") -> Path:
    """Build the wheel from this checkout and zip it; return the zip's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", wheels,
                        str(ROOT)], check=True)
        (wheel,) = Path(wheels).glob("*.whl")
        target = out_dir / bundle_name()
        with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            archive.write(wheel, wheel.name)
    return target


if __name__ == "__main__":
    made = build()
    print(f"{made.relative_to(ROOT)}: {made.stat().st_size / 2**20:.1f} MiB; upload it in Colab's Files panel")
