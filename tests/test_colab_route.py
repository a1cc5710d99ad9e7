"""The Colab route, run as Colab runs it: the generated setup cell in a fresh environment with Colab's pins,
a stand-in ``google.colab`` module, an empty working folder outside the repository, and the source given
first as a git URL of this checkout (tagged with its release), then as the uploaded bundle; notebook 00 and a
kernel notebook execute against that install, never against the repository tree, and load the data. The bundle
route runs with ``JAX_PLATFORMS`` unset, as on Colab (jax finds libtpu but no TPU here, and falls back to
the CPU with a warning); the git route with ``JAX_PLATFORMS=cpu``, as the rest of the suite.

Slow (a fresh environment: about two minutes of installs), so it runs under ``make test-colab`` only
(``FLASHLIB_COLAB_ROUTE=1``); it uses the checkout's committed HEAD, as CI's clean clone has it. The cheap
checks — every notebook's setup cell and badge are the generated ones — run everywhere."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from release_check import NOTEBOOK_RUNNER

from flashlib import release

ROOT = Path(__file__).resolve().parents[1]
COLAB_ROUTE = os.environ.get("FLASHLIB_COLAB_ROUTE") == "1"
needs_route = pytest.mark.skipif(not COLAB_ROUTE, reason="the simulated Colab install runs under make test-colab")
# Colab's TPU runtime, as tests/colab-constraints.txt pins it, plus what runs a notebook.
PACKAGES = ["jax[tpu]", "jaxlib", "numpy", "matplotlib", "ipywidgets", "ipykernel", "nbclient", "nbformat"]
KERNEL_NOTEBOOK = "05_pallas_on_tpu.ipynb"
# Appended to each executed notebook: where flashlib came from, its version, where the data came from.
PROBE = """import json, os, jax, flashlib, flashlib.data
from flashlib.data import load_attention_data
sample = load_attention_data()
print(json.dumps({"file": flashlib.__file__, "version": flashlib.__version__, "data": str(flashlib.data.data_dir()),
                  "data_env": os.environ.get("FLASHLIB_DATA"),
                  "sentences": len(sample.sentences), "jax_platforms": os.environ.get("JAX_PLATFORMS"),
                  "backend": jax.default_backend()}))"""


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "notebooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


setup_cells = _script("make_setup_cells")


# ---------------------------------------------------------------------------------------------------
# Everywhere: the notebooks carry the generated cells
# ---------------------------------------------------------------------------------------------------


def test_every_notebook_has_the_generated_setup_cell_and_badge():
    stale = [path.name for path in setup_cells.stale_files()]
    assert not stale, f"{stale} differ from pyproject.toml's release: run `make notebooks`"


def test_a_drifted_setup_cell_is_noticed(tmp_path):
    drifted = tmp_path / "00_start_here.ipynb"
    nb = json.loads((ROOT / "notebooks" / drifted.name).read_text())
    setup = next(c for c in nb["cells"] if setup_cells.SETUP_TAG in c["metadata"].get("tags", []))
    setup["source"] = [line.replace('FLASHLIB_VERSION = "', 'FLASHLIB_VERSION = "0.') for line in setup["source"]]
    drifted.write_text(json.dumps(nb))
    assert not setup_cells.notebook_is_current(drifted)


def test_the_cells_come_from_the_declared_home():
    source = setup_cells.setup_source()
    assert f'FLASHLIB_HOME = "{release.declared_home()}"' in source
    assert f'FLASHLIB_VERSION = "{release.version()}"' in source and release.DISTRIBUTION in source
    home = release.declared_home()
    if release.is_placeholder(home):
        assert release.colab_url("00_start_here.ipynb") is None
        assert setup_cells.badge_source("00_start_here.ipynb") == setup_cells.UNPUBLISHED
    published = "https://github.com/someone/flashlib"  # a string to format, never fetched
    assert release.colab_url("00_start_here.ipynb", home=published, release="0.1.0") == (
        "https://colab.research.google.com/github/someone/flashlib/blob/v0.1.0/notebooks/00_start_here.ipynb")


def _run_setup_cell_here(folder: Path, on_colab: bool = True) -> str:
    """Run this release's setup cell in this process, in ``folder``, with a stand-in ``google.colab`` (or, with
    ``on_colab=False``, none); return the message of the ``RuntimeError`` it must raise (before anything is
    installed)."""
    if not on_colab:
        assert "google.colab" not in sys.modules
    stand_in = sys.modules.setdefault("google.colab", type(sys)("google.colab")) if on_colab else None
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        with pytest.raises(RuntimeError) as raised:
            exec(setup_cells.setup_source(), {})
    finally:
        os.chdir(cwd)
        if stand_in is not None and sys.modules.get("google.colab") is stand_in:
            del sys.modules["google.colab"]
    return str(raised.value)


def test_the_no_bundle_message_names_this_release(tmp_path):
    """Without a bundle and with the placeholder home, the cell's message names the zip and the tag with this
    release's version filled in (the tag's sentence once printed a literal ``v{FLASHLIB_VERSION}``). Run in
    this process with a stand-in ``google.colab``, in an empty folder: it raises before touching anything."""
    if not release.is_placeholder(release.declared_home()):
        pytest.skip("the home is published")
    message, version = _run_setup_cell_here(tmp_path), release.version()
    assert f"flashlib-colab-{version}.zip" in message and f"tag v{version}:" in message
    assert "{" not in message and "}" not in message
    assert list(tmp_path.iterdir()) == []


def _zip_with(path: Path, *members: str) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for member in members:
            archive.writestr(member, "")
    return path


def test_a_renamed_upload_of_another_release_is_named_and_refused(tmp_path):
    """A browser renames a second upload ("... (1).zip"): it is still found, and a bundle of another release is
    refused with the fix (the cell said "not published yet" and never named the zip that was there)."""
    version = release.version()
    upload = _zip_with(tmp_path / f"flashlib-colab-{version} (1).zip", "flashlib_tutorial-0.0.9-py3-none-any.whl")
    message = _run_setup_cell_here(tmp_path)
    assert f"{upload.name} holds flashlib 0.0.9" in message and f"upload flashlib-colab-{version}.zip" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [upload.name]  # nothing extracted, nothing installed
    upload.unlink()
    _zip_with(tmp_path / f"flashlib-colab-{version}.zip", "a-1-py3-none-any.whl", "b-1-py3-none-any.whl")
    assert "holds 2 wheels" in _run_setup_cell_here(tmp_path)


def test_the_wheel_alone_is_an_upload_too(tmp_path):
    """The bundle is the wheel in a zip; the wheel itself (dist/ of make release-check) is found as well, also
    renamed by a browser, and one of another release is refused with the fix."""
    wheel = tmp_path / f"{release.DISTRIBUTION.replace('-', '_')}-0.0.9-py3-none-any (1).whl"
    wheel.write_bytes(b"")
    message = _run_setup_cell_here(tmp_path)
    assert f"{wheel.name} holds flashlib 0.0.9" in message
    assert f"upload flashlib-colab-{release.version()}.zip" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [wheel.name]


def test_with_no_upload_the_cell_says_where_it_looked(tmp_path):
    if not release.is_placeholder(release.declared_home()):
        pytest.skip("the home is published")
    message = _run_setup_cell_here(tmp_path)
    assert f"{tmp_path} holds no upload (flashlib-colab-{release.version()}.zip or " in message


def test_an_upload_is_installed_off_colab_too_and_wins_over_a_source(tmp_path, monkeypatch, capsys):
    """Off Colab (Kaggle, a local runtime) the cell once did nothing even with the bundle beside the notebook, and
    the next import failed; and FLASHLIB_SOURCE was silently ignored while an upload was there. Here the zip
    holds a wheel pip cannot install (empty): the cell runs without google.colab, says which source won, and
    pip's refusal is one sentence naming the upload."""
    version = release.version()
    upload = _zip_with(tmp_path / f"flashlib-colab-{version}.zip",
                       f"{release.DISTRIBUTION.replace('-', '_')}-{version}-py3-none-any.whl")
    monkeypatch.setenv("FLASHLIB_SOURCE", (tmp_path / "a-fork").as_uri())
    message = _run_setup_cell_here(tmp_path, on_colab=False)
    printed = capsys.readouterr().out
    assert f"from the uploaded {upload.name} (FLASHLIB_SOURCE is ignored while an upload is here)" in printed
    assert message.startswith(f"pip could not install the uploaded {upload.name}") and "make colab-bundle" in message


