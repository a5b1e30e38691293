"""HTTP routes: predict (a shortcut and TensorFlow Serving's URLs, by version or label),
classify and regress, model status and metadata, and health.

A view parses the URL and the JSON body, builds the request's Call, hands it to the request
layer (app/core/serving.py) with the decoding of its inputs, and encodes the answer; resolution,
limits, the deadline and the shape of answers are the layer's."""

from __future__ import annotations

import gc
import os
from typing import Any

import orjson
from flask import Blueprint, Flask, Response, current_app, request
from werkzeug.routing import BaseConverter, IntegerConverter

from app.core.batching import Tensors, check_rows
from app.core.call import ModelSpec
from app.core.models import Signature
from app.core.serving import CLASSIFY, REGRESS, Answer, RequestLayer, examples_decode
from app.http import bodies as limits
from app.http.layers import HttpExchange, exchange_of
from app.http.routes import Reply, Route, services
from app.ops.settings import MODEL_NAME_PATTERN
from app.wire import classify, codec, metadata, priority

bp = Blueprint("api", __name__)


class ModelNameConverter(BaseConverter):
    # Stops at ':' so that '/v1/models/<name>:predict' parses; the name never reaches a path.
    regex = MODEL_NAME_PATTERN.pattern.strip("^$")


class AsciiIntConverter(IntegerConverter):
    regex = r"[0-9]+"


