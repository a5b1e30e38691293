"""The request layer: the policy every front door shares, below its wire format.

A front door (TF Serving REST in app/api.py, TF Serving gRPC in app/grpc_server.py, the Open
Inference Protocol in app/v2_rest.py and app/v2_grpc.py) is parse -> call -> infer -> encode:

    call = Call.within(layer.deadline_s(client_timeout_s), model=ModelSpec(name, version, label),
                       signature=..., outputs=..., client_gone=..., record=..., trace=...)
    answer = layer.infer(call, decode)      # decode(signature, max_rows) -> the input arrays
    ... write answer.outputs (answer.selected: the outputs asked for, in order) ...

`classify`, `regress` and `multi_inference` are shaped on top of the same `run`. What lives
here, and nowhere in a front door: which model, version, label and signature a call names,
with TensorFlow Serving's words for each refusal (looked up once per call); the row limit
(handed to `decode`, so it refuses before building any array) and byte limits; the deadline
(REQUEST_TIMEOUT_MS, capped by the client's own, made absolute once); the shape of classify
and regress answers; and the request record that feeds the access log and the request metrics.

`Call.client_gone` is the one way a front door says whether its client still waits: a cheap
predicate, asked once just before the call's first rows run. When it answers True the rows
never run and the layer raises ClientGone (HTTP 499, gRPC CANCELLED), counted as the
rejection reason `client_gone`. `socket_client_gone` makes one for an HTTP connection;
gRPC's is its call context's `is_active`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import select
import socket
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from flask import Flask

from app import logs
from app.batching import BatchResult, Tensors
from app.call import Call, ClientGonePredicate, ModelSpec
from app.errors import BadRequest, ClientGone, DeadlineExceeded, InvalidInput, MethodNotAllowed
from app.limits import max_request_bytes
from app.logs import RequestRecord
from app.metrics import Metrics, RequestCounts
from app.models import (
    CLASSIFY_METHOD,
    DEFAULT_SIGNATURE,
    REGRESS_METHOD,
    STRING,
    LoadedModel,
    Signature,
    TensorInfo,
)
from app.payload_log import PayloadLog
from app.payload_log import init_app as init_payload_log
from app.registry import ModelRegistry, Servable
from app.settings import Settings

CLASSIFY, REGRESS = "classify", "regress"
# The signature keys TF Serving's classify and regress read (tensorflow/cc/saved_model/signature_constants.h).
EXAMPLES_INPUT = "inputs"
_EXAMPLE_METHODS = {CLASSIFY: (CLASSIFY_METHOD, "classification"), REGRESS: (REGRESS_METHOD, "regression")}
_TASK_METHODS = {CLASSIFY_METHOD: CLASSIFY, REGRESS_METHOD: REGRESS}

# The WSGI environ key under which tracing's layer leaves a request's trace (app/tracing.py).
TRACE_KEY = "model_server.trace"

# A front door's decoding of its request's inputs against the signature the call resolved to,
# refusing more than `max_rows` rows before it builds any array: decode(signature, max_rows).
Decode = Callable[[Signature, int], Tensors]


# Linux's "the peer closed its end" poll event; where it is missing, leaving is not seen.
_PEER_CLOSED = getattr(select, "POLLRDHUP", None)


def socket_client_gone(sock: socket.socket | None) -> ClientGonePredicate | None:
    """Whether the HTTP client on `sock` has closed its connection (None where that cannot be seen).

    One poll(2) that does not wait and reads nothing: the client closing its end (POLLRDHUP), a
    reset or an error (POLLHUP, POLLERR) mean it has gone; bytes to read (a pipelined next
    request, TLS records) or nothing yet mean it still waits. A non-blocking MSG_PEEK recv tells
    the same, but raises BlockingIOError for every client that waits, which costs several times
    more. A client that only shuts down its sending side and still reads is taken for gone
    (HTTP clients do not do that).
    """
    if sock is None or _PEER_CLOSED is None:
        return None
    return SocketClientGone(sock, _PEER_CLOSED)


class SocketClientGone:
    """socket_client_gone's predicate; `sock` lets a model process's client watch it (one poll set for all)."""

    __slots__ = ("sock", "_poller")

    def __init__(self, sock: socket.socket, events: int) -> None:
        self.sock = sock
        self._poller = select.poll()
        self._poller.register(sock, events)

    def __call__(self) -> bool:
        return bool(self._poller.poll(0))


@dataclasses.dataclass(frozen=True)
class Answer:
    """What a prediction came back with; `servable` is the version that answered it, `selected`
    the outputs the call asked for (all, if none), in its order."""

    servable: Servable
    signature: Signature
    selected: list[TensorInfo]
    outputs: dict[str, np.ndarray]
    rows: int
    batch_rows: int
    batch_requests: int


@dataclasses.dataclass(frozen=True)
class Classes:
    """A classify answer, one row per example: labels ('' where the model has none) and scores (0 where none)."""

    labels: list[list[str]]
    scores: np.ndarray  # float32, rows x classes


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of a MultiInference: a model and signature, and TF Serving's method name to run it by."""

    model_name: str
    signature_name: str
    method_name: str


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """One task's answer: `classes` for a classify task, `regressions` for a regress task."""

    signature: Signature
    classes: Classes | None = None
    regressions: np.ndarray | None = None


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
                 metrics: Metrics, check_method_name: bool = False) -> None:
        self.registry = registry
        # TF Serving's --enable_signature_method_name_check, off by default as there: a TF2
        # SavedModel's signatures all say tensorflow/serving/predict.
        self.check_method_name = check_method_name
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

    def versions(self, servable: Servable) -> list[int]:
        """The versions of the servable's model that a request may name."""
        return self.registry.versions(servable.model.name)

    @staticmethod
    def servable_ready(servable: Servable) -> bool:
        """A version is ready while every one of its batch threads is alive."""
        return all(batcher.alive for batcher in servable.batchers.values())

    def predict_signature(self, servable: Servable, name: str) -> Signature:
        """The signature a predict names; '' is serving_default, as in TF Serving."""
        return servable.signature(name)

    def example_signature(self, servable: Servable, name: str, method: str) -> tuple[Signature, str]:
        """Classify's or regress's signature, after TF Serving's checks, and the name of its one input."""
        return example_signature(servable.model, name, method, check_method_name=self.check_method_name)

    @staticmethod
    def select_outputs(signature: Signature, names: tuple[str, ...] | list[str] = ()) -> list[TensorInfo]:
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

    # -- the deadline ---------------------------------------------------------------------

    def deadline_s(self, client_timeout_s: float | None = None) -> float:
        """How long a call may take: REQUEST_TIMEOUT_MS, or less if the client gave less (a call
        whose time is up is refused when it runs). `Call.within` makes it the call's deadline."""
        return self.timeout_s if client_timeout_s is None else min(self.timeout_s, client_timeout_s)

    def http_call(self, environ: dict[str, Any], spec: ModelSpec, signature: str, outputs: tuple[str, ...] = (),
                  client_timeout_s: float | None = None, priority: int = 0) -> Call:
        """An HTTP front door's Call for the request of `environ`: its record, its trace, and a
        client_gone that watches its connection (Gunicorn hands the app the client's socket;
        Flask's test client has none)."""
        return Call.within(self.deadline_s(client_timeout_s), model=spec, signature=signature, outputs=outputs,
                           client_gone=socket_client_gone(environ.get("gunicorn.socket")),
                           record=environ.get(logs.RECORD_KEY) or logs.RequestRecord(""),
                           trace=environ.get(TRACE_KEY), priority=priority)

    # -- the prediction -------------------------------------------------------------------

    # Sampled predictions go here (app/payload_log.py); None: not logged (warm-up's layer, or sampling off).
    payload_log: PayloadLog | None = None

    def infer(self, call: Call, decode: Decode) -> Answer:
        """The call's model and signature resolved, its inputs decoded, its rows run within its deadline."""
        servable = self.model(call.model, call.record)
        return self.run(call, servable, servable.signature(call.signature), decode)

    async def infer_async(self, call: Call, decode: Decode) -> Answer:
        """`infer` on an asyncio loop: the wait for the rows holds no thread."""
        servable = self.model(call.model, call.record)
        return await self.run_async(call, servable, servable.signature(call.signature), decode)

    def run(self, call: Call, servable: Servable, signature: Signature, decode: Decode) -> Answer:
        """Decode against `signature`, queue the rows on its batcher and wait for them; ClientGone
        if the call's client_gone answered True before they ran. Every shape of answer (predict,
        classify, regress, multi-inference) comes through here."""
        staged = self._stage(call, servable, signature, decode)
        try:
            servable, result = self.registry.predict(call, servable, signature, staged.inputs)
        except concurrent.futures.CancelledError:
            # The engine cancels a request's future only when client_gone said so (and counted it).
            raise ClientGone("the client left before its request ran") from None
        return self._answered(call, servable, signature, staged, result)

    async def run_async(self, call: Call, servable: Servable, signature: Signature, decode: Decode) -> Answer:
        """`run` on an asyncio loop."""
        staged = self._stage(call, servable, signature, decode)
        try:
            servable, result = await self.registry.predict_async(call, servable, signature, staged.inputs)
        except concurrent.futures.CancelledError:
            raise ClientGone("the client left before its request ran") from None
        return self._answered(call, servable, signature, staged, result)

    def _stage(self, call: Call, servable: Servable, signature: Signature, decode: Decode) -> _Staged:
        selected = self.select_outputs(signature, call.outputs)
        inputs = decode(signature, servable.batchers[signature.name].info.max_request_rows)
        for spec in signature.narrowed_inputs:
            _check_exact(spec, inputs.get(spec.name))
        # A request with no inputs, or a scalar one (an unbatched signature's), is one item.
        first = next(iter(inputs.values()), None)
        rows = first.shape[0] if first is not None and first.ndim else 1
        if call.record is not None:
            call.record.rows = rows
        if call.deadline is not None and call.deadline <= time.monotonic():
            raise DeadlineExceeded("the call's deadline passed before it was queued")
        return _Staged(selected, inputs, rows)

    def _answered(self, call: Call, servable: Servable, signature: Signature, staged: _Staged,
                  result: BatchResult) -> Answer:
        record = call.record
        if record is not None:
            record.batch_rows, record.batch_requests = result.batch_rows, result.batch_requests
        # Here, and only here, a finished call has its decoded inputs and its outputs together.
        answer = _answer(servable, signature, staged.selected, staged.rows, result)
        if self.payload_log is not None:
            self.payload_log.offer(staged.inputs, answer, record.request_id if record is not None else "")
        return answer

    def classify(self, call: Call, decode: Decode) -> tuple[Answer, Classes]:
        """Classify serialized tf.Examples (one per row) with TF Serving's checks of the answer."""
        answer = self._examples(call, CLASSIFY, decode)
        return answer, classes(answer.outputs, answer.rows)

    def regress(self, call: Call, decode: Decode) -> tuple[Answer, np.ndarray]:
        """Regress serialized tf.Examples: one float32 value per example."""
        answer = self._examples(call, REGRESS, decode)
        return answer, regressions(answer.outputs, answer.rows)

    def _examples(self, call: Call, method: str, decode: Decode) -> Answer:
        servable = self.model(call.model, call.record)
        signature, _input_name = self.example_signature(servable, call.signature, method)
        return self.run(call, servable, signature, decode)

    def multi_inference(self, call: Call, tasks: list[Task], decode: Decode) -> tuple[Servable, list[TaskResult]]:
        """Every task over the same examples, in the tasks' order, once all of them passed TF Serving's checks.

        TF Serving feeds the examples once and fetches every task's outputs from one session run;
        here each task's signature runs on its own batcher, within the call's one deadline. Later
        tasks go to the version that answered the first, so every result names one version.
        """
        servable = self.model(call.model, call.record)
        plan = multi_inference_plan(servable.model, tasks, check_method_name=self.check_method_name)
        results = []
        for method, signature in plan:
            answer = self.run(call, servable, signature, decode)
            servable = answer.servable
            if method == CLASSIFY:
                results.append(TaskResult(answer.signature, classes=classes(answer.outputs, answer.rows)))
            else:
                results.append(TaskResult(answer.signature, regressions=regressions(answer.outputs, answer.rows)))
        return servable, results


