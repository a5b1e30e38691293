"""The text model's custom Keras layer, registered serializable: loading the saved model needs it.

Without this module imported, `keras.models.load_model` fails with "Could not locate class
'Scale'"; the handler's `custom_objects()` imports it in the process that loads the model (the
worker, or with MODEL_PROCESSES the model process), on either backend (keras.ops only).
"""

from __future__ import annotations

from typing import Any

import keras


@keras.saving.register_keras_serializable(package="text_example")
class Scale(keras.layers.Layer):
    """Logits times a learned scale, divided by the temperature of the call.

    One temperature per call, read from the batch's first row, as a sampler reads one number of
    steps per call: rows of different temperatures must not share a call. The handler's batch
    key keeps them apart; without it a mixed batch would answer some rows at another's temperature.
    """

    def __init__(self, initial: float = 1.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.initial = initial

    def build(self, input_shape: Any) -> None:
        self.scale = self.add_weight(shape=(), initializer=keras.initializers.Constant(self.initial), name="scale")

    def call(self, logits: Any, temperature: Any) -> Any:
        return logits * self.scale / temperature[0]

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "initial": self.initial}
