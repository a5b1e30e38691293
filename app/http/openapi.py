"""The OpenAPI 3 description of every route, served at GET /openapi.json.

Werkzeug's '/v1/models/<model_name:name>:predict' is the literal OpenAPI path
'/v1/models/{name}:predict': the name pattern stops at ':'. Every error answers
{"error": "..."} with one of the statuses listed for its route (the README's error table);
init_app checks the document against the routes the app serves; tests/test_fuzz.py holds a live
server to it. `x-model-signatures` shows each model's serving signature as served now (a model
with a handler: the handler's), by name: per-row shapes (null: any size) and dtypes ("bytes" for
strings), as a handler declares them.
"""

from __future__ import annotations

import re
from typing import Any, cast

import orjson
from flask import Flask, Response, current_app

from app.core.models import STRING, Signature, TensorInfo
from app.core.registry import ModelRegistry
from app.http.routes import HttpApp
from app.ops.settings import MODEL_NAME_PATTERN

OPENAPI_VERSION = "3.0.3"

_ERRORS = {
    400: "Malformed JSON, missing 'instances'/'inputs' or both given, wrong row shape, ragged rows, "
         "non-numeric or boolean values, values out of range for the input's dtype, unknown input names; "
         "a path under /v1/ that is not one of TensorFlow Serving's URLs ('Malformed request: ...'); "
         "model outputs that are not one row per input row; an unknown version label or signature_name; "
         "classify/regress with a signature of another method.",
    403: "A restricted API category (HTTP_RESTRICTED_API, RESTRICTED_MODEL_CONTROL) called without its header.",
    404: "Unknown route, model or version.",
    405: "Wrong method for this path; 'Allow' lists the right ones.",
    413: "Body over MAX_REQUEST_BYTES, or more rows in one request than MAX_REQUEST_ROWS.",
    415: "A Content-Encoding other than identity: bodies are read uncompressed.",
    500: "The model raised; the message names the exception's class.",
    503: "Overloaded (queue full), shutting down, or the batch thread died; retry after 'Retry-After' seconds.",
    504: "The deadline (REQUEST_TIMEOUT_MS) passed before the result.",
}

_HEADERS = {
    405: {"Allow": {"description": "The methods this path takes.", "schema": {"type": "string"}}},
    503: {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}},
}

# MODEL_NAME_PATTERN is matched whole (fullmatch); an OpenAPI pattern matches anywhere unless anchored.
_NAME_PATTERN = f"^{MODEL_NAME_PATTERN.pattern}$"
_NAME = {
    "name": "name", "in": "path", "required": True, "description": "The model's name.",
    "schema": {"type": "string", "pattern": _NAME_PATTERN},
}
_VERSION = {
    "name": "version", "in": "path", "required": True, "description": "The model's version number.",
    "schema": {"type": "integer", "minimum": 0},
}

_LABEL = {
    "name": "label", "in": "path", "required": True, "description": "A version label of MODEL_CONFIG's version_labels.",
    "schema": {"type": "string", "pattern": _NAME_PATTERN},
}
_V2_VERSION = {
    "name": "version", "in": "path", "required": True,
    "description": "A version number, or (any other text) a version label.",
    "schema": {"type": "string", "pattern": "^[^/]+$"},
}

_PREDICT_ERRORS = (400, 404, 405, 413, 415, 500, 503, 504)
_GET_ERRORS = (400, 404, 405)


def _error(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _ERRORS[status],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    if status in _HEADERS:
        response["headers"] = _HEADERS[status]
    return response


def _operation(summary: str, ok: dict[str, Any], errors: tuple[int, ...], *,
               parameters: tuple[dict[str, Any], ...] = (), body: bool = False) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": ok, **{str(status): _error(status) for status in errors}},
    }
    if parameters:
        operation["parameters"] = list(parameters)
    if body:
        operation["requestBody"] = {
            "required": True,
            "description": "Read as JSON whatever the Content-Type says, as TensorFlow Serving reads it; "
                           "floats may be NaN, Infinity or -Infinity.",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/PredictRequest"}}},
        }
    return operation


