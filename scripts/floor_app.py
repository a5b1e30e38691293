"""The floor under the server's own work: Gunicorn and Flask with nothing of app/ in a request.

    GRPC_BIND= gunicorn -c gunicorn.conf.py --pythonpath scripts floor_app:app   # the floor scenario runs it
    GRPC_BIND= FLOOR_BATCHER=true gunicorn -c gunicorn.conf.py --pythonpath scripts floor_app:app

Gunicorn reads the request, Flask routes it, the view parses the JSON body (orjson), hands the
request to a model thread, waits, and answers a fixed body of a real answer's size: no request
ids, access lines, metrics, limits, decoding, padding or encoding. The model thread runs the
model's compiled predict on a seeded row per waiting request, padded to the server's buckets, at
most MAX_BATCH_SIZE a call, so request threads compete with TensorFlow as in the server; it does
not hold a batch to fill. With FLOOR_BATCHER=true the model thread is the server's own Batcher.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np
import orjson
from flask import Flask, Response, request

from app.core.batching import Batcher, bucket_sizes
from app.core.call import Call
from app.core.models import example_batch, load_model, warm_up
from app.ops.settings import Settings
from app.wire import metadata

settings = Settings.from_env()
model = load_model(settings.model_path, name=settings.model_name)
BUCKETS = bucket_sizes(settings.max_batch_size)
warm_up(model, BUCKETS)
# Seeded values, not example_batch's zeros: a zero row would give a short answer.
BATCH = {name: np.random.default_rng(0).standard_normal(zeros.shape).astype(zeros.dtype) if zeros.dtype.kind == "f"
         else zeros for name, zeros in example_batch(model, settings.max_batch_size).items()}
# One row of the first output, float32 written as the server writes it: a real answer's size.
ANSWER = orjson.dumps({"predictions": next(iter(model.predict(BATCH).values()))[:1]},
                      option=orjson.OPT_SERIALIZE_NUMPY)
METADATA = orjson.dumps(metadata.describe(model))


class ModelThread:
    """One predict call at a time; a request waits for a call that starts after it arrived. A failed call
    fails the requests it was for (their views answer 500) and the thread goes on: nothing hangs on it."""

    def __init__(self, predict: Callable[[int], object], buckets: Sequence[int]) -> None:
        self._predict = predict
        self._buckets = tuple(buckets)
        self._ready = threading.Condition()
        self._waiting: list[Future[None]] = []
        threading.Thread(target=self._run, name="floor-model", daemon=True).start()

    def wait(self, timeout_s: float | None = None) -> None:
        done: Future[None] = Future()
        with self._ready:
            self._waiting.append(done)
            self._ready.notify()
        done.result(timeout_s)

    def _run(self) -> None:
        largest = self._buckets[-1]
        while True:
            with self._ready:
                while not self._waiting:
                    self._ready.wait()
                taken, self._waiting = self._waiting[:largest], self._waiting[largest:]
            try:
                self._predict(next(size for size in self._buckets if size >= len(taken)))
            except Exception as exc:  # noqa: BLE001 - handed to the requests it was for
                for done in taken:
                    done.set_exception(exc)
            else:
                for done in taken:
                    done.set_result(None)


app = Flask(__name__)
if os.environ.get("FLOOR_BATCHER", "").lower() == "true":
    batcher = Batcher(model.predict, name=settings.model_name, max_batch_size=settings.max_batch_size,
                      buckets=BUCKETS)
    ONE_ROW = {name: batch[:1] for name, batch in BATCH.items()}
    CALL = Call()

    def wait_for_the_model() -> None:
        batcher.submit(CALL, ONE_ROW).result()
else:
    wait_for_the_model = ModelThread(
        lambda rows: model.predict({name: batch[:rows] for name, batch in BATCH.items()}), BUCKETS).wait


@app.post("/predict")
def predict() -> Response:
    orjson.loads(request.get_data())
    wait_for_the_model()
    return Response(ANSWER, content_type="application/json")


@app.get(f"/v1/models/{settings.model_name}/metadata")
def model_metadata() -> Response:
    return Response(METADATA, content_type="application/json")


@app.get("/readyz")
def readyz() -> Response:
    tensorflow = getattr(app, "tensorflow", {})  # gunicorn.conf.py's post_worker_init sets it
    return Response(orjson.dumps({"status": "ready", "pid": os.getpid(), "tensorflow": tensorflow}),
                    content_type="application/json")
