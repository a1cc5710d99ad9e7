"""The suite's cost, from a JUnit XML report: the 30 slowest tests and the time by file, as Markdown.

``python tests/suite_timings.py REPORT.xml [--title TITLE]`` prints what ``tests/TIMINGS.md`` keeps for each
measured run (``pytest --junitxml=REPORT.xml``). A test's time is setup + call + teardown, as pytest's
``--durations`` counts it; under pytest-xdist the test times add up to more than the wall time.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict


def read(path: str) -> tuple[dict[str, float], dict[str, int]]:
    """``({test id: seconds}, {outcome: count})`` of one report."""
    seconds: dict[str, float] = {}
    outcomes: dict[str, int] = defaultdict(int)
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        module = case.get("classname", "").replace(".", "/")  # pytest writes the path with dots, no .py
        module = module[: -len("/ipynb")] + ".ipynb" if module.endswith("/ipynb") else module + ".py"
        test_id = f"{module}::{name}"
        seconds[test_id] = seconds.get(test_id, 0.0) + float(case.get("time", 0.0))
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        outcomes[kind] += 1
    return seconds, dict(outcomes)


def by_file(seconds: dict[str, float]) -> dict[str, float]:
    files: dict[str, float] = defaultdict(float)
    for test_id, spent in seconds.items():
        files[test_id.split("::")[0]] += spent
    return dict(files)


def markdown(path: str, title: str, top: int = 30, files: int = 15) -> str:
    seconds, outcomes = read(path)
    total = sum(seconds.values())
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(outcomes.items()))
    lines = [f"### {title}", "", f"{len(seconds)} tests ({counts}); {total:.0f} s of test time.", "",
             "| seconds | test |", "|---:|---|"]
    for test_id, spent in sorted(seconds.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {spent:.1f} | `{test_id}` |")
    lines += ["", "| seconds | share | file |", "|---:|---:|---|"]
    for name, spent in sorted(by_file(seconds).items(), key=lambda kv: -kv[1])[:files]:
        lines.append(f"| {spent:.0f} | {100 * spent / total:.1f}% | `{name}` |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--title", default="run")
    args = parser.parse_args()
    print(markdown(args.report, args.title))


if __name__ == "__main__":
    main()