def test_a_source_that_cannot_be_cloned_is_one_sentence(tmp_path, monkeypatch):
    """FLASHLIB_SOURCE naming no repository (or a tag not pushed): one sentence, not pip's CalledProcessError."""
    monkeypatch.setenv("FLASHLIB_SOURCE", (tmp_path / "no-such-repository").as_uri())
    message = _run_setup_cell_here(tmp_path)
    assert message.startswith(f"pip could not install tag v{release.version()} of file://") and "upload" in message
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------
# Under make test-colab: the install itself
# ---------------------------------------------------------------------------------------------------


def _run(*command, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-30:])
        raise AssertionError(f"{' '.join(str(c) for c in command[:3])} ... exited {done.returncode}:\n{tail}")
    return done


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    """``(python, home_url, env)``: a fresh venv with Colab's pins and a stand-in google.colab imported at
    start-up (as Colab's kernel has it), and a bare git repository of this checkout tagged with the release."""
    root = tmp_path_factory.mktemp("colab")
    venv = root / "venv"
    _run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    # --no-compile: no bytecode for every module of every package up front (CPU the suite needs); Python
    # compiles what the notebooks import, when they import it.
    _run(python, "-m", "pip", "install", "--quiet", "--no-compile", "-c", ROOT / "tests" / "colab-constraints.txt",
         *PACKAGES)
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (site / "google" / "colab").mkdir(parents=True, exist_ok=True)
    (site / "google" / "colab" / "__init__.py").write_text('"""Stand-in for Colab\'s own module."""\n')
    (site / "google" / "colab" / "output.py").write_text('"""Stand-in: jax imports it on Colab."""\n')
    (site / "zz_colab_stand_in.pth").write_text("import google.colab\n")
    home = root / "home.git"
    _run("git", "clone", "--quiet", "--bare", ROOT, home)
    _run("git", "-C", home, "tag", "--force", release.release_tag(), "HEAD")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FLASHLIB_DATA", "VIRTUAL_ENV")}
    env.update(JAX_PLATFORMS="cpu", MPLBACKEND="Agg", PATH=f"{venv / 'bin'}:{env['PATH']}")
    return python, f"file://{home}", env


