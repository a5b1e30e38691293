"""The Open Inference Protocol (KServe v2) over HTTP, with Triton's extensions.

Routes (kserve/open-inference-protocol, specification/protocol/inference_rest.md):

    GET  /v2                                     server metadata
    GET  /v2/health/live, /v2/health/ready
    GET  /v2/models/{m}[/versions/{v}]           model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready
    GET  /v2/models/{m}[/versions/{v}]/config   Triton's model configuration (app/wire/v2_config.py)
    POST /v2/models/{m}[/versions/{v}]/infer
    GET  /v2/models[/{m}[/versions/{v}]]/stats  Triton's statistics (app/core/model_stats.py)

A version of digits names a version, any other a version label ("stable"). The signature is
the request parameter `signature_name` (serving_default without it); the request parameter
`timeout` (microseconds, as tritonclient sends it) caps the server's deadline. Each route has
its category of Triton's restricted APIs (HTTP_RESTRICTED_API, app/wire/restricted.py).

Binary tensor data: with an `Inference-Header-Content-Length: N` header, the body's first N
bytes are the JSON request and the rest the inputs whose parameters carry `binary_data_size`,
in the order listed. An output asked for with `binary_data: true` comes back the same way,
after a JSON header whose length the answer's Inference-Header-Content-Length gives; the
request parameter `binary_data_output: true` (which tritonclient sends when it names no
output) does so for the outputs not listed, as in Triton. `Inference-Header-Content-Length: 0`
(or an empty body without it) is a raw binary request: the whole body is the one input's
data, its shape deduced from the signature (v2_tensors.raw_input), every output binary.

This module only translates: app/core/serving.py resolves, limits, times and records the request,
and app/wire/v2_tensors.py checks each tensor against the signature. Where Triton's clients
read the words of a refusal, they are Triton's (v2_tensors.in_triton_words).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import simdjson
from flask import request

from app.core.errors import BadRequest, ServingError, Unavailable
from app.core.registry import Servable
from app.core.services import Services
from app.core.serving import Answer
from app.http import bodies
from app.http.layers import HttpExchange
from app.http.routes import Reply, Route
from app.ops.numerals import whole_number
from app.wire import codec, priority, v2_config, v2_tensors
from app.wire.v2_statistics import statistics

HEADER_LENGTH = "Inference-Header-Content-Length"
# Its WSGI name: read from the environ as request.headers would read it.
_HEADER_LENGTH_KEY = "HTTP_" + HEADER_LENGTH.upper().replace("-", "_")

def server_metadata(services: Services, exchange: HttpExchange) -> Reply:
    return _json({"name": v2_tensors.SERVER_NAME, "version": v2_tensors.SERVER_VERSION,
                  "extensions": v2_tensors.EXTENSIONS})


def live(services: Services, exchange: HttpExchange) -> Reply:
    return _json({"live": True})


def ready(services: Services, exchange: HttpExchange) -> Reply:
    if not services.layer.ready:
        raise Unavailable("not every model is ready")
    return _json({"ready": True})


def model_metadata(services: Services, exchange: HttpExchange, name: str, version: str | None = None) -> Reply:
    layer = services.layer
    servable = _model(services, name, version)
    signature = layer.predict_signature(servable, request.args.get("signature_name", ""))
    return _json(v2_tensors.model_metadata(servable.model, signature, layer.versions(servable)))


def model_ready(services: Services, exchange: HttpExchange, name: str, version: str | None = None) -> Reply:
    servable = _model(services, name, version)
    if not services.layer.servable_ready(servable):
        raise Unavailable(f"model '{servable.model.name}' v{servable.model.version} cannot serve")
    return _json({"name": servable.model.name, "ready": True})


def model_config(services: Services, exchange: HttpExchange, name: str, version: str | None = None) -> Reply:
    """Triton's model configuration extension (app/wire/v2_config.py)."""
    servable = _model(services, name, version)
    config = v2_config.model_config(servable, services.registry.config_entry(servable.model.name))
    return _json(v2_config.config_json(config))


def _model(services: Services, name: str, version: str | None) -> Servable:
    spec = v2_tensors.model_spec(name, version)
    try:
        return services.layer.model(spec)
    except ServingError as exc:
        raise v2_tensors.in_triton_words(exc, spec) from None


