"""An image classifier's handler: JPEG or PNG bytes in, the top 5 labels and their scores out.

    MODEL_PATH=examples/models/image_classifier.keras MODEL_HANDLER=examples.image_classifier.handler \
        .venv/bin/gunicorn -c gunicorn.conf.py wsgi:app
    curl -d "{\"instances\": [{\"b64\": \"$(base64 -w0 photo.jpg)\"}]}" localhost:8000/v1/models/default:predict

Clients send the photo's bytes (TF Serving REST: {"b64": ...}; v2: a BYTES tensor); the model
(model.py) takes 224 x 224 RGB pixels as uint8 and answers 10 class probabilities. This module
imports numpy and Pillow only, never Keras: with MODEL_PROCESSES it runs in workers that have no
TensorFlow. Each function runs on the request's own thread, never on the batch thread.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

SIZE = 224  # the model's input: SIZE x SIZE x 3, uint8
TOP = 5
LABELS = ("apple", "banana", "bread", "carrot", "cheese", "egg", "lemon", "milk", "onion", "tomato")
_LABELS = np.array([label.encode() for label in LABELS], dtype=object)
# Pillow refuses larger images with DecompressionBombError; a camera sends 640 x 480.
Image.MAX_IMAGE_PIXELS = 4096 * 4096

# What clients see: per-row shapes (the batch dimension is implied), "bytes" for strings.
signature = {
    "inputs": {"image_bytes": {"dtype": "bytes", "shape": []}},
    "outputs": {"labels": {"dtype": "bytes", "shape": [TOP]}, "scores": {"dtype": "float32", "shape": [TOP]}},
}


def decode(data: bytes) -> np.ndarray:
    """One photo as the model's pixels; ValueError (the client's 400) for anything not a JPEG or PNG."""
    try:
        with Image.open(io.BytesIO(data), formats=("JPEG", "PNG")) as image:
            rgb = image.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    except Image.UnidentifiedImageError:  # an OSError, whose message names a Python object
        raise ValueError("image_bytes is not a JPEG or PNG image") from None
    except (OSError, Image.DecompressionBombError) as exc:  # a truncated file, say
        raise ValueError(f"image_bytes is a JPEG or PNG image Pillow cannot read: {exc}") from None
    return np.asarray(rgb, dtype=np.uint8)


def preprocess(inputs: dict[str, np.ndarray], parameters: dict[str, Any]) -> dict[str, np.ndarray]:
    """A request's photos (an object array of bytes, one per row) as the model's input rows."""
    return {"pixels": np.stack([decode(data) for data in inputs["image_bytes"]])}


def postprocess(outputs: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
                parameters: dict[str, Any]) -> dict[str, np.ndarray]:
    """The request's probability rows as its top labels (bytes) and scores, best first."""
    probabilities = outputs["probabilities"]
    top = np.argsort(-probabilities, axis=1, kind="stable")[:, :TOP]
    return {"labels": _LABELS[top], "scores": np.take_along_axis(probabilities, top, axis=1).astype(np.float32)}