def _json_ok(description: str, schema: dict[str, Any], headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        response["headers"] = headers
    return response


_PREDICT_OK = _json_ok(
    "One output row per input row: 'predictions' for the row format, 'outputs' for the columnar one.",
    {"$ref": "#/components/schemas/PredictResponse"},
    {
        "X-Batch-Size": {"description": "Rows in the predict call that served it.", "schema": {"type": "integer"}},
        "X-Batch-Requests": {"description": "Requests in that call.", "schema": {"type": "integer"}},
        "X-Model-Version": {"description": "The version that answered.", "schema": {"type": "integer"}},
    },
)
_STATUS_OK = _json_ok("The model version's status, in TensorFlow Serving's form.",
                      {"$ref": "#/components/schemas/ModelStatus"})
_METADATA_OK = _json_ok("The serving signature: input and output names, dtypes and shapes.",
                        {"$ref": "#/components/schemas/ModelMetadata"})


def _predict(summary: str, *parameters: dict[str, Any]) -> dict[str, Any]:
    return {"post": _operation(summary, _PREDICT_OK, _PREDICT_ERRORS, parameters=parameters, body=True)}


def _examples(summary: str, *parameters: dict[str, Any]) -> dict[str, Any]:
    ok = _json_ok("One result per example.", {"$ref": "#/components/schemas/ResultsResponse"})
    operation = _operation(summary, ok, _PREDICT_ERRORS, parameters=parameters, body=True)
    operation["requestBody"]["content"]["application/json"]["schema"] = {"$ref": "#/components/schemas/ExamplesRequest"}
    return {"post": operation}


def _version_paths() -> dict[str, Any]:
    """Label routes, and :classify / :regress by model, version and label."""
    paths: dict[str, Any] = {
        "/v1/models/{name}/labels/{label}:predict": _predict("Predict with the version a label names.", _NAME, _LABEL),
        "/v1/models/{name}/labels/{label}": {
            "get": _operation("The status of the version a label names.", _STATUS_OK, _GET_ERRORS,
                              parameters=(_NAME, _LABEL))},
        "/v1/models/{name}/labels/{label}/metadata": {
            "get": _operation("The signatures of the version a label names.", _METADATA_OK, _GET_ERRORS,
                              parameters=(_NAME, _LABEL))},
    }
    for method in ("classify", "regress"):
        summary = f"{method.capitalize()} tf.Examples with a {method} signature"
        paths[f"/v1/models/{{name}}:{method}"] = _examples(f"{summary}.", _NAME)
        paths[f"/v1/models/{{name}}/versions/{{version}}:{method}"] = _examples(f"{summary} of one version.",
                                                                                _NAME, _VERSION)
        paths[f"/v1/models/{{name}}/labels/{{label}}:{method}"] = _examples(f"{summary} of a label's version.",
                                                                            _NAME, _LABEL)
    return paths


def _v2_paths() -> dict[str, Any]:
    """The Open Inference Protocol (KServe v2) routes of app/http/v2.py."""
    infer_ok = {
        "description": "The outputs: JSON, or with binary outputs a JSON header (its length in "
                       "Inference-Header-Content-Length) followed by their bytes.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/V2InferResponse"}},
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
    header_length = {
        "name": "Inference-Header-Content-Length", "in": "header", "required": False,
        "description": "Binary tensor data: the length of the JSON request at the body's start; 0: the "
                       "body is the one input's raw data.",
        "schema": {"type": "integer", "minimum": 0},
    }
    signature = {"name": "signature_name", "in": "query", "required": False,
                 "description": "A signature of the model; absent: 'serving_default'.", "schema": {"type": "string"}}
    metadata_ok = _json_ok("The model's versions and its signature's inputs and outputs, with v2 datatypes.",
                           {"$ref": "#/components/schemas/V2ModelMetadata"})
    ready_ok = _json_ok("The model can serve.", {"type": "object", "required": ["ready"]})
    paths: dict[str, Any] = {
        "/v2": {"get": _operation("Server metadata: name, version and extensions.", _json_ok(
            "The server.", {"type": "object", "required": ["name", "version", "extensions"]}), (405,))},
        "/v2/health/live": {"get": _operation("Liveness.", _json_ok("Alive.", {"type": "object"}), (405,))},
        "/v2/health/ready": {"get": _operation("Readiness of every model.", _json_ok("Ready.", {"type": "object"}),
                                               (405, 503))},
    }
    stats_ok = _json_ok("Triton's statistics extension: counts and cumulative durations per model version.",
                        {"type": "object", "required": ["model_stats"]})
    paths["/v2/models/stats"] = {"get": _operation("Statistics of every model version.", stats_ok, (405,))}
    for prefix, parameters in (("/v2/models/{name}", (_NAME,)),
                               ("/v2/models/{name}/versions/{version}", (_NAME, _V2_VERSION))):
        paths[f"{prefix}/stats"] = {"get": _operation("Statistics of a model's versions (of one version).",
                                                      stats_ok, _GET_ERRORS, parameters=parameters)}
        paths[prefix] = {"get": _operation("A model's metadata.", metadata_ok, _GET_ERRORS,
                                           parameters=(*parameters, signature))}
        paths[f"{prefix}/ready"] = {"get": _operation("Whether a model can serve.", ready_ok, (*_GET_ERRORS, 503),
                                                      parameters=parameters)}
        paths[f"{prefix}/config"] = {"get": _operation(
            "Triton's model configuration extension: the model as Triton's ModelConfig describes it.",
            _json_ok("Triton's ModelConfig, every field written.", {"type": "object", "required": ["name"]}),
            _GET_ERRORS, parameters=parameters)}
        infer = _operation("Run the model on named tensors (Open Inference Protocol).", infer_ok, _PREDICT_ERRORS,
                           parameters=(*parameters, header_length), body=True)
        infer["requestBody"]["content"]["application/json"]["schema"] = {"$ref": "#/components/schemas/V2InferRequest"}
        infer["requestBody"]["content"]["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
        paths[f"{prefix}/infer"] = {"post": infer}
    for operations in paths.values():  # every route has a category HTTP_RESTRICTED_API may restrict
        for operation in operations.values():
            operation["responses"]["403"] = _error(403)
    return {**paths, **_repository_paths()}


def _repository_paths() -> dict[str, Any]:
    """Triton's model repository extension (app/core/repository.py)."""
    body = {"required": False, "content": {"application/json": {"schema": {"type": "object"}}}}
    index = _operation("Every model of MODEL_REPOSITORY and every model served, with each version's state.",
                       _json_ok("name, version, state, reason per model version.",
                                {"type": "array", "items": {"type": "object", "required": ["name"]}}), (400, 405))
    paths: dict[str, Any] = {"/v2/repository/index": {"post": index}}
    for action, summary in (("load", "Serve a model of MODEL_REPOSITORY, in every worker, before answering."),
                            ("unload", "Stop serving a model, in every worker, before answering.")):
        operation = _operation(summary, {"description": "Done (an empty body)."}, (400, 404, 405, 503, 504),
                               parameters=(_NAME,))
        paths[f"/v2/repository/models/{{name}}/{action}"] = {"post": operation}
    for path in paths.values():
        path["post"]["responses"]["403"] = _error(403)
        path["post"]["requestBody"] = body
    return paths


_V2_TENSOR = {
    "type": "object",
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": {"type": "string"},
        "datatype": {"type": "string", "description": "BOOL, INT8-64, UINT8-64, FP16, FP32, FP64, BF16 or BYTES."},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "parameters": {"type": "object", "properties": {"binary_data_size": {"type": "integer", "minimum": 0}}},
        "data": {"type": "array", "description": "Values, flat or nested, row-major; floats may be NaN, "
                                                 "Infinity or -Infinity."},
    },
}

