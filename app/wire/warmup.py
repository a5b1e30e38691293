"""TensorFlow Serving's model warm-up: a version's recorded requests, replayed before it is served.

A SavedModel may carry `assets.extra/tf_serving_warmup_requests`, a TFRecord file of
`tensorflow.serving.PredictionLog` protos (predict, classify, regress or multi_inference).
With ENABLE_MODEL_WARMUP on (TF Serving's --enable_model_warmup, on by default there too),
each record is sent once to the version being loaded, before it joins the registry, so its
first real requests find every graph traced and every kernel ready. As in TF Serving
(servables/tensorflow/saved_model_warmup.cc, saved_model_warmup_util.cc):

- the record's model spec is ignored: it runs on the version being loaded;
- a record that fails, does not parse, or a file that is not TFRecord, fails the load of
  that version; a file over 1000 records too;
- session_run and predict_streamed records are refused as unsupported.

Each record goes through the gRPC front door and the request layer that serve real calls
(app/grpc/server.py, app/core/serving.py), on a registry that holds this version alone, so a
warm-up request meets exactly the checks and the batcher a client's would, and is counted
in no request metric.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, cast

from app.core.errors import ServingError
from app.core.models import ModelLoadError
from app.core.registry import ModelRegistry
from app.ops.logs import RequestRecord
from app.ops.metrics import Metrics
from app.ops.settings import Settings

log = logging.getLogger(__name__)

WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")
MAX_RECORDS = 1000  # TF Serving's WarmupConsts::kMaxNumRecords


class _Context:
    """What the front door asks of a gRPC context: the time left, whether it was cancelled, and
    its metadata (none: a warm-up request runs at its model's default priority)."""

    def __init__(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s

    def time_remaining(self) -> float:
        return self._deadline - time.monotonic()

    def cancelled(self) -> bool:
        return False

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


def _unobserved(route: str, handler: Any, *_on_loop: Any) -> Any:
    return handler


def warmup_path(source: str) -> str | None:
    """The warm-up file of the SavedModel at `source`, or None where it has none."""
    path = os.path.join(source, WARMUP_FILE)
    return path if os.path.isfile(path) else None


def replay(servable: Any, settings: Settings, metrics: Metrics) -> int:
    """Send every warm-up record of the servable's SavedModel to it; the number sent.

    Raises ModelLoadError, naming the file and the record, when one fails.
    """
    path = warmup_path(servable.model.source)
    if path is None:
        return 0
    # Imported here: the gRPC front door and its protos only where a model has a warm-up file.
    from tensorflow_serving.apis import prediction_log_pb2

    from app.core import limits, serving
    from app.grpc import server as grpc_server

    model = servable.model
    registry = ModelRegistry(model.name)
    registry.add(servable)
    layer = serving.RequestLayer(registry, timeout_s=settings.request_timeout_ms / 1000.0,
                                 max_request_bytes=limits.max_request_bytes(settings, registry), metrics=metrics,
                                 check_method_name=settings.enable_signature_method_name_check)
    # No wrapper around the handlers: a warm-up record is not a request, so no metrics, no access line.
    servicer = grpc_server.PredictionServicer(layer, cast(Any, _unobserved), max_bytes=layer.max_request_bytes)
    handlers = {"predict_log": servicer.Predict, "classify_log": servicer.Classify,
                "regress_log": servicer.Regress, "multi_inference_log": servicer.MultiInference}
    started = time.perf_counter()
    sent = 0
    for index, raw in enumerate(_records(path)):
        if index >= MAX_RECORDS:
            raise ModelLoadError(f"Number of warmup records exceeds the maximum ({MAX_RECORDS}) at {path}")
        try:
            record = prediction_log_pb2.PredictionLog.FromString(raw)
        except Exception:
            raise ModelLoadError(f"Failed to parse warmup record {index} from {path}") from None
        kind = record.WhichOneof("log_type")
        if kind not in handlers:
            raise ModelLoadError(f"Unsupported log_type for warmup: {kind} (record {index} of {path})")
        request = getattr(record, kind).request
        _aim_at(request, kind, model.name)
        try:
            handlers[kind](request, RequestRecord(f"warmup-{index}"), _Context(layer.timeout_s))
        except ServingError as exc:
            raise ModelLoadError(f"model '{model.name}' v{model.version}: warm-up record {index} ({kind}) of "
                                 f"{path} failed: {exc.message}") from None
        sent += 1
    log.info("model '%s' v%d: %d warm-up requests replayed from %s in %.2f s", model.name, model.version, sent,
             path, time.perf_counter() - started)
    return sent


def _aim_at(request: Any, kind: str, name: str) -> None:
    """Point the request at the version being loaded: its name, no version or label of its own."""
    specs = [task.model_spec for task in request.tasks] if kind == "multi_inference_log" else [request.model_spec]
    for spec in specs:
        spec.name = name
        spec.ClearField("version")
        spec.ClearField("version_label")


def _records(path: str) -> Any:
    import tensorflow as tf

    try:
        for raw in tf.data.TFRecordDataset(path):
            yield raw.numpy()
    except tf.errors.DataLossError as exc:
        raise ModelLoadError(f"{path}: {exc.message}. Please verify your warmup data is in TFRecord format.") \
            from None
