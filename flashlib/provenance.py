"""Which sources a table of measurements was made from: a fingerprint that a data script writes beside its
numbers, so a reader (or the script itself, at the end of a long sweep) can tell whether the kernel changed.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

__all__ = ["REPOSITORY", "SourceState", "source_state"]

REPOSITORY = Path(__file__).resolve().parents[1]


class SourceState(NamedTuple):
    """The state of some flashlib sources when a table of estimates was made (:func:`source_state`)."""

    commit: str  # the checkout's short HEAD; "" outside a git checkout
    edited: bool  # uncommitted changes to those sources
    sha256: str  # 16 hex digits over their contents: notices an edit made while a sweep ran


def source_state(sources: Sequence[str]) -> SourceState:
    """:class:`SourceState` of ``sources``: files, or folders of ``*.py`` files, relative to the repository."""
    digest = hashlib.sha256()
    for source in sources:
        path = REPOSITORY / source
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.read_bytes())
    edited = bool(_git("status", "--porcelain", "--", *sources))
    return SourceState(_git("rev-parse", "--short", "HEAD"), edited, digest.hexdigest()[:16])


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPOSITORY, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return done.stdout.strip()
