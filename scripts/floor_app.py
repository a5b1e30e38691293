"""The floor under the server's own work: Gunicorn and Flask with nothing of app/ in a request.

    GRPC_BIND= gunicorn -c gunicorn.conf.py --pythonpath scripts floor_app:app   # as profile_worker.py runs it

What a request costs here is what any batching server on Flask and Gunicorn's gthread worker
pays, whatever its own code: Gunicorn reads and parses the request, Flask routes it, the
view parses the JSON body (orjson), hands the request to a model thread and waits for it,
and answers with a fixed body of the size a real answer has. There are no request ids, access
lines, metrics, body limits, float32 decoding, padding, splitting or encoding.

The model thread runs the served model's own compiled predict function, on a full batch,
whenever requests wait, and releases those that waited when the call began. So, as in the
server, a call streams the weights through the caches between one batch of requests and the
next, and request threads compete with TensorFlow for the cores: the floor is measured under
the server's conditions, not on an idle machine. Its rows are fixed (a full batch of seeded
random rows): the floor's answers are not the model's answers to the requests.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import orjson
from flask import Flask, Response, request

from app import metadata, runtime
from app.models import example_batch, load_model, warm_up
from app.settings import Settings

settings = Settings.from_env()
model = load_model(settings.model_path, name=settings.model_name)
warm_up(model, [settings.max_batch_size])
# Seeded values, not example_batch's zeros: a zero row would give a short answer.
BATCH = {name: np.random.default_rng(0).standard_normal(zeros.shape).astype(zeros.dtype) if zeros.dtype.kind == "f"
         else zeros for name, zeros in example_batch(model, settings.max_batch_size).items()}
# One row of the first output, float32 written as the server writes it: a real answer's size.
ANSWER = orjson.dumps({"predictions": next(iter(model.predict(BATCH).values()))[:1]},
                      option=orjson.OPT_SERIALIZE_NUMPY)
METADATA = orjson.dumps(metadata.describe(model))


class ModelThread:
    """One predict call at a time; a request waits for the next call that starts after it."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._waiting: list[threading.Event] = []
        threading.Thread(target=self._run, name="floor-model", daemon=True).start()

    def wait(self) -> None:
        done = threading.Event()
        with self._ready:
            self._waiting.append(done)
            self._ready.notify()
        done.wait()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._waiting:
                    self._ready.wait()
                taken, self._waiting = self._waiting, []
            model.predict(BATCH)
            for done in taken:
                done.set()


app = Flask(__name__)
model_thread = ModelThread()


@app.post("/predict")
def predict() -> Response:
    orjson.loads(request.get_data())
    model_thread.wait()
    return Response(ANSWER, content_type="application/json")


@app.get(f"/v1/models/{settings.model_name}/metadata")
def model_metadata() -> Response:
    return Response(METADATA, content_type="application/json")


@app.get("/readyz")
def readyz() -> Response:
    return Response(orjson.dumps({"status": "ready", "pid": os.getpid(), "tensorflow": runtime.configured()}),
                    content_type="application/json")
