"""The manual's example models and files, built here from fixed seeds: nothing is downloaded.

    .venv/bin/python examples/make_models.py

writes examples/models/ (git-ignored; made afresh each time), which the manual's commands name,
run from the repository's root as every command there is:

    my_model.keras       4 features in, 3 scores out (getting started)
    classifier.keras     4 features in, 3 class probabilities out (configuration, Keras on JAX)
    multi.keras          inputs a (3 values) and b (2), outputs prob and score (API)
    ranker/1, ranker/2   SavedModels of 4 features in, 3 scores out (versions and labels)
    half_plus_two/1, half_plus_three/1
                         TF Serving's example models: y = 0.5 x + 2, y = 0.5 x + 3
    models.config, batching.config
                         TF Serving's ModelServerConfig and BatchingParameters for them
    *.json               the MODEL_CONFIG files the manual shows
    image_classifier.keras, photo.jpg
                         the handler example's CNN (examples/image_classifier/) and a 640 x 480 photo
    text_classifier.keras
                         the handler example's text model, with a custom layer (examples/text_classifier/)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# TensorFlow's native start-up lines, before it is first imported: noise for this script.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from scripts.export_saved_model import export  # noqa: E402
from scripts.tfs_models import save_half_plus_three_tf1, save_half_plus_two_tf1  # noqa: E402

MODELS = REPO / "examples" / "models"
# Relative to the repository's root, where the manual's commands run.
FOLDER = "examples/models"

MODELS_CONFIG = f"""\
model_config_list {{
  config {{ name: "half_plus_two" base_path: "{FOLDER}/half_plus_two" model_platform: "tensorflow" }}
  config {{ name: "half_plus_three" base_path: "{FOLDER}/half_plus_three" model_platform: "tensorflow" }}
}}
"""
BATCHING_CONFIG = """\
max_batch_size { value: 32 }
batch_timeout_micros { value: 1000 }
max_enqueued_batches { value: 16 }
"""
# MODEL_CONFIG files, by name: each is shown on the page that explains it (tests/test_manual_runs.py
# checks that the page shows this file).
CONFIGS = {
    # configuration.md: several models, the default first.
    "several.json": {"default": "ranker",
                     "models": [{"name": "ranker", "path": f"{FOLDER}/ranker", "max_batch_size": 64,
                                 "batch_timeout_ms": 2},
                                {"name": "classifier", "path": f"{FOLDER}/classifier.keras"}]},
    # configuration.md: versions and labels.
    "ranker.json": {"models": [{"name": "ranker", "path": f"{FOLDER}/ranker",
                                "model_version_policy": {"specific": {"versions": [1, 2]}},
                                "version_labels": {"stable": 1, "canary": 2}}]},
    # batching.md: priority levels.
    "priority.json": {"models": [{"name": "ranker", "path": f"{FOLDER}/ranker", "priority_levels": 2,
                                  "default_priority_level": 2,
                                  "priority_queue_policy": {"2": {"max_queue_size": 256,
                                                                  "default_timeout_microseconds": 5000000}}}]},
    # handlers.md: the two handler examples.
    "handlers.json": {"default": "image", "models": [
        {"name": "image", "path": f"{FOLDER}/image_classifier.keras", "handler": "examples.image_classifier.handler"},
        {"name": "text", "path": f"{FOLDER}/text_classifier.keras", "handler": "examples.text_classifier.handler"}]},
    # api.md: the built-in model as `default`, a model of two inputs and two outputs, and a
    # regress signature.
    "api.json": {"models": [{"name": "default"}, {"name": "multi", "path": f"{FOLDER}/multi.keras"},
                            {"name": "half_plus_three", "path": f"{FOLDER}/half_plus_three"}]},
}


def dense_model(*, seed: int, activation: str | None = None):
    """4 features -> 16 hidden units -> 3 outputs, weights drawn from numpy (the same model on any backend)."""
    import keras

    rng = np.random.default_rng(seed)
    inputs = keras.Input((4,), name="features")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")
    output = keras.layers.Dense(3, activation=activation, name="probabilities" if activation else "scores")
    model = keras.Model(inputs, output(hidden(inputs)))
    for layer, shape in ((hidden, (4, 16)), (output, (16, 3))):
        layer.set_weights([rng.uniform(-0.5, 0.5, shape).astype("float32"), np.zeros(shape[1], "float32")])
    return model


def multi_model(*, seed: int):
    """Inputs a (3 values) and b (2) -> outputs prob (a probability) and score."""
    import keras

    rng = np.random.default_rng(seed)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    joined = keras.layers.Concatenate(name="joined")([a, b])
    prob = keras.layers.Dense(1, activation="sigmoid", name="prob")
    score = keras.layers.Dense(1, name="score")
    model = keras.Model([a, b], [prob(joined), score(joined)])
    for layer in (prob, score):
        layer.set_weights([rng.uniform(-0.5, 0.5, (5, 1)).astype("float32"), np.zeros(1, "float32")])
    return model


def tf_serving_model(save, base: Path) -> None:
    """A TF Serving example model as version 1 of `base`, without the asset sources its builder leaves."""
    save(base / "1")
    for leftover in base.glob(".assets-*"):
        shutil.rmtree(leftover)


def handler_examples() -> None:
    """The handlers page's models (docs/handlers.md) and a photo for its curl lines."""
    from examples.image_classifier import model as image_classifier
    from examples.image_classifier import photos
    from examples.text_classifier import model as text_classifier

    image_classifier.build().save(MODELS / "image_classifier.keras")
    text_classifier.build().save(MODELS / "text_classifier.keras")
    (MODELS / "photo.jpg").write_bytes(photos.photo(0))


def main() -> None:
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")  # the TF1 builders' deprecation warnings
    if MODELS.exists():
        shutil.rmtree(MODELS)
    MODELS.mkdir(parents=True)
    dense_model(seed=1).save(MODELS / "my_model.keras")
    dense_model(seed=3, activation="softmax").save(MODELS / "classifier.keras")
    multi_model(seed=4).save(MODELS / "multi.keras")
    export(str(MODELS / "my_model.keras"), MODELS / "ranker", 1)
    with tempfile.TemporaryDirectory() as staging:
        dense_model(seed=2).save(Path(staging) / "ranker-2.keras")
        export(str(Path(staging) / "ranker-2.keras"), MODELS / "ranker", 2)
    tf_serving_model(save_half_plus_two_tf1, MODELS / "half_plus_two")
    tf_serving_model(save_half_plus_three_tf1, MODELS / "half_plus_three")
    (MODELS / "models.config").write_text(MODELS_CONFIG)
    (MODELS / "batching.config").write_text(BATCHING_CONFIG)
    for name, config in CONFIGS.items():
        (MODELS / name).write_text(json.dumps(config, indent=1) + "\n")
    handler_examples()
    print(f"wrote {FOLDER}/: {', '.join(sorted(path.name for path in MODELS.iterdir()))}")


if __name__ == "__main__":
    main()
