"""Notebook 02's puzzles and exercises (:mod:`flashlib.exercises.tiling`), run three ways: on the notebook's stub
(reported as not attempted, no traceback), on plausible wrong answers (each fails with the message that points
at its mistake) and on a solution (it passes)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from flashlib.checks import CheckFailed
from flashlib.exercises import tiling as nb02


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- puzzle 1: tiled S = Q K^T / sqrt(d) ---------------------------------------------------------------------------


def _scores(q, k, block_q, block_k, matmul, *, scale=True, last_tile=True, swap=False, assign=True, clamp=False):
    """Tiled scores with one mistake switched on at a time."""
    if swap:
        block_q, block_k = block_k, block_q
    s = jnp.zeros((q.shape[0], k.shape[0]))
    q_end = q.shape[0] if last_tile else q.shape[0] - q.shape[0] % block_q
    k_end = k.shape[0] if last_tile else k.shape[0] - k.shape[0] % block_k
    factor = 1 / np.sqrt(q.shape[1]) if scale is True else scale or 1.0
    for i in range(0, q_end, block_q):
        for j in range(0, k_end, block_k):
            if clamp:  # the last tile shifted back to a full one, overlapping the tile before
                i, j = max(0, min(i, q.shape[0] - block_q)), max(0, min(j, k.shape[0] - block_k))  # noqa: PLW2901
            s_ij = matmul(q[i : i + block_q], k[j : j + block_k].T) * factor
            s = s.at[i : i + block_q, j : j + block_k].set(s_ij) if assign else s
            if not assign:
                s.at[i : i + block_q, j : j + block_k].set(s_ij)  # the new array is dropped
    return s


def scores_unscaled(q, k, block_q, block_k, matmul=jnp.matmul):  # forgets 1 / sqrt(d)
    return _scores(q, k, block_q, block_k, matmul, scale=False)


def scores_drop_last_tile(q, k, block_q, block_k, matmul=jnp.matmul):  # range(0, n - n % block, block)
    return _scores(q, k, block_q, block_k, matmul, last_tile=False)


def scores_swapped_blocks(q, k, block_q, block_k, matmul=jnp.matmul):  # cuts Q by block_k and K by block_q
    return _scores(q, k, block_q, block_k, matmul, swap=True)


def scores_fixed_scale(q, k, block_q, block_k, matmul=jnp.matmul):  # the notebook's scale = 1/8 (d = 64) as a global
    return _scores(q, k, block_q, block_k, matmul, scale=1 / 8)


def scores_set_not_assigned(q, k, block_q, block_k, matmul=jnp.matmul):  # s.at[...].set(...) without s =
    return _scores(q, k, block_q, block_k, matmul, assign=False)


def scores_clamped_last_tile(q, k, block_q, block_k, matmul=jnp.matmul):  # full tiles only, the last shifted back
    return _scores(q, k, block_q, block_k, matmul, clamp=True)


def scores_one_tile_too_many(q, k, block_q, block_k, matmul=jnp.matmul):  # range(n // block + 1): an empty tile
    s = jnp.zeros((q.shape[0], k.shape[0]))
    for i in range(q.shape[0] // block_q + 1):
        for j in range(k.shape[0] // block_k + 1):
            rows, cols = slice(i * block_q, (i + 1) * block_q), slice(j * block_k, (j + 1) * block_k)
            s = s.at[rows, cols].set(matmul(q[rows], k[cols].T) / np.sqrt(q.shape[1]))
    return s


def scores_untiled(q, k, block_q, block_k, matmul=jnp.matmul):  # right numbers, one big product
    return matmul(q, k.T) / np.sqrt(q.shape[1])


def scores_with_at_sign(q, k, block_q, block_k, matmul=jnp.matmul):  # tiled, but the checker cannot see it
    return _scores(q, k, block_q, block_k, jnp.matmul)


def test_tiled_scores_stub_is_not_attempted(capsys):
    def tiled_scores(q, k, block_q, block_k, matmul=jnp.matmul):
        raise NotImplementedError  # your code here

    assert nb02.TILED_SCORES.use(tiled_scores) is nb02.tiled_scores_solution
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (scores_unscaled, "without the scale: multiply by 1 / sqrt"),
    (scores_drop_last_tile, "neither length divides its block.* the last, shorter tile is not"),
    (scores_swapped_blocks, "swapped block sizes"),
    (scores_untiled, "not tiled: a call multiplied \\[32, 8\\] @ \\[8, 48\\]"),
    (scores_with_at_sign, "matmul was never called"),
    (scores_fixed_scale, "divide the blocks' — off by a constant factor 0.3536: the scale is 1 / sqrt\\(d\\)"),
    (scores_set_not_assigned, "the result is still all zeros: x.at\\[...\\].set\\(...\\) returns a new array"),
    (scores_clamped_last_tile, "neither length divides.* — 10 calls multiplied \\[8, 8\\] @ \\[8, 16\\], the grid has"),
    (scores_one_tile_too_many, "the lengths divide the blocks' — .*an empty tile: the loop runs one tile past the end"),
])
def test_tiled_scores_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb02.check_tiled_scores(wrong)


def test_tiled_scores_wrong_answer_falls_back_to_the_solution(capsys):
    assert nb02.TILED_SCORES.use(scores_unscaled) is nb02.tiled_scores_solution
    assert "not passed yet" in capsys.readouterr().out


def test_tiled_scores_solution_passes(capsys):
    nb02.TILED_SCORES.check(nb02.tiled_scores_solution)
    assert capsys.readouterr().out.startswith("passed: tiled_scores")

    def tiled_scores(q, k, block_q, block_k, matmul=jnp.matmul):  # a learner's answer that passes
        return nb02.tiled_scores_solution(q, k, block_q, block_k, matmul)

    assert nb02.TILED_SCORES.use(tiled_scores) is tiled_scores
    assert "puzzle 1: tiled scores: solved" in capsys.readouterr().out


def scores_numpy_in_place(q, k, block_q, block_k, matmul=jnp.matmul):  # a NumPy array filled in place
    s = np.zeros((q.shape[0], k.shape[0]), np.float32)
    for j in range(0, k.shape[0], block_k):  # key tiles outside: the order does not matter
        for i in range(0, q.shape[0], block_q):
            s[i : i + block_q, j : j + block_k] = matmul(q[i : i + block_q] / np.sqrt(q.shape[1]), k[j : j + block_k].T)
    return s


def scores_concatenated(q, k, block_q, block_k, matmul=jnp.matmul):
    return jnp.concatenate([jnp.concatenate([matmul(q[i : i + block_q], k[j : j + block_k].T)
                                             for j in range(0, k.shape[0], block_k)], axis=1)
                            for i in range(0, q.shape[0], block_q)]) / np.sqrt(q.shape[1])


@pytest.mark.parametrize("valid", [scores_numpy_in_place, scores_concatenated])
def test_tiled_scores_other_styles_pass(valid, capsys):
    nb02.check_tiled_scores(valid)
    assert capsys.readouterr().out.startswith("passed: tiled_scores")


# -- puzzle 2: tiled O = P V -----------------------------------------------------------------------------------------


def _pv(p, v, block_q, block_k, matmul, *, accumulate=True, last_key_tile=True, whole_rows=False, reset=True,
        renormalise=False):
    out = jnp.zeros((p.shape[0], v.shape[1]))
    k_end = p.shape[1] if last_key_tile else p.shape[1] - p.shape[1] % block_k
    acc = jnp.zeros((block_q, v.shape[1]))
    for i in range(0, p.shape[0], block_q):
        if whole_rows:
            out = out.at[i : i + block_q].set(matmul(p[i : i + block_q], v))
            continue
        if reset:
            acc = jnp.zeros((p[i : i + block_q].shape[0], v.shape[1]))
        for j in range(0, k_end, block_k):
            tile = p[i : i + block_q, j : j + block_k]
            tile = tile / tile.sum(axis=1, keepdims=True) if renormalise else tile
            product = matmul(tile, v[j : j + block_k])
            acc = acc + product if accumulate else product
        out = out.at[i : i + block_q].set(acc)
    return out


def pv_overwrites(p, v, block_q, block_k, matmul=jnp.matmul):  # acc = ... instead of acc += ...
    return _pv(p, v, block_q, block_k, matmul, accumulate=False)


def pv_drop_last_key_tile(p, v, block_q, block_k, matmul=jnp.matmul):
    return _pv(p, v, block_q, block_k, matmul, last_key_tile=False)


def pv_whole_rows(p, v, block_q, block_k, matmul=jnp.matmul):  # tiles the queries only
    return _pv(p, v, block_q, block_k, matmul, whole_rows=True)


def pv_acc_never_reset(p, v, block_q, block_k, matmul=jnp.matmul):  # acc = zeros once, before the query loop
    return _pv(p, v, block_q, block_k, matmul, reset=False)


def pv_renormalised_tiles(p, v, block_q, block_k, matmul=jnp.matmul):  # each tile softmaxed again on its own
    return _pv(p, v, block_q, block_k, matmul, renormalise=True)


def test_tiled_pv_stub_is_not_attempted(capsys):
    def tiled_pv(p, v, block_q, block_k, matmul=jnp.matmul):
        raise NotImplementedError  # your code here

    assert nb02.TILED_PV.use(tiled_pv) is nb02.tiled_pv_solution
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (pv_overwrites, "only the last key tile counts.*acc \\+="),
    (pv_drop_last_key_tile, "neither length divides its block.* the last, shorter key tile is missing"),
    (pv_whole_rows, "not tiled: a call multiplied \\[16, 48\\] @ \\[48, 8\\]"),
    (pv_acc_never_reset, "case 'the lengths divide the blocks' — acc carries over from the previous query tile"),
    (pv_renormalised_tiles, "case 'the lengths divide the blocks' — each P tile is re-normalised by its own row sums"),
])
def test_tiled_pv_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb02.check_tiled_pv(wrong)


def test_tiled_pv_solution_passes(capsys):
    nb02.TILED_PV.check(nb02.tiled_pv_solution)
    assert capsys.readouterr().out.startswith("passed: tiled_pv")


def pv_added_into_out(p, v, block_q, block_k, matmul=jnp.matmul):  # no acc: each product added into O's rows
    out = jnp.zeros((p.shape[0], v.shape[1]))
    for i in range(0, p.shape[0], block_q):
        for j in range(0, p.shape[1], block_k):
            out = out.at[i : i + block_q].add(matmul(p[i : i + block_q, j : j + block_k], v[j : j + block_k]))
    return out


def test_tiled_pv_other_style_passes(capsys):
    nb02.check_tiled_pv(pv_added_into_out)
    assert capsys.readouterr().out.startswith("passed: tiled_pv")


# -- exercise 1: blocked matmul with rectangular tiles --------------------------------------------------------------


matmul_solution = nb02.tiled_matmul_solution


def matmul_untiled(a, b, block_m, block_n, block_k, matmul=jnp.matmul):  # the old checker passed this
    return matmul(a, b)


def matmul_swaps_n_and_k(a, b, block_m, block_n, block_k, matmul=jnp.matmul):
    return matmul_solution(a, b, block_m, block_k, block_n, matmul)


def matmul_with_at_sign(a, b, block_m, block_n, block_k, matmul=jnp.matmul):  # tiled, but not through matmul
    return matmul_solution(a, b, block_m, block_n, block_k, jnp.matmul)


def matmul_overwrites(a, b, block_m, block_n, block_k, matmul=jnp.matmul):  # acc = ... instead of acc += ...
    c = jnp.zeros((a.shape[0], b.shape[1]))
    for i in range(0, a.shape[0], block_m):
        for j in range(0, b.shape[1], block_n):
            for p in range(0, a.shape[1], block_k):
                acc = matmul(a[i : i + block_m, p : p + block_k], b[p : p + block_k, j : j + block_n])
            c = c.at[i : i + block_m, j : j + block_n].set(acc)
    return c


def matmul_acc_per_row_of_tiles(a, b, block_m, block_n, block_k, matmul=jnp.matmul):  # acc reset per i, not (i, j)
    c = jnp.zeros((a.shape[0], b.shape[1]))
    for i in range(0, a.shape[0], block_m):
        acc = jnp.zeros((block_m, block_n))
        for j in range(0, b.shape[1], block_n):
            for p in range(0, a.shape[1], block_k):
                acc += matmul(a[i : i + block_m, p : p + block_k], b[p : p + block_k, j : j + block_n])
            c = c.at[i : i + block_m, j : j + block_n].set(acc)
    return c


def test_tiled_matmul_stub_is_not_attempted(capsys):
    def my_tiled_matmul(a, b, block_m, block_n, block_k, matmul=jnp.matmul):
        raise NotImplementedError  # three loops over tiles, one accumulator

    assert nb02.TILED_MATMUL.use(my_tiled_matmul) is matmul_solution  # as the notebook calls it
    assert "exercise 1: tiled matmul with rectangular tiles: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (matmul_untiled, "all differ' — not tiled: a call multiplied \\[12, 40\\] @ \\[40, 16\\]"),
    (matmul_swaps_n_and_k, "swapped block sizes"),
    (matmul_with_at_sign, "matmul was never called"),
    (matmul_overwrites, "only the last block_k slice of the shared dimension counts"),
    (matmul_acc_per_row_of_tiles, "all differ' — acc carries over from the output tile to its left"),
])
def test_tiled_matmul_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb02.check_tiled_matmul(wrong)


def test_tiled_matmul_solution_passes(capsys):
    nb02.TILED_MATMUL.check(matmul_solution)
    assert capsys.readouterr().out.startswith("passed: tiled_matmul")

    def my_tiled_matmul(a, b, block_m, block_n, block_k, matmul=jnp.matmul):  # a learner's answer that passes
        return matmul_solution(a, b, block_m, block_n, block_k, matmul)

    assert nb02.TILED_MATMUL.use(my_tiled_matmul) is my_tiled_matmul
    assert capsys.readouterr().out.rstrip().endswith("exercise 1: tiled matmul with rectangular tiles: passed")


def test_tiled_matmul_wrong_answer_says_where_the_hints_are(capsys):
    assert nb02.TILED_MATMUL.use(matmul_overwrites) is matmul_solution
    assert "not passed yet — the hints are below the exercise" in capsys.readouterr().out


# -- exercise 2: count the causal grid --------------------------------------------------------------------------------


def test_causal_count_stub_is_not_attempted(capsys):
    def my_causal_count():
        raise NotImplementedError  # return {"steps": ..., "skipped": ..., "masked": ...}

    assert nb02.CAUSAL_COUNT.use(my_causal_count) == {"steps": 24, "skipped": 3, "masked": 3}  # as the notebook
    assert "exercise 2: count the causal grid: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    ({"steps": 24, "skipped": 18, "masked": 3}, "18 skipped and 3 masked: that is a top-left aligned mask"),
    ({"steps": 21, "skipped": 3, "masked": 3}, "21 steps.*the skipped steps count too"),
    ({"steps": 24, "skipped": 3, "masked": 4}, "3 skipped and 4 masked: draw the diagonal"),
    ((24, 3, 3), "answer a dict"),
])
def test_causal_count_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb02.check_causal_count(wrong)


def test_causal_count_solution_passes(capsys):
    assert nb02.causal_count_solution() == {"steps": 24, "skipped": 3, "masked": 3}  # counted by its loops
    nb02.CAUSAL_COUNT.use(nb02.causal_count_solution)
    nb02.CAUSAL_COUNT.use({"steps": 24, "skipped": 3, "masked": 3})  # the value itself, as well as a function
    out = capsys.readouterr().out
    assert out.startswith("passed: causal count of the 384 x 1024 grid has 24 steps")
    assert out.count("exercise 2: count the causal grid: passed") == 2


# -- exercise 3: how big a query tile? --------------------------------------------------------------------------------


def test_block_q_stub_is_not_attempted(capsys):
    def my_block_q():
        raise NotImplementedError  # return (block_q, q_tile_kib)

    assert nb02.BLOCK_Q.use(my_block_q) == (1024, 256.0)  # as the notebook calls it
    assert "exercise 3: how big a query tile: not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    ((512, 128), "block_q = 512 gives only 7.3x"),
    ((2048, 512), "block_q = 2048 gives 22.0x, but a smaller power of two"),
    ((640, 160), "block_q = 640 is not a power of two"),
    ((1024.5, 256), "not a power of two"),
    ((1024, 512), "a bfloat16 element is 2 bytes, not 4"),
    ((1024, 262144), "that is bytes: a KiB is 1024 bytes"),
    ((1024, 262.144), "not 1000"),
])
def test_block_q_wrong_answers_fail_with_their_hint(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        nb02.check_block_q(wrong)


@pytest.mark.parametrize("answer", [(1024, 256), (2.0 ** 10, 256.0), (np.int64(1024), 1024 * 128 * 2 / 1024),
                                    (jnp.int32(1024), jnp.float32(256.0)), (2 ** jnp.ceil(jnp.log2(1000.0)), 256)])
def test_block_q_solution_passes(capsys, answer):
    nb02.check_block_q(answer)
    assert capsys.readouterr().out.startswith("passed: block_q = 1024 moves 13.2x fewer bytes")


def test_block_q_worked_out_passes(capsys):
    assert nb02.pick_block_q_solution() == (1024, 256.0)  # found by trying the powers of two
    nb02.BLOCK_Q.use(nb02.pick_block_q_solution)
    assert capsys.readouterr().out.rstrip().endswith("exercise 3: how big a query tile: passed")
