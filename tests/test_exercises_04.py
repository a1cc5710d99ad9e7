"""Notebook 04's puzzle and exercises (:mod:`flashlib.exercises.flash_jax`), run three ways: on the notebook's stub
(reported as not attempted, no traceback), on plausible wrong answers (each fails, with the message that names
its mistake) and on a solution (it passes)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashlib import reference
from flashlib.blockwise import pad_to_multiple
from flashlib.checks import CheckFailed
from flashlib.exercises import flash_jax as nb04


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- the puzzle: flash_attention_head ------------------------------------------------------------------------


def head_with(mistake, q, k, v, *, causal=False, block_q=128, block_k=128):
    """The notebook's one-head flash attention, with one learner's mistake switched on."""
    (q_len, d), kv_len = q.shape, k.shape[0]
    if mistake == "section 1's BLOCK":  # the notebook's global BLOCK = 128 instead of the arguments
        block_q = block_k = 128
    block_q, block_k = min(block_q, q_len), min(block_k, kv_len)
    qb = pad_to_multiple(q, 0, block_q).reshape(-1, block_q, d)
    kb = pad_to_multiple(k, 0, block_k).reshape(-1, block_k, d)
    vb = pad_to_multiple(v, 0, block_k).reshape(-1, block_k, d)
    # section 1's global `scale` is for D = 64
    scale = {"unscaled": 1.0, "scale 1/d": 1.0 / d, "section 1's scale": 1 / 8}.get(mistake, reference.default_scale(d))

    def one_q_block(i, q_blk):
        q_pos = (0 if mistake == "q_pos within the block" else i * block_q) + jnp.arange(block_q)[:, None]

        def kv_step(state, inputs):
            m, l, acc = state  # noqa: E741
            j, k_blk, v_blk = inputs
            kv_pos = j * block_k + jnp.arange(block_k)[None, :]
            visible = {"no padding mask": jnp.ones((1, block_k), bool), "kv_pos <= kv_len": kv_pos <= kv_len}.get(
                mistake, kv_pos < kv_len)
            if causal:
                offset = {"top-left": 0, "offset reversed": q_len - kv_len,  # the padded lengths' offset:
                          "padded lengths": len(kb) * block_k - len(qb) * block_q}.get(mistake, kv_len - q_len)
                visible = visible & (kv_pos < q_pos + offset if mistake == "strict <" else kv_pos <= q_pos + offset)
            fill = -1e30 if mistake == "finite fill" else -jnp.inf  # a large finite number instead of -inf
            s = jnp.where(visible, q_blk @ k_blk.T * scale, fill)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[:, None])
            if mistake == "no rescale":  # forgets that acc was accumulated against the old maximum
                return (m_new, alpha * l + p.sum(axis=1), acc + p @ v_blk), None
            return (m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v_blk), None

        m0 = jnp.zeros(block_q) if mistake == "m starts at 0" else jnp.full(block_q, -jnp.inf)
        init = (m0, jnp.zeros(block_q), jnp.zeros((block_q, d)))
        if mistake == "python loops":  # right numbers, but the loop is unrolled into the program
            state = init
            for j in range(len(kb)):
                state, _ = kv_step(state, (j, kb[j], vb[j]))
            m, l, acc = state  # noqa: E741
        else:
            n = len(kb) - (mistake == "last key block dropped" and len(kb) > 1)  # e.g. kv_len // block_k blocks
            (m, l, acc), _ = jax.lax.scan(kv_step, init, (jnp.arange(n), kb[:n], vb[:n]))
        if mistake == "no division":
            return acc
        return acc / jnp.where(l == 0.0, 1.0, l)[:, None]

    if mistake == "vmap":  # right numbers, but every query block's tile exists at once
        out = jax.vmap(one_q_block)(jnp.arange(len(qb)), qb)
    elif mistake == "python loops":
        out = jnp.stack([one_q_block(i, qb[i]) for i in range(len(qb))])
    else:
        out = jax.lax.map(lambda args: one_q_block(*args), (jnp.arange(len(qb)), qb))
    return out.reshape(-1, d)[:q_len]


def test_head_stub_falls_back_to_the_solution(capsys):
    assert nb04.FLASH_ATTENTION_HEAD.use(_stub) is nb04.flash_attention_head_solution
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, message", [
    ("no padding mask", r"padded keys are visible.*kv_pos < kv_len"),
    ("top-left", r"top-left aligned.*bottom-right"),
    ("no division", r"not normalised: divide acc by l"),
    ("no rescale", r"alpha = exp\(m_old - m_new\)"),
    ("python loops", r"traced program.*jax.lax.scan"),
    ("vmap", r"scratch memory.*one after another with jax.lax.map"),
    ("unscaled", r"'lengths that divide the blocks, no mask' — the scores are not scaled.*1/sqrt\(d\) \(d = 32\)"),
    ("scale 1/d", r"the scale is 1/d; it is 1/sqrt\(d\)"),
    ("strict <", r"case 'causal, q_len = kv_len' — query i must also see key j = i \+ kv_len - q_len.*<=, not <"),
    ("offset reversed", r"q_len 50, kv_len 75.* — the offset is the wrong way round"),
    ("padded lengths", r"q_len 50, kv_len 75.* — the causal offset comes from the padded lengths"),
    ("q_pos within the block", r"case 'causal, q_len = kv_len' .*query row 64 is wrong: it should see keys 0..64 "
                               r".*absolute positions, q_pos = i \* block_q \+ row"),
    ("finite fill", r"the first 35 queries see no key.*row 0 does not: mask with -jnp.inf"),
    ("section 1's scale", r"the scale is 1/sqrt\(64\), section 1's global `scale`"),
    ("section 1's BLOCK", r"block sizes — called with block_q=32, block_k=16 it computes no \[32, 16\] tile"),
    ("kv_pos <= kv_len", r"kv_len = 75 does not divide.* — the first padded key \(position kv_len\) is visible"),
    ("m starts at 0", r"case 'every score far below zero .*, no mask' — the running max m starts at 0, not -inf"),
    ("last key block dropped", r"case 'lengths that divide the blocks, no mask' — the last key block \(keys 96..127\) "
                               r"is missing: scan over all -\(-kv_len // block_k\) = 4 key blocks"),
])
def test_head_wrong_answers_fail_with_their_hint(mistake, message):
    with pytest.raises(CheckFailed, match=message):
        nb04.check_flash_attention_head(functools.partial(head_with, mistake))


def head_vmap_over_key_blocks(q, k, v, *, causal=False, block_q=128, block_k=128):
    """Right numbers, but every key block's tile of a query block exists at once (one softmax over all of them)."""
    (q_len, d), kv_len = q.shape, k.shape[0]
    block_q, block_k = min(block_q, q_len), min(block_k, kv_len)
    qb = pad_to_multiple(q, 0, block_q).reshape(-1, block_q, d)
    kb, vb = (pad_to_multiple(x, 0, block_k).reshape(-1, block_k, d) for x in (k, v))
    kv_pos = jnp.arange(len(kb) * block_k).reshape(len(kb), 1, block_k)  # [nk, 1, bk]

    def one_q_block(i, q_blk):
        visible = kv_pos < kv_len
        if causal:
            visible = visible & (kv_pos <= i * block_q + jnp.arange(block_q)[:, None] + kv_len - q_len)
        s = jnp.where(visible, jnp.einsum("qd,jkd->jqk", q_blk, kb) * reference.default_scale(d), -jnp.inf)
        m = s.max(axis=(0, 2))
        p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[None, :, None])  # [nk, bq, bk]
        l = p.sum(axis=(0, 2))  # noqa: E741
        return jnp.einsum("jqk,jkd->qd", p, vb) / jnp.where(l == 0.0, 1.0, l)[:, None]

    return jax.lax.map(lambda args: one_q_block(*args), (jnp.arange(len(qb)), qb)).reshape(-1, d)[:q_len]


