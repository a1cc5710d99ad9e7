"""The notebooks' exercise checkers, importable so that a test can run each one on the stub, on plausible
wrong answers and on a solution (``tests/test_exercises.py``). One module per notebook; a checker builds its
own cases, prints ``passed: ...`` or raises :class:`flashlib.checks.CheckFailed` with a message that names
the failing case in words and the likely mistake. Notebooks call them through :func:`flashlib.checks.exercise`.

So far: notebook 03 (:mod:`flashlib.exercises.online_softmax`). The other notebooks' checkers still live in
their cells and move here one notebook at a time (issue 13).
"""
