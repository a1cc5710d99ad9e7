"""Sentences in the notebooks that quote a printed number say what the stored output prints.

Each claim is a piece of a notebook's prose and a pattern its outputs must match: when a re-run changes
the number, the prose must change with it (or be phrased so any plausible run agrees, and leave this list).
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import re
from pathlib import Path
from typing import NamedTuple

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


class Claim(NamedTuple):
    prose: str  # verbatim in one markdown cell
    output: str  # a regex some code cell's stored output matches


CLAIMS: dict[str, list[Claim]] = {
    "01_attention_and_softmax.ipynb": [
        Claim("about `3.4e38 ≈ e^88.7`", r"largest float32 = e\^88\.72"),
        Claim("`exp` of anything above 88.7 is `inf`", r"exp finite at 88, 89: \[ True False\]"),
        Claim("The scratch memory is two `N × N` float32 matrices", r"8192 \|\s+256 MiB \| 2\.0"),
        Claim("one layer at batch 8, 16 heads, `N = 8192`", r"S for one layer: 32 GiB"),
        Claim("in which the same 16 GB is 14.9 GiB", r"HBM of one TPU v5e chip: 16 GB = 14\.9 GiB"),
        Claim("32 GiB for one layer at batch 8, 16 heads, `N = 8192`: over twice a v5e", r"S alone is 2\.1x that"),
        Claim("8 GiB, more than half of a v5e chip's 14.9 GiB", r"HBM of one TPU v5e chip: 16 GB = 14\.9 GiB"),
        Claim("(6 layers,\n12 heads, `d = 32`)", r"6 layers x 12 heads, head_dim 32"),
        Claim('puts 68% of the attention of "it" on "animal"', r"sentence 0 \(tired\): 'it' -> animal 68%"),
        Claim('"street" gets only 12% and "animal" still gets more (28%)',
              r"sentence 1 \(wide\): 'it' -> \[CLS\] 33%, animal 28%, street 12%"),
    ],
    "02_tiling.ipynb": [
        Claim("about 240 FLOPs per byte", r"a v5e must do 240\.5 FLOPs per byte"),
        Claim("tiles of 8 leave the MXU idle 98% of the time", r"block   8:    4\.0 FLOPs per byte"),
        Claim("(240.9 against 240.5)", r"block 512:  240\.9 FLOPs per byte"),
        Claim("(240.9 against 240.5)", r"a v5e must do 240\.5 FLOPs per byte"),
        Claim('hands "animal" 0.80 instead of 0.68',
              r"softmax of the tile: 'animal' gets 0\.80[\s\S]*tile of the softmax: 'animal' gets 0\.68"),
        Claim("the 15% of the mass that\nsits in the second tile",
              r"tile of the softmax: 'animal' gets 0\.68, the tile's 8 keys get 0\.85"),
        Claim("only 85% of the softmax mass has been seen", r"the tile's 8 keys get 0\.85 in total"),
        Claim("The ratio tends to\n`2·block_q / d`",
              r"block_q 1024: naive moves 28\.7x the bytes \(2 \* block_q / d = 32\)"),
        Claim("31.8 FLOPs per byte here", r"naive:\s+31\.8 FLOPs per byte"),
        Claim("memory bound at `block_q = 128`, past the ridge point from `block_q = 256` on",
              r"block_q  128:  126\.0 FLOPs per byte -> memory bound\ntiled, block_q  256:  248\.2 FLOPs per byte -> "
              r"compute bound"),
        Claim("36 of 64 here", r"\{'compute': 28, 'masked': 8, 'skipped': 28\} of 64 grid steps"),
        Claim("The bytes drop less (40% here)", r"causal skipping saves 40% of the HBM traffic at N = 4096"),
        Claim("falls by 45% here, not 50%", r"K and V: 45% less"),
        Claim("that 11%\nof the full traffic does not shrink at all", r"Q and O: 11% of the full traffic, unchanged"),
    ],
    "03_online_softmax.ipynb": [
        Claim("At $j = 1$ and $j = 3$ the maximum grows and the sum so far shrinks by $e^{-2}$",
              r" 1\s+3\.0\s+3\.0\s+0\.1353\s+1\.1353\n 2\s+2\.0\s+3\.0\s+1\.0000\s+1\.5032\n"
              r" 3\s+5\.0\s+5\.0\s+0\.1353"),
        Claim("where the\nmaximum jumps from 3 to 5", r" 2\s+2\.0\s+3\.0\s+1\.0000\s+1\.5032\n 3\s+5\.0\s+5\.0\s+"),
        Claim("its scores against the 16 keys of the sentence",
              r"\[CLS\] the animal didn ' t cross the street because it was too tired \. \[SEP\]"),
        Claim("**block 1** holds nothing larger, so $\\alpha = 1$", r"\n\s+1\s+4- 7\s+3\.246\s+3\.246\s+1\.000\s"),
        Claim("the old sum is scaled by $\\alpha \\approx 0.91$", r"\n\s+2\s+8-11\s+3\.246\s+3\.342\s+0\.908\s"),
        Claim("**block 3** contains \"tired\", the key this head cares about", r'"it" attends most to "tired"'),
        Claim("everything seen\n  before shrinks by $\\alpha \\approx 0.2$",
              r"\n\s+3\s+12-15\s+3\.342\s+4\.949\s+0\.201\s"),
    ],
    "04_flash_attention_in_jax.ipynb": [
        Claim("six sentences of 14 to 18 tokens", r"sentence lengths: \[16, 16, 18, 15, 14, 16\]"),
        Claim("a partial last block for the sentences of 14, 15 and 18 tokens",
              r"sentence lengths: \[16, 16, 18, 15, 14, 16\]"),
        Claim("All four pass.", r"passed: q_len=237, kv_len=100, causal=True matches the float64 oracle"),
        Claim("where the naive score matrix alone is 1 GiB",
              r"passed: naive at N = 16384: at least one float32 score matrix, 1 GiB"),
        Claim("At 16k\n  tokens the scores alone are 1 GiB per head",
              r"passed: naive at N = 16384: at least one float32 score matrix, 1 GiB"),
        Claim("against a scratch-memory ratio in the hundreds",
              r"N = 4096, ours against naive: [\d.]+x the speed, [1-9]\d\dx less scratch memory"),
    ],
    "05_pallas_on_tpu.ipynb": [
        Claim("so a kernel must do 197e12 / 819e9 ≈ 241 FLOPs", r"v5e needs 241 FLOPs per HBM byte"),
        Claim("v5e needs about 241 FLOPs", r"v5e needs 241 FLOPs per HBM byte"),
        Claim("`(256, 64)` lowers although 64 is not a multiple of 128",
              r"array \(256, 64\)\s+block \(256, 64\)\s+lowers: True"),
        Claim("bf16 blocks of 8 rows compile", r"bf16 block \(8, 128\) compiles for v5e: True"),
        Claim("A finite, plausible, **wrong** answer", r"finite: True\ncorrect: False"),
        Claim("every accumulator started at `k = 1`, was reset at `k = 0`, and lost the `k = 1` term",
              r"wrong = EXACT minus the term of k = \[1\] in every output block"),
    ],
    "06_flash_attention_kernel.ipynb": [
        Claim("By 16k tokens it no longer fits", r"kv_len  16384:\s+32\.0 MiB\s+fits v5e's 16 MiB: False"),
        Claim("including the 12 skipped ones", r"32 grid steps: 12 computed, 8 masked, 12 skipped"),
        Claim("and 14 copies of", r"k blocks copied: 18 with the clamped index map, 32 without"),
        Claim("the grid keeps all 32 steps per head, and each of the 12 skipped ones still runs",
              r"32 grid steps: 12 computed, 8 masked, 12 skipped"),
        Claim("the grid has exactly the 12 + 8 steps that compute",
              r"32 grid steps: 12 computed, 8 masked, 12 skipped"),
        Claim("Six grid steps instead of 20 (and 8 instead of 32 for the full grids",
              r"grid steps per head: 6 with 512-key copies, 20 with one 128-key block per step \(full grids: 8 and "
              r"32\)"),
        Claim("where unchunked sub-blocks would run 8 full masked",
              r"128-key sub-blocks: 12 plain, 8 masked, 12 skipped"),
        Claim("the kernel runs 8 masked and 4 plain `128 × 128` chunks",
              r"row chunks of the masked ones: 4 plain, 8 masked, 4 skipped"),
        Claim("of the 16 row chunks on the diagonal, a quarter is skipped outright",
              r"row chunks of the masked ones: 4 plain, 8 masked, 4 skipped"),
        Claim("They use most of v5e's budget, 14.5 MiB of 16",
              r"BlockSizes\.default for v5e, 8k tokens: block_q=512"
              r", block_k=512, keys copied per step=4096, 14\.5 MiB"),
        Claim("copy 4096 keys per grid step", r"keys copied per step=4096"),
        Claim("The two equalities are not an independent check",
              r"compiler's flops == flashlib\.cost\.attention_flops: True\n"
              r"compiler's bytes == flashlib\.cost\.attention_bytes: True"),
        Claim("That is 62.5% of the non-causal work where the ideal triangle is 50%",
              r"matmul work: 62\.5% of non-causal attention \(the causal ideal is 50\.0%\)"),
        Claim("12 of 32 steps skipped, 18 instead of 32 copies",
              r"k blocks copied: 18 with the clamped index map, 32 without"),
        Claim("12 of 32 steps skipped, 18 instead of 32 copies", r"32 grid steps: 12 computed, 8 masked, 12 skipped"),
    ],
    "07_backward_pass.ipynb": [
        Claim("none of which is in the 1.3 ps", r"recompute S:\s+1\.3 ps of MXU time per score"),
        Claim("the backward costs 2.5× the forward", r"5 matmuls, 2\.5x the forward's 2"),
        Claim("five matmuls, 2.5× the forward", r"5 matmuls, 2\.5x the forward's 2"),
        Claim("4 + 3 = 7 matmuls instead of 5 — 3.5× the forward",
              r"backward kernels: 3\.5x the forward kernel's flops"),
        Claim("7 matmuls, 3.5× the forward", r"backward kernels: 3\.5x the forward kernel's flops"),
    ],
    "08_performance.ipynb": [
        Claim("(0.81 at $T = 1024$ after 0.64", r"v6e: flashlib / XLA = [^\n]*T=512: 0\.64, T=1024: 0\.81"),
        Claim("from $T = 512$ on both chips the kernel is",
              r"v5e: flashlib / XLA[^\n]*\n\s*flashlib is estimated faster from T=512\n(.|\n)*"
              r"v6e: flashlib / XLA[^\n]*\n\s*flashlib is estimated faster from T=512"),
        Claim("The winners use most of v5e's budget (11 to 15 of 16 MiB)",
              r"v5e T=1024 causal=False: best q1024/k512 needs 11\.0 of 16 MiB(.|\n)*"
              r"v5e T=2048 causal=False: best q1024/k512 needs 15\.0 of 16 MiB"),
        Claim("compute bound on v5e (ridge 241)", r"v5e: peak 197 TFLOP/s bf16, HBM 819 GB/s, ridge 241 FLOP/B"),
        Claim("below v6e's ridge of 560", r"v6e: peak 918 TFLOP/s bf16, HBM 1638 GB/s, ridge 560 FLOP/B"),
        Claim("(v5e ≈ 240, v6e ≈ 560 FLOP/B)", r"ridge 241 FLOP/B(.|\n)*ridge 560 FLOP/B"),
        Claim("by 2.0x to 3.3x on v5e\n  and up to 7.8x on v6e",
              r"v5e: points above[^\n]*\n\s+xla's counted bytes / estimated time: 2\.0x to 3\.3x the HBM bandwidth\n"
              r"v6e: points above[^\n]*\n\s+xla's counted bytes / estimated time: 2\.5x to 7\.8x"),
        Claim("Yet the XLA points sit *above* the memory roof",
              r"v5e: points above the roof: xla 6/6(.|\n)*v6e: points above the roof: xla 6/6"),
        Claim("v6e's derived clock, which the cell above calls implausibly high",
              r"the derived clock \(3\.5 GHz\) is implausibly high"),
        Claim("scoped-VMEM limit (16 MiB v5e, 32 MiB v6e)", r"needs [\d.]+ of 16 MiB(.|\n)*needs [\d.]+ of 32 MiB"),
        Claim("v6e loses at most 0.4% of its estimated\ncycles up to $T = 2048$. From $T = 4096$ on it gives up its "
              "largest configurations and pays 1.055x to\n1.105x the estimated cycles",
              r"v6e T=1024 causal=False: [^\n]*: 1\.004x the cycles\nv6e T=2048 causal=False: [^\n]*: 1\.000x[^\n]*\n"
              r"v6e T=4096 causal=False: [^\n]*: 1\.090x[^\n]*\nv6e T=8192 causal=False: [^\n]*: 1\.105x[^\n]*\n"
              r"v6e T=1024 causal=True : [^\n]*: 1\.000x[^\n]*\nv6e T=2048 causal=True : [^\n]*: 1\.000x[^\n]*\n"
              r"v6e T=4096 causal=True : [^\n]*: 1\.055x[^\n]*\nv6e T=8192 causal=True : [^\n]*: 1\.066x[^\n]*\n"
              r"passed: choose_blocks picks the tuned table's best for all 16 entries"),
        Claim("v6e would lose at most about 10% of its estimated cycles",
              r"v6e T=8192 causal=False: at 32 MiB [^\n]*: 1\.105x the cycles"),
    ],
    "10_decoding.ipynb": [
        Claim("The training kernel (`forward`, at the 16-row query block that `q_len = 1` pads to) is ~5x the floor",
              r"forward\s+1\s+4096\s+1\s+[\d,]+\s+[\d,]+\s+5\.\d+\n(.|\n)*forward\s+8\s+65536\s+1\s+[\d,]+\s+[\d,]+\s+5\.\d+"),
        Claim("512 keys a step costs 2.477x the floor, 4096 a step 1.033x",
              r"contiguous\s+-\s+-\s+512\s+2\.477\n(.|\n)*contiguous\s+-\s+-\s+4096\s+1\.033"),
        Claim("smallest copy of all, 5.771x", r"paged\s+128\s+1\s+128\s+5\.771"),
        Claim("**16 x 128, 1.764x, above it:**", r"paged\s+128\s+16\s+2048\s+1\.764"),
        Claim("**4 x 512, 1.048x, below it:**", r"paged\s+512\s+4\s+2048\s+1\.048"),
        Claim("**512 x 1, 1.900x, below contiguous 512 (2.477x): unexplained.**",
              r"contiguous\s+-\s+-\s+512\s+2\.477\n(.|\n)*paged\s+512\s+1\s+512\s+1\.900"),
        Claim("was 5.77x the HBM floor in section 5", r"128-token pages one a step: 5\.77x the floor"),
        Claim("and one 512-token page per step 1.90x", r"paged\s+512\s+1\s+512\s+1\.900"),
        Claim("and 4 x 512, 1.05x (both\nlower bounds", r"512-token pages four a step: 1\.05x"),
        Claim("at 8 FLOP/B the MXUs wait on HBM", r"contiguous: 8 FLOP/B, \d+% to \d+% of the roof"),
        Claim("of ~241 on v5e", r"intensity 8 FLOP/B vs ridge 241 -> memory bound"),
        Claim("8 for GQA 8:1 in bf16 against v5e's ridge of ~241", r"intensity 8 FLOP/B vs ridge 241"),
        Claim("16 x 128 = 2048 keys a step, 1.76x", r"paged\s+128\s+16\s+2048\s+1\.764"),
        Claim("one contiguous 2048-key block (1.230x)", r"contiguous\s+-\s+-\s+2048\s+1\.230"),
        Claim("One 128-token page a step costs 5.77x the\n  floor; copying several pages a step (`pages_per_step`) "
              "lowers it: sixteen 128-token pages 1.76x",
              r"paged\s+128\s+1\s+128\s+5\.771\n(.|\n)*paged\s+128\s+16\s+2048\s+1\.764"),
        Claim("512-token pages 1.05x (both lower bounds: see section 5's caveat)",
              r"512-token pages four a step: 1\.05x"),
        Claim('expect "the" and\n"of", repeated', r"'it was the [^'\n]*\bthe\b[^'\n]*\bof\b"),
        Claim("pool pages 3 and 8 are named, reserved for its next tokens, but not yet read",
              r"sequence 1: pages named step by step \[5, 11, 11, 11\], named but never "
              r"read \[3, 8\]"),
        Claim("A grid step runs the kernel's body once per query head, eight times",
              r"forward kernel: 8 query heads a step"),
        Claim("the padded query block and the output written back add 3% to the cache's bytes",
              r"HBM bytes\s+1\.03x"),
        Claim("sixteen times the FLOPs still leaves the kernel left of the ridge",
              r"matmul FLOPs 16\.00x\n(.|\n)*forward kernel: [^\n]*intensity 124 FLOP/B vs ridge 241 -> memory bound"),
        Claim("The extra exps (20x", r"exps\s+20\.00x"),
        Claim("not for its bytes (3% more),\n  nor for its 16x matmul work",
              r"HBM bytes\s+1\.03x\n\s+matmul FLOPs 16\.00x"),
    ],
    "09_masks_and_variants.ipynb": [
        Claim("in interpret mode here, on 128 queries over 256 keys",
              r"q \(1, 4, 128, 32\) k \(1, 2, 256, 32\)"),
        Claim("(above: 32 for q and k, 64 for v and the output)",
              r"q \(1, 4, 128, 32\) k \(1, 2, 256, 32\) v \(1, 2, 256, 64\) -> out \(1, 4, 128, 64\)"),
        Claim("Four steps per query block instead of eight", r"kv grid steps per query block: 4 of 8 key blocks"),
        Claim("K and V take a quarter of MHA's bytes in HBM, with MQA an eighth",
              r"kv_heads 2: K/V held\s+2 MiB \(0\.250 of MHA's\)(.|\n)*"
              r"kv_heads 1: K/V held\s+1 MiB \(0\.125 of MHA's\)"),
        Claim("The kernel also *copies* a quarter of MHA's",
              r"causal=False kv_heads 2: [^\n]*q heads per step 4, copied\s+8 MiB \(0\.250\)"),
        Claim("so it takes them 4 at a time",
              r"causal=False kv_heads 1: [^\n]*q heads per step 4, copied\s+8 MiB \(0\.250\)"),
        Claim("to 0.81x MHA's\nwithout the causal mask and 0.69x with it",
              r"causal=False kv_heads 2: [^\n]*\(0\.812 x MHA\)(.|\n)*causal=True  kv_heads 2: [^\n]*\(0\.685 x MHA\)"),
        Claim("(0.81x MHA's cycles, 0.69x causal, in the estimate)",
              r"causal=False kv_heads 2: [^\n]*\(0\.812 x MHA\)(.|\n)*causal=True  kv_heads 2: [^\n]*\(0\.685 x MHA\)"),
        Claim("From 2k to 32k tokens the cost per query token grows by 1.09x",
              r"T =   2048:[^\n]*(.|\n)*T =  32768:[^\n]*\nlargest / smallest cycles per query token: 1\.09"),
        Claim("(1.09x\n  per query token from 2k to 32k tokens", r"largest / smallest cycles per query token: 1\.09"),
        Claim("We pack three MiniLM sentences", r"sentence lengths \[16, 16, 18\] -> one row of 50 tokens"),
        Claim("(query 0-4 with keys 0-6 here)", r"passed: 'segments' is the oracle's mask"),
    ],
    "11_scaling_out.ipynb": [
        Claim("the compiled ring holds 14 collective-permutes: 7 transfers", r"'collective-permute': 14,"),
        Claim("so the ring takes 1.87x the ideal time on 8 devices", r"contiguous: the ring takes 1\.87\dx the time"),
        Claim("(1.87x the ideal\n  time on 8 devices)", r"contiguous: the ring takes 1\.87\dx the time"),
        Claim("its 6 ports, one per neighbour of its 3D torus, and its 100 GB/s are derived",
              r"v5p\s+100 GB/s"),
        Claim("a v5e needs chunks of about 4k tokens", r"v5e\s+50 GB/s[^\n]*\s(3[89]|4[0-2])\d\d tokens"),
        Claim("(a v6e, whose compute grew faster than its links, about 9k)", r"v6e\s+100 GB/s[^\n]*\s9\d\d\d tokens"),
        Claim("so its chunks too need about 4k", r"v5e\s+50 GB/s[^\n]*\s(3[89]|4[0-2])\d\d tokens"),
        Claim("about 8k tokens per device on a v5e", r"v5e\s+50 GB/s[^\n]*\s(3[89]|4[0-2])\d\d tokens"),
        Claim("is 64 x 64 = 4096 token pairs, the top of the colour bar, and a diagonal 64 · 65 / 2 = 2080",
              r"contiguous, a full pair 4096 and a diagonal 2080"),
        Claim("are 2 · 528 + 1024 = 2080", r"zig-zag, step 0 2080 and each later step 2048"),
        Claim("2 · 1024 = 2048.", r"zig-zag, step 0 2080 and each later step 2048"),
        Claim("4 conditionals, of which 3 run a kernel at step 0",
              r"step 0: every device computes diagonal, diagonal, full, skip"),
        Claim("and 2 at each later step", r"step 3: every device computes full, full, skip, skip"),
        Claim("here 0 → 1 → 3 → 2",
              r"chip 0 at \(0, 0\) -> chip 1 at \(1, 0\) -> chip 3 at \(1, 1\) -> chip 2 at \(0, 1\)"),
        Claim("The loop holds 2 of the program's collective-permutes", r"collective-permutes: 2 in the loop"),
        Claim("The 15\nbefore it cut q, k and v", r"collective-permutes: 2 in the loop [^\n]*, 15 before it"),
        Claim("the 7 after it", r"15 before it, 7 after it"),
        Claim("in flight during the step's 4 conditionals", r"\(4 and 4 conditionals between start and done\)"),
        Claim("its transfers would take about 15x as long as its kernels",
              r"section 5's ring \(v5e, chunks of 256 tokens\): transfer/compute 15\.\d"),
    ],
}


def _texts(notebook: str) -> tuple[str, str]:
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    prose = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    outputs = []
    for cell in cells:
        for out in cell.get("outputs", []):
            outputs.append("".join(out.get("text", "")))
            outputs.append("".join(out.get("data", {}).get("text/plain", "")))
    return prose, "\n".join(outputs)


@pytest.mark.parametrize("notebook, claim", [(nb, c) for nb, claims in CLAIMS.items() for c in claims],
                         ids=lambda x: x if isinstance(x, str) else x.prose[:40])
def test_the_prose_quotes_the_output(notebook, claim):
    prose, outputs = _texts(notebook)
    assert claim.prose in prose, f"{notebook}: the prose no longer says {claim.prose!r}"
    assert re.search(claim.output, outputs), f"{notebook}: no output matches {claim.output!r} for {claim.prose!r}"


def test_every_notebook_ends_with_references():
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        last = "".join(cells[-1]["source"]) if cells[-1]["cell_type"] == "markdown" else ""
        assert "## References" in last, f"{path.name}: end with a '## References' markdown cell"


# ---------------------------------------------------------------------------------------------------
# The prose names code that exists: files, private functions, flashlib.* attributes
# ---------------------------------------------------------------------------------------------------

ROOT = NOTEBOOKS.parent
TICKED = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"\b((?:flashlib|data|tests|notebooks)/[\w/.\-]+\.(?:py|csv|md|json|ipynb|txt))\b")
PRIVATE = re.compile(r"(?<![\w.])(_[A-Za-z]\w*)")


@functools.cache
def _known_names() -> frozenset[str]:
    """Names defined in flashlib and in JAX's Pallas TPU ops (which notebooks 06-08 read and quote)."""
    import jax.experimental.pallas.ops.tpu as jax_tpu_ops  # noqa: PLC0415 - only this test reads JAX's sources

    return frozenset(_names_defined_in(ROOT.glob("flashlib/**/*.py"))
                     | _names_defined_in(Path(jax_tpu_ops.__file__).parent.glob("**/*.py")))