def test_head_vmap_over_key_blocks_fails_on_scratch():
    with pytest.raises(CheckFailed, match=r"scratch memory .* fold the key blocks in one by one with jax.lax.scan"):
        nb04.check_flash_attention_head(head_vmap_over_key_blocks)


def head_fori_loops(q, k, v, *, causal=False, block_q=128, block_k=128):
    """Another valid style: jax.lax.fori_loop over both block axes, slicing with dynamic_slice, writing the output
    into a buffer, guarding empty rows after the division."""
    (q_len, d), kv_len = q.shape, k.shape[0]
    bq, bk = min(block_q, q_len), min(block_k, kv_len)
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    qp, kp, vp = (jnp.pad(x, ((0, n * b - x.shape[0]), (0, 0))) for x, n, b in ((q, nq, bq), (k, nk, bk), (v, nk, bk)))

    def q_body(i, out):
        q_blk, rows = jax.lax.dynamic_slice_in_dim(qp, i * bq, bq), i * bq + jnp.arange(bq)[:, None]

        def kv_body(j, state):
            m, l, acc = state  # noqa: E741
            cols = j * bk + jnp.arange(bk)[None, :]
            visible = (cols < kv_len) & (cols - rows <= kv_len - q_len if causal else True)
            s = jnp.where(visible, q_blk @ jax.lax.dynamic_slice_in_dim(kp, j * bk, bk).T / jnp.sqrt(d), -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p, alpha = jnp.exp(s - shift[:, None]), jnp.exp(m - shift)
            v_blk = jax.lax.dynamic_slice_in_dim(vp, j * bk, bk)
            return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v_blk

        init = (jnp.full(bq, -jnp.inf), jnp.zeros(bq), jnp.zeros((bq, d)))
        _, l, acc = jax.lax.fori_loop(0, nk, kv_body, init)  # noqa: E741
        o = jnp.where(l[:, None] > 0, acc / jnp.maximum(l, 1e-30)[:, None], 0.0)
        return jax.lax.dynamic_update_slice_in_dim(out, o, i * bq, 0)

    return jax.lax.fori_loop(0, nq, q_body, jnp.zeros((nq * bq, d), q.dtype))[:q_len]


def test_head_fori_loop_style_passes(capsys):
    nb04.check_flash_attention_head(head_fori_loops)
    assert capsys.readouterr().out.startswith("passed: flash_attention_head")


def test_head_solution_passes(capsys):
    answer = nb04.flash_attention_head_solution
    assert nb04.FLASH_ATTENTION_HEAD.use(answer) is answer
    out = capsys.readouterr().out
    assert out.startswith("passed: flash_attention_head")
    assert "passed — but this is flashlib's version, which an earlier run of this cell handed back" in out


# -- exercise 1: one head from scratch -------------------------------------------------------------------------


one_head_solution = nb04.flash_attention_one_head_solution


def one_head_whole_blocks_only(q, k, v, block_k):  # range(kv_len // block_k): the short last block is lost
    m, l, acc = jnp.full(q.shape[0], -jnp.inf), jnp.zeros(q.shape[0]), jnp.zeros(q.shape)  # noqa: E741
    for b in range(max(1, k.shape[0] // block_k)):
        lo = b * block_k
        s = q @ k[lo:lo + block_k].T * reference.default_scale(q.shape[1])
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new[:, None])
        m, l, acc = m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v[lo:lo + block_k]  # noqa: E741
    return acc / l[:, None]


def one_head_numpy_float64(q, k, v, block_k):  # right numbers, but np.zeros makes a float64 accumulator
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    m, l, acc = np.full(q.shape[0], -np.inf), np.zeros(q.shape[0]), np.zeros(q.shape)  # noqa: E741
    for lo in range(0, k.shape[0], block_k):
        s = q @ k[lo:lo + block_k].T * reference.default_scale(q.shape[1])
        m_new = np.maximum(m, s.max(axis=1))
        alpha, p = np.exp(m - m_new), np.exp(s - m_new[:, None])
        m, l, acc = m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v[lo:lo + block_k]  # noqa: E741
    return acc / l[:, None]


def one_head_no_division(q, k, v, block_k):
    m, acc = jnp.full(q.shape[0], -jnp.inf), jnp.zeros(q.shape)
    for lo in range(0, k.shape[0], block_k):
        s = q @ k[lo:lo + block_k].T * reference.default_scale(q.shape[1])
        m_new = jnp.maximum(m, s.max(axis=1))
        acc = jnp.exp(m - m_new)[:, None] * acc + jnp.exp(s - m_new[:, None]) @ v[lo:lo + block_k]
        m = m_new
    return acc  # forgot acc / l


def one_head_all_at_once(q, k, v, block_k):  # right numbers, but ignores block_k: plain softmax attention
    return jax.nn.softmax(q @ k.T * reference.default_scale(q.shape[1]), axis=1) @ v


def one_head_with(mistake, q, k, v, block_k):
    """Exercise 1 from scratch with one learner's mistake switched on."""
    kv_len = q.shape[0] if mistake == "loops over q_len" else k.shape[0]  # the query length used for the keys too
    if mistake == "zero-padded keys, no mask":
        k, v = (jnp.pad(x, ((0, -kv_len % block_k), (0, 0))) for x in (k, v))
        kv_len = k.shape[0]
    scale = 1.0 if mistake == "unscaled" else reference.default_scale(q.shape[1])
    m, l, acc = jnp.full(q.shape[0], -jnp.inf), jnp.zeros(q.shape[0]), jnp.zeros(q.shape)  # noqa: E741
    if mistake == "m starts at 0":  # the m = jnp.zeros(q.shape[0], q.dtype)
        m = jnp.zeros(q.shape[0], q.dtype)
    for lo in range(0, kv_len, block_k):
        hi = lo + block_k - (mistake == "slices one key short")  # k[lo:lo + block_k - 1]
        s = q @ k[lo:hi].T * scale
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new[:, None])
        m, l, acc = m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v[lo:hi]  # noqa: E741
    return acc / l[:, None]


def one_head_numpy_float32(q, k, v, block_k, scale=None):  # another valid style: NumPy, the state in float32
    q, k, v = (np.asarray(x) for x in (q, k, v))
    scale = np.float32(1 / np.sqrt(q.shape[1])) if scale is None else scale
    m, l, acc = np.full(len(q), -np.inf, q.dtype), np.zeros(len(q), q.dtype), np.zeros(q.shape, q.dtype)  # noqa: E741
    for lo in range(0, len(k), block_k):
        s = q @ k[lo:lo + block_k].T * scale
        m_new = np.maximum(m, s.max(axis=1))
        alpha, p = np.exp(m - m_new), np.exp(s - m_new[:, None])
        m, l, acc = m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v[lo:lo + block_k]  # noqa: E741
    return acc / l[:, None]


def test_one_head_stub_is_not_attempted(capsys):
    assert nb04.ONE_HEAD.use(_stub) is one_head_solution  # as the notebook calls it
    assert "exercise 1: from scratch: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (one_head_whole_blocks_only, r"case 'block_k = 32 does not divide.*keys past the last whole block are missing"),
    (one_head_numpy_float64, r"output dtype float64, expected q's dtype float32"),
    (one_head_no_division, r"not normalised"),
    (one_head_all_at_once, r"the scores of all 75 keys exist at once .*block by block"),
    (functools.partial(one_head_with, "loops over q_len"), r"'block_k = 25 divides.*only the first q_len = 50 keys"),
    (functools.partial(one_head_with, "unscaled"), r"the scores are not scaled"),
    (lambda q, k, v, block_k: one_head_numpy_float32(q, k, v, block_k, scale=1 / np.sqrt(q.shape[1])),  # float64 scalar
     r"output dtype float64.*a NumPy scalar such as np.sqrt\(d\) turns float32 into float64"),
    (functools.partial(one_head_with, "zero-padded keys, no mask"),
     r"case 'block_k = 32 does not divide kv_len = 75' — the 21 zero rows padded onto k score 0"),
    (functools.partial(one_head_with, "m starts at 0"),
     r"case 'every score far below zero .*' — NaN or inf in the output: the running max m starts at 0, not -inf"),
    (functools.partial(one_head_with, "slices one key short"), r"max error .*: check that the blocks cover every key "
                                                                r"exactly once \(k\[lo:lo \+ block_k\]"),
])
def test_one_head_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb04.check_one_head(wrong)


