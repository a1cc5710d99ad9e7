"""flashlib.decode_estimate (issue 17): the HBM floor's arithmetic anywhere; with a libtpu that writes static
profiles (the newest-jax environment), the decode kernel within 1.3x of the floor where the forward kernel is
~5x; and the committed table (data/estimates/decode_v5e.csv) says the same for every cache length and split.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from flashlib import decode_estimate, estimate, hardware

TABLE = Path(__file__).resolve().parents[1] / "data" / "estimates" / "decode_v5e.csv"
needs_profile = pytest.mark.skipif(
    not estimate.supports_static_profile(),
    reason=f"libtpu {estimate.libtpu_version()} predates the static profile flag (the newest-jax environment has it)",
)


def test_the_floor_is_the_cache_over_the_bandwidth():
    nbytes = decode_estimate.cache_bytes(1, 4, 4096, 128, "bfloat16")
    assert nbytes == 2 * 4 * 4096 * 128 * 2  # K and V, 2 bytes each
    v5e = hardware.CHIPS["v5e"]
    assert decode_estimate.hbm_floor_cycles(nbytes, "v5e") == pytest.approx(nbytes / 819e9 * v5e.clock_hz)
    assert round(decode_estimate.hbm_floor_cycles(nbytes, v5e)) == 15_394  # 10.2 us at 1.50 GHz


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be one of contiguous, paged, guarded, forward"):
        decode_estimate.estimate_decode("ragged")


def _table() -> list[dict[str, str]]:
    lines = [line for line in TABLE.read_text().splitlines() if not line.startswith("#")]
    return list(csv.DictReader(lines))


def test_the_committed_table_has_the_kernel_near_the_floor_and_the_forward_far_from_it():
    rows = _table()
    decode_rows = [r for r in rows if r["kind"] == "contiguous" and r["block_k"] == "2048"]
    forward_rows = [r for r in rows if r["kind"] == "forward"]
    assert {int(r["kv_len"]) for r in decode_rows} == {4096, 16384, 65536} and len(forward_rows) == 6
    assert all(r["status"] == "ok" and 1.0 <= float(r["vs_floor"]) <= 1.3 for r in decode_rows), decode_rows
    assert all(float(r["vs_floor"]) > 4 for r in forward_rows)


@pytest.mark.tpu
@needs_profile
def test_the_decode_kernel_reads_the_cache_near_the_hbm_floor():
    row = decode_estimate.estimate_decode("contiguous", kv_len=4096, num_splits=2)
    assert 1.0 <= row["vs_floor"] <= 1.3, row
    forward = decode_estimate.estimate_decode("forward", kv_len=4096)
    # the forward reads K and V once per group too (notebook 09's heads per step), but computes each head on its
    # own 16-row query tile, 15 rows of padding
    assert forward["cycles"] > 3 * row["cycles"]
