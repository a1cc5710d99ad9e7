"""A tiny character-level transformer: the model notebook 07 trains through each attention backend and notebook 10
generates text with through the paged decode kernel.

Two layers, two heads of 32 dimensions, width 64, a 64-character context, tied embeddings, layer norm without a
learned gain; trained with Adam on the opening of *A Tale of Two Cities* (public domain). Small enough that 80
steps run in seconds on a CPU, and large enough that its loss falls and its greedy continuations are recognisably
English-shaped. The attention call is the only place a backend enters::

    from flashlib import char_model
    params, losses = char_model.train("pallas")        # [steps] losses, one per Adam step
    logits = char_model.logits_of(params, ids, "reference")  # ids [batch, t] -> [batch, t, vocab]

Notebook 07 shows this module's source where it trains the model (one definition, in the library, for both
notebooks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import flashlib

__all__ = ["CONTEXT", "HEADS", "LAYERS", "TEXT", "VOCAB", "WIDTH", "batches", "encode", "decode_ids", "init_params",
           "layer_norm", "logits_of", "loss_fn", "train", "train_step"]

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
    "was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything "
    "before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the "
    "other way - in short, the period was so far like the present period, that some of its noisiest "
    "authorities insisted on its being received, for good or for evil, in the superlative degree of "
    "comparison only. There were a king with a large jaw and a queen with a plain face, on the throne of "
    "England; there were a king with a large jaw and a queen with a fair face, on the throne of France. In "
    "both countries it was clearer than crystal to the lords of the State preserves of loaves and fishes, "
    "that things in general were settled for ever."
)
VOCAB = sorted(set(TEXT))  # 37 characters
CONTEXT, WIDTH, HEADS, LAYERS = 64, 64, 2, 2


def encode(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def decode_ids(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


def batches(steps: int = 80, batch: int = 16, seed: int = 0) -> np.ndarray:
    """``[steps, batch, CONTEXT + 1]`` windows of the text at random starts: inputs and, shifted by one, targets."""
    tokens = np.array(encode(TEXT))
    starts = np.random.default_rng(seed).integers(0, len(tokens) - CONTEXT, size=(steps, batch))
    return tokens[starts[..., None] + np.arange(CONTEXT + 1)]


def init_params(key):
    keys = iter(jax.random.split(key, 2 + 4 * LAYERS))

    def dense(fan_in, fan_out):
        return jax.random.normal(next(keys), (fan_in, fan_out)) * fan_in**-0.5

    return {"embed": jax.random.normal(next(keys), (len(VOCAB), WIDTH)) * 0.1,
            "position": jax.random.normal(next(keys), (CONTEXT, WIDTH)) * 0.1,
            "layers": [{"qkv": dense(WIDTH, 3 * WIDTH), "proj": dense(WIDTH, WIDTH),
                        "up": dense(WIDTH, 4 * WIDTH), "down": dense(4 * WIDTH, WIDTH)} for _ in range(LAYERS)]}


def layer_norm(x):  # no learned gain and bias: fewer parameters, same idea
    return (x - x.mean(-1, keepdims=True)) * lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def logits_of(params, inputs, impl):  # inputs [batch, t] -> logits [batch, t, vocab]
    x = params["embed"][inputs] + params["position"][: inputs.shape[1]]  # [b, t, width]
    b, t, _ = x.shape
    for layer in params["layers"]:
        qkv = layer_norm(x) @ layer["qkv"]  # [b, t, 3 * width]
        q, k, v = (y.reshape(b, t, HEADS, -1).transpose(0, 2, 1, 3) for y in jnp.split(qkv, 3, axis=-1))
        o = flashlib.attention(q, k, v, causal=True, impl=impl)  # [b, heads, t, 32]: the only difference
        x = x + o.transpose(0, 2, 1, 3).reshape(b, t, -1) @ layer["proj"]
        x = x + jax.nn.gelu(layer_norm(x) @ layer["up"]) @ layer["down"]
    return layer_norm(x) @ params["embed"].T  # tied embeddings


def loss_fn(params, batch, impl):  # mean next-character cross-entropy
    logp = jax.nn.log_softmax(logits_of(params, batch[:, :-1], impl))
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))


@functools.partial(jax.jit, static_argnames="impl")
def train_step(params, opt, batch, impl, lr=3e-3, b1=0.9, b2=0.99):  # Adam
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, impl)
    m, v, t = opt
    t = t + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    params = jax.tree.map(lambda p, m, v: p - lr * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + 1e-8),
                          params, m, v)
    return params, (m, v, t), loss


def train(impl: str, steps: int = 80, batch: int = 16, seed: int = 0):
    """Train from ``init_params(key(seed))`` on ``batches(steps, batch, seed)``: ``(params, losses [steps])``."""
    params = init_params(jax.random.key(seed))
    opt = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params), 0)
    losses = []
    for window in batches(steps, batch, seed):
        params, opt, loss = train_step(params, opt, window, impl)
        losses.append(float(loss))
    return params, np.array(losses)
