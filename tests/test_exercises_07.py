"""Notebook 07's puzzles (the dK/dV kernel, the dQ kernel) and exercises (D both ways, dV of one key block, the
busiest dK/dV program), each run three ways: the notebook's stub is reported as not attempted, plausible wrong
answers fail with the message that names their mistake, and a solution passes. Each wrong kernel is the
solution with one mistake, so the test shows which mistake each message is for."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl

from flashlib.checks import CheckFailed
from flashlib.exercises import backward as nb07
from flashlib.exercises.backward_solutions import NT_DIMS, TN_DIMS
from flashlib.geometry import MASK_VALUE


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- wrong answers: the solution with one mistake ---------------------------------------------------------------


def probabilities_with(*, subtract_lse=True, mask=True, masked=MASK_VALUE, always_mask=False, q_axis=0):
    def probabilities(q_ref, k_ref, lse_ref, q_block, kv_block, *, scale, causal, offset):
        s = lax.dot_general(q_ref[...], k_ref[...], NT_DIMS, preferred_element_type=jnp.float32) * scale
        if (causal or always_mask) and mask:
            q_pos = q_block * q_ref.shape[q_axis] + lax.broadcasted_iota(jnp.int32, s.shape, 0)
            kv_pos = kv_block * k_ref.shape[0] + lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(kv_pos <= q_pos + offset, s, masked)
        return jnp.exp(s - lse_ref[...]) if subtract_lse else jnp.exp(s)
    return probabilities


def dkv_kernel_with(*, subtract_d=True, scale_dk=True, skip=True, zero=True, scale_dv=False, zero_at_first=False,
                    write_every_step=False, init_axis=3):
    def dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dk_ref, dv_ref, dk_acc, dv_acc, *, scale, causal,
                   offset):
        kv_block, q_block = pl.program_id(2), pl.program_id(3)

        first = nb07.first_q_block(kv_block, q_ref.shape[0], k_ref.shape[0], offset)

        init_block = q_block if init_axis == 3 else kv_block  # axis 2: the key block's, which stays for its steps

        @pl.when(init_block == (first if zero_at_first and causal else 0))  # the first visited step is as good
        def init():
            dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
            if zero:  # without it dV sums onto whatever the scratch held (NaN under InterpretParams)
                dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

        @pl.when(q_block >= first if causal and skip else True)
        def body():
            p = nb07.probabilities(q_ref, k_ref, lse_ref, q_block, kv_block, scale=scale, causal=causal,
                                   offset=offset)
            dv_acc[...] += lax.dot_general(p.astype(do_ref.dtype), do_ref[...], TN_DIMS,
                                           preferred_element_type=jnp.float32)
            dp = lax.dot_general(do_ref[...], v_ref[...], NT_DIMS, preferred_element_type=jnp.float32)
            ds = p * (dp - d_ref[...]) if subtract_d else p * dp
            dk_acc[...] += lax.dot_general(ds.astype(q_ref.dtype), q_ref[...], TN_DIMS,
                                           preferred_element_type=jnp.float32)

        @pl.when(True if write_every_step else q_block == pl.num_programs(3) - 1)  # the issue's: every step
        def finalize():
            dk_ref[...] = (dk_acc[...] * scale if scale_dk else dk_acc[...]).astype(dk_ref.dtype)
            dv_ref[...] = (dv_acc[...] * scale if scale_dv else dv_acc[...]).astype(dv_ref.dtype)
    return dkv_kernel


def dq_kernel_with(*, subtract_d=True, scale_dq=True, skip=True, init_axis=3):
    def dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dq_ref, dq_acc, *, scale, causal, offset):
        q_block, kv_block = pl.program_id(2), pl.program_id(3)

        @pl.when((kv_block if init_axis == 3 else q_block) == 0)
        def init():
            dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

        last = nb07.last_kv_block(q_block, q_ref.shape[0], k_ref.shape[0], offset)

        @pl.when(kv_block <= last if causal and skip else True)
        def body():
            p = nb07.probabilities(q_ref, k_ref, lse_ref, q_block, kv_block, scale=scale, causal=causal,
                                   offset=offset)
            dp = lax.dot_general(do_ref[...], v_ref[...], NT_DIMS, preferred_element_type=jnp.float32)
            ds = p * (dp - d_ref[...]) if subtract_d else p * dp
            dq_acc[...] += jnp.dot(ds, k_ref[...], preferred_element_type=jnp.float32)

        @pl.when(kv_block == pl.num_programs(3) - 1)
        def finalize():
            dq_ref[...] = dq_acc[...] * scale if scale_dq else dq_acc[...]
    return dq_kernel


def first_q_block_no_offset(j, block_q, block_k, offset):  # forgets that kv_len - q_len shifts the diagonal
    return lax.div(j * block_k, block_q)


def first_q_block_unclamped(j, block_q, block_k, offset):  # a negative block index for a KV cache
    return lax.div(j * block_k - offset, block_q)


def last_kv_block_one_too_far(i, block_q, block_k, offset):  # the first key the *next* query block sees
    return lax.div(jnp.maximum((i + 1) * block_q + offset, 0), block_k)


def last_kv_block_one_short(i, block_q, block_k, offset):  # a mutant: the last query's last key, minus one
    return lax.div(jnp.maximum((i + 1) * block_q - 2 + offset, 0), block_k)


def last_kv_block_unclamped(i, block_q, block_k, offset):  # -1 for a query block that sees no key
    return lax.div((i + 1) * block_q - 1 + offset, block_k)


# -- puzzle 1: the dK/dV kernel ----------------------------------------------------------------------------------

DKV = (nb07.probabilities, nb07.first_q_block, nb07.dkv_kernel)


def test_dkv_stub_is_not_attempted(capsys):
    assert nb07.DKV_KERNEL.use((_stub, _stub, _stub)) is nb07.DKV_KERNEL.solution
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    ((probabilities_with(subtract_lse=False), DKV[1], DKV[2]), r"P is exp\(s\), not exp\(s - lse\)"),
    ((probabilities_with(mask=False), DKV[1], DKV[2]), "the diagonal tile .* no causal mask"),
    ((probabilities_with(always_mask=True), DKV[1], DKV[2]), "a non-causal tile — the tile is masked although causal "
                                                             "is False"),
    # a mutant (tests/mutants.py): the query block's length read from the head_dim axis
    ((probabilities_with(q_axis=1), DKV[1], DKV[2]), "failed: probabilities, the diagonal tile"),
    ((DKV[0], first_q_block_no_offset, DKV[2]), r"first_q_block\(1, block_q=32, block_k=64, offset=128\) is 2, "
                                                "expected 0 — the first query block"),
    ((DKV[0], first_q_block_unclamped, DKV[2]), r"offset=128\) is -4, expected 0 \(an index map .* clamp at 0\)"),
    ((DKV[0], DKV[1], dkv_kernel_with(subtract_d=False)), r"case 'non-causal.* dk is wrong: .*subtract D"),
    ((DKV[0], DKV[1], dkv_kernel_with(scale_dk=False)), r"case 'non-causal.* dk is 1/scale too large"),
    # init under the key axis: zeroed only for the first key block (the issue's: it was told about dS)
    ((DKV[0], DKV[1], dkv_kernel_with(init_axis=2)), r"case 'non-causal.* dk has NaN: zero the accumulator at the "
                                                     "first step of the inner axis"),
    ((DKV[0], DKV[1], dkv_kernel_with(zero=False)), r"case 'non-causal.* dv has NaN: zero the accumulator"),
    ((DKV[0], DKV[1], dkv_kernel_with(scale_dv=True)), r"case 'non-causal.* dv is scale times too small: dV = P\^T dO "
                                                       "has no scale"),
    ((DKV[0], DKV[1], dkv_kernel_with(skip=False)), r"case 'causal, q_len = kv_len.* dk has NaN: the body ran on a "
                                                    "step the causal mask hides"),
    ((DKV[0], DKV[1], dkv_kernel_with(write_every_step=True)), r"case 'non-causal.* dk_ref or dv_ref is stored into "
                                                               r"on 1 query step\(s\) before the last: .*wasted"),
])
def test_dkv_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb07.check_dkv_kernel(wrong)


def test_dkv_alternative_passes(capsys):  # -inf for MASK_VALUE (P = 0 either way), zeroed at the first visited step
    nb07.check_dkv_kernel((probabilities_with(masked=-jnp.inf), DKV[1], dkv_kernel_with(zero_at_first=True)))
    assert "passed: the dK/dV kernel" in capsys.readouterr().out


def test_dkv_solution_passes(capsys):
    assert nb07.DKV_KERNEL.use(DKV) is DKV
    out = capsys.readouterr().out
    assert "passed: the dK/dV kernel, with causal skipping, in all 5 cases" in out and "flashlib's version" in out


# -- puzzle 2: the dQ kernel ------------------------------------------------------------------------------------

DQ = (nb07.last_kv_block, nb07.dq_kernel)


def test_dq_stub_is_not_attempted(capsys):
    assert nb07.DQ_KERNEL.use((_stub, _stub)) is nb07.DQ_KERNEL.solution
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    ((last_kv_block_one_too_far, DQ[1]), r"last_kv_block\(1, block_q=32, block_k=64, offset=0\) is 1, expected 0 — "),
    ((last_kv_block_one_short, DQ[1]), r"last_kv_block\(1, block_q=32, block_k=64, offset=1\) is 0, expected 1 — "),
    ((last_kv_block_unclamped, DQ[1]), r"last_kv_block\(0, block_q=64, block_k=32, offset=-128\) is -2, "
                                       r"expected 0 \(an index map .* clamp at 0\)"),
    ((DQ[0], dq_kernel_with(subtract_d=False)), r"case 'non-causal.* dq is wrong: .*subtract D"),
    ((DQ[0], dq_kernel_with(scale_dq=False)), r"case 'non-causal.* dq is 1/scale too large"),
    ((DQ[0], dq_kernel_with(init_axis=2)), r"case 'non-causal.* dq has NaN: zero the accumulator at the first step "
                                           "of the inner axis"),
    ((DQ[0], dq_kernel_with(skip=False)), r"case 'causal, q_len = kv_len.* dq has NaN: the body ran on a step the "
                                          "causal mask hides"),
])
def test_dq_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb07.check_dq_kernel(wrong)


def test_dq_solution_passes(capsys):
    assert nb07.DQ_KERNEL.use(DQ) is DQ
    assert "passed: the dQ kernel, with causal skipping, in all 5 cases" in capsys.readouterr().out


# -- exercise 1: D both ways ----------------------------------------------------------------------------------


def d_both_from_p(p, dp, out, do):  # the definition twice: right values, but a kernel cannot have it early
    return jnp.sum(p * dp, axis=1), jnp.sum(p * dp, axis=1)


def d_both_from_o(p, dp, out, do):
    return jnp.sum(do * out, axis=1), jnp.sum(do * out, axis=1)


def d_over_queries(p, dp, out, do):  # sums the wrong axis
    return jnp.sum(p * dp, axis=0), jnp.sum(do * out, axis=1)


def d_keepdims(p, dp, out, do):
    return jnp.sum(p * dp, axis=1, keepdims=True), jnp.sum(do * out, axis=1, keepdims=True)


def test_d_stub_is_not_attempted(capsys):
    assert nb07.D_BOTH_WAYS.use(_stub) is nb07.d_both_ways_solution
    assert "exercise 1: D, both ways: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (d_both_from_p, r"the second, rowsum\(dO \* O\), changed when P and dP were withheld"),
    (d_both_from_o, r"the first, rowsum\(P \* dP\), changed when O was withheld"),
    (d_over_queries, r"rowsum\(P \* dP\) is off: sum each query's row, axis=1"),
    (d_keepdims, r"rowsum\(P \* dP\) has shape \(64, 1\), expected \(64,\)"),
])
def test_d_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb07.check_d_both_ways(wrong)


def test_d_solution_passes(capsys):
    nb07.D_BOTH_WAYS.use(nb07.d_both_ways_solution)
    out = capsys.readouterr().out
    assert "passed: D both ways" in out and "exercise 1: D, both ways: passed" in out


# -- exercise 2: dV of one key block ------------------------------------------------------------------------------


def dv_loop(q, k, do, lse, j, *, block_q, block_k, scale, first=None, mask=True, subtract_lse=True, ceil=False):
    """The solution written another way, with one mistake switched on (the defaults make it right)."""
    k_j = k[j * block_k:(j + 1) * block_k]
    dv = jnp.zeros((block_k, q.shape[1]))
    start = -(-j * block_k // block_q) if ceil else j * block_k // block_q  # ceil: too late when block_q > block_k
    for i in range(start if first is None else first, q.shape[0] // block_q):
        rows = slice(i * block_q, (i + 1) * block_q)
        s = q[rows] @ k_j.T * scale
        q_pos, kv_pos = i * block_q + jnp.arange(block_q)[:, None], j * block_k + jnp.arange(block_k)[None]
        s = jnp.where(kv_pos <= q_pos, s, -jnp.inf) if mask else s
        dv += jnp.exp(s - lse[rows, None] if subtract_lse else s).T @ do[rows]
    return dv


@pytest.mark.parametrize("wrong, message", [
    (functools.partial(dv_loop, first=0), "key block 1 of 32 x 64 blocks — NaN: it used a query block that cannot "
                                          "see key block 1"),
    (functools.partial(dv_loop, mask=False), "key block 0 of 32 x 64 blocks — the diagonal block is not masked"),
    (functools.partial(dv_loop, subtract_lse=False), r"key block 0 .* off from the float64 oracle: .*the saved lse"),
    (functools.partial(dv_loop, ceil=True), r"key block 1 of 64 x 32 blocks — query block 0 is left out, but it sees "
                                            "key block 1 .* rounded down"),
], ids=["from block 0", "no mask", "no lse", "first block rounded up"])
def test_dv_of_key_block_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb07.check_dv_of_key_block(wrong)


def test_dv_of_key_block_stub_and_solution(capsys):
    assert nb07.DV_OF_KEY_BLOCK.use(_stub) is nb07.dv_of_key_block_solution
    assert "exercise 2: the dV accumulation of one key block: not attempted yet" in capsys.readouterr().out
    nb07.DV_OF_KEY_BLOCK.use(nb07.dv_of_key_block_solution)
    out = capsys.readouterr().out
    assert "passed: dv_of_key_block" in out and "key block: passed" in out
    nb07.check_dv_of_key_block(dv_loop)
    assert "passed: dv_of_key_block" in capsys.readouterr().out


def test_dv_of_key_block_without_a_loop_passes(capsys):  # all the rows that see block j at once, P masked after exp
    def dv_at_once(q, k, do, lse, j, *, block_q, block_k, scale):
        first = j * block_k // block_q * block_q
        s = q[first:] @ k[j * block_k:(j + 1) * block_k].T * scale
        visible = j * block_k + jnp.arange(block_k)[None] <= first + jnp.arange(q.shape[0] - first)[:, None]
        return jnp.where(visible, jnp.exp(s - lse[first:, None]), 0.0).T @ do[first:]
    nb07.check_dv_of_key_block(dv_at_once)
    assert "passed: dv_of_key_block" in capsys.readouterr().out


# -- exercise 3: the busiest dK/dV program ----------------------------------------------------------------------


@pytest.mark.parametrize("wrong, message", [
    ((7, 8, 0, 1), "the busiest key block is not 7"),  # the dQ kernel's rows, not the dK/dV kernel's
    ((0, 8, 7, 0), "its body steps is not 0: .*skipped steps do not count"),
    ((0, 7, 7, 1), "its body steps is not 7"),
])
def test_busiest_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb07.check_busiest(wrong)


def test_busiest_stub_and_solution(capsys):
    assert nb07.BUSIEST.use(_stub) == (0, 8, 7, 1)
    assert "exercise 3: the block that dominates: not attempted yet" in capsys.readouterr().out
    assert nb07.busiest_solution() == (0, 8, 7, 1)
    nb07.BUSIEST.use(nb07.busiest_solution)
    out = capsys.readouterr().out
    assert "passed: the busiest and the idlest dK/dV program" in out and "dominates: passed" in out
