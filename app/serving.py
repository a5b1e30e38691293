"""The request layer: the policy every front door shares, below its wire format.

A front door (TF Serving REST in app/api.py, TF Serving gRPC in app/grpc_server.py, and
any protocol to come) reads its wire format into plain values and calls this layer:

    record = layer.requests.start(method, route, request_id)    # one record: access log + metrics
    servable = layer.model(ModelSpec(name, version, label), record)
    signature = layer.predict_signature(servable, signature_name)   # or example_signature(...)
    outputs = layer.select_outputs(signature, requested_names)
    rows = check_rows(count, layer.row_limit(servable))          # early, before arrays are built
    answer = layer.predict(servable, signature, inputs, record=record,
                           client_timeout_s=..., pinned=spec.pinned)
    layer.requests.finish(record)

and writes `answer` (or the ServingError raised on the way) back in its wire format. What
lives here, and nowhere in a front door: which model, version, label and signature a
request names, with TensorFlow Serving's words for each refusal; the row and byte limits;
the deadline (REQUEST_TIMEOUT_MS, capped by the client's own); the shape of classify and
regress answers; and the request record that feeds both the access log and the request
metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from flask import Flask

from app import logs
from app.batching import BatchResult
from app.errors import BadRequest, DeadlineExceeded, InvalidInput, PayloadTooLarge
from app.limits import max_request_bytes
from app.logs import RequestRecord
from app.metrics import Metrics, RequestCounts
from app.models import CLASSIFY_METHOD, DEFAULT_SIGNATURE, REGRESS_METHOD, STRING, Signature, TensorInfo
from app.registry import ModelRegistry, Servable
from app.settings import Settings

CLASSIFY, REGRESS = "classify", "regress"
_EXAMPLE_METHODS = {CLASSIFY: (CLASSIFY_METHOD, "classification"), REGRESS: (REGRESS_METHOD, "regression")}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The model a request names: by name (None: the server's first), version or label."""

    name: str | None = None
    version: int | None = None
    label: str | None = None

    @property
    def pinned(self) -> bool:
        """A pinned request is served by the version it names or refused, never by another."""
        return self.version is not None or self.label is not None


@dataclasses.dataclass(frozen=True)
class Answer:
    """What a prediction came back with; `servable` is the version that answered it."""

    servable: Servable
    signature: Signature
    outputs: dict[str, np.ndarray]
    batch_rows: int
    batch_requests: int


@dataclasses.dataclass(frozen=True)
class Classes:
    """A classify answer, one row per example: labels ('' where the model has none) and scores (0 where none)."""

    labels: list[list[str]]
    scores: np.ndarray  # float32, rows x classes


def check_rows(rows: int, limit: int, *, unit: str = "rows") -> int:
    """`rows`, or PayloadTooLarge when it is over the model's MAX_REQUEST_ROWS."""
    if rows > limit:
        raise PayloadTooLarge(f"the request holds {rows} {unit}; this model takes at most {limit} "
                              "rows per request (MAX_REQUEST_ROWS)")
    return rows


