"""Shared test set-up: CPU only, deterministic keys, hypothesis profiles, the ``tpu`` marker, the
picture tests' fixtures and marks, and how the suite is split across pytest-xdist's workers.

Parallel runs (``make test`` runs ``pytest -n auto --dist loadgroup``): every test is its own unit of work
except those that must share a process, which :func:`pytest_collection_modifyitems` puts in one
``xdist_group``: the cells of one notebook (nbval runs them in order in one kernel), a module whose
tests share a module-scoped fixture (the 8-device subprocess of ``test_sharded.py``, the Colab venv of
``test_colab_route.py``: built once, not once per worker), and a peer suite's case (its float64 oracle and
naive errors are cached per case and shared by the four impls). Each worker is its own process, so each
has its own ``vm.max_map_count`` budget (see :func:`_release_compiled_programs`); the run's terminal
summary prints every worker's peak count of memory mappings, and the time spent in each test file.

Search or smoke: ``FLASHLIB_SEARCH=smoke`` (set by ``make test-colab``) runs the property searches that
re-check the same property with the same strategy in both environments (:func:`search_examples`) with a
quarter of their examples, still drawn at random; the main environment runs the full search. In a module
marked ``rotate_jnp_impls`` (the peer suites, the hard regimes' fixed cases) the smoke environment runs each
fixed case on ``pallas`` (the kernel, whose code moves most between jax versions) and on one of the three
implementations written in plain ``jax.numpy`` (reference, blockwise, xla), chosen per case by a hash of its
id (:func:`_rotated_out`), so every jnp impl still meets about a third of the cases there; the main
environment runs every case on every impl. Then of each parametrized test function's remaining cases one in
three runs there (:func:`_cases_rotated_out`), counted apart for each impl, chip, dtype and branch; the TPU
compile checks for Colab's free v5e-1 all run there, with Colab's libtpu. The smoke environment is there to
find what moves between jax versions, which every test function meets at least once; the main environment
gives every case its verdict on the newest jax."""

from __future__ import annotations

import gc
import importlib
import os
import re
import time
import zlib
from collections import defaultdict

# Before jax is imported anywhere: run on the CPU even where libtpu is installed (it is, for the AOT
# compile checks), and let several processes load libtpu at once.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from peers import rules  # noqa: E402

from flashlib import env  # noqa: E402

# "search" (the default) or "smoke": how many examples a search that runs in both environments draws here.
SEARCH_MODE = os.environ.get("FLASHLIB_SEARCH", "search")
if SEARCH_MODE not in ("search", "smoke"):
    raise pytest.UsageError(f"FLASHLIB_SEARCH={SEARCH_MODE!r}: use 'search' (default) or 'smoke'")