def _execute(python: Path, notebook: str, folder: Path, env: dict) -> dict:
    """Run ``notebook`` (copied alone into ``folder``, the kernel's working folder) with the probe appended;
    return what the probe printed."""
    shutil.copy(ROOT / "notebooks" / notebook, folder / notebook)
    done = _run(python, "-c", NOTEBOOK_RUNNER, folder / notebook, PROBE, folder, env=env, cwd=folder)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_install(probe: dict) -> None:
    """flashlib came from the install, not the repository, and read its data from inside the wheel."""
    assert not Path(probe["file"]).is_relative_to(ROOT), f"flashlib was imported from the repository: {probe}"
    assert "site-packages" in probe["file"]
    assert probe["version"] == release.version()
    assert probe["data_env"] is None, probe  # the cell no longer points FLASHLIB_DATA anywhere
    assert Path(probe["data"]) == Path(probe["file"]).parent / "data_files" and probe["sentences"] > 0


@needs_route
def test_the_setup_cell_refuses_the_placeholder_home(colab, tmp_path):
    python, _, env = colab
    if not release.is_placeholder(release.declared_home()):
        pytest.skip("the home is published")
    done = subprocess.run([python, "-c", setup_cells.setup_source()], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert done.returncode != 0 and "not published yet" in done.stderr and "make colab-bundle" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was cloned or downloaded


@needs_route
def test_installs_from_a_git_home_and_runs_the_notebooks(colab, tmp_path):
    python, home, env = colab
    for notebook in ("00_start_here.ipynb", KERNEL_NOTEBOOK):
        probe = _execute(python, notebook, tmp_path, {**env, "FLASHLIB_SOURCE": home})
        _check_install(probe)
        assert probe["jax_platforms"] == "cpu"


@needs_route
def test_installs_from_the_uploaded_bundle(colab, tmp_path):
    python, _, env = colab
    _run(python, "-m", "pip", "uninstall", "--quiet", "--yes", release.DISTRIBUTION, env=env)
    bundle = _script("make_colab_bundle").build(tmp_path / "dist")
    folder = tmp_path / "content"
    folder.mkdir()
    shutil.copy(bundle, folder / bundle.name)
    (folder / "flashlib-colab").mkdir()  # an earlier upload's extraction (two wheels made the cell fail)
    (folder / "flashlib-colab" / f"{release.DISTRIBUTION.replace('-', '_')}-0.0.9-py3-none-any.whl").touch()
    as_on_colab = {key: value for key, value in env.items() if key != "JAX_PLATFORMS"}  # Colab leaves it unset
    probe = _execute(python, "00_start_here.ipynb", folder, as_on_colab)
    _check_install(probe)
    assert probe["jax_platforms"] is None, probe  # the notebook ran as on Colab (here on jax's CPU fallback)
    # A runtime restarted without the setup cell: no FLASHLIB_DATA, an empty folder. The defaults are this
    # checkout's (the tuned table ships in the wheel; it once fell back to other blocks here, silently).
    restarted = tmp_path / "restarted"
    restarted.mkdir()
    # And the data is the wheel's (the bundle's data/ and FLASHLIB_DATA pointing at it were lost on a restart).
    defaults = ("from flashlib.kernels import BlockSizes\n"
                "from flashlib.data import load_attention_data\n"
                "print([BlockSizes.default(8192, 8192, 128, 'bfloat16', generation=g) for g in ('v5e', 'v6e')])\n"
                "print(len(load_attention_data().sentences))")
    from flashlib.data import load_attention_data
    from flashlib.kernels import BlockSizes

    want = [BlockSizes.default(8192, 8192, 128, "bfloat16", generation=g) for g in ("v5e", "v6e")]
    printed = _run(python, "-c", defaults, env=as_on_colab, cwd=restarted).stdout.strip().splitlines()
    assert printed == [str(want), str(len(load_attention_data().sentences))]
