"""TensorFlow Serving's gRPC services: PredictionService (Predict, Classify, Regress,
MultiInference, GetModelMetadata), ModelService (GetModelStatus, HandleReloadConfigRequest)
and grpc.health.v1.Health, which answers SERVING exactly when /readyz answers 200.

`model_spec` takes a name, a version or a version_label, and a signature. Each method reads
its protos into the request layer's calls (app/wire/tfs_proto.py) and writes the answer's;
the call's deadline is the client's gRPC deadline, capped by REQUEST_TIMEOUT_MS, and errors
map to TF Serving's codes on app/grpc/calls.py's path, which every call takes around its
handler. Predict awaits its rows on the loop; the other methods run on THREADS threads.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
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
from app.core.serving import RequestLayer
from app.grpc.calls import handler
from app.grpc.exchange import GrpcExchange
from app.ops import tfs_config
from app.wire import classify, metadata, tensor_proto, tfs_proto
from app.wire.classify import Classes
from app.wire.tfs_proto import model_spec, set_model_spec

_PREDICTION = "/tensorflow.serving.PredictionService"


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, layer: RequestLayer, *, tensor_content: bool = False) -> None:
        self.Predict = handler(self._predict)
        self.Classify = handler(self._classify)
        self.Regress = handler(self._regress)
        self.GetModelMetadata = handler(self._metadata)
        self.MultiInference = handler(self._multi_inference)
        self._layer = layer
        self._tensor_content = tensor_content

    async def _predict(self, request: Any, exchange: GrpcExchange) -> Any:
        call = tfs_proto.predict_call(exchange, request)
        decode = tfs_proto.predict_decode(request, max_bytes=self._layer.max_request_bytes)
        answer = await self._layer.start(call, decode)
        response = predict_pb2.PredictResponse()
        set_model_spec(response.model_spec, answer.servable.model, answer.signature.name)
        for output in answer.selected:
            tensor_proto.from_ndarray(answer.outputs[output.name], output.tf_dtype, response.outputs[output.name],
                                      tensor_content=self._tensor_content)
        return response

    def _classify(self, request: Any, exchange: GrpcExchange) -> Any:
        answer, classes = classify.classify(self._layer, tfs_proto.call(exchange, request), tfs_proto.examples(request))
        response = classification_pb2.ClassificationResponse()
        set_model_spec(response.model_spec, answer.servable.model, answer.signature.name)
        _fill_classes(response.result, classes)
        return response

    def _regress(self, request: Any, exchange: GrpcExchange) -> Any:
        answer, values = classify.regress(self._layer, tfs_proto.call(exchange, request), tfs_proto.examples(request))
        response = regression_pb2.RegressionResponse()
        set_model_spec(response.model_spec, answer.servable.model, answer.signature.name)
        for value in values.tolist():
            response.result.regressions.add().value = value
        return response

    def _multi_inference(self, request: Any, exchange: GrpcExchange) -> Any:
        call = tfs_proto.multi_inference_call(exchange, request)
        servable, results = classify.multi_inference(self._layer, call, tfs_proto.tasks(request),
                                                     tfs_proto.examples(request))
        response = inference_pb2.MultiInferenceResponse()
        for result in results:
            entry = response.results.add()
            set_model_spec(entry.model_spec, servable.model, result.signature.name)
            if result.classes is not None:
                _fill_classes(entry.classification_result, result.classes)
            elif result.regressions is not None:
                entry.regression_result.regressions.extend(
                    regression_pb2.Regression(value=value) for value in result.regressions.tolist())
        return response

    def _metadata(self, request: Any, exchange: GrpcExchange) -> Any:
        if not request.HasField("model_spec"):
            raise errors.BadRequest("Missing ModelSpec")
        if not request.metadata_field:
            raise errors.BadRequest("GetModelMetadataRequest must specify at least one metadata_field")
        for field in request.metadata_field:
            if field != "signature_def":
                raise errors.BadRequest(f"Metadata field {field} is not supported")
        model = self._layer.model(model_spec(request.model_spec), exchange).model
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        set_model_spec(response.model_spec, model, None)
        signatures = get_model_metadata_pb2.SignatureDefMap()
        for key, signature in sorted(model.signatures.items()):
            signatures.signature_def[key].CopyFrom(metadata.signature_def(signature))
        response.metadata["signature_def"].Pack(signatures)
        return response


def _fill_classes(target: Any, classes: Classes) -> None:
    for labels, scores in zip(classes.labels, classes.scores.tolist(), strict=True):
        classifications = target.classifications.add()
        for label, score in zip(labels, scores, strict=True):
            classifications.classes.add(label=label, score=score)


_ERROR_CODES = status_pb2.StatusProto.DESCRIPTOR.fields_by_name["error_code"].enum_type.values_by_name


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, layer: RequestLayer) -> None:
        self.GetModelStatus = handler(self._status)
        self.HandleReloadConfigRequest = handler(self._reload)
        self._layer = layer

    def _reload(self, request: Any, exchange: GrpcExchange) -> Any:
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
        self._layer.registry.reload_config(document, timeout_s=exchange.context.time_remaining())
        response = model_management_pb2.ReloadConfigResponse()
        response.status.error_code = _ERROR_CODES["OK"].number
        return response

    def _status(self, request: Any, exchange: GrpcExchange) -> Any:
        if not request.HasField("model_spec"):
            raise errors.BadRequest("Missing ModelSpec")
        statuses = self._layer.model_status(model_spec(request.model_spec))
        exchange.model = request.model_spec.name or None
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