@pytest.mark.parametrize("answer", [one_head_solution, one_head_numpy_float32])
def test_one_head_solution_passes(answer, capsys):
    assert nb04.ONE_HEAD.use(answer) is answer
    out = capsys.readouterr().out
    assert out.startswith("passed: exercise 1") and "exercise 1: from scratch: passed" in out


# -- exercise 2: the log-sum-exp ----------------------------------------------------------------------------------


def with_lse(q, k, v, block_k, *, lse_of=lambda m, l: m + jnp.log(l), m0=-jnp.inf):  # noqa: E741
    m, l, acc = jnp.full(q.shape[0], m0), jnp.zeros(q.shape[0]), jnp.zeros(q.shape)  # noqa: E741
    for lo in range(0, k.shape[0], block_k):
        s = q @ k[lo:lo + block_k].T * reference.default_scale(q.shape[1])
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new[:, None])
        m, l, acc = m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v[lo:lo + block_k]  # noqa: E741
    return acc / l[:, None], lse_of(m, l)


def test_lse_stub_is_not_attempted(capsys):
    assert nb04.LSE.use(_stub) is nb04.flash_attention_with_lse_solution
    assert "exercise 2: the log-sum-exp: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("lse_of, message", [
    (lambda m, l: m, r"lse equals the row maximum m: add log\(l\)"),  # noqa: E741
    (lambda m, l: jnp.log(l), r"lse equals log\(l\) alone"),  # noqa: E741
    (lambda m, l: m + jnp.log(l)[:, None], r"lse has shape \(50, 50\), expected \(50,\)"),  # noqa: E741
    (lambda m, l: m + jnp.log2(l), r"lse\[\d+\] = .*, expected .*: use the final m and l, lse = m \+ log\(l\)"),  # noqa: E741
])
def test_lse_wrong_answers_fail_with_their_hint(lse_of, message):
    with pytest.raises(CheckFailed, match=message):
        nb04.check_lse(functools.partial(with_lse, lse_of=lse_of))


