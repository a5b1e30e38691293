"""TensorFlow Serving's gRPC API, served by each Gunicorn worker beside its HTTP port.

Every worker starts a `grpc.server` on GRPC_BIND once its app and models are loaded
(Gunicorn's post_worker_init: grpc's threads must not exist before the fork, and the
master never imports grpc). All workers bind the same port with SO_REUSEPORT, so the
kernel spreads connections over them as it does for Gunicorn's shared socket.

Services: PredictionService (Predict, Classify, Regress, GetModelMetadata), ModelService
(GetModelStatus) and grpc.health.v1.Health, which answers SERVING exactly when /readyz
answers 200. `model_spec` takes a name, a version or a version_label, and a signature. A call
goes through the registry and batchers REST uses: the same validation, row limit, queue,
deadline (the client's gRPC deadline, capped by REQUEST_TIMEOUT_MS) and errors, mapped to
TensorFlow Serving's status codes in `STATUS_CODES`. Each call is counted in
model_server_requests (route: the full method name, method: GRPC, status: the code's name)
and written to the access log, like an HTTP request.

On SIGTERM the server stops taking calls at once and lets every accepted one finish; the
worker's exit waits for them before the batchers close.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np
from flask import Flask
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow.core.example import example_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
    status_pb2,
)

from app import classify, errors, grpc_limits, logs, tensor_proto
from app.logs import access_log, accept_request_id
from app.models import DEFAULT_SIGNATURE, LoadedModel, Signature, TensorInfo
from app.registry import Servable

log = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"


class SignatureNotFound(errors.BadRequest):
    """TensorFlow Serving answers an unknown signature_name with FAILED_PRECONDITION."""


# The one map from the server's errors to gRPC status codes; the most specific class wins.
# TensorFlow Serving's own choices: model_servers/get_model_metadata_impl.cc and
# predict_util.cc (INVALID_ARGUMENT, FAILED_PRECONDITION), core/server_core.cc (NOT_FOUND),
# and the batching library's "Task size ... is larger than maximum input batch size"
# (INVALID_ARGUMENT) for a request over the row limit.
STATUS_CODES: dict[type[errors.ServingError], grpc.StatusCode] = {
    errors.ServingError: grpc.StatusCode.INTERNAL,
    errors.BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SignatureNotFound: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.MethodNotAllowed: grpc.StatusCode.UNIMPLEMENTED,
    errors.PayloadTooLarge: grpc.StatusCode.INVALID_ARGUMENT,
    errors.PredictFailed: grpc.StatusCode.INTERNAL,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_code(exc: errors.ServingError) -> grpc.StatusCode:
    return next(STATUS_CODES[cls] for cls in type(exc).__mro__ if cls in STATUS_CODES)


class ModelsAdapter:
    """Everything the gRPC services ask of the model registry, in one place."""

    def __init__(self, app: Flask) -> None:
        self._registry = app.extensions["models"]
        self._timeout_s = app.extensions["settings"].request_timeout_ms / 1000.0

    def get(self, model_spec: Any) -> tuple[Servable, bool]:
        """The servable the spec names, and whether it was pinned (by version or label)."""
        version = model_spec.version.value if model_spec.HasField("version") else None
        label = model_spec.version_label or None
        servable = self._registry.get(model_spec.name or None, version, label=label)
        return servable, version is not None or label is not None

    def predict(self, servable: Servable, inputs: dict[str, np.ndarray], *, signature: Signature, pinned: bool,
                time_remaining_s: float | None) -> tuple[Servable, Any]:
        timeout_s = self._timeout_s if time_remaining_s is None else min(self._timeout_s, time_remaining_s)
        if timeout_s <= 0:
            raise errors.DeadlineExceeded("the call's deadline passed before it was queued")
        return self._registry.predict(servable, inputs, timeout_s=timeout_s, signature_name=signature.name,
                                      pinned=pinned)

    def status(self, model_spec: Any) -> list[dict[str, Any]]:
        version = model_spec.version.value if model_spec.HasField("version") else None
        return self._registry.model_status(model_spec.name or self._registry.default_name, version,
                                           label=model_spec.version_label or None)

    @property
    def ready(self) -> bool:
        return self._registry.ready


class _Call:
    """What one call's access-log line and metrics say about it."""

    __slots__ = ("rows", "batch_rows", "batch_requests", "model")

    def __init__(self) -> None:
        self.rows: int | None = None
        self.batch_rows: int | None = None
        self.batch_requests: int | None = None
        self.model: str | None = None


