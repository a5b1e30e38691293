"""The floor under the server's own work: Gunicorn and Flask with nothing of app/ in a request.

    GRPC_BIND= gunicorn -c gunicorn.conf.py --pythonpath scripts floor_app:app   # as profile_worker.py runs it
    GRPC_BIND= FLOOR_BATCHER=true gunicorn -c gunicorn.conf.py --pythonpath scripts floor_app:app

What a request costs here is what any batching server on Flask and Gunicorn's gthread worker
pays, whatever its own code: Gunicorn reads and parses the request, Flask routes it, the
view parses the JSON body (orjson), hands the request to a model thread and waits for it,
and answers with a fixed body of the size a real answer has. There are no request ids, access
lines, metrics, body limits, float32 decoding, padding, splitting or encoding.

The model thread runs the served model's own compiled predict function whenever requests
wait, on a row for each (one row a request, as Locust sends), padded to the server's bucket
sizes and at most MAX_BATCH_SIZE of them a call, and releases the requests the call was
for. So, as in the server, a call streams the weights through the caches between one batch
of requests and the next, a lone request runs a batch of one, and request threads compete
with TensorFlow for the cores: the floor is measured under the server's conditions, not on
an idle machine. It does not hold a batch to let it fill under load, as the server does.
Its rows are fixed (seeded random rows): the floor's answers are not the model's answers to
the requests.

With FLOOR_BATCHER=true the model thread is the server's own batching engine instead
(app/batching.py's Batcher with the server's defaults, filling under load included), fed one
seeded row a request: what Gunicorn, Flask and the server's batching cost, without the
codec, request ids, access lines, metrics and body limits.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np
import orjson
from flask import Flask, Response, request

from app import metadata
from app.batching import Batcher, bucket_sizes
from app.models import example_batch, load_model, warm_up
from app.settings import Settings

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
    """One predict call at a time; a request waits for a call that starts after it arrived.

    A failed call fails the requests it was for (their views answer 500) and the thread goes
    on: a benchmark against the floor must not hang on it.
    """

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

    def wait_for_the_model() -> None:
        batcher.submit(ONE_ROW).result()
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
    tensorflow = app.extensions.get("tensorflow", {})  # gunicorn.conf.py's post_worker_init sets it
    return Response(orjson.dumps({"status": "ready", "pid": os.getpid(), "tensorflow": tensorflow}),
                    content_type="application/json")