def test_lse_with_m_starting_at_0_fails_on_scores_far_below_zero():
    with pytest.raises(CheckFailed, match=r"case 'every score far below zero .*' — NaN or inf in the output: "
                                          r"the running max m starts at 0"):
        nb04.check_lse(functools.partial(with_lse, m0=0.0))


def test_lse_pair_the_wrong_way_round_fails():
    with pytest.raises(CheckFailed, match=r"'block_k = 32' — the pair is the wrong way round: return \(out, lse\)"):
        nb04.check_lse(lambda *args: with_lse(*args)[::-1])


def test_lse_as_a_list_passes(capsys):  # [out, lse] is a pair too
    nb04.check_lse(lambda *args: list(with_lse(*args)))
    assert capsys.readouterr().out.startswith("passed: exercise 2")


def test_lse_all_at_once_fails():  # jax.nn.logsumexp of the whole score matrix: right numbers, not flash attention
    def all_at_once(q, k, v, block_k):
        s = q @ k.T * reference.default_scale(q.shape[1])
        return jax.nn.softmax(s, axis=1) @ v, jax.nn.logsumexp(s, axis=1)

    with pytest.raises(CheckFailed, match=r"exercise 2, case 'block_k = 32' — the scores of all 75 keys exist at once"):
        nb04.check_lse(all_at_once)


