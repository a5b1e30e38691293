"""The Open Inference Protocol (KServe v2) over gRPC: `inference.GRPCInferenceService`, on the
gRPC port TF Serving's services use (kserve/open-inference-protocol, inference_grpc.md).

ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelInfer, ModelStreamInfer,
ModelStatistics, Triton's model configuration (ModelConfig, app/wire/v2_config.py) and model
repository (app/core/repository.py) extensions; shared memory, trace and log settings stay the
base class's UNIMPLEMENTED. The messages are tritonclient's generated ones (tritonclient.grpc's
service_pb2, package `inference`), the ones its client sends. KServe's own copy of the same
protos declares the same `inference` package under another file name, so one process can load
one of the two, never both (kserve issue 3099): this server loads tritonclient's.

ModelInfer reads each input from `raw_input_contents` (in the order of `inputs`, BYTES
elements length-prefixed, as tritonclient always sends) or from its typed `contents`, and
answers every output in `raw_output_contents`. A version of digits names a version, any other
a version label; the parameter `signature_name` picks the signature; the call's deadline, and
the parameter `timeout` (microseconds) if given, cap the server's own. ModelStreamInfer serves
each request of a stream as a ModelInfer call (app/grpc/calls.py, `Streamed`), answered in order,
a failure as the stream's `error_message` with the request's id.

Only translation lives here: app/core/serving.py resolves, limits, times and records each call,
app/wire/v2_tensors.py checks each tensor, and app/grpc/calls.py maps errors to codes. Each
method has its category of Triton's restricted protocols (GRPC_RESTRICTED_PROTOCOL, `CATEGORIES`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

from app.core.errors import BadRequest, NotFound, ServingError
from app.core.registry import Servable
from app.core.repository import Repository, expected_parameter
from app.core.serving import Answer, RequestLayer
from app.grpc.calls import HEALTH_PREFIX, Streamed, handler
from app.grpc.exchange import GrpcExchange
from app.ops.settings import Settings
from app.wire import priority, v2_config, v2_tensors
from app.wire.restricted import MODEL_REPOSITORY, grpc_restrictions, metadata_values
from app.wire.v2_statistics import statistics

SERVICE = "/inference.GRPCInferenceService"
# InferTensorContents: the typed field each datatype's values travel in (FP16 and BF16 have
# none: raw_input_contents only).
CONTENTS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, layer: RequestLayer, repository: Repository) -> None:
        self._layer = layer
        self._repository = repository
        # ServerLive and ServerReady answer on the loop, as the call path runs a plain gRPC method.
        self.ModelReady = handler(self._model_ready)
        self.ServerMetadata = handler(self._server_metadata)
        self.ModelMetadata = handler(self._model_metadata)
        self.ModelInfer = handler(self._infer)
        self.ModelStreamInfer = Streamed(self._infer, _stream_answer, _stream_failure)
        self.ModelConfig = handler(self._model_config)
        self.ModelStatistics = handler(self._statistics)
        self.RepositoryIndex = handler(self._repository_index)
        self.RepositoryModelLoad = handler(self._repository_load)
        self.RepositoryModelUnload = handler(self._repository_unload)

    def ServerLive(self, request: Any, context: grpc.ServicerContext) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        return service_pb2.ServerReadyResponse(ready=self._layer.ready)

    def _model_ready(self, request: Any, exchange: GrpcExchange) -> Any:
        try:
            servable = self._layer.model(v2_tensors.model_spec(request.name, request.version), exchange)
        except NotFound:
            return service_pb2.ModelReadyResponse(ready=False)
        return service_pb2.ModelReadyResponse(ready=self._layer.servable_ready(servable))

    def _model(self, name: str, version: str, exchange: GrpcExchange) -> Servable:
        spec = v2_tensors.model_spec(name, version)
        try:
            return self._layer.model(spec, exchange)
        except ServingError as exc:
            raise v2_tensors.in_triton_words(exc, spec) from None

    def _model_config(self, request: Any, exchange: GrpcExchange) -> Any:
        """Triton's model configuration extension (app/wire/v2_config.py)."""
        servable = self._model(request.name, request.version, exchange)
        config = v2_config.model_config(servable, self._layer.registry.config_entry(servable.model.name))
        return service_pb2.ModelConfigResponse(config=v2_config.config_message(config))

    def _server_metadata(self, request: Any, exchange: GrpcExchange) -> Any:
        return service_pb2.ServerMetadataResponse(name=v2_tensors.SERVER_NAME, version=v2_tensors.SERVER_VERSION,
                                              extensions=v2_tensors.EXTENSIONS)

    def _model_metadata(self, request: Any, exchange: GrpcExchange) -> Any:
        servable = self._model(request.name, request.version, exchange)
        metadata = v2_tensors.model_metadata(servable.model, self._layer.predict_signature(servable, ""),
                                             self._layer.versions(servable))
        return service_pb2.ModelMetadataResponse(
            name=metadata["name"], versions=metadata["versions"], platform=metadata["platform"],
            inputs=[service_pb2.ModelMetadataResponse.TensorMetadata(**tensor) for tensor in metadata["inputs"]],
            outputs=[service_pb2.ModelMetadataResponse.TensorMetadata(**tensor) for tensor in metadata["outputs"]])

    async def _infer(self, request: Any, exchange: GrpcExchange) -> Any:
        parameters = request.parameters
        spec = v2_tensors.model_spec(request.model_name, request.model_version)
        timeout_s = _timeout_s(parameters)
        outputs = tuple(output.name for output in request.outputs)
        v2_tensors.check_outputs(outputs)
        call = exchange.call(spec, signature=_signature_name(parameters), client_timeout_s=timeout_s,
                             outputs=outputs, priority=priority.from_v2_grpc(parameters),
                             parameters=_values(parameters))
        try:
            answer = await self._layer.start(call, lambda signature, max_rows: v2_tensors.decode_inputs(
                _tensors(request), signature, max_rows=max_rows))
        except ServingError as exc:
            raise v2_tensors.in_triton_words(exc, spec) from None
        return _infer_response(request, answer)

    def _statistics(self, request: Any, exchange: GrpcExchange) -> Any:
        """Triton's statistics extension (app/core/model_stats.py)."""
        exchange.model = request.name or None
        # Under Gunicorn the counts are read from the multiprocess files alone.
        body = statistics(self._layer.registry, None, request.name, request.version)
        return json_format.ParseDict(body, service_pb2.ModelStatisticsResponse(), ignore_unknown_fields=True)

    # -- Triton's model repository extension (app/core/repository.py) ---------------------------

    def _repository_index(self, request: Any, exchange: GrpcExchange) -> Any:
        _one_repository(request)
        return service_pb2.RepositoryIndexResponse(models=[
            service_pb2.RepositoryIndexResponse.ModelIndex(**model)
            for model in self._repository.index(ready=request.ready)])

    def _repository_load(self, request: Any, exchange: GrpcExchange) -> Any:
        _one_repository(request)
        self._repository.load(request.model_name, _grpc_parameters(request, "load"),
                              timeout_s=exchange.context.time_remaining())
        return service_pb2.RepositoryModelLoadResponse()

    def _repository_unload(self, request: Any, exchange: GrpcExchange) -> Any:
        _one_repository(request)
        self._repository.unload(request.model_name, _grpc_parameters(request, "unload"),
                                timeout_s=exchange.context.time_remaining())
        return service_pb2.RepositoryModelUnloadResponse()