class _Observed:
    """Wraps each handler: status mapping, metrics, access log and request id, once for all."""

    def __init__(self, metrics: Any) -> None:
        self._metrics = metrics

    def __call__(self, route: str, handler: Callable[[Any, _Call, grpc.ServicerContext], Any]) -> Callable:
        seconds = self._metrics.request_seconds.labels(route)

        def observed(request: Any, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            request_id = accept_request_id(dict(context.invocation_metadata()).get(REQUEST_ID_KEY, ""))
            context.send_initial_metadata(((REQUEST_ID_KEY, request_id),))
            call = _Call()
            code, message = grpc.StatusCode.OK, ""
            self._metrics.in_flight.inc()
            try:
                return handler(request, call, context)
            except errors.ServingError as exc:
                code, message = status_code(exc), exc.message
            except Exception as exc:
                log.exception("unhandled error in %s", route)
                code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
            finally:
                self._metrics.in_flight.dec()
                self._metrics.requests.labels(route, "GRPC", code.name).inc()
                seconds.observe(time.perf_counter() - started)
                _log_access(route, code, started, call, request_id)
            context.abort(code, message)

        return observed


def _log_access(route: str, code: grpc.StatusCode, started: float, call: _Call, request_id: str) -> None:
    if access_log.isEnabledFor(logging.INFO):
        fields = {
            "method": "GRPC",
            "path": route,
            "status": code.name,
            "latency_ms": round((time.perf_counter() - started) * 1000, 3),
            "rows": call.rows,
            "batch_rows": call.batch_rows,
            "batch_requests": call.batch_requests,
            "model": call.model,
            "request_id": request_id,
        }
        logs.log_access(fields, writer=logs.process_writer())


def predict_signature(servable: Servable, signature_name: str) -> Signature:
    # An empty name is serving_default, as in TF Serving (model_servers/predict_util.cc).
    key = signature_name or DEFAULT_SIGNATURE
    signature = servable.model.signatures.get(key)
    if signature is None:
        raise SignatureNotFound(f'Serving signature key "{key}" not found.')
    return signature


def example_signature(servable: Servable, signature_name: str, method: str) -> tuple[Signature, str]:
    """Classify's or Regress's signature, checked as the REST API checks it, and its input's name."""
    model = servable.model
    if not signature_name and DEFAULT_SIGNATURE not in model.signatures:
        signature_name = model.default_signature
    signature = model.signatures.get(signature_name or DEFAULT_SIGNATURE)
    if signature is None:
        # TF Serving's words (servables/tensorflow/classifier.cc, regressor.cc).
        raise errors.BadRequest(f"No signature was found with the name: {signature_name or DEFAULT_SIGNATURE}")
    return signature, classify.check_signature(signature, method)


def serialized_examples(model_input: Any, *, max_rows: int) -> np.ndarray:
    """One serialized tf.Example per example; context features merged in, the example's own winning.

    TF Serving concatenates the serialized context and example (servables/tensorflow/util.cc),
    which parses as this merge.
    """
    kind = model_input.WhichOneof("kind")
    if kind == "example_list":
        examples, context = model_input.example_list.examples, None
    elif kind == "example_list_with_context":
        examples, context = model_input.example_list_with_context.examples, model_input.example_list_with_context.context
    else:
        examples, context = [], None
    if not examples:
        raise errors.InvalidInput("Input is empty.")
    if len(examples) > max_rows:
        # Refused before any example is serialized, as the REST API refuses them before building.
        raise errors.PayloadTooLarge(f"the request holds {len(examples)} examples; this model takes at most "
                                     f"{max_rows} rows per request (MAX_REQUEST_ROWS)")
    serialized = np.empty(len(examples), dtype=object)
    for index, example in enumerate(examples):
        if context is not None:
            merged = example_pb2.Example()
            for name, feature in [*context.features.feature.items(), *example.features.feature.items()]:
                merged.features.feature[name].CopyFrom(feature)
            example = merged
        serialized[index] = example.SerializeToString()
    return serialized


def _set_model_spec(target: Any, model: LoadedModel, signature_name: str | None) -> None:
    target.name = model.name
    target.version.value = model.version
    if signature_name is not None:
        target.signature_name = signature_name


def decode_inputs(request: Any, model: Signature, *, max_rows: int, max_bytes: int) -> dict[str, np.ndarray]:
    wanted = {spec.name for spec in model.inputs}
    given = set(request.inputs.keys())
    if given != wanted:
        raise errors.InvalidInput(
            f"input size does not match signature: {len(given)}!={len(wanted)} len({_names(given)}) != "
            f"len({_names(wanted)}). Sent extra: {_names(given - wanted)}. "
            f"Missing but required: {_names(wanted - given)}.")
    return {spec.name: tensor_proto.to_ndarray(request.inputs[spec.name], spec, f"inputs['{spec.name}']",
                                               max_rows=max_rows, max_bytes=max_bytes)
            for spec in model.inputs}


def output_specs(output_filter: Any, model: Signature) -> list[TensorInfo]:
    if not output_filter:
        return list(model.outputs)
    by_name = {spec.name: spec for spec in model.outputs}
    chosen: list[TensorInfo] = []
    for alias in output_filter:
        if alias not in by_name:
            raise errors.InvalidInput(f"output tensor alias not found in signature: {alias} Outputs expected "
                                      f"to be in the set {_names(by_name)}.")
        if by_name[alias] in chosen:
            raise errors.InvalidInput(f"duplicate output tensor alias: {alias}")
        chosen.append(by_name[alias])
    return chosen


def _names(names: Any) -> str:
    return "{" + ",".join(sorted(names)) + "}"


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, models: ModelsAdapter, observed: _Observed, *, max_bytes: int) -> None:
        # MultiInference stays the base class's UNIMPLEMENTED.
        self.Predict = observed("/tensorflow.serving.PredictionService/Predict", self._predict)
        self.Classify = observed("/tensorflow.serving.PredictionService/Classify", self._classify)
        self.Regress = observed("/tensorflow.serving.PredictionService/Regress", self._regress)
        self.GetModelMetadata = observed("/tensorflow.serving.PredictionService/GetModelMetadata", self._metadata)
        self._models = models
        self._max_bytes = max_bytes

    def _servable(self, request: Any, call: _Call) -> tuple[Servable, bool]:
        if not request.HasField("model_spec"):
            raise errors.BadRequest("Missing ModelSpec")
        servable, pinned = self._models.get(request.model_spec)
        call.model = servable.model.name
        return servable, pinned

    def _predict(self, request: Any, call: _Call, context: grpc.ServicerContext) -> Any:
        servable, pinned = self._servable(request, call)
        signature = predict_signature(servable, request.model_spec.signature_name)
        outputs = output_specs(request.output_filter, signature)
        inputs = decode_inputs(request, signature, max_rows=servable.batchers[signature.name].max_request_rows,
                               max_bytes=self._max_bytes)
        call.rows = next(iter(inputs.values())).shape[0]
        servable, result = self._models.predict(servable, inputs, signature=signature, pinned=pinned,
                                                time_remaining_s=context.time_remaining())
        call.batch_rows, call.batch_requests = result.batch_rows, result.batch_requests
        response = predict_pb2.PredictResponse()
        _set_model_spec(response.model_spec, servable.model, signature.name)
        for spec in outputs:
            tensor_proto.from_ndarray(result.outputs[spec.name], spec.tf_dtype, response.outputs[spec.name])
        return response

    def _examples(self, request: Any, call: _Call, context: grpc.ServicerContext,
                  method: str) -> tuple[Servable, Signature, dict[str, np.ndarray], int]:
        servable, pinned = self._servable(request, call)
        signature, input_name = example_signature(servable, request.model_spec.signature_name, method)
        examples = serialized_examples(request.input, max_rows=servable.batchers[signature.name].max_request_rows)
        call.rows = rows = len(examples)
        servable, result = self._models.predict(servable, {input_name: examples}, signature=signature, pinned=pinned,
                                                time_remaining_s=context.time_remaining())
        call.batch_rows, call.batch_requests = result.batch_rows, result.batch_requests
        return servable, signature, result.outputs, rows

    def _classify(self, request: Any, call: _Call, context: grpc.ServicerContext) -> Any:
        servable, signature, outputs, rows = self._examples(request, call, context, classify.CLASSIFY)
        response = classification_pb2.ClassificationResponse()
        _set_model_spec(response.model_spec, servable.model, signature.name)
        classes, scores = outputs.get("classes"), outputs.get("scores")
        if classes is None and scores is None:
            raise errors.BadRequest("Expected classification signature outputs to contain 'classes' or 'scores'")
        width = (classes if classes is not None else scores).reshape(rows, -1).shape[1]
        for row in range(rows):
            classifications = response.result.classifications.add()
            for column in range(width):
                entry = classifications.classes.add()
                if classes is not None:
                    entry.label = _text(classes.reshape(rows, width)[row, column])
                if scores is not None:
                    entry.score = float(scores.reshape(rows, width)[row, column])
        return response

    def _regress(self, request: Any, call: _Call, context: grpc.ServicerContext) -> Any:
        servable, signature, outputs, rows = self._examples(request, call, context, classify.REGRESS)
        values = np.asarray(outputs.get("outputs", next(iter(outputs.values()))))
        if values.size != rows:
            raise errors.BadRequest(f"Expected output Tensor shape to be [{rows}] or [{rows}, 1]; "
                                    f"got {list(values.shape)}")
        response = regression_pb2.RegressionResponse()
        _set_model_spec(response.model_spec, servable.model, signature.name)
        for value in values.reshape(rows).astype(np.float32).tolist():
            response.result.regressions.add().value = value
        return response

    def _metadata(self, request: Any, call: _Call, context: grpc.ServicerContext) -> Any:
        if not request.HasField("model_spec"):
            raise errors.BadRequest("Missing ModelSpec")
        if not request.metadata_field:
            raise errors.BadRequest("GetModelMetadataRequest must specify at least one metadata_field")
        for field in request.metadata_field:
            if field != "signature_def":
                raise errors.BadRequest(f"Metadata field {field} is not supported")
        model = self._models.get(request.model_spec)[0].model
        call.model = model.name
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        _set_model_spec(response.model_spec, model, None)
        signatures = get_model_metadata_pb2.SignatureDefMap()
        for key, signature in sorted(model.signatures.items()):
            signatures.signature_def[key].CopyFrom(signature_def(signature))
        response.metadata["signature_def"].Pack(signatures)
        return response


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def signature_def(signature: Signature) -> Any:
    """The same signature as the REST metadata (app/metadata.py), as a SignatureDef proto."""
    proto = meta_graph_pb2.SignatureDef(method_name=signature.method_name)
    for target, specs, prefix in ((proto.inputs, signature.inputs, f"{signature.name}_"),
                                  (proto.outputs, signature.outputs, "")):
        for spec in specs:
            info = target[spec.name]
            info.name = f"{prefix}{spec.name}:0"
            info.dtype = types_pb2.DataType.Value(spec.tf_dtype)
            info.tensor_shape.dim.add().size = -1
            for dim in spec.shape:
                info.tensor_shape.dim.add().size = -1 if dim is None else dim
    return proto