def text(value: Any) -> str:
    """A label as text: bytes decoded as UTF-8 (bad bytes replaced), anything else as str()."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class Requests:
    """Opens and closes the one record of a request that no WSGI layer wraps (gRPC, and the like):
    requests in flight, each answer counted and timed by route, method and status, and its access line."""

    def __init__(self, metrics: Metrics) -> None:
        self._in_flight = metrics.in_flight
        self._counts = RequestCounts(metrics)

    def start(self, method: str, route: str, request_id: str) -> RequestRecord:
        self._in_flight.inc()
        return RequestRecord(request_id, method, route)

    def finish(self, record: RequestRecord) -> None:
        self._in_flight.dec()
        self._counts.count(record.path, record.method, str(record.status), record.seconds())
        logs.write_access(record, writer=logs.process_writer())


class RequestLayer:
    """Resolution, limits, deadline and shaping over one app's registry and settings."""

    def __init__(self, registry: ModelRegistry, *, timeout_s: float, max_request_bytes: int,
                 metrics: Metrics) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        # gRPC's message limit and the HTTP body limit: one value, from settings and the models.
        self.max_request_bytes = max_request_bytes
        self.requests = Requests(metrics)

    # -- which model, version, label and signature ------------------------------------

    def model(self, spec: ModelSpec, record: RequestRecord | None = None) -> Servable:
        servable = self.registry.get(spec.name, spec.version, label=spec.label)
        if record is not None:
            record.model = servable.model.name
        return servable

    def model_status(self, spec: ModelSpec) -> list[dict[str, Any]]:
        return self.registry.model_status(spec.name or self.registry.default_name, spec.version, label=spec.label)

    @property
    def ready(self) -> bool:
        return self.registry.ready

    def predict_signature(self, servable: Servable, name: str) -> Signature:
        """The signature a predict names; '' is serving_default, as in TF Serving."""
        return servable.signature(name)

    def example_signature(self, servable: Servable, name: str, method: str) -> tuple[Signature, str]:
        """Classify's or regress's signature, after TF Serving's checks, and the name of its one input.

        Without a name: serving_default, or the model's main signature where it has no serving_default.
        """
        model = servable.model
        if not name and DEFAULT_SIGNATURE not in model.signatures:
            name = model.default_signature
        key = name or DEFAULT_SIGNATURE
        signature = model.signatures.get(key)
        if signature is None:
            # TF Serving's words (servables/tensorflow/classifier.cc, regressor.cc).
            raise BadRequest(f"No signature was found with the name: {key}")
        method_name, kind = _EXAMPLE_METHODS[method]
        if signature.method_name != method_name:
            raise BadRequest(f"Expected {kind} signature method_name to be {method_name}. "
                             f"Was: {signature.method_name}")
        if len(signature.inputs) != 1 or signature.inputs[0].dtype != STRING:
            raise BadRequest(f"Expected one input Tensor of serialized tf.Examples in signature '{signature.name}'")
        return signature, signature.inputs[0].name

    @staticmethod
    def select_outputs(signature: Signature, names: list[str] | None = None) -> list[TensorInfo]:
        """The outputs asked for, in the order asked (none asked: all), with TF Serving's refusals."""
        if not names:
            return list(signature.outputs)
        by_name = {spec.name: spec for spec in signature.outputs}
        chosen: list[TensorInfo] = []
        for name in names:
            if name not in by_name:
                raise InvalidInput(f"output tensor alias not found in signature: {name} Outputs expected "
                                 f"to be in the set {braced(by_name)}.")
            if by_name[name] in chosen:
                raise InvalidInput(f"duplicate output tensor alias: {name}")
            chosen.append(by_name[name])
        return chosen

    # -- limits and deadline --------------------------------------------------------------

    @staticmethod
    def row_limit(servable: Servable) -> int:
        """MAX_REQUEST_ROWS of the model: a front door refuses more before it builds any array."""
        return servable.batcher.max_request_rows

    def deadline_s(self, client_timeout_s: float | None = None) -> float:
        """How long a request may take: REQUEST_TIMEOUT_MS, or less if the client gave less."""
        timeout_s = self.timeout_s if client_timeout_s is None else min(self.timeout_s, client_timeout_s)
        if timeout_s <= 0:
            raise DeadlineExceeded("the call's deadline passed before it was queued")
        return timeout_s

    # -- the prediction -------------------------------------------------------------------

    def predict(self, servable: Servable, signature: Signature, inputs: dict[str, np.ndarray], *,
                record: RequestRecord, pinned: bool, client_timeout_s: float | None = None) -> Answer:
        """Queue the rows on the signature's batcher and wait for them, within the deadline."""
        # A request with no inputs, or a scalar one (an unbatched signature's), is one item.
        first = next(iter(inputs.values()), None)
        record.rows = first.shape[0] if first is not None and first.ndim else 1
        timeout_s = self.deadline_s(client_timeout_s)
        servable, result = self.registry.predict(servable, inputs, timeout_s=timeout_s,
                                                 signature_name=signature.name, pinned=pinned)
        record.batch_rows, record.batch_requests = result.batch_rows, result.batch_requests
        return _answer(servable, signature, result)

    def classify(self, servable: Servable, signature_name: str, examples: np.ndarray, *, record: RequestRecord,
                 pinned: bool, client_timeout_s: float | None = None) -> tuple[Answer, Classes]:
        """Classify serialized tf.Examples (one per row) with TF Serving's checks of the answer."""
        answer = self._examples(servable, signature_name, CLASSIFY, examples, record, pinned, client_timeout_s)
        return answer, classes(answer.outputs, len(examples))

    def regress(self, servable: Servable, signature_name: str, examples: np.ndarray, *, record: RequestRecord,
                pinned: bool, client_timeout_s: float | None = None) -> tuple[Answer, np.ndarray]:
        """Regress serialized tf.Examples: one float32 value per example."""
        answer = self._examples(servable, signature_name, REGRESS, examples, record, pinned, client_timeout_s)
        return answer, regressions(answer.outputs, len(examples))

    def _examples(self, servable: Servable, signature_name: str, method: str, examples: np.ndarray,
                  record: RequestRecord, pinned: bool, client_timeout_s: float | None) -> Answer:
        signature, input_name = self.example_signature(servable, signature_name, method)
        return self.predict(servable, signature, {input_name: examples}, record=record, pinned=pinned,
                            client_timeout_s=client_timeout_s)