def _infer_response(request: Any, answer: Answer) -> Any:
    response = service_pb2.ModelInferResponse(model_name=answer.servable.model.name,
                                              model_version=str(answer.servable.model.version), id=request.id)
    for output in answer.selected:
        array = v2_tensors.output_array(answer.outputs[output.name], output)
        response.outputs.add(name=output.name, datatype=v2_tensors.datatype(output), shape=array.shape)
        response.raw_output_contents.append(v2_tensors.to_bytes(array))
    return response


def _values(parameters: Any) -> dict[str, Any]:
    """The request's InferParameters as JSON values, as REST's `parameters` reads (a model's handler's)."""
    return {name: getattr(parameter, choice) for name, parameter in parameters.items()
            if (choice := parameter.WhichOneof("parameter_choice"))}


def _signature_name(parameters: Any) -> str:
    if "signature_name" not in parameters:
        return ""
    if parameters["signature_name"].WhichOneof("parameter_choice") != "string_param":
        raise BadRequest(v2_tensors.SIGNATURE_NAME_ERROR)
    return parameters["signature_name"].string_param


def _timeout_s(parameters: Any) -> float | None:
    """The parameter `timeout` (microseconds) in seconds; the call's own deadline caps it (GrpcExchange.call)."""
    if "timeout" not in parameters:
        return None
    # Read from int64_param (tritonclient's) or uint64_param; any other kind, or a negative
    # number, is refused as over REST rather than read as 0 (an immediate deadline).
    timeout = parameters["timeout"]
    choice = timeout.WhichOneof("parameter_choice")
    if choice not in ("int64_param", "uint64_param") or getattr(timeout, choice) < 0:
        raise BadRequest(v2_tensors.TIMEOUT_ERROR)
    return float(getattr(timeout, choice) / 1e6)


