"""HTTP routes: predict (a shortcut and TensorFlow Serving's URLs, by version or label),
classify and regress, model status and metadata, and health.

A view parses the URL and the JSON body, builds the request's Call, hands it to the request
layer (app/serving.py) with the decoding of its inputs, and encodes the answer; resolution,
limits, the deadline and the shape of answers are the layer's."""

from __future__ import annotations

import gc
import os
from typing import Any

import orjson
from flask import Blueprint, Flask, Response, current_app, request
from werkzeug.routing import BaseConverter, IntegerConverter, ValidationError

from app import classify, codec, limits, metadata, priority
from app.batching import Tensors, check_rows
from app.call import ModelSpec
from app.direct import Reply, Route
from app.errors import unreadable_version
from app.models import Signature
from app.numerals import INT64_MAX, whole_number
from app.registry import get_registry
from app.serving import CLASSIFY, REGRESS, Answer, RequestLayer, examples_decode, get_layer
from app.settings import MODEL_NAME_PATTERN

bp = Blueprint("api", __name__)


class ModelNameConverter(BaseConverter):
    # Stops at ':' so that '/v1/models/<name>:predict' parses; the name never reaches a path.
    regex = MODEL_NAME_PATTERN.pattern.strip("^$")


class AsciiIntConverter(IntegerConverter):
    """A URL's version: ASCII digits up to int64, or no match (app/errors.py then answers TF Serving's 400)."""

    regex = r"[0-9]+"

    def to_python(self, value: str) -> int:
        number = whole_number(value, INT64_MAX)
        if number is None:
            raise ValidationError()
        return number


def _url_version(text: str) -> int:
    number = whole_number(text, INT64_MAX)
    if number is None:
        raise unreadable_version(text)
    return number


def _json(body: bytes, status: int = 200, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(body, status=status, content_type="application/json", headers=headers)


def predict(layer: RequestLayer, environ: dict[str, Any], spec: ModelSpec) -> Reply:
    """Parse, queue, wait, answer: the request thread never touches TensorFlow."""
    # Like TensorFlow Serving, the body is JSON whatever its Content-Type says.
    parsed = codec.parse_request(limits.body(environ))

    def decode(signature: Signature, max_rows: int) -> Tensors:
        check_rows(parsed.rows, max_rows)  # before any array is built
        return codec.decode_inputs(parsed, signature)

    answer = layer.infer(layer.http_call(environ, spec, parsed.signature_name, priority=_priority(environ)), decode)
    return _reply(answer, codec.encode_response(answer.outputs, answer.signature, parsed))


def _classify_or_regress(spec: ModelSpec, method: str) -> Response:
    layer, environ = get_layer(current_app), request.environ
    signature_name, examples = classify.parse(limits.body(environ), method)
    call = layer.http_call(environ, spec, signature_name, priority=_priority(environ))
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


# The predict URLs as app/direct.py matches them, without Flask per request.
_NAME = ModelNameConverter.regex
PREDICT_ROUTES = [
    Route("/predict", "/predict", lambda layer, environ, _: predict(layer, environ, ModelSpec())),
    Route("/v1/models/<model_name:name>:predict", rf"/v1/models/({_NAME}):predict",
          lambda layer, environ, groups: predict(layer, environ, ModelSpec(groups[0]))),
    Route("/v1/models/<model_name:name>/versions/<int:version>:predict",
          rf"/v1/models/({_NAME})/versions/({AsciiIntConverter.regex}):predict",
          lambda layer, environ, groups: predict(layer, environ, ModelSpec(groups[0], _url_version(groups[1])))),
    Route("/v1/models/<model_name:name>/labels/<model_name:label>:predict",
          rf"/v1/models/({_NAME})/labels/({_NAME}):predict",
          lambda layer, environ, groups: predict(layer, environ, ModelSpec(groups[0], label=groups[1]))),
]


# Flask's rules for the same URLs: the other methods' 405 and Allow, /openapi.json, and the
# answer wherever app/direct.py is not in front (tests/test_direct.py checks the two agree).
@bp.post("/predict")
def predict_default() -> Response:
    return predict(get_layer(current_app), request.environ, ModelSpec()).response()


@bp.post("/v1/models/<model_name:name>:predict")
def predict_model(name: str) -> Response:
    return predict(get_layer(current_app), request.environ, ModelSpec(name)).response()


@bp.post("/v1/models/<model_name:name>/versions/<int:version>:predict")
def predict_version(name: str, version: int) -> Response:
    return predict(get_layer(current_app), request.environ, ModelSpec(name, version)).response()


@bp.post("/v1/models/<model_name:name>/labels/<model_name:label>:predict")
def predict_label(name: str, label: str) -> Response:
    return predict(get_layer(current_app), request.environ, ModelSpec(name, label=label)).response()


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
    statuses = get_layer(current_app).model_status(ModelSpec(name, version, label))
    return _json(orjson.dumps({"model_version_status": statuses}))


@bp.get("/v1/models/<model_name:name>/metadata")
@bp.get("/v1/models/<model_name:name>/versions/<int:version>/metadata")
@bp.get("/v1/models/<model_name:name>/labels/<model_name:label>/metadata")
def model_metadata(name: str, version: int | None = None, label: str | None = None) -> Response:
    servable = get_layer(current_app).model(ModelSpec(name, version, label))
    return _json(orjson.dumps(metadata.describe(servable.model)))


@bp.get("/healthz")
def healthz() -> Response:
    # Liveness: a worker whose batch thread died is replacing itself; until it is gone it is not alive.
    broken = sorted({batcher.info.name for servable in get_registry(current_app).servables()
                     for batcher in servable.batchers.values() if batcher.broken})
    if broken:
        return _json(orjson.dumps({"error": f"the batch thread of model(s) {broken} died"}), status=503)
    return _json(b'{"status":"alive"}')


@bp.get("/readyz")
def readyz() -> Response:
    registry = get_registry(current_app)
    ready = registry.ready
    # File paths and the pid tell an attacker about the host: shown only when asked for.
    detail = current_app.extensions["settings"].readyz_detail
    models = {name: servable.status() for name, servable in registry.items()}
    if not detail:
        for status in models.values():
            status.pop("source", None)
    body = {
        "ready": ready,
        "tensorflow": current_app.extensions["tensorflow"],
        "large_bodies_in_flight": current_app.extensions["body_limits"].large_bodies_in_flight,
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