def _answer(servable: Servable, signature: Signature, result: BatchResult) -> Answer:
    # The version that answered may be newer than the one resolved (a retired one sends on).
    return Answer(servable, servable.model.signatures.get(signature.name, signature), result.outputs,
                  result.batch_rows, result.batch_requests)


def classes(outputs: dict[str, np.ndarray], rows: int) -> Classes:
    """TF Serving's classification result from a signature's 'classes' and/or 'scores' outputs."""
    labels, scores = outputs.get("classes"), outputs.get("scores")
    if labels is not None:
        width = labels.reshape(rows, -1).shape[1]
    elif scores is not None:
        width = scores.reshape(rows, -1).shape[1]
    else:
        raise BadRequest("Expected classification signature outputs to contain 'classes' or 'scores'")
    texts = ([[text(value) for value in row] for row in labels.reshape(rows, width)] if labels is not None
             else [[""] * width for _ in range(rows)])
    values = (scores.reshape(rows, width).astype(np.float32) if scores is not None
              else np.zeros((rows, width), np.float32))
    return Classes(texts, values)


def regressions(outputs: dict[str, np.ndarray], rows: int) -> np.ndarray:
    """TF Serving's regression result: the 'outputs' output (or the only one), one value per example."""
    values = np.asarray(outputs.get("outputs", next(iter(outputs.values()))))
    if values.size != rows:
        raise BadRequest(f"Expected output Tensor shape to be [{rows}] or [{rows}, 1]; got {list(values.shape)}")
    return values.reshape(rows).astype(np.float32)


def braced(names: Any) -> str:
    """Names as TF Serving lists them in its messages: {a,b,c}, sorted."""
    return "{" + ",".join(sorted(names)) + "}"


def init_app(app: Flask, settings: Settings, registry: ModelRegistry) -> RequestLayer:
    layer = RequestLayer(registry, timeout_s=settings.request_timeout_ms / 1000.0,
                         max_request_bytes=max_request_bytes(settings, registry), metrics=app.extensions["metrics"])
    app.extensions["serving"] = layer
    return layer


def get_layer(app: Flask) -> RequestLayer:
    return app.extensions["serving"]
