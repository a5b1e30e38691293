"""TensorFlow Serving's REST API: predict (a shortcut and TF Serving's URLs, by version or label),
classify and regress, model status and metadata, and health.

A handler parses the URL and the JSON body, builds the request's Call from its exchange, hands
it to the request layer (app/core/serving.py) with the decoding of its inputs, and encodes the
answer; resolution, limits, the deadline and the shape of answers are the layer's. `ROUTES` is
the door's one table (app/http/routes.py): Flask's rules and the direct router's come from it.
"""

from __future__ import annotations

import gc
import os
from typing import Any, cast

import orjson
from flask import current_app

from app.core.batching import Tensors, check_rows
from app.core.call import ModelSpec
from app.core.models import Signature
from app.core.services import Services
from app.core.serving import Answer
from app.http import bodies
from app.http.layers import HttpExchange
from app.http.routes import HttpApp, Reply, Route
from app.wire import classify, codec, metadata, priority

_MODEL = "/v1/models/<model_name:name>"
# A model by name (its newest version), by version or by label: the rules' three prefixes.
_MODELS = (_MODEL, f"{_MODEL}/versions/<int:version>", f"{_MODEL}/labels/<model_name:label>")


def predict(services: Services, exchange: HttpExchange, name: str | None = None, version: int | None = None,
            label: str | None = None) -> Reply:
    """Parse, queue, wait, answer: the request thread never touches TensorFlow."""
    # Like TensorFlow Serving, the body is JSON whatever its Content-Type says.
    parsed = codec.parse_request(bodies.body(exchange))

    def decode(signature: Signature, max_rows: int) -> Tensors:
        check_rows(parsed.rows, max_rows)  # before any array is built
        return codec.decode_inputs(parsed, signature)

    call = exchange.call(ModelSpec(name, version, label), signature=parsed.signature_name,
                         priority=_priority(exchange.environ))
    answer = services.layer.infer(call, decode)
    return _reply(answer, codec.encode_response(answer.outputs, answer.signature, parsed))


def classify_examples(services: Services, exchange: HttpExchange, name: str, version: int | None = None,
                      label: str | None = None) -> Reply:
    return _examples(services, exchange, ModelSpec(name, version, label), classify.CLASSIFY)


def regress_examples(services: Services, exchange: HttpExchange, name: str, version: int | None = None,
                     label: str | None = None) -> Reply:
    return _examples(services, exchange, ModelSpec(name, version, label), classify.REGRESS)


def _examples(services: Services, exchange: HttpExchange, spec: ModelSpec, method: str) -> Reply:
    signature_name, examples = classify.parse(bodies.body(exchange), method)
    call = exchange.call(spec, signature=signature_name, priority=_priority(exchange.environ))
    decode = classify.examples_decode(examples)
    if method == classify.CLASSIFY:
        answer, classes = classify.classify(services.layer, call, decode)
        return _reply(answer, classify.encode_classes(classes))
    answer, values = classify.regress(services.layer, call, decode)
    return _reply(answer, classify.encode_regressions(values))


def _reply(answer: Answer, body: bytes) -> Reply:
    return Reply(body, [
        ("X-Batch-Size", str(answer.batch_rows)),
        ("X-Batch-Requests", str(answer.batch_requests)),
        ("X-Model-Version", str(answer.servable.model.version)),
    ])


def model_status(services: Services, exchange: HttpExchange, name: str, version: int | None = None,
                 label: str | None = None) -> Reply:
    statuses = services.layer.model_status(ModelSpec(name, version, label))
    return Reply(orjson.dumps({"model_version_status": statuses}))


def model_metadata(services: Services, exchange: HttpExchange, name: str, version: int | None = None,
                   label: str | None = None) -> Reply:
    servable = services.layer.model(ModelSpec(name, version, label))
    return Reply(orjson.dumps(metadata.describe(servable.model)))


def healthz(services: Services, exchange: HttpExchange) -> Reply:
    # Liveness: a worker whose batch thread died is replacing itself; until it is gone it is not alive.
    broken = sorted({batcher.info.name for servable in services.registry.servables()
                     for batcher in servable.batchers.values() if batcher.broken})
    if broken:
        return Reply(orjson.dumps({"error": f"the batch thread of model(s) {broken} died"}), status=503)
    return Reply(b'{"status":"alive"}')


def readyz(services: Services, exchange: HttpExchange) -> Reply:
    registry = services.registry
    ready = registry.ready
    # File paths and the pid tell an attacker about the host: shown only when asked for.
    detail = services.settings.readyz_detail
    models = {name: servable.status() for name, servable in registry.items()}
    if not detail:
        for status in models.values():
            status.pop("source", None)
    body = {
        "ready": ready,
        "tensorflow": services.tensorflow,
        "large_bodies_in_flight": cast(HttpApp, current_app).body_limits.large_bodies_in_flight,
        # Objects start-up left out of the garbage collector's full passes (runtime.freeze_heap).
        "gc_frozen_objects": gc.get_freeze_count(),
        "models": models,
    }
    if detail:
        body["pid"] = os.getpid()
    return Reply(orjson.dumps(body), status=200 if ready else 503)


ROUTES = [
    Route("POST", "/predict", predict, direct=True),
    *(Route("POST", f"{prefix}:predict", predict, direct=True) for prefix in _MODELS),
    *(Route("POST", f"{prefix}:classify", classify_examples) for prefix in _MODELS),
    *(Route("POST", f"{prefix}:regress", regress_examples) for prefix in _MODELS),
    *(Route("GET", prefix, model_status) for prefix in _MODELS),
    *(Route("GET", f"{prefix}/metadata", model_metadata) for prefix in _MODELS),
    Route("GET", "/healthz", healthz),
    Route("GET", "/readyz", readyz),
]


# The WSGI name of the X-Priority header: read from the environ as request.headers would read it.
_PRIORITY_KEY = "HTTP_" + priority.HEADER.upper().replace("-", "_")


def _priority(environ: dict[str, Any]) -> int:
    """The TF Serving REST request's priority level, from its X-Priority header (0: the model's default)."""
    return priority.from_header(environ.get(_PRIORITY_KEY))
