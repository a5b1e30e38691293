"""Load test: each user sends random rows to the model, shaped from the model's metadata.

    locust -f locustfile.py --host http://localhost:8000            # dashboard on :8089
    locust -f locustfile.py --host URL --headless -u 20 -r 5 -t 60s --csv out/run
    LOCUST_PROTOCOL=grpc locust -f locustfile.py --host grpc://localhost:8500
    LOCUST_PROTOCOL=v2 locust -f locustfile.py --host http://localhost:8000
    LOCUST_PROTOCOL=v2-grpc locust -f locustfile.py --host grpc://localhost:8500

Over HTTP a user POSTs instances to /predict; over gRPC it calls TensorFlow Serving's
PredictionService/Predict with the stubs of `tensorflow-serving-api`, the inputs as
tensor_content. With v2 it POSTs to the Open Inference Protocol's /v2/models/<model>/infer
as tritonclient does: numbers as binary tensor data, strings as JSON. With v2-grpc it calls
GRPCInferenceService/ModelInfer with raw_input_contents, through the stubs tritonclient ships.
The input names, per-row shapes and dtypes come from the model's metadata (GET
/v1/models/<model>/metadata, GetModelMetadata, GET /v2/models/<model> or ModelMetadata),
fetched once per host, so the same file loads any served model. A call fails on a status other than 200 (OK) and on a number
of output rows other than the rows sent.

Environment knobs:
    LOCUST_PROTOCOL         http (default), grpc, v2 or v2-grpc; with grpc and v2-grpc, --host is the
                            gRPC address
    LOCUST_MODEL            model whose metadata shapes the input (default "default")
    LOCUST_PATH             predict route (default /predict)
    LOCUST_ROWS             rows per request (default 1)
    LOCUST_WAIT_MIN/MAX     think time between requests, seconds (default 1 and 3; 0 0 = closed loop)
    LOCUST_SHAPE=step       ramp one user every LOCUST_STEP_SECONDS (default 10) up to
                            LOCUST_STEP_USERS_MAX (default 50), hold LOCUST_STEP_HOLD_SECONDS
                            (default one step), then stop. Unset: the plain -u/-r/-t run.
    LOCUST_SUMMARY_FILE     if set, a JSON file written at exit with the mean X-Batch-Size and
                            X-Batch-Requests the answers reported (scripts/benchmark/ reads it)
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

# Locust first: it monkey-patches ssl and sockets with gevent, which must precede requests' imports.
from locust import FastHttpUser, LoadTestShape, User, between, events, task  # isort: skip

import grpc
import numpy as np
import orjson
import requests


def _env_number(name: str, default: float, *, kind: type = float, minimum: float = 0) -> Any:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return kind(default)
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a {kind.__name__}") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be {minimum} or more")
    return value


MODEL = os.environ.get("LOCUST_MODEL", "default")
PREDICT_PATH = os.environ.get("LOCUST_PATH", "/predict")
ROWS = _env_number("LOCUST_ROWS", 1, kind=int, minimum=1)
WAIT_MIN = _env_number("LOCUST_WAIT_MIN", 1.0)
WAIT_MAX = _env_number("LOCUST_WAIT_MAX", 3.0)
if WAIT_MAX < WAIT_MIN:
    raise ValueError(f"LOCUST_WAIT_MAX={WAIT_MAX} is below LOCUST_WAIT_MIN={WAIT_MIN}")
PROTOCOL = os.environ.get("LOCUST_PROTOCOL", "http").strip().lower() or "http"
if PROTOCOL not in ("http", "grpc", "v2", "v2-grpc"):
    raise ValueError(f"LOCUST_PROTOCOL={PROTOCOL!r}: expected 'http', 'grpc', 'v2' or 'v2-grpc'")
if PROTOCOL in ("grpc", "v2-grpc"):
    # After Locust's gevent monkey-patching, before any channel: grpc then yields to gevent.
    import grpc.experimental.gevent

    grpc.experimental.gevent.init_gevent()
if PROTOCOL == "v2-grpc":
    from tritonclient.grpc import service_pb2, service_pb2_grpc
if PROTOCOL == "grpc":
    # TensorFlow Serving's stubs import TensorFlow (seconds): before the run starts, not in it.
    from tensorflow.core.framework import types_pb2
    from tensorflow_serving.apis import get_model_metadata_pb2, predict_pb2, prediction_service_pb2_grpc
SHAPE = os.environ.get("LOCUST_SHAPE", "").strip().lower()
if SHAPE not in ("", "step"):
    raise ValueError(f"LOCUST_SHAPE={SHAPE!r}: expected 'step' or nothing")

# TensorFlow's DataType names, as the metadata gives them, to numpy dtypes.
NUMPY_DTYPES = {
    "DT_FLOAT": np.float32, "DT_DOUBLE": np.float64, "DT_HALF": np.float16, "DT_BFLOAT16": np.float32,
    "DT_INT8": np.int8, "DT_INT16": np.int16, "DT_INT32": np.int32, "DT_INT64": np.int64,
    "DT_UINT8": np.uint8, "DT_UINT16": np.uint16, "DT_UINT32": np.uint32, "DT_UINT64": np.uint64,
    "DT_BOOL": np.bool_, "DT_STRING": np.str_,
}


def input_specs(metadata: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{input name: (per-row shape, DataType name)} from TensorFlow Serving's metadata JSON.

    The batch dimension is dropped; any other unknown dimension (-1) is given size 1.
    """
    signature = metadata["metadata"]["signature_def"]["signature_def"]["serving_default"]
    specs = {}
    for name, tensor in signature["inputs"].items():
        dims = [int(dim["size"]) for dim in tensor["tensor_shape"]["dim"][1:]]
        specs[name] = (tuple(1 if size < 0 else size for size in dims), tensor["dtype"])
    return specs


