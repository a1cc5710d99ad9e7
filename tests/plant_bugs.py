"""Is the suite still able to fail? Plant one known bug at a time in the library, run the tests that must
catch it under ``make test``'s settings, and report whether they failed.

``python tests/plant_bugs.py [--smoke] [NAME ...]`` (from the repository root, in the test environment):
each planted bug is a one-line edit (:data:`BUGS`), applied in place and always reverted (the file is
restored byte for byte, also on Ctrl-C or SIGTERM, e.g. from ``timeout``). ``--smoke`` runs the searches
as ``make test-colab`` does (``FLASHLIB_SEARCH=smoke``), the weaker of the two settings. A bug the tests
do not catch is printed as SURVIVED and the exit status is 1. The tests run as make test runs them:
``JAX_DISABLE_MOST_OPTIMIZATIONS=1``, pytest-xdist with the suite's groups, stopping at the first failure.

Each bug is paired with tests that caught it before the suite moved to parallel workers, unoptimized CPU
compiles and smoke-sized searches on the Colab mirror (their shapes, examples or placement changed). Not every
test catches every bug: ``test_wide_logits_keep_the_rule_pallas`` (10 random examples up to 160 tokens) does
not catch the Pallas kernel's dropped rescale of ``l`` nor the band's off-by-one, in either setting; the peers'
fixed cases and ``test_tpu_forward.py`` do. The off-by-one (a query block's last key one short) only drops a
block where that key is the first of its block, which aligned square blocks never meet: of the tests tried
(``test_tpu_forward.py``, the kernel-variant search, the wide-logit search) only the NumPy geometry search
catches it, at 75 examples as at 300.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Bug:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest arguments that must fail with the bug planted


BUGS = [
    Bug("pallas-causal-offset", "flashlib/kernels/variants.py",
        "visible &= kv_pos <= diagonal + right", "visible &= kv_pos <= diagonal + right + 1",
        ("tests/test_hard_regimes.py::test_wide_logits_keep_the_rule_pallas", "tests/peers/test_jax_splash.py")),
    Bug("blockwise-dropped-rescale", "flashlib/blockwise.py",
        "l=state.l * alpha + jnp.sum(p, axis=-1),", "l=state.l + jnp.sum(p, axis=-1),",
        ("tests/test_implementations.py::test_matches_oracle",
         "tests/test_hard_regimes.py::test_wide_logits_keep_the_rule")),
    Bug("pallas-dropped-rescale", "flashlib/kernels/forward_kernel.py",
        "head.l[rows, :] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)",
        "head.l[rows, :] = l_prev + jnp.sum(p, axis=1, keepdims=True)",
        ("tests/peers/test_flash_attention.py", "tests/test_tpu_forward.py::test_matches_oracle")),
    Bug("band-off-by-one-block", "flashlib/geometry.py",
        "return (q_block + 1) * block_q - 1 + (kv_len - q_len) + right",
        "return (q_block + 1) * block_q - 2 + (kv_len - q_len) + right",
        ("tests/test_pallas_variants.py::test_block_geometry_follows_the_element_rule",)),
    Bug("merge-without-rescale", "flashlib/reference.py",
        "l=a.l * alpha + b.l * beta,", "l=a.l * alpha + b.l,",
        ("tests/test_decode.py::test_reference_and_split_kv_match_the_oracle", "tests/test_sharded.py")),
]


def run_planted(bug: Bug, *, smoke: bool) -> tuple[bool, float]:
    """``(caught, seconds)``: whether every test set of ``bug`` failed with it planted."""
    path = ROOT / bug.path
    original = path.read_bytes()
    text = original.decode()
    if text.count(bug.old) != 1:
        raise SystemExit(f"{bug.name}: the line to change is not in {bug.path} exactly once; update BUGS")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
           "FLASHLIB_SEARCH": "smoke" if smoke else "search"}
    start = time.monotonic()
    caught = True
    try:
        path.write_text(text.replace(bug.old, bug.new))
        for target in bug.tests:
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "2", "--dist", "loadgroup",
                                   "-p", "no:cacheprovider", target], cwd=ROOT, env=env, capture_output=True,
                                  text=True)
            # a failure: exit 1, or 2 where xdist stops the session at -x's first failure
            failed = done.returncode in (1, 2) and "failed" in done.stdout.lower()
            print(f"  {bug.name}: {target}: {'FAILED (caught)' if failed else f'exit {done.returncode}'}")
            caught &= failed
    finally:
        path.write_bytes(original)
    return caught, time.monotonic() - start


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # so a planted bug is reverted (run_planted's finally) when killed by SIGTERM


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="planted bugs to run (default: all)")
    parser.add_argument("--smoke", action="store_true", help="run the searches as make test-colab does")
    args = parser.parse_args()
    chosen = [bug for bug in BUGS if not args.names or bug.name in args.names]
    survived = []
    for bug in chosen:
        caught, seconds = run_planted(bug, smoke=args.smoke)
        print(f"{'caught  ' if caught else 'SURVIVED'} {bug.name} ({seconds:.0f} s)", flush=True)
        if not caught:
            survived.append(bug.name)
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