_SCHEMAS: dict[str, Any] = {
    "V2InferRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string", "description": "Echoed back."},
            "parameters": {"type": "object", "properties": {
                "signature_name": {"type": "string"},
                "timeout": {"type": "integer", "minimum": 0, "description": "Microseconds."},
                "binary_data_output": {"type": "boolean"}}},
            "inputs": {"type": "array", "minItems": 1, "items": _V2_TENSOR},
            "outputs": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"},
                "parameters": {"type": "object", "properties": {"binary_data": {"type": "boolean"}}}}}},
        },
    },
    "V2InferResponse": {
        "type": "object",
        "required": ["model_name", "model_version", "outputs"],
        "properties": {"model_name": {"type": "string"}, "model_version": {"type": "string"},
                       "id": {"type": "string"}, "outputs": {"type": "array", "items": {"type": "object"}}},
    },
    "V2ModelMetadata": {
        "type": "object",
        "required": ["name", "versions", "platform", "inputs", "outputs"],
        "properties": {"name": {"type": "string"}, "versions": {"type": "array", "items": {"type": "string"}},
                       "platform": {"type": "string"}, "inputs": {"type": "array"}, "outputs": {"type": "array"}},
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string", "description": "What is wrong, and where."}},
    },
    "PredictRequest": {
        "type": "object",
        "description": "TensorFlow Serving's predict body: 'instances' (rows) or 'inputs' (columns), not both.",
        "properties": {
            "signature_name": {"type": "string",
                               "description": "A signature of the model; '' or absent: 'serving_default'."},
            "instances": {
                "type": "array", "minItems": 1,
                "description": "A list of rows; for several inputs each row is an object keyed by input name.",
                "items": {},
            },
            "inputs": {
                "description": "The batch itself, or an object of named batches.",
                "oneOf": [{"type": "array", "minItems": 1, "items": {}}, {"type": "object"}],
            },
        },
        "oneOf": [{"required": ["instances"]}, {"required": ["inputs"]}],
    },
    "ExamplesRequest": {
        "type": "object",
        "description": "TensorFlow Serving's classify/regress body: tf.Example features by name.",
        "required": ["examples"],
        "properties": {
            "signature_name": {"type": "string", "description": "A classify or regress signature; '' or absent: "
                                                                "'serving_default'."},
            "context": {"type": "object", "description": "Features shared by every example."},
            "examples": {"type": "array", "minItems": 1, "items": {"type": "object"}},
        },
    },
    "ResultsResponse": {
        "type": "object",
        "required": ["results"],
        "properties": {"results": {"type": "array", "description": "classify: [[label, score], ...] per example; "
                                                                   "regress: one value per example."}},
    },
    "PredictResponse": {
        "type": "object",
        "properties": {"predictions": {"type": "array"}, "outputs": {}},
    },
    "ModelStatus": {
        "type": "object",
        "required": ["model_version_status"],
        "properties": {"model_version_status": {"type": "array", "items": {"type": "object"}}},
    },
    "ModelMetadata": {
        "type": "object",
        "required": ["model_spec", "metadata"],
        "properties": {"model_spec": {"type": "object"}, "metadata": {"type": "object"}},
    },
    "Readiness": {
        "type": "object",
        "required": ["ready", "pid", "models"],
        "properties": {
            "ready": {"type": "boolean"},
            "pid": {"type": "integer"},
            "tensorflow": {"type": "object"},
            "models": {"type": "object"},
        },
    },
}


