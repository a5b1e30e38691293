"""TensorFlow Serving's gRPC API, served by each Gunicorn worker beside its HTTP port.

Every worker starts a `grpc.aio` server on GRPC_BIND once its app and models are loaded
(Gunicorn's post_worker_init: grpc's threads must not exist before the fork, and the
master never imports grpc), on an event loop thread of its own. All workers bind the same
port with SO_REUSEPORT, so the kernel spreads connections over them as it does for
Gunicorn's shared socket.

Services: PredictionService (Predict, Classify, Regress, MultiInference, GetModelMetadata), ModelService
(GetModelStatus) and grpc.health.v1.Health, which answers SERVING exactly when /readyz
answers 200. `model_spec` takes a name, a version or a version_label, and a signature. This
module only translates protos: a call goes through the request layer REST uses
(app/core/serving.py), with the same resolution, row and byte limits, queue, deadline (the
client's gRPC deadline, capped by REQUEST_TIMEOUT_MS) and errors, mapped to TensorFlow
Serving's status codes (app/grpc/calls.py, the path every call takes). Each call is counted
in model_server_requests (route: the full method name, method: GRPC, status: the code's
name) and written to the access log, like an HTTP request, with the status its client got
(app/grpc/exchange.py). Predict and ModelInfer await their rows on the loop; the other
methods run on THREADS threads.

On SIGTERM the server stops taking calls at once and lets every accepted one finish; the
worker's exit waits for them before the batchers close.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow.core.example import example_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    inference_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
    status_pb2,
)

from app.core import errors
from app.core.batching import check_rows
from app.core.call import Call, ModelSpec
from app.core.models import LoadedModel, Signature
from app.core.services import Services
from app.core.serving import (
    Answer,
    Classes,
    Decode,
    RequestLayer,
    Task,
    braced,
    examples_decode,
    multi_inference_spec,
)
from app.grpc import calls as grpc_calls
from app.grpc import exchange as grpc_record
from app.grpc import limits as grpc_limits
from app.grpc import socket as grpc_socket
from app.grpc import tls
from app.grpc import v2 as v2_grpc
from app.ops import tfs_config
from app.ops.logs import RequestRecord
from app.wire import metadata, tensor_proto
from app.wire.priority import from_metadata as priority_from_metadata

log = logging.getLogger(__name__)


_T = TypeVar("_T")
# What wraps a servicer's method for the call path: observed(route, blocking[, on_loop]) (app/grpc/calls.py).
Observed = Callable[..., Any]


def model_spec(proto: Any) -> ModelSpec:
    return ModelSpec(proto.name or None, proto.version.value if proto.HasField("version") else None,
                     proto.version_label or None)


def serialized_examples(model_input: Any, *, max_rows: int) -> np.ndarray:
    """One serialized tf.Example per example; context features merged in, the example's own winning.

    TF Serving concatenates the serialized context and example (servables/tensorflow/util.cc),
    which parses as this merge.
    """
    kind = model_input.WhichOneof("kind")
    if kind == "example_list":
        examples, context = model_input.example_list.examples, None
    elif kind == "example_list_with_context":
        with_context = model_input.example_list_with_context
        examples, context = with_context.examples, with_context.context
    else:
        examples, context = [], None
    if not examples:
        raise errors.InvalidInput("Input is empty.")
    # Refused before any example is serialized, as the REST API refuses them before building.
    check_rows(len(examples), max_rows, unit="examples")
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
            f"input size does not match signature: {len(given)}!={len(wanted)} len({braced(given)}) != "
            f"len({braced(wanted)}). Sent extra: {braced(given - wanted)}. "
            f"Missing but required: {braced(wanted - given)}.")
    return {spec.name: tensor_proto.to_ndarray(request.inputs[spec.name], spec, f"inputs['{spec.name}']",
                                               max_rows=max_rows, max_bytes=max_bytes)
            for spec in model.inputs}


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, layer: RequestLayer, observed: Observed, *, max_bytes: int,
                 tensor_content: bool = False) -> None:
        self.Predict = observed("/tensorflow.serving.PredictionService/Predict", self._predict, self._predict_async)
        self.Classify = observed("/tensorflow.serving.PredictionService/Classify", self._classify)
        self.Regress = observed("/tensorflow.serving.PredictionService/Regress", self._regress)
        self.GetModelMetadata = observed("/tensorflow.serving.PredictionService/GetModelMetadata", self._metadata)
        self.MultiInference = observed("/tensorflow.serving.PredictionService/MultiInference", self._multi_inference)
        self._layer = layer
        self._max_bytes = max_bytes
        self._tensor_content = tensor_content

    def _call(self, request: Any, record: RequestRecord, context: grpc.ServicerContext, *,
              outputs: tuple[str, ...] = ()) -> Call:
        if not request.HasField("model_spec"):
            raise errors.BadRequest("Missing ModelSpec")
        return grpc_record.make_call(model_spec(request.model_spec), record, context,
                                self._layer.deadline_s(context.time_remaining()),
                                signature=request.model_spec.signature_name, outputs=outputs,
                                priority=priority_from_metadata(context.invocation_metadata()))

    def _predict(self, request: Any, record: RequestRecord, context: grpc.ServicerContext) -> Any:
        call, decode = self._predict_call(request, record, context)
        return self._predict_response(self._layer.infer(call, decode))

    async def _predict_async(self, request: Any, record: RequestRecord, context: grpc.ServicerContext) -> Any:
        call, decode = self._predict_call(request, record, context)
        return self._predict_response(await self._layer.infer_async(call, decode))

    def _predict_call(self, request: Any, record: RequestRecord, context: grpc.ServicerContext) -> tuple[Call, Decode]:
        call = self._call(request, record, context, outputs=tuple(request.output_filter))
        return call, lambda signature, max_rows: decode_inputs(request, signature, max_rows=max_rows,
                                                               max_bytes=self._max_bytes)

    def _predict_response(self, answer: Answer) -> Any:
        response = predict_pb2.PredictResponse()
        _set_model_spec(response.model_spec, answer.servable.model, answer.signature.name)
        for output in answer.selected:
            tensor_proto.from_ndarray(answer.outputs[output.name], output.tf_dtype, response.outputs[output.name],
                                      tensor_content=self._tensor_content)
        return response

    def _examples(self, request: Any, record: RequestRecord, context: grpc.ServicerContext,
                  method: Callable[[Call, Decode], tuple[Answer, Any]], response: Any) -> Any:
        """Classify or Regress: the layer's `method` over the request's tf.Examples, into `response`."""
        call = self._call(request, record, context)
        answer, result = method(call, _examples(request))
        _set_model_spec(response.model_spec, answer.servable.model, answer.signature.name)
        return result

    def _classify(self, request: Any, record: RequestRecord, context: grpc.ServicerContext) -> Any:
        response = classification_pb2.ClassificationResponse()
        _fill_classes(response.result, self._examples(request, record, context, self._layer.classify, response))
        return response

    def _regress(self, request: Any, record: RequestRecord, context: grpc.ServicerContext) -> Any:
        response = regression_pb2.RegressionResponse()
        for value in self._examples(request, record, context, self._layer.regress, response).tolist():
            response.result.regressions.add().value = value
        return response

    def _multi_inference(self, request: Any, record: RequestRecord, context: grpc.ServicerContext) -> Any:
        tasks = [Task(task.model_spec.name, task.model_spec.signature_name, task.method_name)
                 for task in request.tasks]
        spec = multi_inference_spec(model_spec(request.tasks[0].model_spec) if tasks else ModelSpec())
        call = grpc_record.make_call(spec, record, context, self._layer.deadline_s(context.time_remaining()))
        servable, results = self._layer.multi_inference(call, tasks, _examples(request))
        response = inference_pb2.MultiInferenceResponse()
        for result in results:
            entry = response.results.add()
            _set_model_spec(entry.model_spec, servable.model, result.signature.name)
            if result.classes is not None:
                _fill_classes(entry.classification_result, result.classes)
            elif result.regressions is not None:
                entry.regression_result.regressions.extend(
                    regression_pb2.Regression(value=value) for value in result.regressions.tolist())
        return response

    def _metadata(self, request: Any, record: RequestRecord, context: grpc.ServicerContext) -> Any:
        if not request.HasField("model_spec"):
            raise errors.BadRequest("Missing ModelSpec")
        if not request.metadata_field:
            raise errors.BadRequest("GetModelMetadataRequest must specify at least one metadata_field")
        for field in request.metadata_field:
            if field != "signature_def":
                raise errors.BadRequest(f"Metadata field {field} is not supported")
        model = self._layer.model(model_spec(request.model_spec), record).model
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        _set_model_spec(response.model_spec, model, None)
        signatures = get_model_metadata_pb2.SignatureDefMap()
        for key, signature in sorted(model.signatures.items()):
            signatures.signature_def[key].CopyFrom(metadata.signature_def(signature))
        response.metadata["signature_def"].Pack(signatures)
        return response


def _examples(request: Any) -> Decode:
    return examples_decode(lambda max_rows: serialized_examples(request.input, max_rows=max_rows))


def _fill_classes(target: Any, classes: Classes) -> None:
    for labels, scores in zip(classes.labels, classes.scores.tolist(), strict=True):
        classifications = target.classifications.add()
        for label, score in zip(labels, scores, strict=True):
            classifications.classes.add(label=label, score=score)


_ERROR_CODES = status_pb2.StatusProto.DESCRIPTOR.fields_by_name["error_code"].enum_type.values_by_name


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, layer: RequestLayer, observed: Observed) -> None:
        self.GetModelStatus = observed("/tensorflow.serving.ModelService/GetModelStatus", self._status)
        self.HandleReloadConfigRequest = observed("/tensorflow.serving.ModelService/HandleReloadConfigRequest",
                                                  self._reload)
        self._layer = layer

    def _reload(self, request: Any, record: RequestRecord, context: grpc.ServicerContext) -> Any:
        """Serve the models of request.config, live, in every worker: answered once all applied it,
        or with what failed where, within the call's deadline (app/core/shared_config.py; with
        MODEL_PROCESSES, every model process and every worker)."""
        if request.config.WhichOneof("config") != "model_config_list":
            # TF Serving's words (model_servers/model_service_impl.cc).
            raise errors.BadRequest("ServerModelConfig type not supported by HandleReloadConfigRequest. "
                                    "Only ModelConfigList is currently supported")
        try:
            document = tfs_config.model_config_document(request.config)
        except tfs_config.FlagError as exc:
            raise errors.BadRequest(str(exc)) from None
        # With MODEL_PROCESSES, the registry asks the model processes (app/model_process/client.py).
        self._layer.registry.reload_config(document, timeout_s=context.time_remaining())
        response = model_management_pb2.ReloadConfigResponse()
        response.status.error_code = _ERROR_CODES["OK"].number
        return response

    def _status(self, request: Any, record: RequestRecord, context: grpc.ServicerContext) -> Any:
        if not request.HasField("model_spec"):
            raise errors.BadRequest("Missing ModelSpec")
        statuses = self._layer.model_status(model_spec(request.model_spec))
        record.model = request.model_spec.name or None
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

    def __init__(self, layer: RequestLayer) -> None:
        self._layer = layer
        self.stopping = False

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.service not in self.SERVICES:
            raise errors.NotFound(f"unknown service {request.service!r}")
        serving = self._layer.ready and not self.stopping
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING)


class GrpcServer:
    """One worker's gRPC server, on an event loop thread of its own: start after the app loaded,
    stop with every accepted call answered."""

    def __init__(self, services: Services, *, bind: str, threads: int) -> None:
        self.bind = bind
        self.health = HealthServicer(services.layer)
        self._stopped: threading.Event | None = None
        self._lock = threading.Lock()
        self._threads = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc")
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._run_loop, name="grpc-loop", daemon=True)
        self._loop_thread.start()
        try:
            self._server, self.port = self._on_loop(self._build(services, bind, threads))
        except BaseException:
            self._close_loop()
            raise

    async def _build(self, services: Services, bind: str, threads: int) -> tuple[grpc.aio.Server, int]:
        models, settings = services.layer, services.settings
        max_bytes = models.max_request_bytes  # REST's body limit: MAX_REQUEST_BYTES, or derived from the models
        repository = services.repository
        path = grpc_calls.CallPath(
            models.requests, max_calls=threads, receive_timeout_s=settings.grpc_receive_timeout_ms / 1000.0,
            threads=self._threads, tracing=services.tracing, restricted=v2_grpc.restriction(repository))
        # Connections, streams, metadata and messages (app/grpc/limits.py); calls and their
        # message's wait, the record, the trace, errors to codes (app/grpc/calls.py).
        server = grpc_limits.build_server(settings, max_bytes=max_bytes, threads=self._threads, path=path)
        prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
            PredictionServicer(models, grpc_calls.observed, max_bytes=max_bytes,
                               tensor_content=settings.grpc_tensor_content), server)
        model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelServicer(models, grpc_calls.observed), server)
        v2_grpc.add_to_server(server, models, repository, grpc_calls.observed)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            port = tls.add_port(server, bind, settings.grpc_ssl_config_file)
        except RuntimeError as exc:
            raise RuntimeError(f"GRPC_BIND={bind!r}: cannot listen there: {exc}") from None
        return server, port

    def _on_loop(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def start(self) -> GrpcServer:
        self._on_loop(self._server.start())
        log.info("gRPC (TensorFlow Serving's PredictionService and ModelService) on %s, pid %d",
                 self.bind, os.getpid())
        return self

    def stop(self, *, grace_s: float) -> threading.Event:
        """Refuse new calls at once; cancel those still running after grace_s. Safe to call twice."""
        with self._lock:
            if self._stopped is None:
                self.health.stopping = True
                stopped = self._stopped = threading.Event()

                def ended(_future: Any) -> None:
                    self._threads.shutdown(wait=False)
                    self._close_loop()
                    stopped.set()

                asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop).add_done_callback(ended)
            return self._stopped

    def drain(self, *, timeout_s: float) -> bool:
        """Stop, and wait until every accepted call is answered; False if some were still running."""
        return self.stop(grace_s=timeout_s).wait(timeout_s)

    def _run_loop(self) -> None:
        self._loop.run_forever()
        self._loop.close()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def serve_in_worker(worker: Any) -> GrpcServer | None:
    """Gunicorn's post_worker_init: start gRPC, and refuse new calls as soon as a stop is asked.

    The stop runs on the worker's stopping thread, not in a signal handler: gRPC's stop takes
    locks and starts a thread, and a second signal would interrupt the first one's handler
    while it holds them (app/worker.py). None when the worker was asked to stop while starting.
    """
    services = getattr(worker.wsgi, "services", None)
    if services is None or not worker.alive:
        return None
    grace_s = float(worker.cfg.graceful_timeout)
    settings = services.settings

    def serve(bind: str) -> GrpcServer:
        return GrpcServer(services, bind=bind, threads=worker.cfg.threads).start()

    if settings.grpc_socket_path:
        # One worker at a time serves the Unix socket; the others wait to take it over.
        owner = grpc_socket.SocketOwner(settings.grpc_socket_path, serve).start()
        worker.grpc_socket = owner
        worker.when_stopping(lambda: owner.stop(grace_s=grace_s))
    if not settings.grpc_bind:
        return None
    server = serve(settings.grpc_bind)
    worker.grpc_server = server
    worker.when_stopping(lambda: server.stop(grace_s=grace_s))
    return server


@contextmanager
def serving(services: Services, *, bind: str, threads: int = 16) -> Iterator[GrpcServer]:
    """A gRPC server for `services` outside Gunicorn (tests, a plain `flask run`)."""
    server = GrpcServer(services, bind=bind, threads=threads).start()
    try:
        yield server
    finally:
        server.drain(timeout_s=10)