def search_examples(n: int) -> int:
    """``n`` examples where this environment runs the search, a quarter of them (at least 3, still random)
    where it runs the smoke set: for a search of the same property with the same strategy in both
    environments, whose code does not depend on the jax version more than its smoke set shows."""
    return n if SEARCH_MODE == "search" else max(3, n // 4)


settings.register_profile(
    "default", deadline=None, max_examples=search_examples(12), suppress_health_check=[HealthCheck.too_slow],
    derandomize=False, print_blob=True,
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=100, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. Each program compiled for the CPU holds a few
    memory mappings until it is freed; the whole suite compiles tens of thousands, and jax 0.7.2's CPU
    backend (the Colab mirror's) segfaults inside the compiler once the process reaches Linux's
    ``vm.max_map_count`` (65,530 by default): measured 41k mappings two thirds of the way through, a crash
    at the next compile after that. So after a module whose process holds more than
    :data:`CLEAR_CACHES_ABOVE` mappings, the caches are cleared: the count stays far below the limit, and the
    programs later modules compile again (the same small ops at the same shapes, the same kernels) are kept
    until then instead of being compiled once per module."""
    yield
    if _memory_mappings() > CLEAR_CACHES_ABOVE:
        jax.clear_caches()
        gc.collect()
        _CLEARS[0] += 1
    _PEAK_MAPPINGS[0] = max(_PEAK_MAPPINGS[0], _memory_mappings())


# Half of Linux's default vm.max_map_count: one module adds at most a few thousand mappings (at 16,000, a quarter,
# each worker cleared 3 times a run and compiled the shared small programs again after each).
CLEAR_CACHES_ABOVE = 32_000


_PEAK_MAPPINGS = [0]
_CLEARS = [0]  # how often this process cleared its caches


@pytest.fixture(autouse=True)
def _full_optimization_where_marked(request):
    """A test marked ``optimized`` compiles at XLA's full level even where ``make test`` sets
    ``JAX_DISABLE_MOST_OPTIMIZATIONS=1``: what it checks is what the optimizer does to the program."""
    lowered = jax.config.values.get("jax_disable_most_optimizations")
    if request.node.get_closest_marker("optimized") is None or not lowered:
        yield
        return
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", True)
        jax.clear_caches()


def _memory_mappings() -> int:
    """This process's count of memory mappings (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def make_qkv(
    batch: int = 1,
    heads: int = 2,
    q_len: int = 64,
    kv_len: int | None = None,
    head_dim: int = 32,
    dtype=jnp.float32,
    seed: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Random normal q, k, v in the flashlib layout."""
    kv_len = q_len if kv_len is None else kv_len
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = rules.normal_as(kq, (batch, heads, q_len, head_dim), dtype)  # jax.random.normal's bits (rules.py)
    k = rules.normal_as(kk, (batch, heads, kv_len, head_dim), dtype)
    v = rules.normal_as(kv, (batch, heads, kv_len, head_dim), dtype)
    return q, k, v


def tpu_race_state():
    """TPU interpret mode's race detector (``.races_found``, ``.reads``): private, and its module moved
    between jax versions; None where this jax has none we can read."""
    for name in ("jax._src.pallas.mosaic.interpret.interpret_pallas_call", "jax._src.pallas.mosaic.interpret"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "races"):
            return module.races
    return None


def assert_no_races() -> None:
    """After a run with ``pltpu.InterpretParams(detect_races=True)``: its race detector found no race (skips
    where this jax has no race-detector state we can read)."""
    races = tpu_race_state()
    if races is None or not hasattr(races, "races_found"):
        pytest.skip("this jax has no readable race-detector state (jax._src.pallas.mosaic.interpret.races)")
    assert not races.races_found


@pytest.fixture
def qkv():
    """The factory :func:`make_qkv` as a fixture."""
    return make_qkv


@pytest.fixture
def no_open_figures():
    """Every function leaves pyplot's registry as it found it (figures are closed once made)."""
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    yield
    assert plt.get_fignums() == before


@pytest.fixture
def shown(monkeypatch) -> list:
    """The figures the widgets hand to ``display``, in order."""
    from flashlib import widgets

    figures: list = []
    monkeypatch.setattr(widgets, "_show", figures.append)
    return figures


# The marks of a module that draws: every test leaves no figure open, and third-party noise on the Colab
# pins (matplotlib 3.10 + new pyparsing, ipywidgets 7 + new ipykernel) is not an error.
PICTURE_TEST_MARKS = [
    pytest.mark.usefixtures("no_open_figures"),
    pytest.mark.filterwarnings("ignore:.*deprecated.*use '.*':DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ipywidgets.*"),
]


def _xdist_group(item) -> str | None:
    """The group of tests that must run in one worker with ``item`` (None: it can run anywhere)."""
    path = item.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        return path  # nbval: one notebook, one kernel, its cells in order
    fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if any(d.scope == "module" and d.argname != "_release_compiled_programs" for defs in fixtures.values()
           for d in defs):
        return path  # a module-scoped fixture, computed once for the module
    case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
    if path.startswith("tests/peers/") and hasattr(case, "id"):
        return f"{path}::{case.id}"  # a peer's case: oracle and naive errors cached for its impls
    return None


def _schedule_rank(item) -> int:
    """Where an ungrouped ``item`` goes in the parallel run's queue. xdist's scheduler queues the groups first,
    the ones with most tests first (``--loadscope-reorder``, its default), then the single tests in collection
    order; the longest single tests are the property searches (5-50 s each), and one of them near the end
    leaves a worker idle while the other finishes it. So the searches go first among the single tests (0),
    the rest (mostly under a second each) after them (1), to fill in at the end."""
    return 0 if getattr(getattr(item, "obj", None), "is_hypothesis_test", False) else 1


# The peers' implementations written in plain jax.numpy: all but the Pallas kernel.
JNP_IMPLS = tuple(name for name in rules.IMPLS if name != "pallas")


def _rotated_out(item) -> bool:
    """In the smoke environment, a fixed case (not a search) of a module marked ``rotate_jnp_impls`` on a
    jnp impl other than the one its case hash picks: deselected there (the main environment runs it)."""
    if SEARCH_MODE != "smoke" or item.get_closest_marker("rotate_jnp_impls") is None:
        return False
    if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
        return False
    impl = getattr(getattr(item, "callspec", None), "params", {}).get("impl")
    if impl not in JNP_IMPLS:
        return False
    case = re.sub(rf"(?<![A-Za-z]){impl}(?![A-Za-z])", "", item.nodeid)  # the id without its impl
    return JNP_IMPLS[zlib.crc32(case.encode()) % len(JNP_IMPLS)] != impl


# The chip Colab lends for free (a v5e-1): every TPU compile check runs for it in both environments.
COLAB_TOPOLOGY = "v5e:1x1"


# In the smoke environment, one case in this many of each parametrized test function runs (see _cases_rotated_out).
SMOKE_CASE_SHARE = 3
# Parameters that choose which code runs, not which input: the smoke share is counted apart for each of their
# values, so every implementation, chip, dtype and causal/paged branch a test function names meets Colab's jax.
CODE_PATH_PARAMETERS = ("impl", "topology", "generation", "dtype", "causal", "paged", "kernel")


def _case_positions(items, key_of) -> list[tuple[object, int]]:
    """``(item, position)`` for each item ``key_of`` gives a key (None: not rotated): its 0-based position among
    the items of its key, in collection order."""
    seen: dict[object, int] = defaultdict(int)
    positions = []
    for item in items:
        key = key_of(item)
        if key is not None:
            positions.append((item, seen[key]))
            seen[key] += 1
    return positions


def _every_nth(items, key_of, n: int) -> set[str]:
    """Of the items ``key_of`` gives a key (None: not rotated), all but the 1st, (n+1)th, (2n+1)th... of each
    key, in collection order: the ones the smoke environment deselects."""
    return {item.nodeid for item, position in _case_positions(items, key_of) if position % n}


def _case_key(item):
    """The rotation key of a parametrized test's case (see :func:`_cases_rotated_out`); None: never rotated."""
    params = getattr(getattr(item, "callspec", None), "params", None)
    if not params or item.nodeid.split("::")[0].endswith(".ipynb"):
        return None
    topology = params.get("topology")
    if isinstance(topology, str) and topology == COLAB_TOPOLOGY and "tpu" in item.keywords:
        return None
    return (item.nodeid.split("[")[0],
            *(repr(params[name]) for name in CODE_PATH_PARAMETERS if name in params))


def _cases_rotated_out(items) -> set[str]:
    """In the smoke environment, one in :data:`SMOKE_CASE_SHARE` of each parametrized test function's cases: the
    1st, 4th, 7th... in collection order (after :func:`_rotated_out`), counted apart for each value of the
    parameters that choose code (:data:`CODE_PATH_PARAMETERS`: the impl, the TPU topology, the dtype, causal...),
    so every test function still runs under Colab's jax on every implementation, chip and branch it names. (Counted
    only apart for the kernel, the planted dropped rescale of blockwise went uncaught there.) Not rotated:
    notebooks, unparametrized tests, and the TPU compile checks for Colab's free chip (:data:`COLAB_TOPOLOGY`),
    which all run there with Colab's libtpu. What a case adds over its neighbours is another shape, variant or
    wrong answer for the same code under the same jax, a verdict the main environment gives on the newest jax;
    the smoke environment is there to find what moves between jax versions (an API, a lowering, interpret
    mode), which every code path meets at least once there."""
    if SEARCH_MODE != "smoke":
        return set()
    return _every_nth(items, _case_key, SMOKE_CASE_SHARE)


def _checker_cases_run_by_the_smoke_environment(items) -> set[str]:
    """In the main environment, the checkers' parametrized cases (``tests/test_exercises_*``: wrong answers,
    other valid styles) that the smoke environment runs, but the first of each test function: each such case
    gets its verdict in one environment of ``.ci/run``, not both. A checker's verdict on a learner's answer is
    its own logic, the same code under either jax; every checker function still runs in both environments (its
    first case, its stub and its solution), so what moves between jax versions under a checker is still seen
    in both. ``make test`` alone therefore skips these cases; ``.ci/run`` runs each of them once."""
    if SEARCH_MODE == "smoke":
        return set()
    exercises = [item for item in items if item.nodeid.startswith("tests/test_exercises_")]
    return {item.nodeid for item, position in _case_positions(exercises, _case_key)
            if position and position % SMOKE_CASE_SHARE == 0}  # what _every_nth keeps there, but the first


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    rotated = {item.nodeid for item in items if _rotated_out(item)}
    rotated |= _cases_rotated_out([item for item in items if item.nodeid not in rotated])
    rotated |= _checker_cases_run_by_the_smoke_environment(items)
    if rotated:
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in rotated])
        items[:] = [item for item in items if item.nodeid not in rotated]
    for item in items:
        group = _xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config, "workerinput", None) is not None:  # an xdist worker: its scheduler follows this order
        items.sort(key=_schedule_rank)  # stable: a notebook's cells stay in order
    if env.has_libtpu():
        return
    if os.environ.get("FLASHLIB_REQUIRE_LIBTPU") == "1":  # set by `make test`: CI must really compile
        raise pytest.UsageError("FLASHLIB_REQUIRE_LIBTPU=1 but libtpu is not installed: pip install 'jax[tpu]'")
    skip = pytest.mark.skip(reason="libtpu is not installed (pip install 'jax[tpu]'): no TPU target to compile for")
    for item in items:
        if "tpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Under ``--dist loadgroup``, every grouped test carries its group in its node id (xdist's channel to
    its scheduler); where it does not, the groups are ignored and a notebook's cells would run on two
    workers: say so instead of failing cell by cell."""
    if getattr(session.config, "workerinput", None) is None or not session.config.getvalue("loadgroup"):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(f"pytest-xdist ignored the xdist_group of {len(lost)} tests (e.g. {lost[0]}): "
                                "this pytest/xdist pair loses the groups (pytest-xdist #1386); install pytest<9.2")


# ---------------------------------------------------------------------------------------------------
# What the run cost: time by test file, and each worker's peak count of memory mappings
# ---------------------------------------------------------------------------------------------------


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the peak to the controller
        workeroutput["peak_mappings"] = max(_PEAK_MAPPINGS[0], _memory_mappings())
        workeroutput["cache_clears"] = _CLEARS[0]


_WORKER_PEAKS: dict[str, tuple[int, int]] = {}  # worker: (peak mappings, cache clears)
_STARTED = time.monotonic()


def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    if output.get("peak_mappings") is not None:
        _WORKER_PEAKS[node.gateway.id] = (output["peak_mappings"], output.get("cache_clears", 0))


def pytest_terminal_summary(terminalreporter):
    seconds: dict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                seconds[report.nodeid.split("::")[0]] += report.duration
    if not seconds:
        return
    total = sum(seconds.values())
    wall = time.monotonic() - _STARTED
    terminalreporter.write_sep("=", f"time by file: {total:.0f} s of test time in {wall:.0f} s of wall time")
    for path, spent in sorted(seconds.items(), key=lambda kv: -kv[1])[:20]:
        terminalreporter.write_line(f"{spent:8.1f} s  {100 * spent / total:5.1f}%  {path}")
    peaks = _WORKER_PEAKS or {"main": (max(_PEAK_MAPPINGS[0], _memory_mappings()), _CLEARS[0])}
    limit = _read_int("/proc/sys/vm/max_map_count")
    terminalreporter.write_line("peak memory mappings per process: " + ", ".join(
        f"{name} {count:,} (caches cleared {clears}x)" for name, (count, clears) in sorted(peaks.items()))
        + (f"; vm.max_map_count {limit:,}, caches cleared above {CLEAR_CACHES_ABOVE:,}" if limit else ""))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None
