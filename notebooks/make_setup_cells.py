"""Write every notebook's setup cell and Colab badge, and README's, from ``pyproject.toml``.

The setup cell is ``notebooks/setup_cell.py.tmpl`` filled in with this release's distribution name, version
and declared home (``[project.urls] Source``); the badge links to the notebook at this release's tag in that
home (while the home is the unpublished placeholder, it says how to run on Colab without one). Both cells are
found by their tags (``flashlib-setup``, ``flashlib-colab-badge``) and added where missing.

    python notebooks/make_setup_cells.py            # rewrite the notebooks and README (make notebooks runs it)
    python notebooks/make_setup_cells.py --check    # exit 1 naming every file that differs (the tests do this)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashlib import release  # noqa: E402

TEMPLATE = ROOT / "notebooks" / "setup_cell.py.tmpl"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
README = ROOT / "README.md"
SETUP_TAG, BADGE_TAG = "flashlib-setup", "flashlib-colab-badge"
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
README_START, README_END = "<!-- colab-badge:start -->", "<!-- colab-badge:end -->"
UNPUBLISHED = ("*On Colab:* this copy of flashlib has no published home yet, so there is no Open-in-Colab link: "
               "upload the bundle instead (README, *On Colab*).")


def setup_source() -> str:
    """The setup cell for this release."""
    text = TEMPLATE.read_text().format(distribution=release.DISTRIBUTION, version=release.version(),
                                       home=release.declared_home())
    return text.rstrip("\n")


def badge_source(notebook: str) -> str:
    """The badge cell of ``notebook`` (a file name): the Colab link at this release's tag, or how to go without."""
    url = release.colab_url(notebook)
    return UNPUBLISHED if url is None else f"[![Open In Colab]({BADGE_IMAGE})]({url})"


def _cell(kind: str, source: str, tag: str, cell_id: str) -> dict:
    metadata = {"cellView": "form", "tags": [tag]} if tag == SETUP_TAG else {"tags": [tag]}  # Colab: collapsed
    cell = {"cell_type": kind, "id": cell_id, "metadata": metadata, "source": source.splitlines(keepends=True)}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return dict(sorted(cell.items()))  # the key order nbformat writes


def _tagged(cells: list[dict], tag: str) -> int | None:
    return next((i for i, c in enumerate(cells) if tag in c.get("metadata", {}).get("tags", [])), None)


def updated_notebook(path: Path) -> dict:
    """``path``'s notebook with its badge cell first and its setup cell where it was (tagged or, the first
    time, the code cell that starts with ``# Setup``; else after the introduction's markdown cells)."""
    nb = json.loads(path.read_text())
    cells = nb["cells"]
    setup = _tagged(cells, SETUP_TAG)
    if setup is None:
        setup = next((i for i, c in enumerate(cells) if c["cell_type"] == "code"
                      and "".join(c["source"]).startswith("# Setup")), None)
    new_setup = _cell("code", setup_source(), SETUP_TAG, "setup")
    if setup is None:
        first_code = next((i for i, c in enumerate(cells) if c["cell_type"] == "code"), len(cells))
        cells.insert(first_code, new_setup)
    else:
        new_setup["id"] = cells[setup].get("id", "setup")
        new_setup["execution_count"] = cells[setup].get("execution_count")
        cells[setup] = new_setup
    badge = _tagged(cells, BADGE_TAG)
    new_badge = _cell("markdown", badge_source(path.name), BADGE_TAG, "colab-badge")
    if badge is None:
        cells.insert(0, new_badge)
    else:
        cells[badge] = new_badge
    return nb


def updated_readme(text: str) -> str:
    """README with the start-here notebook's badge (or the unpublished note) between its markers."""
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    return text[:start] + "\n" + badge_source(NOTEBOOKS[0].name) + "\n" + text[end:]


def _dumped(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def _source(cells: list[dict], index: int | None) -> str | None:
    return None if index is None else "".join(cells[index]["source"])


def notebook_is_current(path: Path) -> bool:
    """Whether ``path`` has this release's badge cell first and its setup cell (compared by source and tag)."""
    cells = json.loads(path.read_text())["cells"]
    badge, setup = _tagged(cells, BADGE_TAG), _tagged(cells, SETUP_TAG)
    return badge == 0 and _source(cells, badge) == badge_source(path.name) and _source(cells, setup) == setup_source()


def stale_files() -> list[Path]:
    """The notebooks (and README) whose setup cell or badge differs from what this release generates."""
    stale = [path for path in NOTEBOOKS if not notebook_is_current(path)]
    if updated_readme(README.read_text()) != README.read_text():
        stale.append(README)
    return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report files that differ; exit 1 if any")
    args = parser.parse_args()
    stale = stale_files()
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)}: setup cell or Colab badge differs from pyproject.toml's release; "
                  "run `make notebooks` (or python notebooks/make_setup_cells.py)")
        return 1 if stale else 0
    for path in stale:
        if path == README:
            path.write_text(updated_readme(path.read_text()))
        else:
            path.write_text(_dumped(updated_notebook(path)))
        print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
