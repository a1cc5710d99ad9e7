"""flashlib.tuning: candidate blocks, the bookkeeping of a tuning run, the committed table and its lookup rule.

Nothing here compiles except the ``@pytest.mark.tpu`` check that every tuned configuration in the committed
table compiles for its TPU target (a small length, one head: seconds). ``tune`` itself is exercised with a
stand-in for the compiler; the real sweep is ``data/tuning/make_tuned_table.py``.
"""

from __future__ import annotations

import importlib.util
import io
import json

import jax
import jax.numpy as jnp
import pytest

import flashlib
from flashlib import estimate, hardware, tuning
from flashlib.kernels.block_sizes import GENERATIONS, BlockSizes, entry_block_sizes, vmem_limit_bytes
from flashlib.progress import progress
from flashlib.tiling import NUM_LANES, sublanes
from flashlib.tpu_compile import compile_for_tpu
from flashlib.tuning import TableKey, Trial, TuningResult

# ---------------------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_candidates_obey_the_tiling_rule_and_fit_vmem(generation, dtype, head_dim):
    found = tuning.candidates(2048, 2048, head_dim, dtype, generation)
    assert found, "some blocks always fit"
    for sizes in found:
        assert sizes.generation == generation
        assert sizes.block_q % sublanes(dtype) == 0 and sizes.block_k % NUM_LANES == 0
        assert sizes.vmem_bytes(head_dim, dtype) <= vmem_limit_bytes(generation)
        sizes.validate(dtype, head_dim)


def test_flashlibs_vmem_estimate_decides_what_is_tried():
    v5e = {(s.block_q, s.block_k) for s in tuning.candidates(2048, 2048, 128, "bfloat16", "v5e")}
    v6e = {(s.block_q, s.block_k) for s in tuning.candidates(2048, 2048, 128, "bfloat16", "v6e")}
    assert (1024, 1024) not in v5e and (1024, 1024) in v6e  # ~17 MiB: over v5e's 16 MiB, under v6e's 32
    assert v6e == {(q, k) for q in tuning.BLOCK_CHOICES for k in tuning.BLOCK_CHOICES}


def test_candidates_are_clamped_to_short_sequences_and_deduplicated():
    found = tuning.candidates(300, 200, 64, jnp.bfloat16, "v5e")
    assert {(s.block_q, s.block_k) for s in found} == {(256, 256), (304, 256)}  # 300 -> 304 rows, 200 -> 256 keys


def test_candidates_need_a_known_generation():
    with pytest.raises(ValueError, match="generation must be one of"):
        tuning.candidates(1024, 1024, 128, "bfloat16", "v4")


# ---------------------------------------------------------------------------------------------------
# A tuning run, with a stand-in for the compiler
# ---------------------------------------------------------------------------------------------------


def _fake_estimate(impl, *, seq, block_q, block_k, block_k_major=None, topology, causal, **shape):
    """Cycles that prefer block_q 512; causal flashlib kernels 'crash the profiler' at block_k 256."""
    if impl == "pallas" and causal and block_k == 256:
        raise estimate.ProfilerCrashError("libtpu's static profiler crashed on this kernel")
    if block_q == 1024 and block_k == 1024:
        raise estimate.EstimateError("does not compile for v6e:1x1: VMEM")
    cycles = 1000 * abs(block_q - 512) + 100_000 // block_k + (5 if impl == "jax_flash" else 0)
    chip = hardware.chip_for_topology(topology)
    return estimate.CycleEstimate(topology, chip, {"kernel": cycles}, flops=chip.flops_per_cycle * 100.0,
                                  libtpu_version="test", compile_seconds=0.1)