def model_statistics(services: Services, exchange: HttpExchange, name: str = "", version: str = "") -> Reply:
    """Triton's statistics extension (app/core/model_stats.py)."""
    return _json(statistics(services.registry, services.metrics, name, version))


def _json(value: Any) -> Reply:
    return Reply(orjson.dumps(value))


def infer(services: Services, exchange: HttpExchange, name: str, version: str | None = None) -> Reply:
    data = bodies.body(exchange)
    length = _header_length(data, exchange.environ.get(_HEADER_LENGTH_KEY))
    if length == 0:
        return _infer_raw(services, exchange, name, version, data)
    body, tensors, json_text = _split(data, length)
    parameters = _parameters(body, "the request")
    request_id = _text(body["id"], "id") if "id" in body else None
    every_binary = _flag(parameters.get("binary_data_output", False), "the parameter 'binary_data_output'")
    signature_name = parameters.get("signature_name", "")
    if not isinstance(signature_name, str):
        raise BadRequest(v2_tensors.SIGNATURE_NAME_ERROR)
    wanted = _requested_outputs(body)
    names = tuple(output for output, _ in wanted)
    v2_tensors.check_outputs(names)
    spec = v2_tensors.model_spec(name, version)
    call = exchange.call(spec, signature=signature_name, outputs=names, client_timeout_s=_timeout_s(parameters),
                         priority=priority.from_v2_rest(parameters), parameters=parameters)
    try:
        answer = services.layer.infer(call, lambda signature, max_rows: v2_tensors.decode_inputs(
            _inputs(body, tensors, json_text), signature, max_rows=max_rows))
    except ServingError as exc:
        raise v2_tensors.in_triton_words(exc, spec) from None
    # As Triton: an output asked for is binary only if its own binary_data says so; the request's
    # binary_data_output is the form of the outputs it does not list (all, when it lists none).
    binary = {output_name: bool(choice) for output_name, choice in wanted}
    return _encode(answer, request_id, lambda output_name: binary.get(output_name, every_binary))


def _infer_raw(services: Services, exchange: HttpExchange, name: str, version: str | None, data: bytes) -> Reply:
    """Triton's raw binary request: the body is the one input's bytes (v2_tensors.raw_input); every
    output answers binary."""
    spec = v2_tensors.model_spec(name, version)
    call = exchange.call(spec)
    try:
        answer = services.layer.infer(call, lambda signature, max_rows: v2_tensors.decode_inputs(
            [v2_tensors.raw_input(data, signature, name)], signature, max_rows=max_rows))
    except ServingError as exc:
        raise v2_tensors.in_triton_words(exc, spec) from None
    return _encode(answer, None, lambda _name: True)


def _encode(answer: Answer, request_id: str | None, binary: Callable[[str], bool]) -> Reply:
    header: dict[str, Any] = {"model_name": answer.servable.model.name,
                              "model_version": str(answer.servable.model.version)}
    if request_id is not None:
        header["id"] = request_id
    header["outputs"], chunks = [], []
    for output in answer.selected:
        array = v2_tensors.output_array(answer.outputs[output.name], output)
        entry: dict[str, Any] = {"name": output.name, "datatype": v2_tensors.datatype(output),
                                 "shape": list(array.shape)}
        if binary(output.name):
            chunks.append(v2_tensors.to_bytes(array))
            entry["parameters"] = {"binary_data_size": len(chunks[-1])}
        else:
            entry["data"] = v2_tensors.to_json(array, output.name)
        header["outputs"].append(entry)
    return _answer(answer, orjson.dumps(header), chunks)


def _answer(answer: Answer, header: bytes, chunks: list[bytes]) -> Reply:
    headers = [("X-Batch-Size", str(answer.batch_rows)), ("X-Batch-Requests", str(answer.batch_requests))]
    if not chunks:
        return Reply(header, headers)
    headers.append((HEADER_LENGTH, str(len(header))))
    return Reply(b"".join([header, *chunks]), headers, "application/octet-stream")