class _Staged(NamedTuple):
    """A call ready for its engine: the outputs it asked for, its decoded inputs, its rows."""

    selected: list[TensorInfo]
    inputs: Tensors
    rows: int


def _check_exact(spec: TensorInfo, array: np.ndarray | None) -> None:
    """400 for a value of the input that the narrower dtype its backend computes it in turns into
    another number: an integer it cannot hold exactly, a finite float past its range. A float's
    rounding to the narrower precision is kept, as Keras's layers cast float64 on TensorFlow too."""
    if array is None or not array.size:
        return
    with np.errstate(over="ignore", invalid="ignore"):
        held = array.astype(spec.narrowed_to).astype(array.dtype)
    if array.dtype.kind in "fc":
        changed = np.isfinite(array) & ~np.isfinite(held)
    else:
        changed = held != array
    if changed.any():
        value = array[changed].flat[0].item()
        raise InvalidInput(f"input '{spec.name}': {value!r} does not fit {spec.narrowed_to}, and Keras on "
                           f"JAX computes this {spec.dtype} input in {spec.narrowed_to} (JAX_ENABLE_X64 is off)")


def examples_decode(examples: Callable[[int], np.ndarray]) -> Decode:
    """Classify's, regress's and MultiInference's decode: `examples(max_rows)`, the serialized
    tf.Examples (refused over max_rows before any is built), as the signature's one input;
    built once, however many of a MultiInference's tasks read them."""
    built: list[np.ndarray] = []

    def decode(_signature: Signature, max_rows: int) -> Tensors:
        if not built:
            built.append(examples(max_rows))
        return {EXAMPLES_INPUT: built[0]}

    return decode


