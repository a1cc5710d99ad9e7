"""Mutation testing of the puzzles' checkers: mutate each puzzle's solution, run its checker on every mutant.

``python tests/mutants.py [--list] [PUZZLE ...]`` (from the repository root, in the test environment; ``make
mutants`` runs all of them). A checker that passes a mutant of the solution would pass a learner's answer with
that bug, so every mutant must be *killed* (the checker raises) or recorded as *equivalent* (it computes the
same thing) in ``data/mutants/equivalent.json`` with one line saying why. The report, per puzzle, goes to
``data/mutants/report.json``; ``tests/test_mutants.py`` fails when the report is stale or records a survivor,
or when an equivalent recorded there no longer matches a mutant of the current solution. Each survivor that
was killed is a wrong answer in ``tests/test_exercises_*.py``, so CI keeps it killed without this run.

The mutations come from cosmic-ray (PyPI ``cosmic-ray``; its operators, applied in memory through
``cosmic_ray.mutating.mutate_code``): chosen over mutmut because its operators are importable one by one and
work on a source string, so each mutant is one function re-executed in this process and judged in a second
or two, where mutmut rewrites the tree and runs a test command per mutant (a fresh jax import each). The
operators are the mistakes a learner makes: a comparison made strict or non-strict or flipped, ``+``/``-``
and ``*``/``/`` swapped, a negation dropped, a constant off by one, ``True``/``False`` and ``and``/``or``
swapped, a loop that never runs, a decorator dropped (``@pl.when`` gone: the phase runs on every step), and
one more of flashlib's own on cosmic-ray's operator base: ``-inf`` initialisers replaced by ``0``.

A mutant is *killed* when the checker raises (``CheckFailed`` with its hint, or any error the learner would
see); it *survives* when the checker passes it. Each run prints one line per survivor with its diff.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import fcntl
import importlib
import inspect
import io
import json
import os
import pkgutil
import platform
import signal
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import parso
from cosmic_ray.mutating import mutate_code
from cosmic_ray.operators.operator import Example, Operator
from cosmic_ray.plugins import get_operator

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "mutants"
REPORT, EQUIVALENT = DATA / "report.json", DATA / "equivalent.json"
TIMEOUT_S = 120  # a mutant that loops (a range that never ends) is killed by the clock

PAIRS = {  # cosmic-ray's operator names, core/<Name>: the learner's mistakes
    "ReplaceComparisonOperator": ["Lt_LtE", "LtE_Lt", "Gt_GtE", "GtE_Gt", "Lt_Gt", "Gt_Lt", "LtE_GtE", "GtE_LtE",
                                  "Eq_NotEq", "NotEq_Eq"],
    "ReplaceBinaryOperator": ["Add_Sub", "Sub_Add", "Mul_Div", "Div_Mul", "FloorDiv_Mul", "Mod_FloorDiv"],
    "ReplaceUnaryOperator": ["Delete_USub"],
}
SINGLE = ["NumberReplacer", "ReplaceTrueWithFalse", "ReplaceFalseWithTrue", "ReplaceAndWithOr", "ReplaceOrWithAnd",
          "ZeroIterationForLoop", "RemoveDecorator"]
OPERATORS = [f"core/{kind}_{pair}" for kind, pairs in PAIRS.items() for pair in pairs] + [f"core/{n}" for n in SINGLE]


class NegativeInfinityToZero(Operator):
    """``-inf`` (``-jnp.inf``, ``-np.inf``, ``-math.inf``, ``float("-inf")``) becomes ``0.0``: the running max
    started at zero, the mistake notebook 04's learners make most."""

    def mutation_positions(self, node):
        if _is_negative_infinity(node):
            yield (node.start_pos, node.end_pos)

    def mutate(self, node, index):
        return parso.python.tree.Number(" 0.0" if node.get_code().startswith(" ") else "0.0", node.start_pos)

    @classmethod
    def examples(cls):
        return (Example("m = -jnp.inf", "m = 0.0"),)


