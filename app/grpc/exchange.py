"""The one record of each gRPC call (access line, request metrics), written with the status its client got.

A call's status is not settled when its handler returns: grpc-core can still fail to deliver
the answer (the client cancels or its deadline passes while the reply is being sent, or the
connection drops). So the record is opened as the call starts (app/grpc/calls.py, before
anything can refuse it) and written when grpc reports the call done, with:

- the code the call was ended with: a refusal's or an error's (`context.abort`), or, for a
  call grpc cancelled while it ran (its client cancelled or left, its deadline passed),
  DEADLINE_EXCEEDED when its deadline had passed, else CANCELLED;
- DEADLINE_EXCEEDED for an answer still unsent when the deadline passed;
- else OK.

What the server is not told: a call grpc-core ends itself (metadata over the server's limit,
reply metadata it will not send) reaches it cancelled, and is recorded CANCELLED while its
client got RESOURCE_EXHAUSTED or INTERNAL; what the client's own library refuses after the
answer arrived (over the client's message or metadata limit) is recorded with the status sent.

Health checks are not recorded: the probes' calls, as /healthz and /readyz over HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from app.core.call import Call, ModelSpec
from app.core.serving import Requests
from app.ops.logs import RequestRecord, accept_request_id

REQUEST_ID_KEY = "x-request-id"
# A client's deadline and the server's are the same instant, give or take the time its headers
# took to arrive; a call cancelled this close to its deadline was cancelled by it.
DEADLINE_SLACK_S = 0.1


class CallRecord:
    """One call's record: opened with the call, written once grpc reports it done."""

    __slots__ = ("record", "_context", "_requests", "_end_trace")

    def __init__(self, requests: Requests, route: str, context: grpc.aio.ServicerContext) -> None:
        request_id = accept_request_id(dict(context.invocation_metadata() or ()).get(REQUEST_ID_KEY, ""))
        self.record = requests.start("GRPC", route, request_id)
        self._context = context
        self._requests = requests
        self._end_trace: Callable[[Any, str], None] | None = None
        context.add_done_callback(self._ended)

    async def echo_id(self) -> None:
        """The request id to the client, in the call's initial metadata."""
        await self._context.send_initial_metadata(((REQUEST_ID_KEY, self.record.request_id),))

    def traced(self, trace: Any, end: Callable[[Any, str], None]) -> None:
        """The call's trace, which its front door puts in its Call; `end(trace, status)` with the record."""
        self.record.trace = trace
        self._end_trace = end

    def cancelled(self) -> None:
        """grpc cancelled the call while it ran. Its code says why, for the record and for
        `CallClientGone`: the rows of a client that left are dropped unrun."""
        left_s = self._context.time_remaining()
        expired = left_s is not None and left_s <= DEADLINE_SLACK_S
        self._context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED)

    def _ended(self, context: grpc.aio.ServicerContext) -> None:
        status = _status(context).name
        self.record.status = status
        self._requests.finish(self.record)
        if self._end_trace is not None:
            self._end_trace(self.record.trace, status)


def _status(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    code = context.code()
    if code is not None:
        return code
    left_s = context.time_remaining()
    if left_s is not None and left_s <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED  # the answer was still unsent
    return grpc.StatusCode.OK


def make_call(spec: ModelSpec, record: RequestRecord, context: Any, timeout_s: float, *,
              signature: str = "", outputs: tuple[str, ...] = (), priority: int = 0) -> Call:
    """A gRPC front door's Call: its record and trace, and its client_gone."""
    return Call.within(timeout_s, model=spec, signature=signature, outputs=outputs,
                       client_gone=CallClientGone(context), record=record, trace=record.trace, priority=priority)


class CallClientGone:
    """client_gone's predicate: the call was cancelled (CallRecord.cancelled). `context` lets a
    model process's client hear the call end (add_done_callback)."""

    __slots__ = ("context",)

    def __init__(self, context: Any) -> None:
        self.context = context

    def __call__(self) -> bool:
        return bool(self.context.cancelled())
