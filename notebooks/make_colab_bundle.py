"""Build ``dist/flashlib-colab-<version>.zip``: what a reader uploads to Colab to run the series when the
project has no published home (or they would rather not install from it).

The zip holds this checkout's wheel (``flashlib_tutorial-<version>-py3-none-any.whl``) and its ``data/``
folder; every notebook's setup cell looks for it in the working folder, installs the wheel and points
``FLASHLIB_DATA`` at the data.

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
DATA_SUFFIXES = {".npz", ".csv", ".json", ".md"}  # the data and what documents it, not the scripts that made it


def version() -> str:
    """The release's version, from ``pyproject.toml`` (what ``flashlib.release.version`` reads in a checkout)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def bundle_name(release: str | None = None) -> str:
    return f"flashlib-colab-{version() if release is None else release}.zip"


def build(out_dir: Path = ROOT / "dist") -> Path:
    """Build the wheel from this checkout and zip it with ``data/``; return the zip's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", wheels,
                        str(ROOT)], check=True)
        (wheel,) = Path(wheels).glob("*.whl")
        target = out_dir / bundle_name()
        with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            archive.write(wheel, wheel.name)
            for path in sorted((ROOT / "data").rglob("*")):
                if path.is_file() and path.suffix in DATA_SUFFIXES:
                    archive.write(path, path.relative_to(ROOT).as_posix())
    return target


if __name__ == "__main__":
    made = build()
    print(f"{made.relative_to(ROOT)}: {made.stat().st_size / 2**20:.1f} MiB; upload it in Colab's Files panel")
