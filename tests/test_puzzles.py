"""The puzzles as a whole: every notebook 01-09 has at least one (05-07 and 09 at least two), each is
wired the same way (stub cell, ``NAME.use(...)`` cell, a generated hints cell), its hints are current, and
:class:`~flashlib.exercises.puzzle.Puzzle` itself falls back to the solution for a stub or a wrong answer."""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import pkgutil
import sys
from pathlib import Path

import pytest

import flashlib.exercises
from flashlib.checks import CheckFailed
from flashlib.exercises.puzzle import Puzzle

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "notebooks"))
import make_hint_cells  # noqa: E402

MINIMUM = {"01": 1, "02": 1, "03": 2, "04": 1, "05": 2, "06": 2, "07": 2, "08": 1, "09": 2, "10": 2, "11": 1}


def _notebook_puzzles() -> dict[str, list[tuple[int, str, str]]]:
    return {path.name[:2]: make_hint_cells.hint_cells(json.loads(path.read_text()))
            for path in make_hint_cells.NOTEBOOKS}


def _library_puzzles() -> set[str]:
    found = set()
    for info in pkgutil.iter_modules(flashlib.exercises.__path__):
        module = importlib.import_module(f"flashlib.exercises.{info.name}")
        found |= {f"{info.name}.{name}" for name, value in vars(module).items()
                  if isinstance(value, Puzzle) and not name.startswith("_")}
    return found


def test_every_notebook_has_its_puzzles():
    found = _notebook_puzzles()
    short = {nb: len(found.get(nb, [])) for nb, least in MINIMUM.items() if len(found.get(nb, [])) < least}
    assert not short, f"notebooks with fewer puzzles than asked for (notebook: count): {short}"


def test_every_library_puzzle_is_in_a_notebook_and_back():
    in_notebooks = {f"{module}.{name}" for cells in _notebook_puzzles().values() for _, module, name in cells}
    assert in_notebooks == _library_puzzles()


def test_hints_cells_are_current():
    stale = {path.name: make_hint_cells.stale_cells(path) for path in make_hint_cells.NOTEBOOKS}
    assert not {k: v for k, v in stale.items() if v}, "run `make notebooks` (notebooks/make_hint_cells.py)"


@pytest.mark.parametrize("path", make_hint_cells.NOTEBOOKS, ids=lambda p: p.name[:2])
def test_each_puzzle_is_used_before_its_hints(path):
    """Above each hints cell: a code cell that hands the learner's answer to ``NAME.use(...)`` (so the rest of
    the notebook runs on a working version), and above that the stub the learner fills in."""
    cells = json.loads(path.read_text())["cells"]
    for index, _, name in make_hint_cells.hint_cells({"cells": cells}):
        above = ["".join(c["source"]) for c in cells[max(0, index - 3):index] if c["cell_type"] == "code"]
        assert any(f"{name}.use(" in source for source in above), f"{path.name}: no `{name}.use(...)` above its hints"
        assert any("NotImplementedError" in source for source in above), f"{path.name}: no stub above {name}'s hints"


# -- Puzzle itself ------------------------------------------------------------------------------------------


def _check_double(fn):
    if fn(3) != 6:
        raise CheckFailed("failed: double, case 'three' — got the wrong number")
    print("passed: double")


def _double(x):
    return 2 * x


DOUBLE = Puzzle("puzzle 0: double", _check_double, _double, ("multiply", "by two"))


def test_use_falls_back_to_the_solution_for_a_stub(capsys):
    def stub(x):
        raise NotImplementedError
    assert DOUBLE.use(stub) is _double
    assert "not attempted yet — the rest of this notebook uses flashlib's version" in capsys.readouterr().out


def test_use_falls_back_and_explains_for_a_wrong_answer(capsys):
    assert DOUBLE.use(lambda x: x + 2) is _double
    out = capsys.readouterr().out
    assert "failed: double, case 'three'" in out and "not passed yet" in out


def test_use_returns_a_passing_answer(capsys):
    def mine(x):
        return x + x
    assert DOUBLE.use(mine) is mine
    assert "solved — the rest of this notebook runs your version" in capsys.readouterr().out