def test_tune_keeps_every_outcome_and_picks_the_fewest_cycles(monkeypatch):
    monkeypatch.setattr(estimate, "estimate_attention", _fake_estimate)
    heard: list[str] = []
    result = tuning.tune(1024, head_dim=128, causal=True, topology="v5e:1x1", baseline=tuning.JAX_FLASH_CHOICES,
                         report=heard.append)
    statuses = {(t.block_q, t.block_k): t.status for t in result.trials}
    assert statuses[(1024, 1024)] == "refused"  # flashlib's VMEM estimate: never compiled
    assert statuses[(512, 256)] == "profiler_crash" and statuses[(512, 1024)] == "ok"
    assert (result.best.block_q, result.best.block_k) == (512, 1024)
    assert entry_block_sizes(result) == BlockSizes(512, 1024, generation="v5e")
    # JAX's configurations longer than the sequence are left out; a compile error is an outcome too
    assert [t.label for t in result.baseline] == ["q512/km512/k512", "q1024/km1024/k1024"]
    assert [t.status for t in result.baseline] == ["ok", "compile_error"]
    assert result.baseline_best.label == "q512/km512/k512"
    assert len(heard) == len(result.trials) - 1 + len(result.baseline)  # one line per compile
    assert result.key == TableKey("v5e", "bfloat16", True, 128, 1024, 1024)


def test_a_toolchain_that_cannot_estimate_still_raises(monkeypatch):
    monkeypatch.setattr(estimate, "supports_static_profile", lambda: False)
    with pytest.raises(estimate.LibtpuTooOldError):
        tuning.estimate_trial("pallas", block_q=256, block_k=256, seq=256)


def test_a_refused_configuration_is_an_outcome():
    trial = tuning.estimate_trial("pallas", block_q=2048, block_k=2048, seq=2048, topology="v5e:1x1")
    assert trial.status == "refused" and "16 MiB scoped limit" in trial.note and trial.cycles is None


def test_results_survive_json(monkeypatch):
    monkeypatch.setattr(estimate, "estimate_attention", _fake_estimate)
    result = tuning.tune(512, head_dim=64, topology="v6e:1x1", baseline=[(512, 512, 512)])
    data = json.loads(json.dumps(result.to_json()))
    assert TuningResult.from_json(data) == result
    assert data["best"] == {"block_q": 512, "block_k": 512, "cycles": result.best.cycles}
    assert data["vs_jax_flash"] == round(result.best.cycles / result.baseline_best.cycles, 3)


# ---------------------------------------------------------------------------------------------------
# The committed table
# ---------------------------------------------------------------------------------------------------


def test_the_committed_table_loads_and_says_where_it_came_from():
    data = json.loads(tuning.TABLE_PATH.read_text())
    assert data["complete"] and data["libtpu"] and data["date"] and data["machine"] and data["kernel_source"]
    table = tuning.load_tuned_table()
    assert len(table) == len(data["entries"]) >= 12
    for key, entry in table.items():
        assert key.generation in GENERATIONS and entry.key == key
        assert {t.status for t in entry.trials} <= set(tuning.STATUSES)
        assert all(t.cycles > 0 for t in entry.trials + entry.baseline if t.ok)
    # every point of the grid the header declares, which covers both generations, head_dim 128 and 1k-8k tokens
    # (head_dim 64 may be left out: libtpu 0.0.50's profiler crashes on it for every kernel, and "about" says so)
    declared = data["grid"]
    generations = {topology.split(":")[0] for topology in declared["topologies"]}
    assert generations >= set(GENERATIONS) and 128 in declared["head_dim"]
    assert {1024, 2048, 4096, 8192} <= set(declared["seq"]) and set(declared["causal"]) == {False, True}
    if 64 not in declared["head_dim"]:
        assert "head_dim=64" in data["about"]
    grid = {(k.generation, k.head_dim, k.causal, k.q_len) for k in table}
    assert grid == {(g, d, c, n) for g in generations for d in declared["head_dim"] for c in declared["causal"]
                    for n in declared["seq"]}


def _tuned_configs() -> list[tuple[TableKey, BlockSizes]]:
    table = tuning.load_tuned_table()
    return [(key, entry_block_sizes(entry)) for key, entry in table.items() if entry.best is not None]


def test_every_tuned_configuration_validates():
    configs = _tuned_configs()
    assert configs
    for key, sizes in configs:
        sizes.fit(key.q_len, key.kv_len, key.dtype).validate(key.dtype, key.head_dim)


