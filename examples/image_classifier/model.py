"""The image classifier's model: a small Keras CNN built from fixed seeds, no downloaded weights.

    python -m examples.image_classifier.model classifier.keras

224 x 224 x 3 uint8 pixels in ("pixels"), 10 probabilities out ("probabilities"). Its first
convolution has stride 4, so that the model costs a small part of what decoding and resizing a
640 x 480 JPEG does (about 6 MFLOP a photo): the benchmark measures the path around the model.
It builds and saves in a second or two on a CPU, on either Keras backend.
"""

from __future__ import annotations

import sys

import keras

from examples.image_classifier.handler import LABELS, SIZE

SEED = 56


def build(seed: int = SEED) -> keras.Model:
    def init(offset: int) -> keras.initializers.Initializer:
        return keras.initializers.GlorotUniform(seed=seed + offset)

    pixels = keras.Input((SIZE, SIZE, 3), dtype="uint8", name="pixels")
    x = keras.layers.Rescaling(1 / 255.0)(pixels)
    x = keras.layers.Conv2D(8, 4, strides=4, activation="relu", kernel_initializer=init(0))(x)
    x = keras.layers.Conv2D(16, 3, strides=2, activation="relu", kernel_initializer=init(1))(x)
    x = keras.layers.Conv2D(32, 3, strides=2, activation="relu", kernel_initializer=init(2))(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    # Wide weights spread the scores (top-5 gaps of 0.007 or more on the benchmark's photos), so
    # that the order of the top 5 does not hang on rounding, whatever the batch size.
    logits = keras.layers.Dense(len(LABELS), kernel_initializer=keras.initializers.RandomNormal(stddev=3.0,
                                                                                                seed=seed + 3))(x)
    probabilities = keras.layers.Softmax(name="probabilities")(logits)
    return keras.Model(pixels, probabilities, name="image_classifier")


if __name__ == "__main__":
    build().save(sys.argv[1])