def spec() -> dict[str, Any]:
    """The whole document, built afresh (callers may change their copy)."""
    readiness = {"$ref": "#/components/schemas/Readiness"}
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "Batching model server",
            "version": "1",
            "description": "A Keras / TensorFlow model behind Gunicorn, with dynamic batching and "
                           "TensorFlow Serving's REST API.",
        },
        "paths": {
            "/predict": _predict("Predict with the default model."),
            "/v1/models/{name}:predict": _predict("Predict with a model.", _NAME),
            "/v1/models/{name}/versions/{version}:predict": _predict("Predict with one version of a model.",
                                                                     _NAME, _VERSION),
            "/v1/models/{name}": {"get": _operation("A model's version status.", _STATUS_OK, _GET_ERRORS,
                                                    parameters=(_NAME,))},
            "/v1/models/{name}/versions/{version}": {
                "get": _operation("One version's status.", _STATUS_OK, _GET_ERRORS, parameters=(_NAME, _VERSION))},
            "/v1/models/{name}/metadata": {
                "get": _operation("A model's signature.", _METADATA_OK, _GET_ERRORS, parameters=(_NAME,))},
            "/v1/models/{name}/versions/{version}/metadata": {
                "get": _operation("One version's signature.", _METADATA_OK, _GET_ERRORS,
                                  parameters=(_NAME, _VERSION))},
            **_version_paths(),
            "/healthz": {"get": _operation(
                "Liveness: 200 while the process is alive; 503 while a batch thread is dead and the worker "
                "replaces itself.",
                _json_ok("Alive.", {"type": "object", "properties": {"status": {"type": "string"}}}), (405, 503))},
            "/readyz": {"get": {
                "summary": "Readiness: every model loaded, warmed and its batch thread alive.",
                "responses": {
                    "200": _json_ok("Ready; the body shows queue depth, batches run and TensorFlow's pools.",
                                    readiness),
                    "405": _error(405),
                    "503": _json_ok("Not ready (a batch thread died); the same body.", readiness),
                },
            }},
            "/metrics": {"get": _operation(
                "Prometheus metrics, added up across workers.",
                {"description": "Prometheus's text format.", "content": {"text/plain": {"schema": {"type": "string"}}}},
                (405,))},
            "/openapi.json": {"get": _operation(
                "This document.", _json_ok("The OpenAPI description.", {"type": "object"}), (405,))},
            **_v2_paths(),
        },
        "components": {"schemas": _SCHEMAS},
    }


