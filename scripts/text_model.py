"""A text-classifier-like Keras model built in-process from seeds, for padding's tests and benchmark.

Token ids (0 is padding): Embedding with mask_zero, a per-token Dense layer, masked average pooling to class
scores; per-token scores are a second output as long as the input. `mask=False`: padding changes the answers.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def build_text_model(*, vocab: int = 50, width: int = 8, hidden: int = 0, mask: bool = True, seed: int = 11) -> Any:
    import keras

    tokens = keras.Input((None,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(vocab, width, mask_zero=mask, name="embed",
                                      embeddings_initializer=keras.initializers.RandomUniform(seed=seed))(tokens)
    if hidden:
        # Dense passes the mask on, so the pooling below still leaves padding out.
        embedded = keras.layers.Dense(hidden, activation="relu", name="per_token",
                                      kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 3))(embedded)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(embedded)
    scores = keras.layers.Dense(3, name="scores", kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1))
    per_token = keras.layers.Dense(2, name="token_scores",
                                   kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 2))
    return keras.Model(tokens, {"scores": scores(pooled), "token_scores": per_token(embedded)}, name="text")


def token_rows(length: int, seed: int, *, vocab: int = 50, rows: int = 1) -> np.ndarray:
    """Token ids of one length, none of them the padding id 0."""
    return np.random.default_rng(seed).integers(1, vocab, (rows, length)).astype("int32")