def _tensors(request: Any) -> list[v2_tensors.Tensor]:
    raw = request.raw_input_contents
    for tensor in request.inputs if raw else ():
        if tensor.HasField("contents"):
            # Triton refuses both too, in these words (infer_handler.cc, InferGRPCToInput), before it
            # counts them: reading one would silently drop the other's values.
            raise BadRequest(f"contents field must not be specified when using raw_input_contents for "
                             f"'{tensor.name}' for model '{request.model_name}'")
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"raw_input_contents holds {len(raw)} tensors; the request has {len(request.inputs)} "
                         "inputs (one each, in order)")
    tensors = []
    for index, tensor in enumerate(request.inputs):
        shape = tuple(tensor.shape)
        if raw:
            tensors.append(v2_tensors.Tensor(tensor.name, tensor.datatype, shape, raw=raw[index]))
            continue
        field = CONTENTS.get(tensor.datatype)
        values = getattr(tensor.contents, field) if field else []
        tensors.append(v2_tensors.Tensor(tensor.name, tensor.datatype, shape, values=values))
    return tensors


def _stream_answer(response: Any) -> Any:
    """A streamed request's answer, final as every answer of a model that is not decoupled."""
    message = service_pb2.ModelStreamInferResponse(infer_response=response)
    message.infer_response.parameters["triton_final_response"].bool_param = True
    return message


def _stream_failure(request: Any, message: str) -> Any:
    """A streamed request's failure, as Triton writes it: the message, and the request's id."""
    return service_pb2.ModelStreamInferResponse(error_message=message, infer_response=service_pb2.ModelInferResponse(
        id=request.id if request is not None else ""))


def add_to_server(server: grpc.aio.Server, layer: RequestLayer, repository: Repository) -> None:
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(layer, repository), server)


# Each method's category of Triton's restricted protocols (grpc_server.cc); TF Serving's
# HandleReloadConfigRequest changes the models served, as the repository's calls do.
CATEGORIES = {
    **{f"{SERVICE}/{name}": "health" for name in ("ServerLive", "ServerReady", "ModelReady")},
    f"{HEALTH_PREFIX}Check": "health", f"{HEALTH_PREFIX}Watch": "health",
    **{f"{SERVICE}/{name}": "metadata" for name in ("ServerMetadata", "ModelMetadata")},
    **{f"{SERVICE}/{name}": "inference" for name in ("ModelInfer", "ModelStreamInfer")},
    f"{SERVICE}/ModelConfig": "model-config",
    f"{SERVICE}/ModelStatistics": "statistics",
    **{f"{SERVICE}/{name}": MODEL_REPOSITORY
       for name in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")},
    "/tensorflow.serving.ModelService/HandleReloadConfigRequest": MODEL_REPOSITORY,
    **{f"{SERVICE}/{name}": "shared-memory" for name in (
        "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
        "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister")},
    f"{SERVICE}/TraceSetting": "trace",
    f"{SERVICE}/LogSettings": "logging",
}


def restriction(settings: Settings) -> Callable[[str, Any], None] | None:
    """Triton's restricted protocols on gRPC: check(method, metadata) raises Forbidden for a method
    of a restricted category called without its key (app/grpc/calls.py answers it UNAVAILABLE
    before its handler runs); None where nothing is restricted."""
    restrictions = grpc_restrictions(settings)
    if not restrictions:
        return None

    def check(method: str, metadata: Any) -> None:
        category = CATEGORIES.get(method)
        found = restrictions.get(category) if category is not None else None
        if found is not None:
            found.check(method, metadata_values(found, metadata), noun="protocol")

    return check


def _one_repository(request: Any) -> None:
    if request.repository_name:
        raise BadRequest("'repository_name' specification is not supported")


def _grpc_parameters(request: Any, call: str) -> dict[str, Any]:
    parameters = {}
    for name, parameter in request.parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        expected = expected_parameter(call, name)
        if expected is not None and choice != expected[1]:
            # Triton's words (grpc_server.cc, RepositoryModelLoad and RepositoryModelUnload).
            raise BadRequest(f"invalid value type for load parameter '{name}', expected {expected[1]}."
                             if call == "load" else
                             f"invalid value type for '{name}' parameter, expected {expected[1]}.")
        parameters[name] = getattr(parameter, choice) if choice else None
    return parameters