_MODEL = "/v2/models/<model_name:name>"
_MODELS = (_MODEL, f"{_MODEL}/versions/<version>")
# The door's one table (app/http/routes.py): Flask's rules and the direct router's come from it.
# Each route with its category of Triton's restricted APIs (app/wire/restricted.py).
ROUTES = [
    Route("GET", "/v2", server_metadata, category="metadata"),
    Route("GET", "/v2/health/live", live, category="health"),
    Route("GET", "/v2/health/ready", ready, category="health"),
    *(Route("GET", prefix, model_metadata, category="metadata") for prefix in _MODELS),
    *(Route("GET", f"{prefix}/ready", model_ready, category="health") for prefix in _MODELS),
    *(Route("GET", f"{prefix}/config", model_config, category="model-config") for prefix in _MODELS),
    # A static rule wins over a model name "stats".
    Route("GET", "/v2/models/stats", model_statistics, category="statistics"),
    *(Route("GET", f"{prefix}/stats", model_statistics, category="statistics") for prefix in _MODELS),
    *(Route("POST", f"{prefix}/infer", infer, direct=True, category="inference") for prefix in _MODELS),
]


def _header_length(data: bytes, header_length: str | None) -> int:
    """How many of the body's bytes are the JSON request: Inference-Header-Content-Length, else all.
    0 is Triton's raw binary request, as is an empty body without the header."""
    if header_length is None:
        return len(data)
    found = whole_number(header_length.strip(), len(data))
    if found is None:
        raise BadRequest(f"{HEADER_LENGTH} must be a number of bytes within the body's {len(data)}; "
                         f"got {header_length!r}")
    return found


def _split(data: bytes, length: int) -> tuple[dict[str, Any], memoryview, bytes]:
    """The JSON request read, the binary data after it (none without Inference-Header-Content-Length),
    and the JSON text."""
    json_text = data if length == len(data) else data[:length]
    body = _numbers_read_whole(json_text)
    if body is None:
        body = codec.loads(json_text)
    if not isinstance(body, dict):
        raise BadRequest("the request must be a JSON object with 'inputs'")
    return body, memoryview(data)[length:], json_text


# Datatypes whose JSON values v2_tensors reads through a double, whatever their nesting.
_FLOAT_DATATYPES = frozenset(("FP16", "FP32", "FP64", "BF16"))


def _numbers_read_whole(text: bytes) -> dict[str, Any] | None:
    """The request as orjson reads it, but each floating-point input's `data` a flat float64
    array (v2_tensors reads those values through a double, flattening any nesting, as simdjson
    does); None where the general path must read it: simdjson refuses it (NaN, Infinity, a number
    past 64 bits), a byte-order mark, a key twice in the request or an input (orjson keeps the
    last), or data that is not all numbers (the general path words what is wrong)."""
    if text.startswith(codec.BOM):
        return None
    try:
        document = simdjson.Parser().parse(text)
        if not isinstance(document, simdjson.Object) or not codec.unique_keys(document):
            return None
        body = {key: _python(document[key]) for key in _keys(document) if key != "inputs"}
        inputs = document.get("inputs")
        if not isinstance(inputs, simdjson.Array):
            return {**body, "inputs": _python(inputs)} if "inputs" in document else body
        # Only a text with that many '[' can hold data nested too deep (v2_tensors.MAX_JSON_DEPTH).
        deep = text.count(b"[") >= v2_tensors.MAX_JSON_DEPTH
        body["inputs"] = [_input(tensor, deep) for tensor in inputs]
    except (ValueError, TypeError, RuntimeError):  # not JSON to simdjson, or data not all numbers
        return None
    return body


def _input(tensor: Any, deep: bool) -> Any:
    if not isinstance(tensor, simdjson.Object):
        return _python(tensor)
    if not codec.unique_keys(tensor):
        raise ValueError("a key twice")
    value = {key: _python(tensor[key]) for key in _keys(tensor) if key != "data"}
    data = tensor.get("data")
    if isinstance(data, simdjson.Array) and value.get("datatype") in _FLOAT_DATATYPES:
        flat = np.frombuffer(data.as_buffer(of_type="d"), dtype=np.float64)
        # as_buffer flattens any nesting: Triton's depth limit is checked on the data's text.
        if deep and v2_tensors.nesting_depth(data.mini) >= v2_tensors.MAX_JSON_DEPTH:
            raise v2_tensors.depth_error(bytes_data=False)
        value["data"] = flat
    elif "data" in tensor:
        value["data"] = _python(data)
    return value