def random_value(shape: tuple[int, ...], dtype_name: str, rng: np.random.Generator, *, as_array: bool = False) -> Any:
    """Random values of one row, as lists (or, with as_array, a numpy array for orjson to write)."""
    dtype = NUMPY_DTYPES.get(dtype_name)
    if dtype is None:
        raise ValueError(f"no random input for dtype {dtype_name}")
    if dtype is np.str_:
        return np.array(["load-test"], dtype=object).repeat(int(np.prod(shape))).reshape(shape).tolist()
    if dtype is np.bool_:
        values = rng.integers(0, 2, shape).astype(bool)
    elif np.issubdtype(dtype, np.integer):
        values = rng.integers(0, 10, shape).astype(dtype)
    else:
        values = rng.standard_normal(shape).astype(dtype)
    return values if as_array else values.tolist()


def random_instances(specs: dict[str, tuple[tuple[int, ...], str]], rows: int, rng: np.random.Generator, *,
                     as_arrays: bool = False) -> list:
    """TensorFlow Serving's row format: bare values for one input, objects keyed by name for several."""
    if len(specs) == 1:
        ((shape, dtype_name),) = specs.values()
        return [random_value(shape, dtype_name, rng, as_array=as_arrays) for _ in range(rows)]
    return [{name: random_value(shape, dtype_name, rng, as_array=as_arrays) for name, (shape, dtype_name) in specs.items()}
            for _ in range(rows)]


def request_body(specs: dict[str, tuple[tuple[int, ...], str]], rows: int, rng: np.random.Generator) -> bytes:
    """A predict body of random rows, written by orjson from the arrays.

    The load generator shares the machine with the server in a benchmark, so it should cost
    little: orjson writes a float32 row straight from its array, each value in its shortest
    float32 form, where json.dumps of its list took most of Locust's CPU per request.
    """
    return orjson.dumps({"instances": random_instances(specs, rows, rng, as_arrays=True)},
                        option=orjson.OPT_SERIALIZE_NUMPY)


_specs_by_host: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
_specs_lock = threading.Lock()  # a gevent lock once Locust has patched threading


