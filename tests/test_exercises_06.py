"""Notebook 06's puzzles and exercises (:mod:`flashlib.exercises.flash_kernel`), each run three ways: the
notebook's stub (reported as not attempted), plausible wrong answers (each fails with the message that names
its mistake) and the solution (it passes). The kernels run under ``pltpu.InterpretParams()``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from flashlib import cost
from flashlib.checks import CheckFailed
from flashlib.exercises import compaction
from flashlib.exercises import flash_kernel as nb06
from flashlib.exercises.flash_kernel_solutions import NT_DIMS
from flashlib.geometry import MASK_VALUE
from flashlib.kernels import BlockSizes
from flashlib.kernels.block_sizes import vmem_limit_bytes


def _stub(*args, **kwargs):
    raise NotImplementedError


def _init(m_ref, l_ref, acc_ref, m0=-jnp.inf):
    m_ref[...] = jnp.full(m_ref.shape, m0, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _fold(s, v_ref, m_ref, l_ref, acc_ref, *, rescale=True, running=True, cast=True, alpha_sign=1):
    m_prev = m_ref[...]  # running=False: this block's max alone (exact in exact arithmetic, overflows in f32)
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True)) if running else s.max(axis=1, keepdims=True)
    alpha, p = (jnp.exp(alpha_sign * (m_prev - m_next)) if rescale else 1.0), jnp.exp(s - m_next)
    m_ref[...] = m_next
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    if cast:  # p in v's dtype, as the spec asks: the MXU's full-rate bf16 matmul, f32 accumulation
        pv = jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)
    else:  # the answer: p stays float32, so v is promoted and the matmul runs in float32
        pv = jnp.dot(p, v_ref[...].astype(jnp.float32))
    acc_ref[...] = alpha * acc_ref[...] + pv


def _scores(q_ref, k_ref, scale):
    return lax.dot_general(q_ref[...], k_ref[...], NT_DIMS, preferred_element_type=jnp.float32) * scale


def _kernel(*, init="first", rescale=True, finalize="last", divide=True, cap=None, m0=-jnp.inf, running=True,
            fixed_cap=None, cast=True, alpha_sign=1):
    """A forward kernel with one mistake switched on (the defaults make it right)."""
    def kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, scale, **params):
        j, last = pl.program_id(3), pl.num_programs(3) - 1
        if init == "first":
            pl.when(j == 0)(lambda: _init(m_ref, l_ref, acc_ref, m0))
        elif init == "every step":
            _init(m_ref, l_ref, acc_ref)
        elif init == "where":  # notebook 06's old step 2: right numbers, no control flow
            m_ref[...] = jnp.where(j == 0, -jnp.inf, m_ref[...])
            l_ref[...] = jnp.where(j == 0, 0.0, l_ref[...])
            acc_ref[...] = jnp.where(j == 0, 0.0, acc_ref[...])
        s = _scores(q_ref, k_ref, scale)
        if cap == "after scale":
            s = params["cap"] * jnp.tanh(s / params["cap"])
        elif cap == "before scale":
            s = params["cap"] * jnp.tanh(s / scale / params["cap"]) * scale
        elif cap == "no factor":
            s = jnp.tanh(s / params["cap"])
        elif cap == "fixed":  # the number from the prompt, not the argument
            s = fixed_cap * jnp.tanh(s / fixed_cap)
        elif cap == "clip":
            s = jnp.clip(s, -params["cap"], params["cap"])
        _fold(s, v_ref, m_ref, l_ref, acc_ref, rescale=rescale, running=running, cast=cast, alpha_sign=alpha_sign)

        def write():
            o_ref[...] = ((acc_ref[...] / l_ref[...]) if divide else acc_ref[...]).astype(o_ref.dtype)
        if finalize == "every step":
            write()
        else:
            pl.when(j == (last if finalize == "last" else 0))(write)
    return kernel


# -- puzzle 1: the forward kernel ------------------------------------------------------------------------------


def test_forward_stub_falls_back_to_the_solution(capsys):
    assert nb06.FORWARD_KERNEL.use(_stub) is nb06.flash_kernel_solution
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (_kernel(init=None), "NaN in the output: scratch starts as garbage"),
    (_kernel(rescale=False), "not rescaled when the maximum grows"),
    (_kernel(init="every step"), "attention over the LAST key block alone"),
    (_kernel(finalize="first"), "attention over the FIRST key block alone"),
    (_kernel(divide=False), "divide by l in finalize"),
    (_kernel(init="where", finalize="every step"), "fewer than two pl.when"),
    (_kernel(m0=0.0), "case 'scores near \\+180.* all near -180: with m starting at 0.*start m at -inf"),
    (_kernel(running=False), "case 'scores near \\+180.* NaN in rows whose scores reach \\+180: .* RUNNING maximum"),
    (_kernel(cast=False), "case '128 queries, 256 keys in bfloat16.* right numbers, but a matmul multiplies float32 x "
                          "float32 operands though the inputs are bfloat16: cast p to v's dtype"),
    (_kernel(alpha_sign=-1), r"NaN in the output: .*alpha = exp\(m_prev - m_next\) .*not exp\(m_next - m_prev\)"),
], ids=["no init", "no rescale", "init every step", "finalize first", "no division", "no pl.when", "m starts at 0",
        "block max, not running max", "p not cast", "alpha's sign flipped"])
def test_forward_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb06.check_forward_kernel(wrong)


def test_forward_solution_passes(capsys):
    nb06.check_forward_kernel(nb06.flash_kernel_solution)
    assert capsys.readouterr().out.startswith("passed: forward kernel")
    nb06.check_forward_kernel(_kernel())  # the right kernel, written another way


# -- puzzle 2: causal skipping -------------------------------------------------------------------------------


def _last(i, block_q, block_k, offset, *, minus_one=True, aligned=True, floordiv=False):
    top = (i + 1) * block_q - (1 if minus_one else 0) + (offset if aligned else 0)
    return top // block_k if floordiv else lax.div(top, block_k)


def _causal_map(*, clamp=True, minus_one=True, floordiv=False):
    def index_map(b, h, i, j, *, block_q, block_k, offset):
        last = _last(i, block_q, block_k, offset, minus_one=minus_one, floordiv=floordiv)
        return b, h, (jnp.minimum(j, last) if clamp else j), 0
    return index_map


def _causal_kernel(*, skip=True, mask=True, aligned=True, floordiv=False, masked_value=MASK_VALUE,
                   finalize_on_last_visible=False, m0=-jnp.inf):
    def kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, scale, offset):
        block_q, block_k = q_ref.shape[0], k_ref.shape[0]
        i, j = pl.program_id(2), pl.program_id(3)
        pl.when(j == 0)(lambda: _init(m_ref, l_ref, acc_ref, m0))

        def body():
            s = _scores(q_ref, k_ref, scale)
            q_pos = i * block_q + lax.broadcasted_iota(jnp.int32, s.shape, 0) + (offset if aligned else 0)
            kv_pos = j * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
            _fold(jnp.where(kv_pos <= q_pos, s, masked_value) if mask else s, v_ref, m_ref, l_ref, acc_ref)
        last = _last(i, block_q, block_k, offset, aligned=aligned, floordiv=floordiv)
        if skip:
            pl.when(j <= last)(body)
        else:
            body()
        # o_ref stays in VMEM for the whole row of steps, so writing it at the last step that computes is right too
        pl.when(j == (last if finalize_on_last_visible else pl.num_programs(3) - 1))(
            lambda: o_ref.__setitem__(..., acc_ref[...] / l_ref[...]))
    return kernel


def test_causal_stub_falls_back_to_the_solution(capsys):
    solution = nb06.CAUSAL_SKIPPING.use((_stub, _stub))
    assert solution == (nb06.causal_kv_index_map_solution, nb06.flash_kernel_causal_solution)
    assert "not attempted yet" in capsys.readouterr().out
    nb06.CAUSAL_SKIPPING.use((_causal_map(), _stub))  # the map written, the kernel not yet
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    ((_causal_map(clamp=False), _causal_kernel()), "step \\(i=0, j=3\\) is skipped .* the index map is not clamped"),
    ((_causal_map(minus_one=False), _causal_kernel()), "step \\(i=0, j=3\\) is skipped and should repeat block 2"),
    ((_causal_map(), _causal_kernel(skip=False)), "the body runs on skipped steps"),
    ((_causal_map(), _causal_kernel(mask=False)), "the diagonal block is not masked element by element"),
    ((_causal_map(), _causal_kernel(aligned=False)), "the mask is aligned top-left"),
    ((_causal_map(floordiv=True), _causal_kernel()), "the index map divides a traced int with //.* lax.div"),
    ((_causal_map(), _causal_kernel(floordiv=True)), "the kernel divides a traced int with //.* lax.div"),
    # a mutant of the solution (tests/mutants.py): m started at 0
    ((_causal_map(), _causal_kernel(m0=0.0)), "every score far below zero .* the running max m starts at 0"),
], ids=["unclamped map", "off-by-one clamp", "no skip", "no mask", "top-left", "// in the map", "// in the kernel",
        "m starts at 0"])
def test_causal_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb06.check_causal(wrong)


def test_causal_solution_passes(capsys):
    nb06.check_causal((nb06.causal_kv_index_map_solution, nb06.flash_kernel_causal_solution))
    copies = ", ".join(str(cost.kv_block_fetches(*case[1:], causal=True)) for case in nb06._CAUSAL_CASES)
    out = capsys.readouterr().out
    assert out.startswith("passed: causal kernel") and copies == "7, 4, 8", copies
    assert f"copies {copies} k blocks where an unclamped one copies 8, 8, 10" in out, out


def test_causal_alternative_passes(capsys):  # -inf for MASK_VALUE (every row sees key 0), o_ref written early
    nb06.check_causal((_causal_map(), _causal_kernel(masked_value=-jnp.inf, finalize_on_last_visible=True)))
    assert capsys.readouterr().out.startswith("passed: causal kernel")


# -- exercise 1: softcapping -----------------------------------------------------------------------------------


def test_softcap_stub_is_not_attempted(capsys):
    assert nb06.SOFTCAP.use(_stub) is nb06.flash_kernel_softcap_solution
    assert "exercise 1: softcapping: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (_kernel(), "the scores are not capped"),
    (_kernel(cap="before scale"), "the cap is applied before the scale"),
    (_kernel(cap="no factor"), "multiply it by cap"),
    (_kernel(cap="fixed", fixed_cap=2.0), "case '64 queries, 384 keys, cap 1' — this is the cap 2 of the case before"),
    (_kernel(cap="clip"), "the scores are clipped to \\[-cap, cap\\]"),
    # a mutant of the solution (tests/mutants.py): m started at 0, harmless while the cap keeps scores near 0
    (_kernel(cap="after scale", m0=0.0), "case '64 queries, 128 keys, cap 200, every score far below zero' — NaN in "
                                         "the output: the running max m starts at 0"),
], ids=["no cap", "before scale", "no factor", "cap hard-coded", "clipped", "m starts at 0"])
def test_softcap_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb06.check_softcap(wrong)


def test_softcap_solution_passes(capsys):
    assert nb06.SOFTCAP.use(nb06.flash_kernel_softcap_solution) is nb06.flash_kernel_softcap_solution
    out = capsys.readouterr().out
    assert out.startswith("passed: softcapped kernel") and "exercise 1: softcapping: passed" in out
    nb06.check_softcap(_kernel(cap="after scale"))  # the right kernel, written another way


# -- exercise 2: counting ------------------------------------------------------------------------------------


def test_counts_stub_is_not_attempted(capsys):
    assert nb06.COUNTS.use(_stub) == (12, 18)
    assert "exercise 2: count the skipped blocks: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    ((12, 32), "one copy per grid step, as without the clamp"),
    ((12, 20), "one copy per step that computes is nearly it"),
    ((20, 18), "20 is the number of steps that run"),
    ((18, 12), "the right pair in the wrong order"),
])
def test_counts_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb06.check_counts(wrong)


def test_counts_solution_passes(capsys):
    assert nb06.skip_counts_solution() == (12, 18)
    nb06.COUNTS.use(nb06.skip_counts_solution)
    out = capsys.readouterr().out
    assert out.startswith("passed: 12 of 32 steps skipped, 18 k block copies") and "passed" in out.splitlines()[-1]
    nb06.COUNTS.use((12, 18))  # the value itself, worked out on paper
    assert "count the skipped blocks: passed" in capsys.readouterr().out


# -- exercise 3: blocks under a VMEM budget ----------------------------------------------------------------------

SIZES = (128, 256, 512, 1024, 2048)


def _picker(*, order, strict=False):
    def pick_blocks(head_dim, dtype, generation):
        limit = vmem_limit_bytes(generation)
        fits = [(bq, bk) for bq in SIZES for bk in SIZES
                if (BlockSizes(bq, bk).vmem_bytes(head_dim, dtype) < limit if strict
                    else BlockSizes(bq, bk).vmem_bytes(head_dim, dtype) <= limit)]
        return max(fits, key=order)
    return pick_blocks


@pytest.mark.parametrize("wrong, message", [
    (_picker(order=lambda b: (b[0] * b[1], b[1])), "ties with \\(1024, 512\\).*take the larger block_q"),
    (_picker(order=lambda b: (b[0] * b[1], -abs(b[0] - b[1]), b[0])), "case 'head_dim 128, float32, v6e'.*ties"),
    (_picker(order=lambda b: (b[0] * b[1], b[0]), strict=True), "needs exactly the 16 MiB limit, and that fits"),
    (_picker(order=lambda b: b), "fits too and has the larger block_q x block_k"),
], ids=["larger block_k", "squarest", "strict <", "largest block_q first"])
def test_budget_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb06.check_budget(wrong)


def test_budget_stub_is_not_attempted_and_the_solution_passes(capsys):
    assert nb06.BUDGET.use(_stub) is nb06.pick_blocks_solution
    assert "exercise 3: fit a budget: not attempted yet" in capsys.readouterr().out
    nb06.BUDGET.use(nb06.pick_blocks_solution)
    out = capsys.readouterr().out
    assert out.startswith("passed: the biggest blocks that fit") and "fit a budget: passed" in out


# -- puzzle 3: the compacted causal grid (flashlib.exercises.compaction) --------------------------------------


def _schedule(*, keep="<=", minus_one=True, order="q major", last="diagonal", first="first"):
    """A causal_schedule with one mistake switched on (the defaults make it right)."""
    def causal_schedule(num_q_blocks, num_kv_blocks, *, block_q, block_k, offset):
        pairs = []
        for i in range(num_q_blocks):
            limit = (i + 1) * block_q - (1 if minus_one else 0) + offset  # the last key query block i sees
            live = [j for j in range(num_kv_blocks) if keep == "all" or (
                j * block_k <= limit if keep == "<=" else j * block_k < limit)]
            pairs += [(i, j, j == live[0], j == (live[-1] if last == "diagonal" else num_kv_blocks - 1))
                      for j in live]
        if order == "kv major":
            pairs.sort(key=lambda pair: (pair[1], pair[0]))
        q_block, kv_block, is_first, is_last = (np.array(x, np.int32) for x in zip(*pairs, strict=True))
        if first == "last":
            is_first = is_last
        return q_block, kv_block, is_first, is_last
    return causal_schedule


def _map(which="q", *, step=False, head_block=0):
    def index_map(b, h, t, q_block_ref, kv_block_ref, first_ref, last_ref):
        table = q_block_ref if which == "q" else kv_block_ref
        return b, h, (t if step else table[t]), head_block
    return index_map


def test_compaction_stub_falls_back_to_the_solution(capsys):
    solution = (compaction.causal_schedule_solution, compaction.compact_q_index_map_solution,
                compaction.compact_kv_index_map_solution)
    assert compaction.COMPACTED_GRID.use((_stub, _stub, _stub)) == solution
    assert "not attempted yet" in capsys.readouterr().out
    compaction.COMPACTED_GRID.use((compaction.causal_schedule_solution, _stub, _stub))  # the tables, no maps yet
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    ((_schedule(keep="all"), _map("q"), _map("kv")), "case '256 queries, 256 keys.* the full 4 x 4 grid"),
    ((_schedule(minus_one=False), _map("q"), _map("kv")),
     "case '256 queries, 256 keys.*query block 0 visits key blocks 0 to 1, one too many.*is the - 1 missing"),
    ((_schedule(keep="<"), _map("q"), _map("kv")),
     "case '128 queries over 193 keys.*query block 0 visits key blocks 0 to 0, one too few.*a < where <= belongs"),
    ((_schedule(order="kv major"), _map("q"), _map("kv")), "the right live pairs in the wrong order"),
    ((_schedule(last="end"), _map("q"), _map("kv")), "last is 0 at live step 0 .*it marks key block num_kv_blocks - 1"),
    ((_schedule(first="last"), _map("q"), _map("kv")),
     "first is 0 at live step 1 .*query block's first live step \\(key block 0\\): init runs there"),
    ((_schedule(), _map("q", step=True), _map("kv")),
     "q_index_map at live step t=1 returns query block 1, the grid step itself"),
    ((_schedule(), _map("kv"), _map("q")),
     "q_index_map at live step t=1 returns query block 1, the other table's entry"),
    ((lambda *a, **k: [(0, 0, 1, 1)], _map("q"), _map("kv")), "return four 1-D integer tables"),
    # mutants of the solution (tests/mutants.py): the head dimension's block index 1 or -1
    ((_schedule(), _map("q"), _map("kv", head_block=1)), "kv_index_map at live step t=0 .* block 0 of the head"),
], ids=["full grid", "no - 1", "strict <", "kv major", "last at the end", "first swapped with last",
        "map returns t", "maps swapped", "pairs, not tables", "head block 1"])
def test_compaction_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        compaction.check_compaction(wrong)


def test_compaction_solution_passes(capsys):
    compaction.check_compaction((compaction.causal_schedule_solution, compaction.compact_q_index_map_solution,
                                 compaction.compact_kv_index_map_solution))
    out = capsys.readouterr().out
    assert out.startswith("passed: compacted grid") and "10 of 16, 20 of 24, 2 of 2, 6 of 8, 4 of 4" in out, out
    compaction.check_compaction((_schedule(), _map("q"), _map("kv")))  # the same tables, by comparisons
