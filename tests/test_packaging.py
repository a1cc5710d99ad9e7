"""The set-up files agree with each other: environment.yml, pyproject.toml, the Colab pins, the Makefile."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _floor(requirement: str) -> tuple[str, str | None]:
    name = re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower()
    floor = re.search(r">=\s*([\d.]+)", requirement)
    return name, floor.group(1) if floor else None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_environment_yml_installs_the_pyproject_extras():
    text = (ROOT / "environment.yml").read_text()
    pip_line = re.search(r"-\s+-e\s+\.\[([\w,]+)\]", text)
    assert pip_line, "environment.yml must pip-install the project itself (-e .[extras])"
    extras = set(pip_line.group(1).split(","))
    assert extras == set(PYPROJECT["project"]["optional-dependencies"]), "environment.yml extras drifted"
    python = re.search(r"-\s+python=(\d+\.\d+)", text).group(1)
    required = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert _version(python) >= _version(required)
    dependencies = text.split("dependencies:", 1)[1]
    conda_packages = re.findall(r"^  -\s+([a-z][\w-]*)", dependencies, flags=re.M)
    assert set(conda_packages) <= {"python", "pip"}, "add dependencies to pyproject.toml, not environment.yml"


def test_makefile_installs_the_same_extras():
    makefile = (ROOT / "Makefile").read_text()
    extras = re.search(r"^EXTRAS := \.\[([\w,]+)\]", makefile, flags=re.M).group(1)
    assert set(extras.split(",")) == set(PYPROJECT["project"]["optional-dependencies"])


def test_dependency_floors_do_not_exceed_colab():
    """Installing flashlib on Colab must never upgrade a preinstalled package (that forces a restart)."""
    pins = dict(
        line.split("==") for line in (ROOT / "tests/colab-constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    requirements = PYPROJECT["project"]["dependencies"] + [
        r for extra in PYPROJECT["project"]["optional-dependencies"].values() for r in extra
    ]
    checked = 0
    for requirement in requirements:
        name, floor = _floor(requirement)
        if name in pins and floor:
            assert _version(floor) <= _version(pins[name]), f"{requirement} is above Colab's {name}=={pins[name]}"
            checked += 1
    assert checked >= 4


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci/run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()


def test_no_requirement_has_an_upper_bound():
    """An upper bound (or an exact pin) below what Colab ships would downgrade it on install: a restart."""
    requirements = PYPROJECT["project"]["dependencies"] + [
        r for extra in PYPROJECT["project"]["optional-dependencies"].values() for r in extra
    ]
    capped = [r for r in requirements if re.search(r"(<|==|~=)", r)]
    assert not capped, f"drop the upper bounds: {capped}"


def test_the_distribution_is_ours_and_declares_one_home():
    project = PYPROJECT["project"]
    assert project["name"] == "flashlib-tutorial"  # "flashlib" on the package index is someone else's
    assert set(project["urls"]) == {"Source"}


def test_the_release_tools_need_no_development_environment():
    """`make colab-bundle` and `make release-check` run on a plain python3 (the bundle once needed the whole
    development environment, 3.5 minutes of installs, to import flashlib for its version): neither script
    imports flashlib or anything outside the standard library, and both read the version pyproject.toml has."""
    import ast
    import importlib.util
    import sys

    from flashlib import release

    for script in ("notebooks/make_colab_bundle.py", "tests/release_check.py"):
        tree = ast.parse((ROOT / script).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert imported - {"__future__"} <= sys.stdlib_module_names, f"{script} imports {imported}"
    spec = importlib.util.spec_from_file_location("make_colab_bundle", ROOT / "notebooks/make_colab_bundle.py")
    bundle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bundle)
    assert bundle.version() == release.version()
    assert bundle.bundle_name() == f"flashlib-colab-{release.version()}.zip"
    makefile = (ROOT / "Makefile").read_text()
    for target in ("colab-bundle", "release-check"):
        recipe = re.search(rf"^{target}:(.*)\n((?:\t.*\n)+)", makefile, flags=re.M)
        assert recipe and "$(VENV)" not in recipe.group(0), f"make {target} must not need the development venv"


def test_the_wheel_lists_every_package_and_maps_the_data():
    """``pyproject.toml`` lists the packages (the data folder is mapped in as ``flashlib.data_files``, which
    automatic discovery cannot do): every package under ``flashlib/`` is listed, so none is left out of the
    wheel, and each data pattern names files that exist (a renamed folder would silently ship nothing)."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "flashlib").rglob("__init__.py")}
    assert set(setuptools["packages"]) == on_disk | {"flashlib.data_files"}
    assert setuptools["package-dir"] == {"flashlib.data_files": "data"}
    for pattern in setuptools["package-data"]["flashlib.data_files"]:
        assert list((ROOT / "data").glob(pattern)), f"no file in data/ matches {pattern!r}"


def test_the_installed_flashlib_reads_the_data_it_was_installed_with(monkeypatch):
    """Without ``FLASHLIB_DATA``, the data is the one installed with flashlib (the wheel's ``data_files``; in
    this editable install, the repository's data/), whatever the working folder holds."""
    import importlib.resources

    from flashlib import data

    monkeypatch.delenv(data.DATA_ENV_VAR, raising=False)
    monkeypatch.chdir(ROOT / "notebooks")  # ../data would also be found; the installed one comes first
    assert Path(str(importlib.resources.files(data.DATA_PACKAGE))).resolve() == (ROOT / "data").resolve()
    assert data.data_dir().resolve() == (ROOT / "data").resolve()
