"""Write every puzzle's hints cell from its :class:`flashlib.exercises.puzzle.Puzzle` (one source for the
hints and the solution: the library).

A hints cell is a markdown cell whose first line names its puzzle, ``<!-- hints: online_softmax.MERGE_ML -->``
(a module of ``flashlib.exercises`` and the puzzle's name in it); the rest of the cell is generated: each hint
level, then the solution's code, as collapsed ``<details>`` blocks.

    python notebooks/make_hint_cells.py            # rewrite the hints cells (make notebooks runs it)
    python notebooks/make_hint_cells.py --check    # exit 1 naming every stale cell (the tests do this)
    python notebooks/make_hint_cells.py notebooks/04_flash_attention_in_jax.ipynb   # only these notebooks
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MARKER = re.compile(r"<!-- hints: (?P<module>[a-z_0-9]+)\.(?P<name>[A-Z_0-9]+) -->")


def puzzle(module: str, name: str):
    """The puzzle ``flashlib.exercises.<module>.<name>``."""
    return getattr(importlib.import_module(f"flashlib.exercises.{module}"), name)


def hints_source(module: str, name: str) -> str:
    """The whole hints cell of puzzle ``module.name``."""
    found = puzzle(module, name)
    return (f"<!-- hints: {module}.{name} -->\n"
            f"**Stuck on {found.label}?** Open one hint at a time; the last block is the solution "
            f"(`flashlib.exercises.{module}.{name}.hint(n)` prints the same in a cell).\n\n" + found.hint_markdown())


def hint_cells(nb: dict) -> list[tuple[int, str, str]]:
    """``(cell index, module, name)`` of every hints cell in ``nb``."""
    found = []
    for index, cell in enumerate(nb["cells"]):
        match = MARKER.match("".join(cell["source"])) if cell["cell_type"] == "markdown" else None
        if match:
            found.append((index, match["module"], match["name"]))
    return found


def stale_cells(path: Path) -> list[str]:
    """``module.name`` of each hints cell of ``path`` whose text differs from what its puzzle generates."""
    nb = json.loads(path.read_text())
    return [f"{module}.{name}" for index, module, name in hint_cells(nb)
            if "".join(nb["cells"][index]["source"]) != hints_source(module, name)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale cells; exit 1 if any")
    parser.add_argument("notebooks", nargs="*", type=Path, help="the notebooks to look at (all if none)")
    args = parser.parse_args()
    stale_any = False
    for path in [p.resolve() for p in args.notebooks] or NOTEBOOKS:
        stale = stale_cells(path)
        if not stale:
            continue
        stale_any = True
        if args.check:
            print(f"{path.relative_to(ROOT)}: hints of {', '.join(stale)} differ from flashlib.exercises; "
                  "run `make notebooks` (or python notebooks/make_hint_cells.py)")
            continue
        nb = json.loads(path.read_text())
        for index, module, name in hint_cells(nb):
            nb["cells"][index]["source"] = hints_source(module, name).splitlines(keepends=True)
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        print(f"updated {path.relative_to(ROOT)}: {', '.join(stale)}")
    return 1 if (args.check and stale_any) else 0


if __name__ == "__main__":
    sys.exit(main())
