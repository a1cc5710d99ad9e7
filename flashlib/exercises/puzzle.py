"""A puzzle: a piece of a notebook's central construction that the learner writes from a spec and a stub.

A :class:`Puzzle` holds what a notebook needs besides the learner's cell: the checker (prints ``passed: ...``
or raises :class:`~flashlib.checks.CheckFailed` naming the failing case in words and the likely mistake), a
solution (the short teaching version, also the fallback), and graded hints whose last level is the solution.

In a notebook the learner's stub cell is followed by::

    stable_softmax = puzzles.STABLE_SOFTMAX.use(stable_softmax)

which checks the attempt and hands back the learner's function when it passes; otherwise (a stub that still
raises ``NotImplementedError``, or an answer the checker rejects) it says so and hands back the solution, so
a reader who skips a puzzle still runs the rest of the notebook on a working version.

An end-of-notebook exercise is a ``Puzzle`` too, labelled ``"exercise N: ..."``: the same checker, graded hints
and solution, and ``.use(...)`` prints ``passed`` or the checker's message (nothing after it depends on the
answer). Where the learner's answer is a value (a number, a dict of counts) rather than a function,
``answer_is_value=True``: the solution is then the function of no arguments that works the value out (what the
last hint level prints, and what mutation testing mutates), and ``.use`` takes the value or a function of no
arguments returning it (a stub that raises ``NotImplementedError`` reads as not attempted). Errors the learner's
code raises itself (a ``TypeError``, a Mosaic error) propagate with their traceback: that is what they debug.

The hints are drawn in the notebook as collapsed markdown by ``notebooks/make_hint_cells.py`` from this one
source (a test checks they are current); ``puzzle.hint(level)`` prints the same text in a cell. After any
failure TPU interpret mode is reset (:func:`flashlib.checks.reset_interpreter`), so the next kernel runs clean.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashlib.checks import CheckFailed, reset_interpreter

__all__ = ["Puzzle"]

SOLUTION_SUFFIX = re.compile(r"\b(\w+)_solution\b")  # flashlib's name for the answer to the stub ``\1``


@dataclass(frozen=True)
class Puzzle:
    """One puzzle: ``checker(answer)`` judges the learner's answer (usually a function), ``solution`` is a
    correct answer of the same kind, ``hints`` go from a nudge to nearly the code (the solution is the level
    after the last hint)."""

    label: str  # "puzzle 1: stable softmax" or "exercise 2: the log-sum-exp", as the notebook's heading names it
    checker: Callable[[Any], object]
    solution: Any
    hints: tuple[str, ...]
    answer_is_value: bool = False  # the answer is a value; ``solution`` is the function of no arguments giving it

    def __post_init__(self) -> None:
        if self.kind not in ("puzzle", "exercise"):
            raise ValueError(f"Puzzle {self.label!r}: the label starts with 'puzzle' or 'exercise'")
        if len(self.hints) < 2:
            raise ValueError(f"Puzzle {self.label!r}: give at least two graded hints before the solution")
        if self.answer_is_value and not callable(self.solution):
            raise ValueError(f"Puzzle {self.label!r}: with answer_is_value, the solution is the function of no "
                             "arguments that works the value out")

    @property
    def kind(self) -> str:
        """``"puzzle"`` (later cells run the learner's answer) or ``"exercise"`` (nothing depends on it)."""
        return self.label.replace(":", " ").split(" ", 1)[0]

    def solved(self) -> Any:
        """A correct answer: the solution itself, or for a value answer the value it works out."""
        return self.solution() if self.answer_is_value else self.solution

    def check(self, answer: Any) -> None:
        """Run the checker on ``answer`` (raises :class:`CheckFailed` or ``NotImplementedError`` for a stub)."""
        self.checker(self._value(answer))

    def _value(self, answer: Any) -> Any:
        return answer() if self.answer_is_value and callable(answer) else answer

    def use(self, answer: Any) -> Any:
        """Check ``answer``; return it when it passes, otherwise say why and return the solution instead."""
        exercise = self.kind == "exercise"
        try:
            answer = self._value(answer)
            self.checker(answer)
        except NotImplementedError:
            print(f"{self.label}: not attempted yet — " + ("fill in the stub above, then run it and this cell again"
                  if exercise else "the rest of this notebook uses flashlib's version (fill in the stub, then run "
                  "it and this cell again)"))
            return self.solved()
        except CheckFailed as failure:
            reset_interpreter()
            print(failure)
            print(f"{self.label}: not passed yet — " + ("the hints are below the exercise" if exercise else
                  "the rest of this notebook uses flashlib's version until yours passes (the hints are below the "
                  "puzzle)"))
            return self.solved()
        except Exception:
            reset_interpreter()  # a kernel that raised must not break the notebook's next one (jax 0.7.2)
            raise
        if self._is_solution(answer):  # this cell ran before and fell back: the name now holds flashlib's version
            print(f"{self.label}: passed — but this is flashlib's version, which an earlier run of this cell handed "
                  "back: run your own cell again (the stub or your answer), then this one")
        else:
            print(f"{self.label}: " + ("passed" if exercise else
                                       "solved — the rest of this notebook runs your version"))
        return answer

    def _is_solution(self, answer: Any) -> bool:
        if isinstance(answer, tuple) and isinstance(self.solution, tuple):
            return len(answer) == len(self.solution) and all(a is b for a, b in zip(answer, self.solution, strict=True))
        return answer is self.solution

    @property
    def levels(self) -> int:
        """Hint levels including the solution: ``hint(levels)`` shows the solution."""
        return len(self.hints) + 1

    def solution_source(self) -> str:
        """The solution's source code (its function, or every function a tuple/dict of them holds), under the
        names the notebook's stubs use: flashlib's ``x_solution`` is shown as ``x``, so the last hint level
        pasted over the stub defines what the ``.use`` cell below it reads (a test holds each notebook to it)."""
        parts = self.solution.values() if isinstance(self.solution, dict) else (
            self.solution if isinstance(self.solution, tuple) else (self.solution,))
        source = "\n\n\n".join(textwrap.dedent(inspect.getsource(part)).rstrip() for part in parts)
        return SOLUTION_SUFFIX.sub(r"\1", source)

    def hint_text(self, level: int) -> str:
        """Hint ``level`` (1-based) as markdown; the level after the last hint is the solution's code."""
        if not 1 <= level <= self.levels:
            raise ValueError(f"level must be 1 to {self.levels} for {self.label!r} (the last level is the solution)")
        if level <= len(self.hints):
            return self.hints[level - 1]
        return "```python\n" + self.solution_source() + "\n```"

    def hint(self, level: int) -> None:
        """Print hint ``level`` (1-based); the last level prints the solution."""
        print(self.hint_text(level))

    def hint_markdown(self) -> str:
        """Every level as collapsed HTML ``<details>`` blocks, for the notebook's hints cell."""
        blocks = []
        for level in range(1, self.levels + 1):
            title = f"Hint {level}" if level <= len(self.hints) else "Solution"
            blocks.append(f"<details><summary>{title}</summary>\n\n{self.hint_text(level)}\n\n</details>")
        return "\n\n".join(blocks)
