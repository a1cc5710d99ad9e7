"""The library's structure, held against its declared layers: imports run one way (down), there are no
import cycles, no module is long without saying why, and nothing in the repository points outside it.

The layer order below is the one drawn in README.md's module map and in ``flashlib/__init__``'s docstring.
A module may import from its own layer or any layer below; a new module must be given a layer here."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
from clean_notebooks import LOCAL_PATH

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flashlib"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (  # bottom up
    ("ground: contract, tiling rules, geometry, chip facts, plumbing", (
        "flashlib._compat", "flashlib.env", "flashlib.hardware", "flashlib.tiling", "flashlib.geometry",
        "flashlib.masks", "flashlib.arguments",
        "flashlib.api", "flashlib.data", "flashlib.release", "flashlib.progress", "flashlib.provenance",
        "flashlib.llo_dump", "flashlib.tpu_compile", "flashlib.slice_compile", "flashlib.viz", "flashlib.viz.*",
    )),
    ("algorithms: the oracle, the pure-JAX stages, the checks, the cost model", (
        "flashlib.reference", "flashlib.blockwise_backward", "flashlib.blockwise", "flashlib.xla", "flashlib.checks",
        "flashlib.cost", "flashlib.decode",
    )),
    ("the Pallas backend: tuned-table reader, block sizes, options, kernels", (
        "flashlib.kernels", "flashlib.kernels.*",
    )),
    ("beyond one chip: batch/head sharding and ring attention on JAX's SPMD (shard_map, ppermute)", (
        "flashlib.sharded", "flashlib.ring_plan", "flashlib.ring_workers", "flashlib.ring",
    )),
    ("the public surface", ("flashlib",)),
    ("measurement: static estimates, the performance lab's tables", ("flashlib.estimate", "flashlib.perf_data",
                                                                  "flashlib.decode_estimate")),
    ("top: tuning sweep, benchmark, plots, widgets, the tiny model the notebooks train, the learner's puzzles and "
     "exercises (they check every stage)", (
        "flashlib.tuning", "flashlib.bench", "flashlib.perf_plots", "flashlib.widgets",
        "flashlib.exercises", "flashlib.exercises.*", "flashlib.char_model",
    )),
)
MAX_LINES = 400
LONG_REASON = "Longer than 400 lines because"  # a module over the limit says why, in its docstring


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if module == pattern or (pattern.endswith(".*") and module.startswith(pattern[:-1])):
                return index
    raise KeyError(module)


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports_in(source: str) -> set[str]:
    """The flashlib modules ``source`` imports, anywhere in it (function-local imports included; not under
    ``if TYPE_CHECKING``): ``from flashlib import cost`` is ``flashlib.cost``; ``from flashlib.kernels import
    BlockSizes`` is the package ``flashlib.kernels``."""
    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(source)]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "flashlib"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "flashlib":
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in MODULES else node.module)
        todo.extend(ast.iter_child_nodes(node))
    return {name for name in found if name in MODULES}


def imports_of(module: str) -> set[str]:
    return imports_in(MODULES[module].read_text()) - {module}


GRAPH: dict[str, set[str]] = {module: imports_of(module) for module in MODULES}


def test_every_module_has_a_layer():
    missing = []
    for module in MODULES:
        try:
            layer_of(module)
        except KeyError:
            missing.append(module)
    assert not missing, f"give these modules a layer in tests/test_architecture.py's LAYERS: {missing}"


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
            for module, targets in graph.items() for target in sorted(targets) if layer_of(target) > layer_of(module)]


def test_imports_run_down_the_layers():
    upward = _upward(GRAPH)
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_there_are_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_a_planted_upward_import_or_cycle_is_caught():
    """The checks read real code: the kernels' block sizes reaching into the tuning sweep from inside a function
    (as they once did) is an upward edge, and the blockwise pair importing each other is a cycle."""
    planted = imports_in("def default():\n    from flashlib import tuning\n    return tuning.lookup\n")
    assert planted == {"flashlib.tuning"}
    graph = {**GRAPH, "flashlib.kernels.block_sizes": GRAPH["flashlib.kernels.block_sizes"] | planted}
    assert _upward(graph) == ["flashlib.kernels.block_sizes (layer 2) imports flashlib.tuning (layer 6)"]
    pair = {**GRAPH, "flashlib.blockwise_backward": GRAPH["flashlib.blockwise_backward"] | {"flashlib.blockwise"}}
    assert _cycles(pair) == [["flashlib.blockwise", "flashlib.blockwise_backward"]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_are_short_or_say_why(module):
    text = MODULES[module].read_text()
    lines = text.count("\n")
    assert lines <= MAX_LINES or LONG_REASON in text, (
        f"{MODULES[module].relative_to(ROOT)} has {lines} lines (> {MAX_LINES}): split it by concept, or say "
        f"'{LONG_REASON} ...' in its docstring")


# Where a file may not point: a sibling checkout's shared folder, or this machine's absolute paths.
CHECKERS = {"clean_notebooks.py", Path(__file__).name}  # the notebook path scrubber and this test name the patterns
# The notes of a sibling checkout (spelled in parts, so the name is not itself a citation of them), and this
# machine's absolute paths: the pattern tests/clean_notebooks.py already keeps out of notebook outputs.
SIBLING_NOTES = "/".join(("shared", "reference"))
OUTSIDE = re.compile(rf"(?:\.\./|\b){SIBLING_NOTES}|/home/[a-z]|{LOCAL_PATH.pattern}")


def _tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed.splitlines() if (ROOT / name).is_file()]


def test_nothing_points_outside_the_repository():
    offenders = []
    for path in _tracked_files():
        if path.suffix in {".npz", ".png", ".gif"} or path.name in CHECKERS:
            continue
        text = path.read_text(errors="ignore")
        offenders += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in OUTSIDE.finditer(text)]
    assert not offenders, "references to places outside the repository:\n" + "\n".join(offenders[:20])
