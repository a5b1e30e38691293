"""The one record of each gRPC call (access line, request metrics), written with the status its client got.

A call's status is not settled when its handler returns: grpc-core can still fail to deliver
the answer. The client cancels or its deadline passes while the reply is being made or sent,
or the connection drops; the client then gets CANCELLED or DEADLINE_EXCEEDED, whatever the
handler returned. So `CallRecords`,
the server's first interceptor, opens the record as a call reaches its thread (before the
limits' guard, so calls the guard refuses or cancels are recorded too) and writes it once
both the handler has returned and grpc-core has reported the call's end
(`ServicerContext.add_callback`), whichever comes last, with the status from the transport:

- the call ended cancelled (its client cancelled or left, its deadline passed, the server
  cancelled it): DEADLINE_EXCEEDED when its deadline had passed, else CANCELLED;
- else the status grpc-core sent: the handler's code (`context.abort`), INTERNAL when the
  answer could not be serialized, UNKNOWN when the handler raised without a code, else OK.

What the server is not told: a call grpc-core ends itself (metadata over the server's
limit, reply metadata it will not send) reaches it cancelled, and is recorded CANCELLED
while its client got RESOURCE_EXHAUSTED or INTERNAL; what the client's own library refuses
after the answer arrived (over the client's message or metadata limit) is recorded with the
status sent.

Health checks are not recorded: the probes' calls, as /healthz and /readyz over HTTP.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

import grpc

from app import patches
from app.call import Call, ModelSpec
from app.grpc_limits import HEALTH_PREFIX
from app.logs import RequestRecord, accept_request_id
from app.serving import Requests

REQUEST_ID_KEY = "x-request-id"
# A client's deadline and the server's are the same instant, give or take the time its headers
# took to arrive; a call cancelled this close to its deadline was cancelled by it.
DEADLINE_SLACK_S = 0.1

# grpc hands a handler only (request, context): the record its interceptor opened reaches the
# handler below through this, and from there travels in the handler's Call.
_current: contextvars.ContextVar[_Call] = contextvars.ContextVar("model_server_grpc_record")


def current() -> RequestRecord:
    """The record of the call this thread serves (LookupError outside a recorded call)."""
    return _current.get().record


def set_trace(trace: object) -> None:
    """Give the record of the call this thread serves its trace (the tracing interceptor's), which
    the front door puts in the call it builds; nothing outside a recorded call."""
    call = _current.get(None)
    if call is not None:
        call.record.trace = trace


def when_written(callback: Callable[[str], None]) -> bool:
    """Call `callback` with the status of the call this thread serves once its record is
    written (the tracing interceptor ends its span so); False outside a recorded call."""
    call = _current.get(None)
    if call is None:
        return False
    call.written.append(callback)
    return True


def cancelled(context: grpc.ServicerContext) -> bool:
    """Whether grpc-core reported the call's end as cancelled.

    grpc-python's synchronous server has no public way to ask: `is_active()` is False for
    every call that has ended, answered or not. Its call state holds what grpc-core reported
    (grpc/_server.py, `_RPCState.client`); tests/test_grpc_truth.py fails if that changes.
    """
    return context._state.client == "cancelled"


class _Call:
    """One call's record, written by whichever of its handler and its end comes last."""

    __slots__ = ("record", "_context", "_requests", "_route", "_lock", "_parts_left", "raised", "reply_failed",
                 "written")

    def __init__(self, requests: Requests, route: str) -> None:
        self._requests = requests
        self._route = route
        self._lock = threading.Lock()
        self._parts_left = 2
        self.raised = False
        self.reply_failed = False
        self.written: list[Callable[[str], None]] = []

    def start(self, context: grpc.ServicerContext) -> RequestRecord:
        """Open the record, on the call's own thread; echo the request id to the client."""
        request_id = accept_request_id(dict(context.invocation_metadata() or ()).get(REQUEST_ID_KEY, ""))
        self.record = self._requests.start("GRPC", self._route, request_id)
        self._context = context
        patches.hold_initial_metadata(context, ((REQUEST_ID_KEY, request_id),))
        if not context.add_callback(self._ended):
            self._ended()  # the call ended before its thread took it up
        return self.record

    def _ended(self) -> None:
        # On grpc's polling thread as the call ends: the status is settled now, while the
        # deadline's test still tells a cancel from an expiry.
        self.record.status = self._status().name
        self.part_done()

    def part_done(self) -> None:
        with self._lock:
            self._parts_left -= 1
            last = self._parts_left == 0
        if last:
            self._requests.finish(self.record)
            for callback in self.written:
                callback(str(self.record.status))

    def _status(self) -> grpc.StatusCode:
        context = self._context
        if cancelled(context):
            if context.time_remaining() <= DEADLINE_SLACK_S:
                return grpc.StatusCode.DEADLINE_EXCEEDED
            return grpc.StatusCode.CANCELLED
        if self.reply_failed:
            return grpc.StatusCode.INTERNAL
        return context.code() or (grpc.StatusCode.UNKNOWN if self.raised else grpc.StatusCode.OK)


class CallRecords(grpc.ServerInterceptor):
    """The server's first interceptor: every call but Health's gets one record (module docstring)."""

    def __init__(self, requests: Requests) -> None:
        self._requests = requests
        # The request id each record echoes goes out with the call's answer (app/patches.py).
        patches.initial_metadata_with_the_answer()

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        if handler.stream_unary is not None:
            make, behavior = grpc.stream_unary_rpc_method_handler, handler.stream_unary
        elif handler.unary_unary is not None:
            make, behavior = grpc.unary_unary_rpc_method_handler, handler.unary_unary
        else:
            return handler
        # Built per call on grpc's polling thread, so it does no more than make the wrappers.
        call = _Call(self._requests, details.method)
        return make(_recorded(call, behavior), request_deserializer=handler.request_deserializer,
                    response_serializer=_serializer(call, handler.response_serializer))


def _recorded(call: _Call, behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Callable:
    def recorded(argument: Any, context: grpc.ServicerContext) -> Any:
        call.start(context)
        token = _current.set(call)
        try:
            return behavior(argument, context)
        except BaseException:
            call.raised = True
            raise
        finally:
            _current.reset(token)
            # grpc serializes and sends the answer after this returns: the end comes later.
            call.part_done()

    pool = getattr(behavior, "experimental_thread_pool", None)
    if pool is not None:
        recorded.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return recorded


def _serializer(call: _Call, serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    if serialize is None:
        return None

    def serialized(response: Any) -> bytes:
        try:
            return serialize(response)
        except Exception:
            call.reply_failed = True  # grpc answers INTERNAL
            raise

    return serialized


def make_call(spec: ModelSpec, record: RequestRecord, context: grpc.ServicerContext, timeout_s: float, *,
              signature: str = "", outputs: tuple[str, ...] = (), priority: int = 0) -> Call:
    """A gRPC front door's Call: its record and trace, and its client_gone. gRPC marks a call
    inactive once its client cancelled it, its deadline passed or its connection dropped; reading
    that mark takes the call's lock and nothing else, and only a request that reaches its batch asks."""
    return Call.within(timeout_s, model=spec, signature=signature, outputs=outputs,
                       client_gone=CallClientGone(context), record=record, trace=record.trace, priority=priority)


class CallClientGone:
    """client_gone's predicate; `context` lets a model process's client hear the call end (add_callback)."""

    __slots__ = ("context",)

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.context = context

    def __call__(self) -> bool:
        return not self.context.is_active()