_ERROR_CODES = status_pb2.StatusProto.DESCRIPTOR.fields_by_name["error_code"].enum_type.values_by_name


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, models: ModelsAdapter, observed: _Observed) -> None:
        # HandleReloadConfigRequest stays the base class's UNIMPLEMENTED: models come from settings.
        self.GetModelStatus = observed("/tensorflow.serving.ModelService/GetModelStatus", self._status)
        self._models = models

    def _status(self, request: Any, call: _Call, context: grpc.ServicerContext) -> Any:
        if not request.HasField("model_spec"):
            raise errors.BadRequest("Missing ModelSpec")
        statuses = self._models.status(request.model_spec)
        call.model = request.model_spec.name or None
        response = get_model_status_pb2.GetModelStatusResponse()
        for entry in statuses:
            status = response.model_version_status.add()
            status.version = int(entry["version"])
            status.state = get_model_status_pb2.ModelVersionStatus.State.Value(entry["state"])
            status.status.error_code = _ERROR_CODES[entry["status"]["error_code"]].number
            status.status.error_message = entry["status"]["error_message"]
        return response


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 Check, as /readyz: SERVING while every model's batch thread is alive.

    Watch stays UNIMPLEMENTED: probes (Kubernetes' grpc probe, grpc_health_probe) call Check.
    """

    SERVICES = frozenset({"", "tensorflow.serving.PredictionService", "tensorflow.serving.ModelService"})

    def __init__(self, models: ModelsAdapter) -> None:
        self._models = models
        self.stopping = False

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.service not in self.SERVICES:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        serving = self._models.ready and not self.stopping
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING)


class GrpcServer:
    """One worker's gRPC server: start after the app loaded, stop with every accepted call answered."""

    def __init__(self, app: Flask, *, bind: str, threads: int) -> None:
        # REST's body limit: MAX_REQUEST_BYTES, or the limit the app derived from it.
        max_bytes = app.config.get("MAX_CONTENT_LENGTH") or app.extensions["settings"].max_request_bytes
        models = ModelsAdapter(app)
        observed = _Observed(app.extensions["metrics"])
        self.health = HealthServicer(models)
        # Connections, streams, metadata, calls, receive timeout, Health's own threads (app/grpc_limits.py).
        self._server = grpc_limits.build_server(app.extensions["settings"], threads=threads, max_bytes=max_bytes)
        prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
            PredictionServicer(models, observed, max_bytes=max_bytes), self._server)
        model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelServicer(models, observed), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        try:
            self.port = self._server.add_insecure_port(bind)
        except RuntimeError as exc:
            raise RuntimeError(f"GRPC_BIND={bind!r}: cannot listen there: {exc}") from None
        self.bind = bind
        self._stopped: threading.Event | None = None
        self._lock = threading.Lock()

    def start(self) -> GrpcServer:
        self._server.start()
        log.info("gRPC (TensorFlow Serving's PredictionService and ModelService) on %s, pid %d",
                 self.bind, os.getpid())
        return self

    def stop(self, *, grace_s: float) -> threading.Event:
        """Refuse new calls at once; cancel those still running after grace_s. Safe to call twice."""
        with self._lock:
            if self._stopped is None:
                self.health.stopping = True
                self._stopped = self._server.stop(grace_s)
            return self._stopped

    def drain(self, *, timeout_s: float) -> bool:
        """Stop, and wait until every accepted call is answered; False if some were still running."""
        return self.stop(grace_s=timeout_s).wait(timeout_s)


def serve_in_worker(worker: Any) -> GrpcServer:
    """Gunicorn's post_worker_init: start gRPC, and stop it on SIGTERM when HTTP stops accepting."""
    app = worker.wsgi
    grace_s = float(worker.cfg.graceful_timeout)
    server = GrpcServer(app, bind=app.extensions["settings"].grpc_bind, threads=worker.cfg.threads).start()
    worker.grpc_server = server
    gunicorn_handler = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        server.stop(grace_s=grace_s)  # returns at once: the calls finish on their own threads
        if callable(gunicorn_handler):
            gunicorn_handler(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
    # As Gunicorn has it: SIGTERM does not interrupt the system calls of requests in flight.
    signal.siginterrupt(signal.SIGTERM, False)
    return server


@contextmanager
def serving(app: Flask, *, bind: str, threads: int = 16) -> Iterator[GrpcServer]:
    """A gRPC server for `app` outside Gunicorn (tests, a plain `flask run`)."""
    server = GrpcServer(app, bind=bind, threads=threads).start()
    try:
        yield server
    finally:
        server.drain(timeout_s=10)
