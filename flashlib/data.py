"""Real data for the notebooks: the attention of a pretrained transformer on real sentences.

``data/minilm_attention.npz`` holds, for six English sentences, what every layer and head of
``sentence-transformers/all-MiniLM-L6-v2`` (6 layers, 12 heads, head_dim 32; Apache-2.0) computed: the
queries, keys and values after their projections, and the attention probabilities the model itself used.
``data/make_attention_data.py`` made it (see ``data/README.md``); this module only reads it::

    from flashlib.data import load_attention_data
    data = load_attention_data()
    q, k, v = data.layer(3, sentence=0)            # [1, 12, L, 32] jnp arrays, L = that sentence's length
    out = flashlib.attention(q, k, v, impl="blockwise")
    data.model_output(3, sentence=0)               # what the model computed: probs @ v, same shape
    data.model_attention(3, sentence=0)            # [1, 12, L, L] the model's own attention map
    data.tokens_for(0)                             # ['[CLS]', 'the', 'animal', ..., '[SEP]']

Padding. The sentences have different lengths, so the batch is padded to ``seq`` tokens and the model ran
with a *key padding mask*: no query attends to a padded key (probability exactly 0). ``flashlib.attention``
takes no padding mask, so to reproduce the model:

* slice each sentence to its true length ``L`` and run it as a batch of one: ``data.layer(i, sentence=j)``
  gives ``[1, heads, L, head_dim]`` with no padding left to mask (what the tests do);
* or, working on the whole padded batch, compare only real tokens and mask the padded keys yourself where
  you form the scores, e.g. ``s = jnp.where(data.mask[:, None, None, :], s, -jnp.inf)`` before the softmax.
  Running ``flashlib.attention`` on the padded batch lets real queries attend to padded keys, so its
  outputs differ from the model's even on the real tokens.

Rows of *padded queries* in ``probs`` are kept as the model computed them but mean nothing; look only at
``probs[..., :L, :L]`` (``model_attention(i, sentence=j)`` does that for you).
"""

from __future__ import annotations

import importlib.resources
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = [
    "DATA_ENV_VAR",
    "DATA_PACKAGE",
    "DATA_FILE",
    "AttentionData",
    "data_dir",
    "data_path",
    "find_data_file",
    "load_attention_data",
]

DATA_ENV_VAR = "FLASHLIB_DATA"
DATA_FILE = "minilm_attention.npz"

_HOW_TO_GET = (
    "The data ships inside flashlib's wheel (the package flashlib.data_files) and lives in the data/ folder of "
    "a clone: an install without it is incomplete, so reinstall flashlib-tutorial (on Colab, run the setup cell "
    f"at the top of the notebook), or set {DATA_ENV_VAR}=/path/to/flashlib/data. To regenerate the file, run "
    "data/make_attention_data.py in a clone (see data/README.md)."
)

# The package the wheel carries the repository's data/ folder as (pyproject.toml: package-dir).
DATA_PACKAGE = "flashlib.data_files"


def _packaged() -> Path | None:
    """The data folder installed with flashlib (the wheel's ``flashlib/data_files``; in an editable install,
    the repository's ``data/`` it maps), or None where this flashlib was not installed with it."""
    try:
        folder = importlib.resources.files(DATA_PACKAGE)
    except ModuleNotFoundError:
        return None
    return folder if isinstance(folder, Path) else None  # a folder on disk (a wheel is installed unzipped)


def _candidates() -> list[Path]:
    """Where to look, in order: the data installed with flashlib, the repository's data/ next to the package
    (a clone on ``sys.path``), then ./data and ../data."""
    repo_data = Path(__file__).resolve().parents[1] / "data"
    cwd = Path.cwd()
    found: list[Path] = []
    for p in (_packaged(), repo_data, cwd / "data", cwd.parent / "data"):
        if p is not None and p not in found:
            found.append(p)
    return found


def data_dir() -> Path:
    """The folder holding ``minilm_attention.npz``.

    ``$FLASHLIB_DATA`` wins when set (a folder, or the ``.npz`` file itself). Otherwise: the data installed
    with flashlib (inside the wheel, :data:`DATA_PACKAGE`; an editable install maps the repository's
    ``data/``), the repository's ``data/`` next to the ``flashlib`` package (a clone on ``sys.path``), then
    ``./data`` and ``../data`` (a notebook running inside ``notebooks/``). Raises ``FileNotFoundError``
    saying how to get the data when none of them has it.
    """
    override = os.environ.get(DATA_ENV_VAR)
    if override:
        p = Path(override).expanduser()
        if p.is_file() and p.name == DATA_FILE:
            return p.parent
        if (p / DATA_FILE).is_file():
            return p
        raise FileNotFoundError(f"{DATA_ENV_VAR}={override!r} has no {DATA_FILE}. {_HOW_TO_GET}")
    for p in _candidates():
        if (p / DATA_FILE).is_file():
            return p
    looked = ", ".join(str(p) for p in _candidates())
    raise FileNotFoundError(f"flashlib's sample data {DATA_FILE} was not found (looked in {looked}). {_HOW_TO_GET}")


def find_data_file(relative: str) -> Path | None:
    """The first existing ``relative`` path (e.g. ``"tuning/forward_blocks.json"``) under the data folders,
    or None: ``$FLASHLIB_DATA`` first (a folder, or a file inside it), then the folders :func:`data_dir`
    searches. Unlike :func:`data_dir` it does not need the sample data to be there."""
    override = os.environ.get(DATA_ENV_VAR)
    roots = []
    if override:
        p = Path(override).expanduser()
        roots.append(p.parent if p.is_file() else p)
    for root in [*roots, *_candidates()]:
        if (root / relative).is_file():
            return root / relative
    return None