def specs_for(host: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The model's input specs, fetched once per host, outside Locust's request statistics."""
    with _specs_lock:
        if host not in _specs_by_host:
            url = f"{host.rstrip('/')}/v1/models/{MODEL}/metadata"
            answer = requests.get(url, timeout=30)
            if answer.status_code != 200:
                raise RuntimeError(f"GET {url} answered {answer.status_code}: {answer.text[:200]}")
            _specs_by_host[host] = input_specs(answer.json())
        return _specs_by_host[host]


class BatchTally:
    """Sums of the batch headers over successful answers: how big the batches that served them were."""

    def __init__(self) -> None:
        self.answers = 0
        self.batch_rows = 0
        self.batch_requests = 0

    def add(self, headers: Any) -> None:
        try:
            rows, requests_in_batch = int(headers["X-Batch-Size"]), int(headers["X-Batch-Requests"])
        except (KeyError, TypeError, ValueError):
            return  # a server without the headers: nothing to tally
        self.answers += 1
        self.batch_rows += rows
        self.batch_requests += requests_in_batch

    def summary(self) -> dict[str, Any]:
        def mean(total: int) -> float | None:
            return total / self.answers if self.answers else None

        return {"answers_with_batch_headers": self.answers, "mean_batch_rows": mean(self.batch_rows),
                "mean_batch_requests": mean(self.batch_requests)}


batch_tally = BatchTally()


@events.quitting.add_listener
def write_summary(environment: Any, **_: Any) -> None:
    path = os.environ.get("LOCUST_SUMMARY_FILE")
    if path:
        with open(path, "w") as file:
            json.dump(batch_tally.summary(), file)


class PredictUser(FastHttpUser):
    # FastHttpUser: a cheaper client, so that one load-generator process can drive more users.
    abstract = PROTOCOL != "http"
    wait_time = between(WAIT_MIN, WAIT_MAX)

    def on_start(self) -> None:
        self.specs = specs_for(self.host)
        self.rng = np.random.default_rng()

    @task
    def predict(self) -> None:
        body = request_body(self.specs, ROWS, self.rng)
        with self.client.post(PREDICT_PATH, data=body, headers={"Content-Type": "application/json"},
                              name=PREDICT_PATH, catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {(response.text or '')[:200]}")
                return
            try:
                predictions = orjson.loads(response.content)["predictions"]
            except (ValueError, KeyError, TypeError) as exc:
                response.failure(f"no predictions in the answer: {type(exc).__name__}: {exc}")
                return
            if len(predictions) != ROWS:
                response.failure(f"{len(predictions)} predictions for {ROWS} rows")
                return
            batch_tally.add(response.headers)


# The Open Inference Protocol's datatypes, as TensorFlow's DataType names random_value takes.
V2_DATATYPES = {
    "FP32": "DT_FLOAT", "FP64": "DT_DOUBLE", "FP16": "DT_HALF", "INT8": "DT_INT8", "INT16": "DT_INT16",
    "INT32": "DT_INT32", "INT64": "DT_INT64", "UINT8": "DT_UINT8", "UINT16": "DT_UINT16", "UINT32": "DT_UINT32",
    "UINT64": "DT_UINT64", "BOOL": "DT_BOOL", "BYTES": "DT_STRING",
}
V2_HEADER_LENGTH = "Inference-Header-Content-Length"


def v2_input_specs(metadata: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{input name: (per-row shape, v2 datatype)} from v2 model metadata; -1 past the rows is 1."""
    return {tensor["name"]: (tuple(1 if size < 0 else size for size in tensor["shape"][1:]), tensor["datatype"])
            for tensor in metadata["inputs"]}


def v2_request(specs: dict[str, tuple[tuple[int, ...], str]], rows: int, rng: np.random.Generator) -> tuple[bytes, int]:
    """A v2 infer body (JSON header, then binary data) and its header's length, as tritonclient builds one."""
    tensors, chunks = [], []
    for name, (shape, datatype) in specs.items():
        if datatype not in V2_DATATYPES:
            raise ValueError(f"no random input for datatype {datatype}")
        tensor = {"name": name, "datatype": datatype, "shape": [rows, *shape]}
        values = [random_value(shape, V2_DATATYPES[datatype], rng, as_array=datatype != "BYTES") for _ in range(rows)]
        if datatype == "BYTES":
            tensor["data"] = values
        else:
            chunks.append(np.ascontiguousarray(values).tobytes())
            tensor["parameters"] = {"binary_data_size": len(chunks[-1])}
        tensors.append(tensor)
    header = orjson.dumps({"inputs": tensors, "parameters": {"binary_data_output": True}})
    return header + b"".join(chunks), len(header)


def v2_specs_for(host: str) -> dict[str, tuple[tuple[int, ...], str]]:
    with _specs_lock:
        key = f"v2 {host}"
        if key not in _specs_by_host:
            url = f"{host.rstrip('/')}/v2/models/{MODEL}"
            answer = requests.get(url, timeout=30)
            if answer.status_code != 200:
                raise RuntimeError(f"GET {url} answered {answer.status_code}: {answer.text[:200]}")
            _specs_by_host[key] = v2_input_specs(answer.json())
        return _specs_by_host[key]


class V2InferUser(FastHttpUser):
    """The Open Inference Protocol over HTTP, with binary tensor data (LOCUST_PROTOCOL=v2)."""

    abstract = PROTOCOL != "v2"
    wait_time = between(WAIT_MIN, WAIT_MAX)

    def on_start(self) -> None:
        self.specs = v2_specs_for(self.host)
        self.rng = np.random.default_rng()
        self.path = f"/v2/models/{MODEL}/infer"

    @task
    def infer(self) -> None:
        body, header_length = v2_request(self.specs, ROWS, self.rng)
        headers = {"Content-Type": "application/octet-stream", V2_HEADER_LENGTH: str(header_length)}
        with self.client.post(self.path, data=body, headers=headers, name=self.path,
                              catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {(response.text or '')[:200]}")
                return
            try:
                length = int(response.headers.get(V2_HEADER_LENGTH) or len(response.content))
                answered = [output["shape"][0] for output in orjson.loads(response.content[:length])["outputs"]]
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                response.failure(f"no outputs in the answer: {type(exc).__name__}: {exc}")
                return
            if not answered or any(rows != ROWS for rows in answered):
                response.failure(f"outputs of {answered} rows for {ROWS} rows")
                return
            batch_tally.add(response.headers)


GRPC_PREDICT = "/tensorflow.serving.PredictionService/Predict"


def grpc_target(host: str) -> str:
    """host:port from --host, with or without a grpc:// scheme."""
    return host.split("://", 1)[1] if "://" in host else host


class GrpcPredictUser(User):
    """Calls PredictionService/Predict over one channel (one connection) per user.

    Locust runs under gevent: grpc is told so before any channel exists, or each call would
    block every other user. TensorFlow Serving's stubs import TensorFlow's protos (and so
    TensorFlow): only LOCUST_PROTOCOL=grpc pays for that.
    """

    abstract = PROTOCOL != "grpc"
    wait_time = between(WAIT_MIN, WAIT_MAX)

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(grpc_target(self.host))
        self.stub = prediction_service_pb2_grpc.PredictionServiceStub(self.channel)
        self.specs = grpc_specs_for(self.host, self.stub)
        self.rng = np.random.default_rng()

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def predict(self) -> None:
        request = grpc_request(self.specs, ROWS, self.rng)
        started = time.perf_counter()
        response, exception = None, None
        try:
            response = self.stub.Predict(request, timeout=60)
            rows = {proto.tensor_shape.dim[0].size if proto.tensor_shape.dim else 0
                    for proto in response.outputs.values()}
            if rows != {ROWS}:
                exception = WrongAnswer(f"{sorted(rows)} output rows for {ROWS} rows")
        except grpc.RpcError as exc:
            exception = exc
        self.environment.events.request.fire(
            request_type="grpc", name=GRPC_PREDICT, response_time=(time.perf_counter() - started) * 1000,
            response_length=response.ByteSize() if response is not None else 0, exception=exception,
            context={}, response=response)


class WrongAnswer(Exception):
    pass


_grpc_specs_by_host: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}


def grpc_specs_for(host: str, stub: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """The model's input specs from GetModelMetadata, once per host, outside Locust's statistics."""
    with _specs_lock:
        if host not in _grpc_specs_by_host:
            request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
            request.model_spec.name = MODEL
            response = stub.GetModelMetadata(request, timeout=30)
            signatures = get_model_metadata_pb2.SignatureDefMap()
            response.metadata["signature_def"].Unpack(signatures)
            inputs = signatures.signature_def["serving_default"].inputs
            _grpc_specs_by_host[host] = {
                name: (tuple(1 if dim.size < 0 else dim.size for dim in info.tensor_shape.dim[1:]),
                       types_pb2.DataType.Name(info.dtype))
                for name, info in inputs.items()}
        return _grpc_specs_by_host[host]


def grpc_request(specs: dict[str, tuple[tuple[int, ...], str]], rows: int, rng: np.random.Generator) -> Any:
    """A PredictRequest of random rows: tensor_content for numbers, string_val for strings."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name = MODEL
    for name, (shape, dtype_name) in specs.items():
        tensor = request.inputs[name]
        tensor.dtype = types_pb2.DataType.Value(dtype_name)
        for size in (rows, *shape):
            tensor.tensor_shape.dim.add().size = size
        values = np.asarray([random_value(shape, dtype_name, rng) for _ in range(rows)])
        if dtype_name == "DT_STRING":
            tensor.string_val.extend(value.encode() for value in values.flat)
        else:
            dtype = np.dtype(_bfloat16() if dtype_name == "DT_BFLOAT16" else NUMPY_DTYPES[dtype_name])
            tensor.tensor_content = values.astype(dtype.newbyteorder("<")).tobytes()
    return request


V2_GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"


class V2GrpcInferUser(User):
    """The Open Inference Protocol over gRPC (LOCUST_PROTOCOL=v2-grpc): ModelInfer, one channel per user."""

    abstract = PROTOCOL != "v2-grpc"
    wait_time = between(WAIT_MIN, WAIT_MAX)

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(grpc_target(self.host))
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.specs = v2_grpc_specs_for(self.host, self.stub)
        self.rng = np.random.default_rng()

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def infer(self) -> None:
        request = v2_grpc_request(self.specs, ROWS, self.rng)
        started = time.perf_counter()
        response, exception = None, None
        try:
            response = self.stub.ModelInfer(request, timeout=60)
            rows = {output.shape[0] if output.shape else 0 for output in response.outputs}
            if rows != {ROWS}:
                exception = WrongAnswer(f"{sorted(rows)} output rows for {ROWS} rows")
        except grpc.RpcError as exc:
            exception = exc
        self.environment.events.request.fire(
            request_type="grpc", name=V2_GRPC_INFER, response_time=(time.perf_counter() - started) * 1000,
            response_length=response.ByteSize() if response is not None else 0, exception=exception,
            context={}, response=response)


def v2_grpc_specs_for(host: str, stub: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """The model's input specs from ModelMetadata, once per host, outside Locust's statistics."""
    with _specs_lock:
        key = f"v2-grpc {host}"
        if key not in _grpc_specs_by_host:
            metadata = stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=MODEL), timeout=30)
            _grpc_specs_by_host[key] = v2_input_specs(
                {"inputs": [{"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
                            for tensor in metadata.inputs]})
        return _grpc_specs_by_host[key]


def v2_grpc_request(specs: dict[str, tuple[tuple[int, ...], str]], rows: int, rng: np.random.Generator) -> Any:
    """A ModelInferRequest of random rows, every input in raw_input_contents as tritonclient sends it."""
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    for name, (shape, datatype) in specs.items():
        if datatype not in V2_DATATYPES:
            raise ValueError(f"no random input for datatype {datatype}")
        request.inputs.add(name=name, datatype=datatype, shape=[rows, *shape])
        values = [random_value(shape, V2_DATATYPES[datatype], rng, as_array=datatype != "BYTES") for _ in range(rows)]
        if datatype == "BYTES":
            # Each element as a 4-byte little-endian length, then its bytes.
            items = [str(item).encode() for item in np.asarray(values).flat]
            request.raw_input_contents.append(
                b"".join(len(item).to_bytes(4, "little") + item for item in items))
        else:
            request.raw_input_contents.append(np.ascontiguousarray(values).tobytes())
    return request


def _bfloat16() -> Any:
    import ml_dtypes  # TensorFlow's numpy extension types

    return ml_dtypes.bfloat16


def step_users(run_time: float, *, step_seconds: float, max_users: int, hold_seconds: float) -> int | None:
    """Users wanted `run_time` seconds into a step ramp; None once the ramp and hold are over."""
    if run_time >= step_seconds * max_users + hold_seconds:
        return None
    return min(max_users, int(run_time // step_seconds) + 1)


class StepShape(LoadTestShape):
    """One more user every `step_seconds`, up to `max_users`; hold for `hold_seconds`; stop.

    Locust lets a shape class found in the locustfile take over every run, so this one
    is abstract (invisible to Locust) unless LOCUST_SHAPE=step.
    """

    abstract = SHAPE != "step"

    def __init__(self, *, step_seconds: float | None = None, max_users: int | None = None,
                 hold_seconds: float | None = None) -> None:
        super().__init__()
        self.step_seconds = (step_seconds if step_seconds is not None
                             else _env_number("LOCUST_STEP_SECONDS", 10.0, minimum=0.001))
        self.max_users = max_users if max_users is not None else _env_number(
            "LOCUST_STEP_USERS_MAX", 50, kind=int, minimum=1)
        self.hold_seconds = (hold_seconds if hold_seconds is not None
                             else _env_number("LOCUST_STEP_HOLD_SECONDS", self.step_seconds))

    def tick(self) -> tuple[int, float] | None:
        users = step_users(self.get_run_time(), step_seconds=self.step_seconds,
                           max_users=self.max_users, hold_seconds=self.hold_seconds)
        # Each step adds one user: spawn it at once rather than spreading it over the step.
        return None if users is None else (users, float(self.max_users))
