"""The mutation report of the puzzles' checkers is current and clean (``tests/mutants.py``, ``make mutants``).

Fixed cases, no search; cheap (mutants are generated, not judged: ``make mutants`` judges them). Runs in both
environments: the mutants are made from the solutions' source, the same under either jax.

Each puzzle's entry in ``data/mutants/report.json`` must count as many mutants as its solution has now (a
changed solution means a stale report: run ``make mutants``), none of them surviving, and every equivalent in
``data/mutants/equivalent.json`` must still be a mutant of the current solution, with its diff and a reason.
The kills themselves are regression cases in ``tests/test_exercises_*.py`` (wrong answers that must fail).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import pkgutil

import mutants
import pytest

PUZZLES = mutants.puzzles()
REPORT = json.loads(mutants.REPORT.read_text())
EQUIVALENT = mutants.load_equivalent()


@functools.cache
def made(name: str) -> list:
    """The mutants of ``name``'s solution (parso parses each function once per operator: ~0.5 s a puzzle)."""
    return mutants.mutants_of(name, PUZZLES[name])


@pytest.mark.parametrize("name", list(PUZZLES))
def test_the_report_is_current_and_no_mutant_survives(name):
    entry = REPORT["puzzles"].get(name)
    assert entry is not None, f"{name} is not in {mutants.REPORT.name}: run make mutants"
    now = made(name)
    assert entry["mutants"] == len(now), (f"{name}: the report counts {entry['mutants']} mutants, the solution now "
                                          f"makes {len(now)}: run python tests/mutants.py {name}")
    recorded = sum(1 for m in now if m.key in EQUIVALENT)
    assert entry["equivalent"] == recorded and entry["killed"] + recorded == len(now), entry
    assert entry["survived"] == 0 and not entry["survivors"], entry["survivors"]


def test_every_equivalent_is_a_current_mutant_with_a_reason():
    current = {mutant.key: mutant.diff for name in PUZZLES for mutant in made(name)}
    stale = {key: entry["diff"] for key, entry in EQUIVALENT.items() if current.get(key) != entry["diff"]}
    assert not stale, f"equivalents that no longer match a mutant (re-judge them with make mutants): {stale}"
    assert all(len(entry["why"]) > 10 for entry in EQUIVALENT.values())


def test_the_operators_make_the_learners_mistakes():
    source = "def f(x, *, n=4):\n    m = -jnp.inf\n    return x[:n] if m < x.sum() else x\n"
    made = {m.operator.split("/")[1]: m.diff for m in mutants.mutants_of_source("t.P", 0, "f", source)}
    assert made["NegativeInfinityToZero"] == "- m = -jnp.inf | + m = 0.0"
    assert made["ReplaceComparisonOperator_Lt_LtE"] == ("- return x[:n] if m < x.sum() else x | "
                                                        "+ return x[:n] if m <= x.sum() else x")
    assert "ReplaceBinaryOperator_Mul_Div" not in made  # the signature's bare * is not multiplication


def test_every_checker_is_a_puzzles_so_the_report_covers_it():
    """Each ``check_*`` of ``flashlib.exercises`` judges some puzzle or exercise (a ``Puzzle``), so mutation testing
    reaches every checker a notebook calls; a checker called directly from a notebook would escape it."""
    import flashlib.exercises as exercises  # noqa: PLC0415

    judged = {puzzle.checker for puzzle in PUZZLES.values()}
    loose = []
    for info in pkgutil.iter_modules(exercises.__path__):
        module = importlib.import_module(f"flashlib.exercises.{info.name}")
        loose += [f"{info.name}.{name}" for name, fn in vars(module).items()
                  if name.startswith("check_") and inspect.isfunction(fn) and fn.__module__ == module.__name__
                  and fn not in judged]
    assert not loose, f"checkers no Puzzle holds (make each an exercise Puzzle with hints and a solution): {loose}"