def multi_inference_spec(first: ModelSpec) -> ModelSpec:
    """The model a MultiInference runs on: its first task's, which must name one
    (model_servers/multi_inference_helper.cc, server_core.cc); no task: no name."""
    if not first.name:
        raise BadRequest("ModelSpec has no name specified.")
    return first


def multi_inference_plan(model: LoadedModel, tasks: list[Task], *,
                         check_method_name: bool = False) -> list[tuple[str, Signature]]:
    """Each task's kind (CLASSIFY or REGRESS) and signature, in order, after TF Serving's checks
    (servables/tensorflow/multi_inference.cc): one model for all, no signature twice, a known
    method name, and the signature's fit for its method. Nothing runs unless every task passes."""
    plan: list[tuple[str, Signature]] = []
    seen: set[str] = set()
    for task in tasks:
        if not task.model_name:
            raise BadRequest("Found ModelSpec with an empty model name.")
        if task.model_name != tasks[0].model_name:
            raise BadRequest("All ModelSpecs in a MultiInferenceRequest must access the same model name.")
        key = task.signature_name or DEFAULT_SIGNATURE
        if key in seen:
            raise BadRequest(f"Duplicate evaluation of signature: {key}")
        seen.add(key)
        if key not in model.signatures:
            raise BadRequest(f"Requested signature not found in model graph: {key}")
        method = _TASK_METHODS.get(task.method_name)
        if method is None:
            # UNIMPLEMENTED over gRPC, as TF Serving answers it.
            raise MethodNotAllowed(f"Unsupported signature method_name: {task.method_name}")
        signature, _ = example_signature(model, key, method, check_method_name=check_method_name)
        plan.append((method, signature))
    return plan


