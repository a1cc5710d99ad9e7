"""flashlib.char_model, the tiny transformer notebooks 07 and 10 train: its windows are the text's, the attention
backend is the only thing ``impl`` changes, and a few Adam steps lower the loss."""

from __future__ import annotations

import jax
import numpy as np

from flashlib import char_model


def test_batches_are_windows_of_the_text_with_targets_shifted_by_one():
    windows = char_model.batches(steps=3, batch=2)
    assert windows.shape == (3, 2, char_model.CONTEXT + 1)
    for window in windows.reshape(-1, char_model.CONTEXT + 1):
        text = char_model.decode_ids(window)
        assert text in char_model.TEXT
    assert char_model.decode_ids(char_model.encode("It was")) == "It was"


def test_impl_changes_only_the_attention_backend():
    params = char_model.init_params(jax.random.key(1))
    ids = char_model.batches(steps=1, batch=2)[0, :, :16]
    reference = char_model.logits_of(params, ids, "reference")
    assert reference.shape == (2, 16, len(char_model.VOCAB))
    np.testing.assert_allclose(char_model.logits_of(params, ids, "xla"), reference, atol=2e-5)


def test_a_few_adam_steps_lower_the_loss():
    _, losses = char_model.train("reference", steps=6, batch=4)
    assert losses.shape == (6,) and losses[-1] < losses[0]
