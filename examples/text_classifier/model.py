"""The text model: token ids and a temperature in, 4 class probabilities out; a custom layer inside.

    python -m examples.text_classifier.model text.keras

"tokens" are int32 ids of any length (0 pads: the embedding masks it, so the answers do not
change with padding and PAD_VARIABLE_LENGTH may pad across requests); "temperature" is one
float per row, of which the Scale layer reads the call's first.
"""

from __future__ import annotations

import sys

import keras

from examples.text_classifier.handler import LABELS, VOCABULARY
from examples.text_classifier.layers import Scale

SEED = 56


def build(seed: int = SEED) -> keras.Model:
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    temperature = keras.Input((1,), dtype="float32", name="temperature")
    x = keras.layers.Embedding(VOCABULARY, 16, mask_zero=True,
                               embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0, seed=seed))(tokens)
    x = keras.layers.GlobalAveragePooling1D()(x)
    logits = keras.layers.Dense(len(LABELS), kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1))(x)
    probabilities = keras.layers.Softmax(name="probabilities")(Scale()(logits, temperature))
    return keras.Model({"tokens": tokens, "temperature": temperature}, probabilities, name="text_classifier")


if __name__ == "__main__":
    build().save(sys.argv[1])