def _keys(value: simdjson.Object) -> list[str]:
    """The keys to read `value` by: simdjson's items() would make every value a Python object, the
    data's numbers too. A key holding NUL would be looked up cut short there (another key's value,
    or none): such a request is the general path's."""
    keys = list(value.keys())
    if any("\x00" in key for key in keys):
        raise ValueError("a key holds NUL")
    return keys


def _python(value: Any) -> Any:
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


def _parameters(value: dict[str, Any], where: str) -> dict[str, Any]:
    parameters = value.get("parameters", {})
    if not isinstance(parameters, dict):
        raise BadRequest(f"{where}: 'parameters' must be a JSON object")
    return parameters


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"'{where}' must be a string")
    return value


def _flag(value: Any, where: str) -> bool:
    # A JSON boolean only: "yes" or 1 ignored would answer in a form the client did not ask for.
    if not isinstance(value, bool):
        raise BadRequest(f"{where} must be true or false")
    return value


def _timeout_s(parameters: dict[str, Any]) -> float | None:
    timeout = parameters.get("timeout")
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
        raise BadRequest(v2_tensors.TIMEOUT_ERROR)
    return timeout / 1e6


def _requested_outputs(body: dict[str, Any]) -> list[tuple[str, bool | None]]:
    """Each output asked for, with its binary_data parameter (None: the request's default)."""
    outputs = body.get("outputs", [])
    if not isinstance(outputs, list):
        raise BadRequest("'outputs' must be a JSON array")
    wanted = []
    for index, output in enumerate(outputs):
        where = f"outputs[{index}]"
        if not isinstance(output, dict):
            raise BadRequest(f"{where} must be a JSON object with a 'name'")
        parameters = _parameters(output, where)
        if parameters.get("classification"):
            raise BadRequest(f"{where}: the classification extension is not supported")
        binary = parameters.get("binary_data")
        if binary is not None:
            binary = _flag(binary, f"{where}.parameters.binary_data")
        wanted.append((_text(output.get("name"), f"{where}.name"), binary))
    return wanted


def _inputs(body: dict[str, Any], data: memoryview, json_text: bytes) -> list[v2_tensors.Tensor]:
    """The inputs, each with its JSON data or its slice of the binary data, in the order listed."""
    inputs = body.get("inputs")
    # Whether the JSON may hold a boolean, for data still JSON values: a search of the whole text
    # (16 us of a 20 KB body under load, as "inputs" holds a 'u'), so only once one needs it.
    booleans: bool | None = None
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest("'inputs' must be a JSON array of at least one tensor")
    tensors, offset = [], 0
    for index, value in enumerate(inputs):
        where = f"inputs[{index}]"
        if not isinstance(value, dict):
            raise BadRequest(f"{where} must be a JSON object")
        name, datatype = _text(value.get("name"), f"{where}.name"), _text(value.get("datatype"), f"{where}.datatype")
        shape = value.get("shape")
        if not isinstance(shape, list) or not all(isinstance(size, int) and not isinstance(size, bool)
                                                  for size in shape):
            raise BadRequest(f"{where}.shape must be a JSON array of whole numbers")
        size = _parameters(value, where).get("binary_data_size")
        if size is None:
            if "data" not in value:
                raise BadRequest(f"{where}: input '{name}' has neither 'data' nor a binary_data_size parameter")
            values = value["data"]
            if booleans is None and not isinstance(values, np.ndarray):
                booleans = codec.may_hold_booleans(json_text)
            tensors.append(v2_tensors.Tensor(name, datatype, tuple(shape), data=values, booleans=bool(booleans)))
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or offset + size > len(data):
            raise BadRequest(f"{where}: binary_data_size {size!r} does not fit the {len(data) - offset} bytes "
                             "of binary data left in the body")
        tensors.append(v2_tensors.Tensor(name, datatype, tuple(shape), raw=data[offset: offset + size]))
        offset += size
    if offset != len(data):
        raise BadRequest(f"the body holds {len(data) - offset} bytes of binary data that no input's "
                         "binary_data_size claims")
    return tensors
