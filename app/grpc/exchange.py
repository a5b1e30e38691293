"""A gRPC call's exchange, closed with the status its client got.

A call's status is not settled when its handler returns: grpc-core can still fail to deliver
the answer (the client cancels or its deadline passes while the reply is being sent, or the
connection drops). So the exchange is opened as the call starts (app/grpc/calls.py, before
anything can refuse it) and closed (app/core/exchange.py: access line, request metrics, trace)
when grpc reports the call done, with:

- the code the call was ended with: a refusal's or an error's (`context.abort`), or, for a
  call grpc cancelled while it ran (its client cancelled or left, its deadline passed),
  DEADLINE_EXCEEDED when its deadline had passed, else CANCELLED;
- DEADLINE_EXCEEDED for an answer still unsent when the deadline passed;
- else OK.

What the server is not told: a call grpc-core ends itself (metadata over the server's limit,
reply metadata it will not send) reaches it cancelled, and is recorded CANCELLED while its
client got RESOURCE_EXHAUSTED or INTERNAL; what the client's own library refuses after the
answer arrived (over the client's message or metadata limit) is recorded with the status sent.

Health checks have none: the probes' calls, as /healthz and /readyz over HTTP. Each request of a
ModelStreamInfer stream has one of its own, closed with its own status once its answer is written
(app/grpc/calls.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

from app.core.call import ANY_MODEL, NO_PARAMETERS, Call, Exchange, ModelSpec, deadline_s
from app.core.exchange import Exchanges
from app.ops.logs import accept_request_id
from app.wire.priority import from_metadata as priority_from_metadata

REQUEST_ID_KEY = "x-request-id"
# A client's deadline and the server's are the same instant, give or take the time its headers
# took to arrive; a call cancelled this close to its deadline was cancelled by it.
DEADLINE_SLACK_S = 0.1


class GrpcExchange(Exchange):
    """One gRPC call: its method is its route and its path, its status a code's name, and its
    context (`context`) gives its deadline, its metadata and whether it is still wanted."""

    def __init__(self, exchanges: Exchanges, method: str, context: grpc.aio.ServicerContext, *,
                 timeout_s: float | None, streamed: bool = False) -> None:
        metadata = context.invocation_metadata() or ()
        # A streamed request has an id of its own: the stream's metadata is every request's.
        given = "" if streamed else dict(metadata).get(REQUEST_ID_KEY, "")
        super().__init__(accept_request_id(given), "GRPC", method, route=method, timeout_s=timeout_s,
                         client_gone=CallClientGone(context))
        self.context = context
        self.metadata = metadata
        # Closed by these once grpc reports the call done, or (a streamed request) once answered.
        self._exchanges = exchanges
        if not streamed:
            context.add_done_callback(self._ended)

    def call(self, model: ModelSpec = ANY_MODEL, *, signature: str = "", outputs: tuple[str, ...] = (),
             client_timeout_s: float | None = None, priority: int | None = None,
             parameters: Mapping[str, Any] = NO_PARAMETERS) -> Call:
        """The call's Call: its deadline the gRPC call's own (and `client_timeout_s`, if sooner),
        capped by REQUEST_TIMEOUT_MS; its priority from the x-priority metadata unless given."""
        return super().call(model, signature=signature, outputs=outputs,
                            client_timeout_s=deadline_s(self.context.time_remaining(), client_timeout_s),
                            priority=priority_from_metadata(self.metadata) if priority is None else priority,
                            parameters=parameters)

    async def echo_id(self) -> None:
        """The request id to the client, in the call's initial metadata."""
        await self.context.send_initial_metadata(((REQUEST_ID_KEY, self.request_id),))

    def cancelled(self) -> None:
        """grpc cancelled the call while it ran. Its code says why, for the exchange and for
        `CallClientGone`: the rows of a client that left are dropped unrun."""
        self.context.set_code(ended_code(self.context))

    def _ended(self, context: grpc.aio.ServicerContext) -> None:
        self.finish(_status(context))

    def finish(self, code: grpc.StatusCode) -> None:
        """Closed with the status its client got: the call's, or a streamed request's own."""
        self.status = code.name
        self._exchanges.close(self)


def ended_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """Why grpc cancelled a call: its deadline had passed, or else its client cancelled or left."""
    left_s = context.time_remaining()
    expired = left_s is not None and left_s <= DEADLINE_SLACK_S
    return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED


def _status(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    code = context.code()
    if code is not None:
        return code
    left_s = context.time_remaining()
    if left_s is not None and left_s <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED  # the answer was still unsent
    return grpc.StatusCode.OK


class CallClientGone:
    """client_gone's predicate: the call was cancelled (GrpcExchange.cancelled). `context` lets a
    model process's client hear the call end (add_done_callback)."""

    __slots__ = ("context",)

    def __init__(self, context: Any) -> None:
        self.context = context

    def __call__(self) -> bool:
        return bool(self.context.cancelled())
