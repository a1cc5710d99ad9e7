"""The real-model data: it loads, it is what data/README.md says, and every flashlib stage reproduces it.

``data/minilm_attention.npz`` holds q, k, v and the attention probabilities of all-MiniLM-L6-v2 on six
sentences (see ``data/make_attention_data.py``). The checks, per layer and sentence on its real tokens:

* the stored probabilities are ``softmax(q k^T / sqrt(32))`` of the stored q and k (the file is
  self-consistent, so the model's attention is a pure function of what we hand flashlib);
* ``flashlib.attention(q, k, v, impl=...)`` equals the model's attention output ``probs @ v``.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashlib
from flashlib.data import DATA_ENV_VAR, DATA_FILE, AttentionData, data_dir, data_path, load_attention_data

# The file is float32 computed from a float64 forward pass; flashlib computes in float32. Observed errors
# are ~1.5e-6 (outputs, |v| <= ~4.4) and ~2e-7 (probabilities); the bounds leave room for other backends.
OUT_ATOL = 2e-5
PROBS_ATOL = 2e-6

IMPLS = [
    pytest.param("reference", {}, id="reference"),
    pytest.param("blockwise", {}, id="blockwise"),
    pytest.param("blockwise", {"block_q": 8, "block_k": 8}, id="blockwise-8x8"),  # several, ragged blocks
    pytest.param("xla", {}, id="xla"),
]


@pytest.fixture(scope="module")
def data() -> AttentionData:
    return load_attention_data()


def test_file_is_small():
    assert data_path().stat().st_size < 5 * 1024 * 1024


def test_shapes_and_dtypes(data):
    layers, batch, heads, seq, head_dim = data.q.shape
    assert (layers, heads, head_dim) == (6, 12, 32)
    assert batch == len(data.sentences) == 6
    for name in ("q", "k", "v"):
        a = getattr(data, name)
        assert a.shape == (layers, batch, heads, seq, head_dim) and a.dtype == np.float32, name
    assert data.probs.shape == (layers, batch, heads, seq, seq) and data.probs.dtype == np.float32
    assert data.mask.shape == (batch, seq) and data.mask.dtype == bool
    assert data.tokens.shape == (batch, seq)
    np.testing.assert_array_equal(data.lengths, data.mask.sum(axis=1))
    assert data.lengths.max() == seq  # padded to the longest sentence, no further
    assert data.metadata["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert data.metadata["model_license"] == "Apache-2.0"
    assert {"package", "package_version", "date", "made_by"} <= set(data.metadata)
    assert data.scale == pytest.approx(1 / np.sqrt(32))
    assert not data.q.flags.writeable  # loaded read-only


def test_tokens(data):
    for j, sentence in enumerate(data.sentences):
        toks = data.tokens_for(j)
        assert len(toks) == data.lengths[j]
        assert toks[0] == "[CLS]" and toks[-1] == "[SEP]"
        assert all(t == "[PAD]" for t in data.tokens[j, len(toks) :])
        assert toks[1] == sentence.split()[0].lower()  # uncased WordPiece
    assert "it" in data.tokens_for(0) and "animal" in data.tokens_for(0)


def test_padded_keys_get_no_attention(data):
    pad_keys = ~data.mask[None, :, None, None, :]  # [1, batch, 1, 1, seq]
    assert np.all(np.where(pad_keys, data.probs, 0.0) == 0.0)
    for j in range(data.num_sentences):
        p = data.model_attention(0, sentence=j)
        np.testing.assert_allclose(p.sum(axis=-1), 1.0, atol=1e-5)


def test_probs_are_softmax_of_stored_qk(data):
    """The data is self-consistent: the model's probabilities follow from the stored q and k alone."""
    q, k = data.q.astype(np.float64), data.k.astype(np.float64)
    s = np.einsum("lbhqd,lbhkd->lbhqk", q, k) * data.scale  # [layers, batch, heads, seq, seq]
    s = np.where(data.mask[None, :, None, None, :], s, -np.inf)  # the model's key padding mask
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    real = data.mask[None, :, None, :, None]  # real query rows
    np.testing.assert_allclose(np.where(real, data.probs, 0.0), np.where(real, p, 0.0), rtol=0, atol=PROBS_ATOL)


@pytest.mark.parametrize(("impl", "options"), IMPLS)
def test_flashlib_reproduces_model_attention(data, impl, options):
    """Every layer, every sentence (cut to its real tokens): flashlib's output == the model's probs @ v."""
    for j in range(data.num_sentences):
        n = int(data.lengths[j])
        # All six layers of sentence j at once, the layer axis standing in for batch: [layers, heads, n, d].
        q, k, v = (a[:, j, :, :n] for a in (data.q, data.k, data.v))
        want = data.probs[:, j, :, :n, :n].astype(np.float64) @ v.astype(np.float64)
        got = np.asarray(flashlib.attention(q, k, v, impl=impl, **options))
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=OUT_ATOL, err_msg=f"impl={impl} sentence {j}")


def test_helpers_give_flashlib_layout(data):
    i, j = 4, 2
    n = int(data.lengths[j])
    q, k, v = data.layer(i, sentence=j)
    assert q.shape == k.shape == v.shape == (1, 12, n, 32)
    out = np.asarray(flashlib.attention(q, k, v, impl="reference"))
    want = data.model_output(i, sentence=j)
    assert want.shape == out.shape
    np.testing.assert_allclose(out, want, rtol=0, atol=OUT_ATOL)
    assert data.model_attention(i, sentence=j).shape == (1, 12, n, n)
    qb, _, _ = data.layer(i)
    assert qb.shape == (6, 12, data.seq_len, 32)
    assert data.model_attention(i).shape == (6, 12, data.seq_len, data.seq_len)
    with pytest.raises(IndexError):
        data.layer(6)
    with pytest.raises(IndexError):
        data.tokens_for(6)


def test_data_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv(DATA_ENV_VAR, raising=False)
    here = data_dir()
    assert (here / DATA_FILE).is_file()

    monkeypatch.setenv(DATA_ENV_VAR, str(here))
    assert data_dir() == here
    monkeypatch.setenv(DATA_ENV_VAR, str(here / DATA_FILE))  # the file itself is accepted too
    assert data_dir() == here

    monkeypatch.setenv(DATA_ENV_VAR, str(tmp_path))  # set but empty: a clear error, no silent fallback
    with pytest.raises(FileNotFoundError, match=DATA_ENV_VAR) as err:
        load_attention_data()
    assert "clone" in str(err.value) and "make_attention_data.py" in str(err.value)
