"""This release of flashlib: its distribution name, its version, its declared home, and the Colab links
that follow from them. ``pyproject.toml`` is the one source of all three; this module reads it (through
the installed package's metadata, or the file itself in a checkout), and so does
``notebooks/make_setup_cells.py``, which writes every notebook's setup cell and Colab badge from them.

The home is ``[project.urls] Source``. Until the project is published it is the placeholder
``https://github.com/<owner>/flashlib``: angle brackets are never part of a real URL, so nothing can be
fetched from it by mistake, and :func:`is_placeholder` says so.
"""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

__all__ = ["DISTRIBUTION", "colab_url", "declared_home", "is_placeholder", "release_tag", "version"]

DISTRIBUTION = "flashlib-tutorial"  # `pip install flashlib-tutorial`; `import flashlib`
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"  # present in a checkout, not in a wheel


@functools.cache  # read once per process: every setup cell and badge the generator writes asks for it
def _pyproject() -> dict | None:
    if not _PYPROJECT.is_file():
        return None
    project = tomllib.loads(_PYPROJECT.read_text())["project"]
    return project if project.get("name") == DISTRIBUTION else None


def version() -> str:
    """The version of this flashlib: ``pyproject.toml``'s in a checkout, else the installed package's."""
    project = _pyproject()
    if project is not None:
        return project["version"]
    return importlib.metadata.version(DISTRIBUTION)


def declared_home() -> str:
    """``[project.urls] Source``: where this release's source lives (possibly the unpublished placeholder)."""
    project = _pyproject()
    if project is not None:
        return project["urls"]["Source"]
    for entry in importlib.metadata.metadata(DISTRIBUTION).get_all("Project-URL") or []:
        label, _, url = entry.partition(",")
        if label.strip() == "Source":
            return url.strip()
    raise LookupError(f"the installed {DISTRIBUTION} declares no Source URL")


def is_placeholder(url: str) -> bool:
    """True for a home that is not published yet (``<owner>``): never fetch from it."""
    return "<" in url or ">" in url


def release_tag(release: str | None = None) -> str:
    """The git tag of a release in its home: ``v0.1.0``."""
    return f"v{version() if release is None else release}"


def colab_url(notebook: str, home: str | None = None, release: str | None = None) -> str | None:
    """The "Open in Colab" address of ``notebook`` (``"00_start_here.ipynb"``) at this release's tag in a
    GitHub home; None while the home is the placeholder (or not on GitHub: Colab opens GitHub notebooks)."""
    home = declared_home() if home is None else home
    prefix = "https://github.com/"
    if is_placeholder(home) or not home.startswith(prefix):
        return None
    repository = home.removeprefix(prefix).removesuffix(".git").strip("/")
    return f"https://colab.research.google.com/github/{repository}/blob/{release_tag(release)}/notebooks/{notebook}"
