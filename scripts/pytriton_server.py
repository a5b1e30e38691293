"""PyTriton around a saved Keras model: Triton's own server and dynamic batcher, for the peers benchmark.

    .venv-pytriton/bin/python scripts/pytriton_server.py --model-path wide.keras --http-port 8000 --grpc-port 8001

Runs in a virtualenv of its own (requirements-pytriton.txt: nvidia-pytriton pins its own numpy and
protobuf). The model is served as "default" under the Keras model's own input and output names, as
this server shows them over v2; the callable is a compiled tf.function over a batch, like the server's.

With --photos (the handler benchmark) the model is the image example's (examples/image_classifier/):
the input is "image_bytes", BYTES of per-row shape [1] (Triton's dims may not be empty, so one photo
is a [1, 1] request), and the callable decodes each photo of the batch in turn with the example
handler's own `decode`, predicts once and answers the handler's "labels" and "scores".
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import sysconfig
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def features_binding(model: Any) -> dict[str, Any]:
    """The Keras model's own inputs and outputs, rows of float32 in."""
    import numpy as np
    import tensorflow as tf
    from pytriton.decorators import batch
    from pytriton.model_config import Tensor

    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise SystemExit("one input and one output only")
    (given,), (answered,) = model.inputs, model.outputs
    input_name, output_name = given.name, model.output_names[0]
    row_shape = tuple(given.shape[1:])
    predict = tf.function(lambda rows: model(rows, training=False),
                          input_signature=[tf.TensorSpec((None, *row_shape), tf.float32)])

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        return {output_name: predict(inputs[input_name]).numpy()}

    return {"infer_func": infer, "inputs": [Tensor(name=input_name, dtype=np.float32, shape=row_shape)],
            "outputs": [Tensor(name=output_name, dtype=np.float32, shape=tuple(answered.shape[1:]))]}


def photos_binding(model: Any) -> dict[str, Any]:
    """The image example: photo bytes in, decoded in the callable; its top labels and scores out."""
    import numpy as np
    import tensorflow as tf
    from pytriton.decorators import batch
    from pytriton.model_config import Tensor

    sys.path.insert(0, str(REPO))  # the examples package
    from examples.image_classifier import handler

    predict = tf.function(lambda pixels: model(pixels, training=False),
                          input_signature=[tf.TensorSpec((None, handler.SIZE, handler.SIZE, 3), tf.uint8)])

    @batch
    def infer(image_bytes: np.ndarray) -> dict[str, np.ndarray]:
        pixels = np.stack([handler.decode(bytes(row[0])) for row in image_bytes])
        answer = handler.postprocess({"probabilities": predict(pixels).numpy()}, {}, {})
        return {"labels": answer["labels"].astype(np.bytes_), "scores": answer["scores"]}

    return {"infer_func": infer, "inputs": [Tensor(name="image_bytes", dtype=np.bytes_, shape=(1,))],
            "outputs": [Tensor(name="labels", dtype=np.bytes_, shape=(handler.TOP,)),
                        Tensor(name="scores", dtype=np.float32, shape=(handler.TOP,))]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--model-name", default="default")
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--photos", action="store_true", help="the image example: photo bytes in, decoded here")
    args = parser.parse_args()
    # SIGTERM as SystemExit: the Triton context then stops tritonserver instead of orphaning it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    # Triton's Python backend stub links libpython3.X.so.1.0 and takes whichever the loader finds
    # first, the system's by default: a patch release other than this interpreter's fails against
    # this one's standard library (multiprocessing's resource_tracker, 3.11.2's library against
    # 3.11.7's modules). This interpreter's own library first; tritonserver and the stub inherit it.
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and sysconfig.get_config_var("Py_ENABLE_SHARED"):
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))

    import keras
    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.triton import Triton, TritonConfig

    model = keras.models.load_model(args.model_path, compile=False)
    binding = (photos_binding if args.photos else features_binding)(model)
    # Every address on loopback: metrics too, which Triton would otherwise bind on 0.0.0.0.
    config = TritonConfig(http_address="127.0.0.1", http_port=args.http_port, grpc_address="127.0.0.1",
                          grpc_port=args.grpc_port, allow_metrics=False)
    with Triton(config=config) as triton:
        # A batch as soon as the model is free, up to the server's largest: its own default.
        triton.bind(model_name=args.model_name, **binding,
                    config=ModelConfig(max_batch_size=args.max_batch_size,
                                       batcher=DynamicBatcher(max_queue_delay_microseconds=0)))
        triton.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
