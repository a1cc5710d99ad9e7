"""``make release-check``: what a release of flashlib-tutorial passes before its tag is pushed.

Run by a plain ``python3`` (>= 3.11, with pip and venv; no project package needed): everything it installs goes
into throwaway virtual environments outside the repository.

1. **A commit, not a working tree.** The build is made from ``git archive HEAD``; uncommitted changes refuse the
   check (``--allow-dirty`` builds HEAD anyway and says what it left out).
2. **The standard tools.** ``python -m build`` (PyPA's build front end) makes the sdist, then the wheel *from
   the sdist*, so a file the sdist forgets breaks the wheel here, not on someone's machine; ``twine check
   --strict`` checks the metadata the package index will show. Neither imports flashlib.
3. **The wheel holds what the library reads** (the tuned block table ``BlockSizes.default`` needs, the data
   the notebooks read as ``flashlib/data_files``), carries the version and name in ``pyproject.toml``, and
   nothing of the repository's tests or notebooks, nor the scripts that made the data.
4. **A fresh install runs the series.** The wheel goes into a new venv with the notebook extras; notebook 00
   and one kernel notebook (05) run there with nbclient, in an empty folder, with no ``FLASHLIB_DATA``, and
   must import flashlib and read its data from that venv.

The sdist and wheel are left in ``dist/`` with their sizes and SHA-256, ready for ``twine upload``.

    python3 tests/release_check.py [--allow-dirty] [--keep]     # make release-check runs this
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("00_start_here.ipynb", "05_pallas_on_tpu.ipynb")
BUILD_TOOLS = ("build>=1.2", "twine>=5.1")
IN_THE_WHEEL = ("flashlib/__init__.py", "flashlib/kernels/forward_blocks.json",  # what the library reads
                "flashlib/data_files/minilm_attention.npz", "flashlib/data_files/estimates/seq_sweep.csv",
                "flashlib/data_files/tuning/forward_blocks.json")
# (data/make_attention_data.py rides along as a module of flashlib.data_files: the record of how the sample was made)
NOT_IN_THE_WHEEL = ("tests/", "notebooks/", "data/", "flashlib/data_files/estimates/make_")
# `python -c NOTEBOOK_RUNNER NOTEBOOK PROBE FOLDER`: run NOTEBOOK's cells with PROBE appended, FOLDER the kernel's
# working folder; print what PROBE printed. (tests/test_colab_route.py runs its notebooks with it too.)
NOTEBOOK_RUNNER = (
    "import sys, nbformat, nbclient\n"
    "nb = nbformat.read(sys.argv[1], as_version=4)\n"
    "nb.cells.append(nbformat.v4.new_code_cell(sys.argv[2]))\n"
    "nbclient.NotebookClient(nb, timeout=1200, startup_timeout=600, kernel_name='python3',\n"
    "                        resources={'metadata': {'path': sys.argv[3]}}).execute()\n"
    "print(nb.cells[-1].outputs[-1]['text'])\n"
)
# Appended to each notebook: where flashlib came from and its version.
PROBE = ("import json, flashlib, flashlib.data; print(json.dumps({'file': flashlib.__file__, "
         "'version': flashlib.__version__, 'data': str(flashlib.data.data_dir())}))")


class ReleaseCheckFailed(SystemExit):
    """One sentence saying what is wrong and what to do (exit status 1)."""

    def __init__(self, message: str):
        super().__init__(f"release-check failed: {message}")


def _run(*command, cwd=None, env=None) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise ReleaseCheckFailed(f"`{' '.join(str(c) for c in command[:4])} ...` exited {done.returncode}:\n{tail}")
    return done.stdout


def _step(text: str) -> None:
    print(f"- {text}", flush=True)


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def export_head(into: Path, *, allow_dirty: bool) -> str:
    """``git archive HEAD`` unpacked in ``into``; returns the commit. Refuses a dirty tree unless allowed."""
    dirty = _run("git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no").rstrip()
    if dirty and not allow_dirty:
        raise ReleaseCheckFailed("the working tree has uncommitted changes; a release is a commit: commit them "
                                 "(or run with --allow-dirty to check HEAD without them)")
    commit = _run("git", "-C", ROOT, "rev-parse", "HEAD").strip()
    archive = into.parent / "head.tar"
    _run("git", "-C", ROOT, "archive", "--format=tar", f"--output={archive}", "HEAD")
    into.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    if dirty:
        _step(f"uncommitted changes are NOT in this build (HEAD {commit[:7]} only):\n{dirty}")
    return commit


def _venv(path: Path, *packages: str, constraints: Path | None = None) -> Path:
    _run(sys.executable, "-m", "venv", path)
    python = path / "bin" / "python"
    _run(python, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    pins = ["-c", constraints] if constraints else []
    _run(python, "-m", "pip", "install", "--quiet", "--no-compile", *pins, *packages)
    return python


def build(source: Path, dist: Path, tools: Path) -> tuple[Path, Path]:
    """sdist, then the wheel from the sdist, with PyPA's build; ``twine check --strict`` on both."""
    python = _venv(tools, *BUILD_TOOLS)
    _run(python, "-m", "build", "--outdir", dist, source)
    (sdist,), (wheel,) = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    _run(python, "-m", "twine", "check", "--strict", sdist, wheel)
    return sdist, wheel