def _json(body: bytes, status: int = 200, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(body, status=status, content_type="application/json", headers=headers)


def predict(layer: RequestLayer, exchange: HttpExchange, spec: ModelSpec) -> Reply:
    """Parse, queue, wait, answer: the request thread never touches TensorFlow."""
    # Like TensorFlow Serving, the body is JSON whatever its Content-Type says.
    parsed = codec.parse_request(limits.body(exchange))

    def decode(signature: Signature, max_rows: int) -> Tensors:
        check_rows(parsed.rows, max_rows)  # before any array is built
        return codec.decode_inputs(parsed, signature)

    call = exchange.call(spec, signature=parsed.signature_name, priority=_priority(exchange.environ))
    answer = layer.infer(call, decode)
    return _reply(answer, codec.encode_response(answer.outputs, answer.signature, parsed))


def _classify_or_regress(spec: ModelSpec, method: str) -> Response:
    layer, exchange = services().layer, exchange_of(request.environ)
    signature_name, examples = classify.parse(limits.body(exchange), method)
    call = exchange.call(spec, signature=signature_name, priority=_priority(exchange.environ))
    decode = examples_decode(examples)
    if method == CLASSIFY:
        answer, classes = layer.classify(call, decode)
        return _reply(answer, classify.encode_classes(classes)).response()
    answer, values = layer.regress(call, decode)
    return _reply(answer, classify.encode_regressions(values)).response()


def _reply(answer: Answer, body: bytes) -> Reply:
    return Reply(body, [
        ("X-Batch-Size", str(answer.batch_rows)),
        ("X-Batch-Requests", str(answer.batch_requests)),
        ("X-Model-Version", str(answer.servable.model.version)),
    ])


# The predict URLs as app/http/routes.py matches them, without Flask per request.
_NAME = ModelNameConverter.regex
PREDICT_ROUTES = [
    Route("/predict", "/predict", lambda layer, exchange, _: predict(layer, exchange, ModelSpec())),
    Route("/v1/models/<model_name:name>:predict", rf"/v1/models/({_NAME}):predict",
          lambda layer, exchange, groups: predict(layer, exchange, ModelSpec(groups[0]))),
    Route("/v1/models/<model_name:name>/versions/<int:version>:predict",
          rf"/v1/models/({_NAME})/versions/({AsciiIntConverter.regex}):predict",
          lambda layer, exchange, groups: predict(layer, exchange, ModelSpec(groups[0], int(groups[1])))),
    Route("/v1/models/<model_name:name>/labels/<model_name:label>:predict",
          rf"/v1/models/({_NAME})/labels/({_NAME}):predict",
          lambda layer, exchange, groups: predict(layer, exchange, ModelSpec(groups[0], label=groups[1]))),
]


# Flask's rules for the same URLs: the other methods' 405 and Allow, /openapi.json, and the
# answer wherever app/http/routes.py is not in front (tests/test_direct.py checks the two agree).
@bp.post("/predict")
def predict_default() -> Response:
    return predict(services().layer, exchange_of(request.environ), ModelSpec()).response()


@bp.post("/v1/models/<model_name:name>:predict")
def predict_model(name: str) -> Response:
    return predict(services().layer, exchange_of(request.environ), ModelSpec(name)).response()


@bp.post("/v1/models/<model_name:name>/versions/<int:version>:predict")
def predict_version(name: str, version: int) -> Response:
    return predict(services().layer, exchange_of(request.environ), ModelSpec(name, version)).response()


@bp.post("/v1/models/<model_name:name>/labels/<model_name:label>:predict")
def predict_label(name: str, label: str) -> Response:
    return predict(services().layer, exchange_of(request.environ), ModelSpec(name, label=label)).response()


def _tf_example_route(method: str):
    """:classify or :regress, by model, version or label."""
    def route(name: str, version: int | None = None, label: str | None = None) -> Response:
        return _classify_or_regress(ModelSpec(name, version, label), method)

    route.__name__ = method
    for prefix in ("/v1/models/<model_name:name>", "/v1/models/<model_name:name>/versions/<int:version>",
                   "/v1/models/<model_name:name>/labels/<model_name:label>"):
        bp.post(f"{prefix}:{method}")(route)


_tf_example_route(CLASSIFY)
_tf_example_route(REGRESS)


@bp.get("/v1/models/<model_name:name>")
@bp.get("/v1/models/<model_name:name>/versions/<int:version>")
@bp.get("/v1/models/<model_name:name>/labels/<model_name:label>")
def model_status(name: str, version: int | None = None, label: str | None = None) -> Response:
    statuses = services().layer.model_status(ModelSpec(name, version, label))
    return _json(orjson.dumps({"model_version_status": statuses}))


@bp.get("/v1/models/<model_name:name>/metadata")
@bp.get("/v1/models/<model_name:name>/versions/<int:version>/metadata")
@bp.get("/v1/models/<model_name:name>/labels/<model_name:label>/metadata")
def model_metadata(name: str, version: int | None = None, label: str | None = None) -> Response:
    servable = services().layer.model(ModelSpec(name, version, label))
    return _json(orjson.dumps(metadata.describe(servable.model)))


@bp.get("/healthz")
def healthz() -> Response:
    # Liveness: a worker whose batch thread died is replacing itself; until it is gone it is not alive.
    broken = sorted({batcher.info.name for servable in services().registry.servables()
                     for batcher in servable.batchers.values() if batcher.broken})
    if broken:
        return _json(orjson.dumps({"error": f"the batch thread of model(s) {broken} died"}), status=503)
    return _json(b'{"status":"alive"}')


@bp.get("/readyz")
def readyz() -> Response:
    served = services()
    registry = served.registry
    ready = registry.ready
    # File paths and the pid tell an attacker about the host: shown only when asked for.
    detail = served.settings.readyz_detail
    models = {name: servable.status() for name, servable in registry.items()}
    if not detail:
        for status in models.values():
            status.pop("source", None)
    body = {
        "ready": ready,
        "tensorflow": served.tensorflow,
        "large_bodies_in_flight": current_app.body_limits.large_bodies_in_flight,  # type: ignore[attr-defined]
        # Objects start-up left out of the garbage collector's full passes (runtime.freeze_heap).
        "gc_frozen_objects": gc.get_freeze_count(),
        "models": models,
    }
    if detail:
        body["pid"] = os.getpid()
    return _json(orjson.dumps(body), status=200 if ready else 503)


def init_app(app: Flask) -> None:
    app.url_map.converters["model_name"] = ModelNameConverter
    # Versions in ASCII digits only ('\\d' and int() also take '１' and Arabic-Indic digits), and
    # no redirect for '//': Werkzeug's would build its Location from the client's Host header.
    app.url_map.converters["int"] = AsciiIntConverter
    app.url_map.merge_slashes = False
    app.register_blueprint(bp)


# The WSGI name of the X-Priority header: read from the environ as request.headers would read it.
_PRIORITY_KEY = "HTTP_" + priority.HEADER.upper().replace("-", "_")


def _priority(environ: dict[str, Any]) -> int:
    """The TF Serving REST request's priority level, from its X-Priority header (0: the model's default)."""
    return priority.from_header(environ.get(_PRIORITY_KEY))