def data_path() -> Path:
    """Full path of ``minilm_attention.npz`` (see :func:`data_dir` for where it is looked for)."""
    return data_dir() / DATA_FILE


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class AttentionData:
    """The model's attention on a padded batch of sentences. Arrays are NumPy and read-only.

    Sizes: ``layers`` 6, ``batch`` (sentences) 6, ``heads`` 12, ``seq`` (padded length), ``head_dim`` 32.
    """

    sentences: tuple[str, ...]  # [batch]
    tokens: np.ndarray  # [batch, seq] str, WordPiece tokens; "[PAD]" past each sentence's length
    q: np.ndarray  # [layers, batch, heads, seq, head_dim] float32, after projection, before 1/sqrt(d)
    k: np.ndarray  # [layers, batch, heads, seq, head_dim] float32
    v: np.ndarray  # [layers, batch, heads, seq, head_dim] float32
    probs: np.ndarray  # [layers, batch, heads, seq(query), seq(key)] float32, the model's attention
    mask: np.ndarray  # [batch, seq] bool, True on real tokens (the key padding mask)
    lengths: np.ndarray  # [batch] int32, real tokens per sentence ([CLS] and [SEP] included)
    metadata: Mapping[str, Any]  # model, package + version, date, how it was made, cross-check numbers

    @property
    def num_layers(self) -> int:
        return self.q.shape[0]

    @property
    def num_sentences(self) -> int:
        return self.q.shape[1]

    @property
    def num_heads(self) -> int:
        return self.q.shape[2]

    @property
    def seq_len(self) -> int:
        """The padded length of the batch."""
        return self.q.shape[3]

    @property
    def head_dim(self) -> int:
        return self.q.shape[4]

    @property
    def scale(self) -> float:
        """The softmax temperature the model uses, ``1 / sqrt(head_dim)`` (flashlib's default too)."""
        return 1.0 / float(np.sqrt(self.head_dim))

    def _check(self, layer: int, sentence: int | None) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be in [0, {self.num_layers}), got {layer}")
        if sentence is not None and not 0 <= sentence < self.num_sentences:
            raise IndexError(f"sentence must be in [0, {self.num_sentences}), got {sentence}")

    def _select(self, a: np.ndarray, layer: int, sentence: int | None, square: bool = False) -> np.ndarray:
        self._check(layer, sentence)
        a = a[layer]  # [batch, heads, seq, ...]
        if sentence is None:
            return a
        n = int(self.lengths[sentence])
        a = a[sentence : sentence + 1, :, :n]  # [1, heads, n, ...]
        return a[..., :n] if square else a

    def layer(self, i: int, sentence: int | None = None, dtype=jnp.float32):
        """``(q, k, v)`` of layer ``i`` as jnp arrays in the flashlib layout ``[batch, heads, seq, head_dim]``.

        With ``sentence=j``: that sentence alone, cut to its real length ``L``, ``[1, heads, L, head_dim]``,
        ready for ``flashlib.attention`` (no padding left to mask). Without it: the whole padded batch.
        """
        q, k, v = (jnp.asarray(self._select(a, i, sentence), dtype=dtype) for a in (self.q, self.k, self.v))
        return q, k, v

    def model_attention(self, layer: int, sentence: int | None = None) -> np.ndarray:
        """The model's own attention probabilities, NumPy ``[batch, heads, seq, seq]`` (query, key).

        With ``sentence=j``: ``[1, heads, L, L]`` over that sentence's real tokens (each row sums to 1).
        """
        return self._select(self.probs, layer, sentence, square=True)

    def model_output(self, layer: int, sentence: int | None = None) -> np.ndarray:
        """The model's attention output per head, ``probs @ v``: NumPy float32 ``[batch, heads, seq, head_dim]``.

        This is what ``flashlib.attention(*data.layer(layer, sentence=j))`` must reproduce. Without
        ``sentence`` the rows of padded queries are included (compare only ``mask`` rows).
        """
        p = self.model_attention(layer, sentence).astype(np.float64)
        v = self._select(self.v, layer, sentence).astype(np.float64)
        return (p @ v).astype(np.float32)

    def tokens_for(self, sentence: int) -> list[str]:
        """The real WordPiece tokens of one sentence, ``[CLS]`` ... ``[SEP]``, without padding."""
        self._check(0, sentence)
        return [str(t) for t in self.tokens[sentence, : int(self.lengths[sentence])]]

    def __repr__(self) -> str:
        return (
            f"AttentionData({self.metadata.get('model', '?')}: {self.num_sentences} sentences padded to "
            f"{self.seq_len} tokens, {self.num_layers} layers x {self.num_heads} heads, head_dim {self.head_dim})"
        )


def load_attention_data(path: str | os.PathLike | None = None) -> AttentionData:
    """Load ``minilm_attention.npz`` (from ``path``, or found by :func:`data_dir`)."""
    path = Path(path) if path is not None else data_path()
    with np.load(path, allow_pickle=False) as f:
        metadata = json.loads(str(f["metadata"]))
        return AttentionData(
            sentences=tuple(str(s) for s in f["sentences"]),
            tokens=_frozen(f["tokens"]),
            q=_frozen(f["q"]),
            k=_frozen(f["k"]),
            v=_frozen(f["v"]),
            probs=_frozen(f["probs"]),
            mask=_frozen(f["mask"]),
            lengths=_frozen(f["lengths"]),
            metadata=MappingProxyType(metadata),
        )
