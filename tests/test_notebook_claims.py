"""Sentences in the notebooks that quote a printed number say what the stored output prints.

Each claim is a piece of a notebook's prose and a pattern its outputs must match: when a re-run changes
the number, the prose must change with it (or be phrased so any plausible run agrees, and leave this list).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


class Claim(NamedTuple):
    prose: str  # verbatim in one markdown cell
    output: str  # a regex some code cell's stored output matches


CLAIMS: dict[str, list[Claim]] = {}


def _texts(notebook: str) -> tuple[str, str]:
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    prose = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    outputs = []
    for cell in cells:
        for out in cell.get("outputs", []):
            outputs.append("".join(out.get("text", "")))
            outputs.append("".join(out.get("data", {}).get("text/plain", "")))
    return prose, "\n".join(outputs)


@pytest.mark.parametrize("notebook, claim", [(nb, c) for nb, claims in CLAIMS.items() for c in claims],
                         ids=lambda x: x if isinstance(x, str) else x.prose[:40])
def test_the_prose_quotes_the_output(notebook, claim):
    prose, outputs = _texts(notebook)
    assert claim.prose in prose, f"{notebook}: the prose no longer says {claim.prose!r}"
    assert re.search(claim.output, outputs), f"{notebook}: no output matches {claim.output!r} for {claim.prose!r}"


def test_every_notebook_ends_with_references():
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        last = "".join(cells[-1]["source"]) if cells[-1]["cell_type"] == "markdown" else ""
        assert "## References" in last, f"{path.name}: end with a '## References' markdown cell"
