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

Each record is read as the gRPC door reads its request (app/wire/tfs_proto.py) and runs on
the request layer that serves real calls (app/core/serving.py), on a registry that holds this
version alone, so a warm-up request meets exactly the checks and the batcher a client's would;
its exchange is opened by no transport, so it is counted in no request metric.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from app.core import serving
from app.core.call import Exchange
from app.core.errors import ServingError
from app.core.models import ModelLoadError
from app.core.registry import ModelRegistry
from app.ops.metrics import Metrics
from app.ops.settings import Settings
from app.wire import classify

log = logging.getLogger(__name__)

WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")
MAX_RECORDS = 1000  # TF Serving's WarmupConsts::kMaxNumRecords


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
    # Imported here: TF Serving's protos only where a model has a warm-up file.
    from tensorflow_serving.apis import prediction_log_pb2

    model = servable.model
    registry = ModelRegistry(model.name)
    registry.add(servable)
    layer = serving.RequestLayer.from_settings(settings, registry)
    handlers = _handlers(layer)
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
            # An exchange no transport opened: a warm-up record is not a request, so no metrics, no access line.
            handlers[kind](request, Exchange(f"warmup-{index}", timeout_s=layer.timeout_s))
        except ServingError as exc:
            raise ModelLoadError(f"model '{model.name}' v{model.version}: warm-up record {index} ({kind}) of "
                                 f"{path} failed: {exc.message}") from None
        sent += 1
    log.info("model '%s' v%d: %d warm-up requests replayed from %s in %.2f s", model.name, model.version, sent,
             path, time.perf_counter() - started)
    return sent


def _handlers(layer: serving.RequestLayer) -> dict[str, Callable[[Any, Exchange], Any]]:
    """Each kind of record read as the gRPC door reads it, and run on the request layer."""
    from app.wire import tfs_proto

    def multi_inference(request: Any, exchange: Exchange) -> Any:
        return classify.multi_inference(layer, tfs_proto.multi_inference_call(exchange, request),
                                        tfs_proto.tasks(request), tfs_proto.examples(request))

    return {
        "predict_log": lambda request, exchange: layer.infer(
            tfs_proto.predict_call(exchange, request),
            tfs_proto.predict_decode(request, max_bytes=layer.max_request_bytes)),
        "classify_log": lambda request, exchange: classify.classify(layer, tfs_proto.call(exchange, request),
                                                                    tfs_proto.examples(request)),
        "regress_log": lambda request, exchange: classify.regress(layer, tfs_proto.call(exchange, request),
                                                                  tfs_proto.examples(request)),
        "multi_inference_log": multi_inference,
    }


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