@pytest.mark.tpu
def test_every_tuned_configuration_compiles_for_its_target():
    """Each distinct tuned configuration, at the shortest length that holds one block, on one head."""
    distinct = {(k.generation, k.dtype, k.causal, k.head_dim, s.block_q, s.block_k): s for k, s in _tuned_configs()}
    for (generation, dtype, causal, head_dim, block_q, block_k), sizes in sorted(distinct.items()):
        seq = max(block_q, block_k)
        q = jax.ShapeDtypeStruct((1, 1, seq, head_dim), jnp.dtype(dtype))

        def fn(q, k, v, causal=causal, sizes=sizes):
            return flashlib.attention(q, k, v, causal=causal, impl="pallas", interpret=False, block_sizes=sizes)

        check = compile_for_tpu(fn, q, q, q, topology=hardware.CHIPS[generation].topology)
        assert check.ok, f"{generation} {dtype} causal={causal} d={head_dim} q{block_q}/k{block_k}: {check.summary}"


def test_a_missing_table_is_empty(tmp_path):
    assert tuning.load_tuned_table(tmp_path / "absent.json") == {}


def test_the_packaged_table_is_read_whatever_flashlib_data_says(tmp_path, monkeypatch):
    """The defaults read the table inside the package: a Colab runtime restarted without its setup cell (no
    FLASHLIB_DATA) and one pointing FLASHLIB_DATA at another data folder get the same blocks (before the table
    shipped in the wheel, v5e's default for 8192 x 8192 bf16 lost its 4096-key copies and v6e's 1024 x 1024
    became 1024 x 512 there). The repository's data/tuning/forward_blocks.json is a link to that file."""
    from flashlib.data import DATA_ENV_VAR, DATA_FILE
    from flashlib.kernels import BlockSizes

    assert tuning.table_path() == tuning.PACKAGED_TABLE and tuning.PACKAGED_TABLE.parent.name == "kernels"
    assert tuning.TABLE_PATH.resolve() == tuning.PACKAGED_TABLE
    want = [BlockSizes.default(8192, 8192, 128, "bfloat16", generation=g) for g in ("v5e", "v6e")]
    assert want[0].block_k_major == 4096 and (want[1].block_q, want[1].block_k) == (1024, 1024)
    (tmp_path / DATA_FILE).touch()
    (tmp_path / "tuning").mkdir()
    entries = json.loads(tuning.TABLE_PATH.read_text())
    entries["entries"] = entries["entries"][:1]
    (tmp_path / "tuning" / tuning.TABLE_PATH.name).write_text(json.dumps(entries))
    for setting in (str(tmp_path), None):
        if setting is None:
            monkeypatch.delenv(DATA_ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(DATA_ENV_VAR, setting)
        assert tuning.table_path() == tuning.PACKAGED_TABLE
        assert [BlockSizes.default(8192, 8192, 128, "bfloat16", generation=g) for g in ("v5e", "v6e")] == want


def test_a_missing_packaged_table_is_an_install_error(tmp_path, monkeypatch):
    from flashlib.kernels import tuned_table

    monkeypatch.setattr(tuned_table, "PACKAGED_TABLE", tmp_path / "forward_blocks.json")
    with pytest.raises(FileNotFoundError, match="missing from the installed package.*reinstall"):
        tuning.load_tuned_table()


def _table_script():
    """``data/tuning/make_tuned_table.py`` as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("make_tuned_table", TABLE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLE_SCRIPT = tuning.TABLE_PATH.parent / "make_tuned_table.py"


@pytest.mark.skipif(not TABLE_SCRIPT.exists(), reason="the table script is in the repository, not the package")
def test_a_table_made_in_pieces_keeps_only_comparable_finished_tables(tmp_path):
    script = _table_script()
    committed = json.loads(tuning.TABLE_PATH.read_text())
    head = {"libtpu": committed["libtpu"], "candidates": committed["candidates"], "grid": committed["grid"]}
    piece = tmp_path / "piece.json"
    piece.write_text(json.dumps(committed))
    kept = script.load_kept([piece], head)
    assert len(kept) == len(committed["entries"]) and {name for name, _ in kept.values()} == {"piece.json"}
    assert head["kept_from"][0]["entries"] == len(kept) and "/tmp" not in head["kept_from"][0]["made_by"]
    other_heads = {**committed["grid"], "heads": committed["grid"]["heads"] + 1}
    for change, why in (({"libtpu": "0.0.1"}, "its libtpu"), ({"grid": other_heads}, "its heads"),  # other cycles
                        ({"complete": False}, "did not finish")):  # or an interrupted run
        piece.write_text(json.dumps({**committed, **change}))
        with pytest.raises(SystemExit, match=why):
            script.load_kept([piece], dict(head))
    # a scratch table is named, not located, in the committed header
    assert script._shown(str(piece)) == "<piece.json>" and script._shown("--keep") == "--keep"


# ---------------------------------------------------------------------------------------------------
# lookup: the nearest-entry rule
# ---------------------------------------------------------------------------------------------------


def _entry(n: int, best: tuple[int, int] | None, *, generation="v6e", causal=False, head_dim=128) -> TuningResult:
    trials = (Trial("pallas", 256, 256, "ok", cycles=10_000),)
    if best is not None:
        trials += (Trial("pallas", *best, "ok", cycles=1_000),)
    else:
        trials = (Trial("pallas", 256, 256, "profiler_crash"),)
    return TuningResult(f"{generation}:1x1", "bfloat16", causal, 1, 8, n, n, head_dim, 1.0, trials)


TABLE = {e.key: e for e in (
    _entry(1024, (512, 1024)), _entry(2048, (1024, 512)), _entry(4096, None),  # 4096: every candidate crashed
    _entry(2048, (256, 512), causal=True), _entry(2048, (512, 256), head_dim=64),
    _entry(2048, (1024, 1024), generation="v5e"),
)}


@pytest.mark.parametrize(
    ("q_len", "kv_len", "head_dim", "causal", "generation", "expected"),
    [
        (2048, 2048, 128, False, "v6e", (1024, 512)),  # exact entry
        (3000, 3000, 128, False, "v6e", (1024, 512)),  # the largest tuned length below
        (8192, 8192, 128, False, "v6e", (1024, 512)),  # 4096 has no best: the next one down
        (1500, 1500, 128, False, "v6e", (512, 1024)),
        (300, 300, 128, False, "v6e", (304, 384)),  # shorter than every entry: the shortest, clamped by fit
        (16, 4096, 128, False, "v6e", (16, 512)),  # q_len != kv_len: the length is the longer one
        (2048, 2048, 64, False, "v6e", (512, 256)),  # its own head_dim when tuned
        (2048, 2048, 96, False, "v6e", (1024, 512)),  # else the smallest tuned head_dim above it
        (2048, 2048, 256, False, "v6e", None),  # no tuned head_dim that large
        (2048, 2048, 128, True, "v6e", (256, 512)),  # causality must match
        (2048, 2048, 128, True, "v5e", None),
        (2048, 2048, 128, False, "v5e", None),  # the entry's blocks no longer fit the v5e budget: refused
    ],
)
def test_lookup_rule(q_len, kv_len, head_dim, causal, generation, expected):
    sizes = tuning.lookup(q_len, kv_len, head_dim, "bfloat16", causal, generation, table=TABLE)
    assert (None if sizes is None else (sizes.block_q, sizes.block_k)) == expected
    if sizes is not None:
        assert sizes.generation == generation
        sizes.validate("bfloat16", head_dim)


def test_lookup_in_the_committed_table_returns_its_best():
    table = tuning.load_tuned_table()
    key, entry = next((k, e) for k, e in table.items() if e.best is not None)
    sizes = tuning.lookup(key.q_len, key.kv_len, key.head_dim, key.dtype, key.causal, key.generation)
    assert sizes == entry_block_sizes(entry)
    assert tuning.lookup(key.q_len, key.kv_len, key.head_dim, "float32", key.causal, key.generation) is None


@pytest.mark.skipif(importlib.util.find_spec("tqdm") is not None, reason="tqdm draws its own bar")
def test_progress_says_which_item_runs():
    out = io.StringIO()
    assert list(progress(["a", "b"], describe=str.upper, file=out)) == ["a", "b"]
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[1/2 ") and lines[1].endswith("B")
