"""The request layer: the policy every front door shares, below its wire format.

A front door (TF Serving's REST in app/http/tfs.py and gRPC in app/grpc/tfs.py, the Open
Inference Protocol's in app/http/v2.py and app/grpc/v2.py) is parse -> call -> infer -> encode:

    call = exchange.call(ModelSpec(name, version, label), signature=..., outputs=...,
                         client_timeout_s=..., priority=...)
    answer = layer.infer(call, decode)      # decode(signature, max_rows) -> the input arrays
    answer = await layer.start(call, decode)                 # the same, on an asyncio loop
    ... write answer.outputs (answer.selected: the outputs asked for, in order) ...

Every prediction takes one path: resolve the version and the signature (`model`, once per
call), `queue` (decode, check the deadline, submit the rows to the registry) and a `Pending`
whose wait is the engine's one deadline wait, on a thread or on a loop; its answer fills in the
call's exchange (rows, batch), is offered to the payload log and marks the call's trace.
TF Serving's classify, regress and MultiInference choose their signature by their own rules
(app/wire/classify.py) and `run` on the same path. What lives here, and nowhere in a front
door: which model, version, label and signature a call names, with TensorFlow Serving's words
for each refusal; the row limit (handed to `decode`, so it refuses before building any array)
and the outputs asked for.

A model with a handler (app/core/handlers.py) takes the same path: its door decodes against
the handler's signature, `queue` runs the handler's batch key and preprocess on this thread and
queues the rows they make under the call's `group`, and `Pending` runs postprocess on the rows
that come back, before the payload log and the trace see the answer; the deadline is checked
after each. On an asyncio loop (`start`), both stages run on the loop's executor, never on the
loop. Classify and regress refuse such a model: its handler answers Predict only.

`Call.client_gone` is the one way a front door says whether its client still waits: a cheap
predicate, asked once just before the call's first rows run. When it answers True the rows
never run and the layer raises ClientGone (HTTP 499, gRPC CANCELLED), counted as the
rejection reason `client_gone`. The HTTP exchange watches its connection's socket; gRPC's
asks its call's context.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, NamedTuple, TypeVar

import numpy as np

from app.core import handlers, limits
from app.core.batching import BatchResult, Engine, Tensors, awaited, wait
from app.core.call import Call, Exchange, ModelSpec
from app.core.errors import BadRequest, ClientGone, DeadlineExceeded, InvalidInput
from app.core.models import (
    Signature,
    TensorInfo,
)
from app.core.registry import ModelRegistry, Servable
from app.ops.payload_log import PayloadLog
from app.ops.settings import Settings

# A front door's decoding of its request's inputs against the signature the call resolved to,
# refusing more than `max_rows` rows before it builds any array: decode(signature, max_rows).
Decode = Callable[[Signature, int], Tensors]


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


class RequestLayer:
    """Resolution, limits, deadline and shaping over one app's registry and settings."""

    @classmethod
    def from_settings(cls, settings: Settings, registry: ModelRegistry) -> RequestLayer:
        """The layer the settings describe: the server's, and warm-up's for one model."""
        return cls(registry, timeout_s=settings.request_timeout_ms / 1000.0,
                   max_request_bytes=limits.max_request_bytes(settings, registry),
                   check_method_name=settings.enable_signature_method_name_check)

    def __init__(self, registry: ModelRegistry, *, timeout_s: float, max_request_bytes: int,
                 check_method_name: bool = False) -> None:
        self.registry = registry
        # TF Serving's --enable_signature_method_name_check, off by default as there: a TF2
        # SavedModel's signatures all say tensorflow/serving/predict.
        self.check_method_name = check_method_name
        self.timeout_s = timeout_s
        # gRPC's message limit and the HTTP body limit: one value, from settings and the models.
        self.max_request_bytes = max_request_bytes

    # -- which model, version, label and signature ------------------------------------

    def model(self, spec: ModelSpec, exchange: Exchange | None = None) -> Servable:
        """The version `spec` names, now; its model's name goes on `exchange` (the access line's)."""
        servable = self.registry.get(spec.name, spec.version, label=spec.label)
        if exchange is not None:
            exchange.model = servable.model.name
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
        whose time is up is refused when it runs), as `Exchange.call` gives it."""
        return self.timeout_s if client_timeout_s is None else min(self.timeout_s, client_timeout_s)

    # -- the prediction -------------------------------------------------------------------

    # Sampled predictions go here (app/ops/payload_log.py); None: not logged (warm-up's layer, or sampling off).
    payload_log: PayloadLog | None = None

    def infer(self, call: Call, decode: Decode) -> Answer:
        """The call's model and signature resolved, its inputs decoded, its rows run within its
        deadline, waited for on this thread (an HTTP request's)."""
        servable = self.model(call.model, call.exchange)
        return self.queue(call, servable, servable.signature(call.signature), decode).answer()

    def start(self, call: Call, decode: Decode) -> Awaitable[Answer]:
        """`infer` on an asyncio loop (gRPC's doors): the rows queued, and a Pending whose wait holds
        no thread. A model's handler runs on the loop's executor (the gRPC server's threads), never
        on the loop, each stage bound by the call's deadline."""
        servable = self.model(call.model, call.exchange)
        signature = servable.signature(call.signature)
        if servable.handler is None:
            return self.queue(call, servable, signature, decode)
        return self._start_handled(call, servable, signature, decode)

    async def _start_handled(self, call: Call, servable: Servable, signature: Signature, decode: Decode) -> Answer:
        loop = asyncio.get_running_loop()
        pending = await _within(call, loop.run_in_executor(None, self.queue, call, servable, signature, decode))
        return await pending

    def run(self, call: Call, servable: Servable, signature: Signature, decode: Decode) -> Answer:
        """`queue` on a signature the caller chose (TF Serving's classify and regress rules,
        app/wire/classify.py), waited for on this thread."""
        return self.queue(call, servable, signature, decode).answer()

    @staticmethod
    def predict_only(servable: Servable) -> None:
        """Classify, Regress and MultiInference refuse a model with a handler: its signature is its handler's."""
        if servable.handler is not None:
            raise BadRequest(f"model '{servable.model.name}' has a handler, which answers Predict only")

    def queue(self, call: Call, servable: Servable, signature: Signature, decode: Decode) -> Pending:
        """Decode against `signature`, run the model's handler on it, if it has one, and queue the
        rows on its batcher. Every prediction (predict, classify, regress, multi-inference) comes
        through here."""
        try:
            staged = self._stage(call, servable, signature, decode)
            inputs = staged.inputs
            if servable.handler is not None:
                call, inputs = self._preprocess(call, servable.handler, signature, staged)
            servable, engine, future = self.registry.submit(call, servable, signature, inputs)
        except BaseException:
            if call.trace is not None:
                call.trace.waited()
            raise
        return Pending(self, call, servable, signature, staged, engine, future)

    @staticmethod
    def _preprocess(call: Call, handled: handlers.Handled, signature: Signature, staged: _Staged
                    ) -> tuple[Call, Tensors]:
        """The handler's batch key and model inputs, on this thread; none queued past the deadline."""
        started = time.time_ns()
        inputs, group = handlers.stage(handled, call, signature, staged.inputs, staged.rows)
        for spec in handled.model_signature(signature).narrowed_inputs:
            _check_exact(spec, inputs.get(spec.name))
        if call.trace is not None:
            call.trace.handled("preprocess", started)
        if call.deadline is not None and call.deadline <= time.monotonic():
            raise DeadlineExceeded("the call's deadline passed while its handler's preprocess ran")
        return (call if group is None else call._replace(group=group)), inputs

    def _stage(self, call: Call, servable: Servable, signature: Signature, decode: Decode) -> _Staged:
        selected = self.select_outputs(signature, call.outputs)
        inputs = decode(signature, servable.batchers[signature.name].info.max_request_rows)
        for spec in signature.narrowed_inputs:
            _check_exact(spec, inputs.get(spec.name))
        if call.trace is not None:
            call.trace.decoded()
        # A request with no inputs, or a scalar one (an unbatched signature's), is one item.
        first = next(iter(inputs.values()), None)
        rows = first.shape[0] if first is not None and first.ndim else 1
        if call.exchange is not None:
            call.exchange.rows = rows
        if call.deadline is not None and call.deadline <= time.monotonic():
            raise DeadlineExceeded("the call's deadline passed before it was queued")
        return _Staged(selected, inputs, rows)


class Pending:
    """A call's rows, queued: its answer, waited for on a thread (`answer()`) or awaited on an
    asyncio loop (`await pending`), within the call's deadline (app/core/batching/engine.py's one
    wait); ClientGone if the call's client_gone answered True before its rows ran."""

    __slots__ = ("call", "_layer", "_servable", "_signature", "_staged", "_engine", "_future")

    def __init__(self, layer: RequestLayer, call: Call, servable: Servable, signature: Signature, staged: _Staged,
                 engine: Engine, future: concurrent.futures.Future[BatchResult]) -> None:
        self.call = call
        self._layer = layer
        self._servable = servable
        self._signature = signature
        self._staged = staged
        self._engine = engine
        self._future = future

    def answer(self) -> Answer:
        try:
            result = wait(self._engine, self.call, self._future)
        except concurrent.futures.CancelledError:
            # The engine cancels a request's future only when client_gone said so (and counted it).
            raise ClientGone("the client left before its request ran") from None
        finally:
            self._waited()
        return self._answered(result)

    def __await__(self) -> Generator[Any, None, Answer]:
        try:
            result = yield from awaited(self._engine, self.call, self._future).__await__()
        except concurrent.futures.CancelledError:
            raise ClientGone("the client left before its request ran") from None
        finally:
            self._waited()
        if self._servable.handler is None:
            return self._answered(result)
        # The handler's postprocess: off the loop, as its preprocess.
        answering = asyncio.get_running_loop().run_in_executor(None, self._answered, result)
        return (yield from _within(self.call, answering).__await__())

    def _waited(self) -> None:
        if self.call.trace is not None:
            self.call.trace.waited()

    def _answered(self, result: BatchResult) -> Answer:
        call, staged = self.call, self._staged
        exchange = call.exchange
        if exchange is not None:
            exchange.batch_rows, exchange.batch_requests = result.batch_rows, result.batch_requests
        # The version that answered may be newer than the one resolved (a retired one sends on).
        servable = self._servable
        signature = servable.model.signatures.get(self._signature.name, self._signature)
        outputs = result.outputs
        if servable.handler is not None:
            outputs = self._postprocess(servable.handler, signature, outputs)
        answer = Answer(servable, signature, staged.selected, outputs, staged.rows, result.batch_rows,
                        result.batch_requests)
        # Here, and only here, a finished call has its decoded inputs and its outputs together.
        payload_log = self._layer.payload_log
        if payload_log is not None:
            payload_log.offer(staged.inputs, answer, exchange.request_id if exchange is not None else "")
        if call.trace is not None:
            call.trace.answered(answer)
        return answer

    def _postprocess(self, handled: handlers.Handled, signature: Signature, outputs: dict[str, np.ndarray]
                     ) -> dict[str, np.ndarray]:
        call = self.call
        started = time.time_ns()
        answer = handlers.finish(handled, call, signature, self._staged.inputs, outputs, self._staged.rows)
        if call.trace is not None:
            call.trace.handled("postprocess", started)
        if call.deadline is not None and call.deadline <= time.monotonic():
            raise DeadlineExceeded("the call's deadline passed while its handler's postprocess ran")
        return answer


_T = TypeVar("_T")


async def _within(call: Call, running: Awaitable[_T]) -> _T:
    """`running` (a handler's stage on a thread), or DeadlineExceeded once the call's deadline passed:
    the thread cannot be stopped, but the call's answer does not wait for it."""
    left = call.seconds_left()
    if left is None:
        return await running
    try:
        return await asyncio.wait_for(running, max(left, 0.0))
    except TimeoutError:
        raise DeadlineExceeded("the call's deadline passed while its handler ran") from None


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


def braced(names: Any) -> str:
    """Names as TF Serving lists them in its messages: {a,b,c}, sorted."""
    return "{" + ",".join(sorted(names)) + "}"