def _is_negative_infinity(node) -> bool:
    code = node.get_code().strip()
    if node.type == "factor" and code.startswith("-") and code.replace(" ", "").endswith(".inf"):
        return True
    return node.type in ("atom_expr", "power") and code.replace(" ", "").replace("'", '"') == 'float("-inf")'


EXTRA = {"flashlib/NegativeInfinityToZero": NegativeInfinityToZero}


def _operator(name: str) -> Operator:
    return EXTRA[name]() if name in EXTRA else get_operator(name)()


@dataclass(frozen=True)
class Mutant:
    puzzle: str  # "variants.BLOCK_KIND"
    part: int  # which function of the solution (a tuple for some puzzles)
    function: str
    operator: str
    occurrence: int
    original: str  # the function's source
    source: str  # the mutated function's source

    @property
    def key(self) -> str:
        return f"{self.puzzle}:{self.function}:{self.operator.split('/')[1]}:{self.occurrence}"

    @property
    def diff(self) -> str:
        diff = difflib.unified_diff(self.original.splitlines(), self.source.splitlines(), lineterm="", n=0)
        lines = [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        return " | ".join(f"{line[0]} {line[1:].strip()}" for line in lines)


def puzzles() -> dict[str, object]:
    """Every :class:`~flashlib.exercises.puzzle.Puzzle` of ``flashlib.exercises``, by ``module.NAME``."""
    import flashlib.exercises as exercises  # noqa: PLC0415 - after argument parsing (jax is slow to import)
    from flashlib.exercises.puzzle import Puzzle  # noqa: PLC0415

    found = {}
    for info in pkgutil.iter_modules(exercises.__path__):
        module = importlib.import_module(f"flashlib.exercises.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, Puzzle) and value.checker.__module__ == module.__name__:
                found[f"{info.name}.{name}"] = value
    return dict(sorted(found.items()))


def solution_parts(puzzle) -> tuple:
    return puzzle.solution if isinstance(puzzle.solution, tuple) else (puzzle.solution,)


def function_source(fn) -> str:
    return textwrap.dedent(inspect.getsource(fn))


def mutants_of(name: str, puzzle) -> list[Mutant]:
    """Every mutant of every function of ``puzzle``'s solution, one mutation each."""
    return [mutant for part, fn in enumerate(solution_parts(puzzle))
            for mutant in mutants_of_source(name, part, fn.__name__, function_source(fn))]


def mutants_of_source(name: str, part: int, function: str, source: str) -> list[Mutant]:
    found = []
    for op_name in [*OPERATORS, *EXTRA]:
        operator, occurrence = _operator(op_name), 0
        while (mutated := mutate_code(source, operator, occurrence)) is not None:
            if mutated != source and not _signature_only(source, mutated):
                found.append(Mutant(name, part, function, op_name, occurrence, source, mutated))
            occurrence += 1
    return found


def _signature_only(source: str, mutated: str) -> bool:
    """cosmic-ray reads a signature's bare ``*`` as multiplication and offers ``/``: not a learner's mistake (the
    checkers call by keyword, which either signature takes), so not a mutant."""
    changed = [(a, b) for a, b in zip(source.splitlines(), mutated.splitlines(), strict=False) if a != b]
    return all(a.lstrip().startswith("def ") and a.replace("*,", "/,") == b for a, b in changed)


def _rebuild(mutant: Mutant, fn):
    namespace = dict(fn.__globals__)
    exec(compile(mutant.source, f"<mutant {mutant.key}>", "exec"), namespace)  # noqa: S102 - our own source
    return namespace[fn.__name__]


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def judge(puzzle, mutant: Mutant) -> tuple[str, str]:
    """``("killed", first line of the checker's message)`` or ``("survived", "")``."""
    parts = list(solution_parts(puzzle))
    fn = parts[mutant.part]
    try:
        parts[mutant.part] = _rebuild(mutant, fn)
    except Exception as error:  # noqa: BLE001 - a mutant that does not even compile is killed
        return "killed", f"does not compile: {type(error).__name__}"
    answer = tuple(parts) if isinstance(puzzle.solution, tuple) else parts[0]
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            puzzle.check(answer)
    except _Timeout:
        return "killed", f"timed out after {TIMEOUT_S} s"
    except Exception as error:  # noqa: BLE001 - CheckFailed, or any error the learner would see
        from flashlib.checks import reset_interpreter  # noqa: PLC0415

        reset_interpreter()
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return "killed", f"{type(error).__name__}: {message[:160]}"
    finally:
        signal.alarm(0)
    return "survived", ""


def load_equivalent() -> dict[str, dict]:
    return json.loads(EQUIVALENT.read_text()) if EQUIVALENT.exists() else {}


@contextlib.contextmanager
def _locked():
    """One writer at a time for the report and the equivalents (several runs may share a checkout)."""
    DATA.mkdir(parents=True, exist_ok=True)
    with open(DATA / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def record_equivalent(key: str, why: str) -> None:
    """Record mutant ``key`` (as a run prints it) as equivalent to the solution, with the reason in one line."""
    name = key.split(":", 1)[0]
    every = puzzles()
    if name not in every:
        raise SystemExit(f"unknown puzzle {name!r} in {key!r}")
    found = {m.key: m for m in mutants_of(name, every[name])}
    if key not in found:
        raise SystemExit(f"{key!r} is not a mutant of {name}'s current solution")
    if len(why.strip()) <= 10:
        raise SystemExit("say in a line why the mutant computes the same thing")
    with _locked():
        equivalent = load_equivalent()
        equivalent[key] = {"diff": found[key].diff, "why": why.strip()}
        EQUIVALENT.write_text(json.dumps(dict(sorted(equivalent.items())), indent=1) + "\n")
    print(f"recorded {key} as equivalent; run python tests/mutants.py {name} to update the report")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="puzzles to run (module.NAME, e.g. variants.BLOCK_KIND); all if none")
    parser.add_argument("--list", action="store_true", help="count the mutants per puzzle, run nothing")
    parser.add_argument("--equivalent", nargs=2, metavar=("KEY", "WHY"),
                        help="record mutant KEY (as a run prints it) as equivalent, WHY in one line; run nothing")
    args = parser.parse_args(argv)
    if args.equivalent:
        record_equivalent(*args.equivalent)
        return 0
    every = puzzles()
    unknown = sorted(set(args.names) - set(every))
    if unknown:
        parser.error(f"unknown puzzle(s) {unknown}; choose from {sorted(every)}")
    chosen = {n: every[n] for n in (args.names or every)}
    equivalent = load_equivalent()
    results, survivors = {}, 0
    for name, puzzle in chosen.items():
        mutants = mutants_of(name, puzzle)
        if args.list:
            print(f"{name}: {len(mutants)} mutants")
            continue
        start, counts, survived = time.perf_counter(), {"killed": 0, "equivalent": 0, "survived": 0}, []
        for mutant in mutants:
            if mutant.key in equivalent:
                counts["equivalent"] += 1
                continue
            verdict, _ = judge(puzzle, mutant)
            counts[verdict] += 1
            if verdict == "survived":
                survived.append({"key": mutant.key, "diff": mutant.diff})
                print(f"SURVIVED {mutant.key}: {mutant.diff}", flush=True)
        survivors += len(survived)
        seconds = time.perf_counter() - start
        print(f"{name}: {len(mutants)} mutants, {counts['killed']} killed, {counts['equivalent']} equivalent, "
              f"{counts['survived']} survived ({seconds:.0f} s)", flush=True)
        results[name] = {"mutants": len(mutants), **counts, "seconds": round(seconds, 1), "survivors": survived}
    if not args.list:  # merged into the report as it is now (another run may have written it meanwhile)
        with _locked():
            report = json.loads(REPORT.read_text()) if REPORT.exists() else {"puzzles": {}}
            report["puzzles"].update(results)
            report["date"] = time.strftime("%Y-%m-%d")
            report["machine"] = f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, CPU only"
            report["operators"] = [*OPERATORS, *EXTRA]
            REPORT.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    return 1 if survivors else 0


if __name__ == "__main__":
    # notebook 11's ring puzzle runs on 8 simulated CPU devices: XLA reads this before jax makes its first array
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    sys.exit(main())
