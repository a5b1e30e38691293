"""LitServe serving the image example's own decode / predict / encode through its batching API.

    .venv-litserve/bin/python scripts/litserve_server.py --model-path classifier.keras --port 8011 --workers 1

For `python -m scripts.benchmark handler`: the peer issue 56 names, in a virtualenv of its own
(requirements-litserve.txt: litserve pulls fastapi, uvicorn and pyzmq; Keras and tensorflow-cpu as
the server's, so that both run the same saved model alike). It takes the body this server's TF
Serving REST door takes, {"instances": [{"b64": "..."}]} with one photo, and answers
{"predictions": [{"labels": [...], "scores": [...]}]}, as that door does.

Where each function runs (LitServe 0.2.19, loops/simple_loops.py BatchedLoop): the API servers
(uvicorn processes, by default one per inference worker) parse the JSON and put it on one
multiprocessing.Manager queue; each of --workers inference processes takes up to --max-batch-size
requests off it, then runs decode_request for each in turn, batch (np.stack), predict once,
unbatch and encode_response for each, all in that one process. One exception in any of them fails
every request of that batch. With batch_timeout 0 (its default) an idle inference process polls
the queue without pause.

Stopping: signal the whole process group. SIGTERM to the main process alone left it and an API
server running 30 s later, with BrokenPipeError in the log (scripts/benchmark/handler.py).
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the examples package

import litserve as ls  # noqa: E402
from fastapi import HTTPException  # noqa: E402

from examples.image_classifier import handler  # noqa: E402


class PhotoAPI(ls.LitAPI):
    def __init__(self, model_path: str, threads: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model_path = model_path
        self.threads = threads

    def setup(self, device: str) -> None:
        import keras
        import tensorflow as tf

        # TensorFlow's pools as the server sizes them: usable CPUs / inference processes.
        tf.config.threading.set_intra_op_parallelism_threads(self.threads)
        tf.config.threading.set_inter_op_parallelism_threads(self.threads)
        model = keras.models.load_model(self.model_path, compile=False)
        spec = tf.TensorSpec((None, handler.SIZE, handler.SIZE, 3), tf.uint8)
        self.model = tf.function(lambda pixels: model(pixels, training=False), input_signature=[spec])
        self.model(np.zeros((1, handler.SIZE, handler.SIZE, 3), np.uint8))  # traced before the first request

    # No annotation on `request`: LitServe hands FastAPI the annotation as the body's type (a dict
    # annotation became a query parameter); without one it passes the parsed JSON.
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        instances = request.get("instances") if isinstance(request, dict) else None
        if not isinstance(instances, list) or len(instances) != 1 or not isinstance(instances[0], dict) \
                or not isinstance(instances[0].get("b64"), str):
            raise HTTPException(400, 'expected {"instances": [{"b64": "..."}]} with one photo')
        try:
            return handler.decode(base64.b64decode(instances[0]["b64"], validate=True))
        except ValueError as exc:  # binascii.Error is a ValueError too
            raise HTTPException(400, str(exc)) from None

    def predict(self, pixels: np.ndarray) -> np.ndarray:
        return self.model(pixels).numpy()  # one row per request; the default unbatch lists them

    def encode_response(self, probabilities: np.ndarray) -> dict[str, Any]:
        answer = handler.postprocess({"probabilities": probabilities[None]}, {}, {})
        return {"predictions": [{"labels": [label.decode() for label in answer["labels"][0]],
                                 "scores": answer["scores"][0].tolist()}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1, help="inference processes (workers_per_device on cpu)")
    parser.add_argument("--api-servers", type=int, default=None, help="uvicorn processes; default: one per worker")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-timeout", type=float, default=0.0, help="seconds; 0 is LitServe's default")
    args = parser.parse_args()
    threads = max(1, len(os.sched_getaffinity(0)) // args.workers)
    api = PhotoAPI(str(Path(args.model_path).resolve()), threads, max_batch_size=args.max_batch_size,
                   batch_timeout=args.batch_timeout)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=args.workers, timeout=30)
    server.run(host="127.0.0.1", port=args.port, num_api_servers=args.api_servers, generate_client_file=False,
               log_level="warning")


if __name__ == "__main__":
    main()