def _names_defined_in(paths) -> set[str]:
    """Every function, class and module-level (or class-level) name assigned in ``paths``."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def _quoted_code(notebook: Path):
    """``(cell index, ticked text)`` of every inline-code span in the notebook's markdown cells."""
    for index, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        if cell["cell_type"] == "markdown":
            yield from ((index, tick) for tick in TICKED.findall("".join(cell["source"])))


@pytest.mark.parametrize("notebook", sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.name)
def test_the_prose_names_code_that_exists(notebook):
    """Twice the library moved on and the prose did not (issue 26): a file path, a private name (``_foo``) or a
    ``flashlib.x.y`` the markdown quotes must exist — in the repository; as a def, class or assignment in
    flashlib, in the notebook's own code cells, or in JAX's Pallas TPU ops (which notebooks 06-08 read); as an
    attribute flashlib has."""
    known = set(_known_names())
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    known |= set(re.findall(r"(?:def|class)\s+(\w+)", code)) | set(re.findall(r"^(\w+)\s*=", code, re.M))
    missing = []
    for index, tick in _quoted_code(notebook):
        missing += [f"cell {index}: {path}" for path in PATH.findall(tick) if not (ROOT / path).exists()]
        missing += [f"cell {index}: {name}" for name in PRIVATE.findall(tick)
                    if name not in known and not name.startswith("__")]
        if re.fullmatch(r"flashlib(\.\w+)+(\(.*\))?", tick):
            dotted = tick.split("(")[0].split(".")
            for cut in range(len(dotted), 0, -1):
                try:
                    target = importlib.import_module(".".join(dotted[:cut]))
                    break
                except ImportError:
                    continue
            for attr in dotted[cut:]:
                if not hasattr(target, attr):
                    missing.append(f"cell {index}: {tick} ({attr} not found)")
                    break
                target = getattr(target, attr)
    assert not missing, f"{notebook.name} quotes code that does not exist: {missing}"