def example_signature(model: LoadedModel, name: str, method: str, *,
                      check_method_name: bool = False) -> tuple[Signature, str]:
    """Classify's or regress's signature and the name of its one input, with TF Serving's checks
    (servables/tensorflow/classifier.cc, regressor.cc: PreProcessClassification, PreProcessRegression).

    The method name is checked only when asked (--enable_signature_method_name_check); otherwise any
    signature fits whose one input is 'inputs' and whose outputs are 'classes' and/or 'scores'
    (classify) or 'outputs' (regress). Without a name: serving_default, or the model's main signature
    where it has no serving_default.
    """
    if not name and DEFAULT_SIGNATURE not in model.signatures:
        name = model.default_signature
    key = name or DEFAULT_SIGNATURE
    signature = model.signatures.get(key)
    if signature is None:
        raise BadRequest(f"No signature was found with the name: {key}")
    method_name, kind = _EXAMPLE_METHODS[method]
    if check_method_name and signature.method_name != method_name:
        raise BadRequest(f"Expected {kind} signature method_name to be {method_name}. "
                         f"Was: {signature.method_name}")
    if len(signature.inputs) != 1:
        raise BadRequest("Expected one input Tensor.")
    outputs = {spec.name for spec in signature.outputs}
    if method == CLASSIFY and len(outputs) not in (1, 2):
        raise BadRequest(f"Expected one or two output Tensors, found {len(outputs)}")
    if method == REGRESS and len(outputs) != 1:
        raise BadRequest("Expected one output Tensor.")
    if signature.inputs[0].name != EXAMPLES_INPUT:
        raise BadRequest(f"No {kind} inputs found in SignatureDef '{signature.name}': its input is "
                         f"'{signature.inputs[0].name}', not '{EXAMPLES_INPUT}'")
    if method == CLASSIFY and not outputs & {"classes", "scores"}:
        raise BadRequest('Expected classification signature outputs to contain at least one of "classes" or '
                         f'"scores". Signature \'{signature.name}\' has {braced(outputs)}')
    if method == REGRESS and outputs != {"outputs"}:
        raise BadRequest(f"No regression outputs found in SignatureDef '{signature.name}': its output is "
                         f"{braced(outputs)}, not 'outputs'")
    if signature.inputs[0].dtype != STRING:
        raise BadRequest(f"Expected one input Tensor of serialized tf.Examples in signature '{signature.name}'")
    return signature, EXAMPLES_INPUT


def _answer(servable: Servable, signature: Signature, selected: list[TensorInfo], rows: int,
            result: BatchResult) -> Answer:
    # The version that answered may be newer than the one resolved (a retired one sends on).
    return Answer(servable, servable.model.signatures.get(signature.name, signature), selected, result.outputs,
                  rows, result.batch_rows, result.batch_requests)


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


def init_app(app: Flask, settings: Settings, registry: ModelRegistry, *,
             make_layer: Callable[..., RequestLayer] = RequestLayer) -> RequestLayer:
    """The app's request layer; `make_layer` is its class, or tracing's (app/tracing.py) when on."""
    layer = make_layer(registry, timeout_s=settings.request_timeout_ms / 1000.0,
                       max_request_bytes=max_request_bytes(settings, registry), metrics=app.extensions["metrics"],
                       check_method_name=settings.enable_signature_method_name_check)
    app.extensions["serving"] = layer
    layer.payload_log = init_payload_log(app, settings)
    return layer


def get_layer(app: Flask) -> RequestLayer:
    return app.extensions["serving"]