def test_running_the_cell_again_after_a_fall_back_does_not_say_solved(capsys):
    def stub(x):
        raise NotImplementedError
    answer = DOUBLE.use(stub)  # the notebook's `double = DOUBLE.use(double)`: the name now holds the solution
    capsys.readouterr()
    assert DOUBLE.use(answer) is _double
    out = capsys.readouterr().out
    assert "solved" not in out and "passed — but this is flashlib's version" in out and "run your own cell again" in out


def test_errors_in_the_learners_code_propagate():
    with pytest.raises(TypeError):
        DOUBLE.use(lambda x: x + "2")


def test_hint_levels_end_with_the_solution(capsys):
    assert DOUBLE.levels == 3
    DOUBLE.hint(3)
    assert "def _double(x):" in capsys.readouterr().out
    assert DOUBLE.hint_markdown().count("<details>") == 3
    with pytest.raises(ValueError, match="level must be 1 to 3"):
        DOUBLE.hint(4)
    with pytest.raises(ValueError, match="at least two graded hints"):
        Puzzle("puzzle 9: p", _check_double, _double, ("one",))
    with pytest.raises(ValueError, match="starts with 'puzzle' or 'exercise'"):
        Puzzle("p", _check_double, _double, ("one", "two"))


def _check_six(answer):
    if answer != 6:
        raise CheckFailed(f"failed: six — got {answer}")
    print("passed: six")


def _six():
    return 2 * 3


SIX = Puzzle("exercise 1: six", _check_six, _six, ("a product", "of two and three"), answer_is_value=True)


def test_an_exercise_says_passed_and_takes_a_value_or_a_function_giving_it(capsys):
    assert SIX.use(6) == 6
    assert capsys.readouterr().out.splitlines()[-1] == "exercise 1: six: passed"
    assert SIX.use(lambda: 6) == 6
    assert SIX.solved() == 6 and "def _six():" in SIX.hint_text(3)


def test_an_exercise_not_attempted_or_wrong_points_at_its_hints(capsys):
    def stub():
        raise NotImplementedError
    assert SIX.use(stub) == 6
    assert "exercise 1: six: not attempted yet — fill in the stub above" in capsys.readouterr().out
    SIX.use(7)
    out = capsys.readouterr().out
    assert "failed: six — got 7" in out and "exercise 1: six: not passed yet — the hints are below the exercise" in out
    with pytest.raises(ValueError, match="function of no arguments"):
        Puzzle("exercise 2: p", _check_six, 6, ("one", "two"), answer_is_value=True)


# -- the last hint level pastes as it is -----------------------------------------------------------------------


def _defined_in_code(source: str) -> set[str]:
    """Names a notebook's code binds at its top level: defs, classes, assignments, imports, loop targets."""
    tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def _free_names(source: str) -> set[str]:
    """Names ``source`` reads that it does not bind itself (parameters, locals, its own defs) nor Python's builtins."""
    tree = ast.parse(source)
    bound = _defined_in_code(source) | set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            bound.add(node.arg)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


@pytest.mark.parametrize("path", make_hint_cells.NOTEBOOKS, ids=lambda p: p.name[:2])
def test_each_solution_pastes_over_its_stub(path):
    """The solution a hints cell ends with defines the names its stub cell defines (so the ``.use`` cell reads the
    pasted answer), and every other name it reads is one the notebook's code cells bind (no NameError)."""
    cells = json.loads(path.read_text())["cells"]
    notebook = _defined_in_code("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code"))
    problems = []
    for index, module, name in make_hint_cells.hint_cells({"cells": cells}):
        source = make_hint_cells.puzzle(module, name).solution_source()
        stubs = set()
        for cell in cells[max(0, index - 3):index]:
            if cell["cell_type"] == "code" and "NotImplementedError" in "".join(cell["source"]):
                stubs |= {n.name for n in ast.parse("".join(cell["source"])).body if isinstance(n, ast.FunctionDef)}
        defined = {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
        if not stubs <= defined:
            problems.append(f"{name}: the stub defines {sorted(stubs)}, the solution {sorted(defined)}")
        if missing := _free_names(source) - notebook:
            problems.append(f"{name}: the solution reads {sorted(missing)}, which the notebook never binds")
    assert not problems, f"{path.name}: {problems}"