@pytest.mark.parametrize("answer", [nb04.flash_attention_with_lse_solution, with_lse])
def test_lse_solution_passes(answer, capsys):
    assert nb04.LSE.use(answer) is answer
    assert capsys.readouterr().out.startswith("passed: exercise 2")


# -- exercise 3: how scratch scales -------------------------------------------------------------------------------


RIGHT = {"naive": (2, 0), "library blockwise": (1, 1), "ours": (0, 1)}


def test_exponents_solution_works_them_out():
    assert nb04.scratch_exponents_solution() == RIGHT
    assert nb04.SCRATCH_EXPONENTS.solved() == RIGHT


def test_exponents_stub_is_not_attempted(capsys):
    def scratch_exponents():  # the notebook's stub
        raise NotImplementedError

    assert nb04.SCRATCH_EXPONENTS.use(scratch_exponents) == RIGHT
    assert nb04.SCRATCH_EXPONENTS.use({"naive": None, "library blockwise": None, "ours": None}) == RIGHT  # left empty
    assert capsys.readouterr().out.count("not attempted yet") == 2


@pytest.mark.parametrize("wrong, message", [
    ({**RIGHT, "ours": (0, 0)}, r"ours — you predicted scratch ∝ block_k\^0.*\[block_q, block_k\]"),
    ({**RIGHT, "library blockwise": (2, 1)}, r"library blockwise — you predicted scratch ∝ N\^2.*\[N, block_k\] slab"),
    ({**RIGHT, "naive": (2, 1)}, r"naive — .*block_k\^1.*no blocks"),
    ({**RIGHT, "naive": 2}, r"naive — got 2: give two numbers \(a, b\)"),
    ({**RIGHT, "naive": ("2", "0")}, r"naive — got \('2', '0'\): give two numbers"),
    ({**RIGHT, "ours": None}, r"ours — got None: give two numbers"),  # two filled in, one forgotten
    ({"naive": (2, 0), "library_blockwise": (1, 1), "ours": (0, 1)}, r"exactly the keys 'naive', 'library blockwise'"),
])
def test_exponents_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb04.check_scratch_exponents(wrong)


@pytest.mark.parametrize("answer", [RIGHT, {method: list(pair) for method, pair in RIGHT.items()},
                                    lambda: RIGHT, nb04.scratch_exponents_solution])  # a value, or a function of it
def test_exponents_solution_passes(answer, capsys):
    nb04.SCRATCH_EXPONENTS.use(answer)
    out = capsys.readouterr().out
    assert out.startswith("passed: exercise 3") and "exercise 3: what sets the scratch memory: passed" in out
