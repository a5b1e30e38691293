"""HTTP routes: predict (a shortcut and TensorFlow Serving's URLs, by version or label),
classify and regress, model status and metadata, and health."""

from __future__ import annotations

import gc
import os

import orjson
from flask import Blueprint, Flask, Response, current_app
from werkzeug.routing import BaseConverter, IntegerConverter

from app import classify, codec, limits, logs, metadata, models, runtime
from app.batching import BatchResult
from app.errors import BadRequest
from app.registry import Servable, get_registry
from app.settings import MODEL_NAME_PATTERN

bp = Blueprint("api", __name__)


class ModelNameConverter(BaseConverter):
    # Stops at ':' so that '/v1/models/<name>:predict' parses; the name never reaches a path.
    regex = MODEL_NAME_PATTERN.pattern.strip("^$")


class AsciiIntConverter(IntegerConverter):
    regex = r"[0-9]+"


def _json(body: bytes, status: int = 200, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(body, status=status, content_type="application/json", headers=headers)


def _predict(servable: Servable, *, pinned: bool = False) -> Response:
    """Parse, queue, wait, answer: the request thread never touches TensorFlow."""
    entry = logs.record()
    entry.model = servable.model.name
    # Like TensorFlow Serving, the body is JSON whatever its Content-Type says.
    parsed = codec.parse_request(limits.body(), max_rows=servable.batcher.max_request_rows)
    signature = servable.signature(parsed.signature_name)
    inputs = codec.decode_inputs(parsed, signature)
    entry.rows = next(iter(inputs.values())).shape[0]
    servable, result = get_registry(current_app).predict(servable, inputs, timeout_s=_timeout_s(),
                                                         signature_name=signature.name, pinned=pinned)
    body = codec.encode_response(result.outputs, servable.signature(signature.name), parsed)
    return _answer(entry, servable, result, body)


def _classify_or_regress(servable: Servable, method: str, *, pinned: bool = False) -> Response:
    entry = logs.record()
    entry.model = servable.model.name
    signature_name, examples = classify.parse(limits.body(), method,
                                              max_rows=servable.batcher.max_request_rows)
    if not signature_name and models.DEFAULT_SIGNATURE not in servable.model.signatures:
        signature_name = servable.model.default_signature
    if signature_name and signature_name not in servable.model.signatures:
        # TF Serving's words (servables/tensorflow/classifier.cc, regressor.cc).
        raise BadRequest(f"No signature was found with the name: {signature_name}")
    signature = servable.signature(signature_name)
    input_name = classify.check_signature(signature, method)
    entry.rows = len(examples)
    servable, result = get_registry(current_app).predict(servable, {input_name: examples}, timeout_s=_timeout_s(),
                                                         signature_name=signature.name, pinned=pinned)
    return _answer(entry, servable, result, classify.encode(result.outputs, method, len(examples)))


def _timeout_s() -> float:
    return current_app.extensions["settings"].request_timeout_ms / 1000.0


def _answer(entry: logs.RequestRecord, servable: Servable, result: BatchResult, body: bytes) -> Response:
    entry.batch_rows, entry.batch_requests = result.batch_rows, result.batch_requests
    return _json(body, headers=[
        ("X-Batch-Size", str(result.batch_rows)),
        ("X-Batch-Requests", str(result.batch_requests)),
        ("X-Model-Version", str(servable.model.version)),
    ])


@bp.post("/predict")
def predict_default() -> Response:
    return _predict(get_registry(current_app).get())


@bp.post("/v1/models/<model_name:name>:predict")
def predict_model(name: str) -> Response:
    return _predict(get_registry(current_app).get(name))


@bp.post("/v1/models/<model_name:name>/versions/<int:version>:predict")
def predict_version(name: str, version: int) -> Response:
    return _predict(get_registry(current_app).get(name, version), pinned=True)


@bp.post("/v1/models/<model_name:name>/labels/<model_name:label>:predict")
def predict_label(name: str, label: str) -> Response:
    return _predict(get_registry(current_app).get(name, label=label), pinned=True)


def _tf_example_route(method: str):
    """:classify or :regress, by model, version or label."""
    def route(name: str, version: int | None = None, label: str | None = None) -> Response:
        servable = get_registry(current_app).get(name, version, label=label)
        return _classify_or_regress(servable, method, pinned=version is not None or label is not None)

    route.__name__ = method
    for prefix in ("/v1/models/<model_name:name>", "/v1/models/<model_name:name>/versions/<int:version>",
                   "/v1/models/<model_name:name>/labels/<model_name:label>"):
        bp.post(f"{prefix}:{method}")(route)


_tf_example_route(classify.CLASSIFY)
_tf_example_route(classify.REGRESS)


@bp.get("/v1/models/<model_name:name>")
@bp.get("/v1/models/<model_name:name>/versions/<int:version>")
@bp.get("/v1/models/<model_name:name>/labels/<model_name:label>")
def model_status(name: str, version: int | None = None, label: str | None = None) -> Response:
    statuses = get_registry(current_app).model_status(name, version, label=label)
    return _json(orjson.dumps({"model_version_status": statuses}))


@bp.get("/v1/models/<model_name:name>/metadata")
@bp.get("/v1/models/<model_name:name>/versions/<int:version>/metadata")
@bp.get("/v1/models/<model_name:name>/labels/<model_name:label>/metadata")
def model_metadata(name: str, version: int | None = None, label: str | None = None) -> Response:
    return _json(orjson.dumps(metadata.describe(get_registry(current_app).get(name, version, label=label).model)))


@bp.get("/healthz")
def healthz() -> Response:
    # Liveness: a worker whose batch thread died is replacing itself; until it is gone it is not alive.
    broken = sorted({batcher.name for servable in get_registry(current_app).servables()
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
        "tensorflow": runtime.configured(),
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