def operations(app: Flask) -> set[tuple[str, str]]:
    """(OpenAPI path, method) of each route `app` serves; METRICS_PATH's alias of /metrics left out."""
    return {
        (re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule), method.lower())
        for rule in app.url_map.iter_rules() if rule.endpoint not in ("static", "metrics_path")
        for method in (rule.methods or set()) - {"HEAD", "OPTIONS"}
    }


def init_app(app: Flask) -> None:
    """Serve the document, once it is known to describe every route the app serves (registered
    before this), and nothing else: a route added without its description stops start-up."""
    document = spec()

    @app.get("/openapi.json")
    def openapi_json() -> Response:
        # Models change live (reloads, versions): their signatures are read at each request.
        signatures = orjson.dumps(model_signatures(cast(HttpApp, current_app).services.registry))
        return Response(served[:-1] + b',"x-model-signatures":' + signatures + b"}", mimetype="application/json")

    described = {(path, method) for path, methods in document["paths"].items() for method in methods}
    served_routes = operations(app)
    if described != served_routes:
        raise RuntimeError(f"app/http/openapi.py and the app's routes differ: not described "
                           f"{sorted(served_routes - described)}, described but not served "
                           f"{sorted(described - served_routes)}")
    served = orjson.dumps(document)


def model_signatures(registry: ModelRegistry) -> dict[str, Any]:
    """Each model's serving signature (its newest version's), as clients send and get it."""
    shown = {}
    for name, servable in registry.items():
        model = servable.model
        signature = model.signatures.get(model.default_signature)
        if signature is not None:
            shown[name] = _signature(signature)
    return shown


def _signature(signature: Signature) -> dict[str, Any]:
    return {"inputs": {spec.name: _tensor(spec) for spec in signature.inputs},
            "outputs": {spec.name: _tensor(spec) for spec in signature.outputs}}


def _tensor(spec: TensorInfo) -> dict[str, Any]:
    return {"dtype": "bytes" if spec.dtype == STRING else spec.dtype.name,
            "shape": None if spec.unknown_rank else list(spec.shape)}