def check_wheel(wheel: Path) -> None:
    """The wheel's name, version and contents."""
    project = _project()
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        fields = dict(line.split(": ", 1) for line in archive.read(metadata).decode().splitlines()
                      if ": " in line and not line.startswith(" "))
    if (fields.get("Name"), fields.get("Version")) != (project["name"], project["version"]):
        raise ReleaseCheckFailed(f"the wheel says {fields.get('Name')} {fields.get('Version')}, pyproject.toml "
                                 f"{project['name']} {project['version']}")
    missing = [path for path in IN_THE_WHEEL if path not in names]
    if missing:
        raise ReleaseCheckFailed(f"the wheel lacks {missing}: add them to [tool.setuptools.package-data]")
    stray = sorted(name for name in names if name.startswith(NOT_IN_THE_WHEEL))
    if stray:
        raise ReleaseCheckFailed(f"the wheel carries {stray[:3]}: narrow [tool.setuptools.packages] / package-data")


def run_notebooks(wheel: Path, source: Path, work: Path) -> list[dict]:
    """Install the wheel (and the notebook extras) into a fresh venv; run each notebook of NOTEBOOKS there in an
    empty folder; return what the probe appended to each printed."""
    python = _venv(work / "venv", f"{wheel}[notebooks]", constraints=source / "tests" / "test-constraints.txt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "FLASHLIB_DATA")}
    env.update(JAX_PLATFORMS="cpu", MPLBACKEND="Agg", PATH=f"{python.parent}{os.pathsep}{env['PATH']}")
    probes = []
    for notebook in NOTEBOOKS:
        folder = work / notebook.removesuffix(".ipynb")
        folder.mkdir()
        shutil.copy(source / "notebooks" / notebook, folder / notebook)
        out = _run(python, "-c", NOTEBOOK_RUNNER, folder / notebook, PROBE, folder, cwd=folder, env=env)
        probe = json.loads(out.strip().splitlines()[-1])
        if not Path(probe["file"]).is_relative_to(work / "venv") or probe["version"] != _project()["version"]:
            raise ReleaseCheckFailed(f"{notebook} imported flashlib {probe['version']} from {probe['file']}, not "
                                     "the wheel just built")
        if Path(probe["data"]) != Path(probe["file"]).parent / "data_files":
            raise ReleaseCheckFailed(f"{notebook} read its data from {probe['data']}, not from the wheel")
        probes.append(probe)
        _step(f"{notebook}: every cell ran against the installed wheel")
    return probes


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-dirty", action="store_true", help="check HEAD even with uncommitted changes")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (its path is printed)")
    args = parser.parse_args(argv)
    project = _project()
    print(f"release-check: {project['name']} {project['version']}", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="flashlib-release-"))  # outside the repository
    try:
        commit = export_head(scratch / "source", allow_dirty=args.allow_dirty)
        _step(f"exported HEAD {commit[:7]}")
        sdist, wheel = build(scratch / "source", scratch / "dist", scratch / "tools")
        _step(f"built {sdist.name} and {wheel.name} (from the sdist); twine check --strict passed")
        check_wheel(wheel)
        _step(f"the wheel holds {', '.join(IN_THE_WHEEL)} and none of {', '.join(NOT_IN_THE_WHEEL)}")
        run_notebooks(wheel, scratch / "source", scratch / "run")
        out = ROOT / "dist"
        out.mkdir(exist_ok=True)
        for made in (sdist, wheel):
            shutil.copy(made, out / made.name)
            print(f"  dist/{made.name}: {made.stat().st_size / 2**10:.0f} KiB, sha256 {_sha256(made)}")
        print(f"release-check passed for {project['version']} at {commit[:7]}: tag it v{project['version']}, push "
              "the tag, then `twine upload dist/*` if it goes to the package index")
    finally:
        if args.keep:
            print(f"scratch folder kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
