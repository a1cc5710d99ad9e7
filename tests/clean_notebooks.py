"""Normalise notebooks after `make notebooks`: drop volatile metadata so diffs show only real changes.

Removes per-cell execution timestamps and widget state, pins the kernelspec to the generic ``python3``
(so nbval and Colab pick the current environment), joins consecutive prints to one stream into one output
(as Jupyter shows them; some kernel versions send each print as its own), and fails if an output leaks a local
absolute path.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LOCAL_PATH = re.compile(r"(/work/|/root/|/home/[^/\s]+/|/tmp/pytest|/Users/)")


def clean(path: Path) -> None:
    nb = json.loads(path.read_text())
    nb["metadata"].pop("widgets", None)
    nb["metadata"]["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        if "outputs" in cell:
            cell["outputs"] = _joined_streams(cell["outputs"])
        for out in cell.get("outputs", []):
            text = json.dumps(out)
            if LOCAL_PATH.search(text):
                raise SystemExit(f"{path}: an output shows a local path ({LOCAL_PATH.search(text).group(0)}...)")
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def _joined_streams(outputs: list[dict]) -> list[dict]:
    joined = []
    for out in outputs:
        previous = joined[-1] if joined else None
        if (out.get("output_type") == "stream" and previous is not None and previous.get("output_type") == "stream"
                and previous.get("name") == out.get("name")):
            text = "".join(previous["text"]) + "".join(out["text"])
            previous["text"] = text.splitlines(keepends=True)
        else:
            joined.append(out)
    return joined


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        clean(Path(arg))
