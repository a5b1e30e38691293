"""The call and the exchange: one request as the layers below its front door see it, and as its
transport sees it.

Each transport's outermost layer opens one `Exchange` per request (HTTP: app/http/layers.py;
gRPC: app/grpc/calls.py): its id, method, path and route, its status, its sizes, its trace and
its client-gone check. The access line, the request metrics and the trace are written from it
when it closes (app/core/exchange.py). A front door builds the request's one `Call` from it:

    call = exchange.call(ModelSpec(name, version, label),   # pinned: a version or a label was named
                         signature="", outputs=(),          # as the request names them ('': the default)
                         client_timeout_s=..., priority=0)  # the deadline: REQUEST_TIMEOUT_MS from
                                                            # now, or sooner where the client says so

The request layer, the registry and the engine read the call, and the queued work item keeps
it; the request layer writes what it learns (the model, the rows, the batch) to `call.exchange`.
Nothing below a front door takes these values as separate parameters: a new per-request field
is one field of `Call` (or, if only its transport knows it, of `Exchange`).

With MODEL_PROCESSES the call crosses into the model process once, as `frame()` in the
predict frame's header, and comes back out there as a Call (`from_frame`) with that side's
client-gone check and trace. The deadline travels as it is: CLOCK_MONOTONIC is one clock for
every process of the host, and a worker and its model process share a host.

Call and ModelSpec are NamedTuples: immutable, and built several times faster than a frozen
dataclass (whose __init__ sets each field through object.__setattr__), which counts once per
request. This module imports nothing of the app: the engine below and every layer above read it.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

# True once nobody will read the answer. Asked on the batch thread: it must be quick and never block.
ClientGonePredicate = Callable[[], bool]


class ModelSpec(NamedTuple):
    """The model a request names: by name (None: the server's first), version or label."""

    name: str | None = None
    version: int | None = None
    label: str | None = None

    @property
    def pinned(self) -> bool:
        """A pinned request is served by the version it names or refused, never by another."""
        return self.version is not None or self.label is not None


ANY_MODEL = ModelSpec()
# A call without request parameters (TF Serving's doors): one shared, read-only mapping.
NO_PARAMETERS: Mapping[str, Any] = types.MappingProxyType({})


def deadline_s(server_s: float | None, client_s: float | None) -> float | None:
    """How long a call may take: the server's REQUEST_TIMEOUT_MS, or less if the client gave less."""
    if client_s is None:
        return server_s
    return client_s if server_s is None else min(server_s, client_s)


class Call(NamedTuple):
    """One request, built once by its front door and read by every layer below it."""

    model: ModelSpec = ANY_MODEL
    # The signature and outputs the request names; the request layer resolves them once.
    signature: str = ""
    outputs: tuple[str, ...] = ()
    # When the answer is no longer wanted, on time.monotonic()'s clock; None: never.
    deadline: float | None = None
    # Asked once, just before the request's first rows run (the engine's work item, app/core/batching/work.py).
    client_gone: ClientGonePredicate | None = None
    # Higher runs sooner; carried to the queued work item, which the row queue reads.
    priority: int = 0
    # The request's exchange (None where no transport opened one): the request layer writes the
    # model, the rows and the batch to it, the payload log reads its request id.
    exchange: Exchange | None = None
    # The request's trace (app/ops/tracing.py), where it is recorded: the engine links its predict spans to it.
    trace: Any = None
    # How long the call was given when its deadline was set: what a timeout's message names
    # (the deadline, not this, is what every layer acts on).
    timeout_s: float | None = None
    # The request's own parameters, as JSON values (v2's `parameters`; none on TF Serving's doors):
    # what a model's handler reads (app/core/handlers.py).
    parameters: Mapping[str, Any] = NO_PARAMETERS
    # Rows share a predict call only with rows of an equal group: a handler's batch key, set by the
    # request layer, never by a door (None: the rows' shapes alone decide).
    group: Hashable = None

    @classmethod
    def within(cls, timeout_s: float | None, **fields: Any) -> Call:
        """A call whose deadline is `timeout_s` from now (None: no deadline)."""
        return cls(deadline=None if timeout_s is None else time.monotonic() + timeout_s, timeout_s=timeout_s,
                   **fields)

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until the deadline (negative once passed); None without one."""
        if self.deadline is None:
            return None
        return self.deadline - (time.monotonic() if now is None else now)

    def frame(self) -> dict[str, Any]:
        """What a model process needs of the call, as JSON values, by name: the model it names (its
        pinning), the deadline, the priority, the batch group and the trace's link (a trace's
        `frame_fields`)."""
        model = self.model
        return {"name": model.name, "version": model.version, "label": model.label, "deadline": self.deadline,
                "priority": self.priority, "group": self.group,
                "trace": None if self.trace is None else self.trace.frame_fields()}

    @classmethod
    def from_frame(cls, fields: dict[str, Any], *, signature: str, client_gone: ClientGonePredicate | None = None,
                   trace: Callable[[Any], Any] | None = None) -> Call:
        """The call `frame()` wrote, on the model process's side: its own client-gone check, and
        its trace made by `trace` from the fields (None: the call is not traced there)."""
        link = fields["trace"]
        group = fields.get("group")
        return cls(ModelSpec(fields["name"], fields["version"], fields["label"]), signature,
                   deadline=fields["deadline"], client_gone=client_gone, priority=fields["priority"],
                   trace=None if link is None or trace is None else trace(link),
                   group=tuple(group) if isinstance(group, list) else group)


class Exchange:
    """One request as its transport sees it, from its first byte to its answer's status.

    Opened by the transport's outermost layer, closed once the answer's status is known
    (app/core/exchange.py writes its access line, counts it and ends its trace). The request
    layer fills in `model`, `rows`, `batch_rows` and `batch_requests`.
    """

    def __init__(self, request_id: str, method: str = "", path: str = "", *, route: str | None = None,
                 timeout_s: float | None = None, trace: Any = None,
                 client_gone: ClientGonePredicate | None = None) -> None:
        self.request_id = request_id
        self.method = method
        self._path = path
        # The route's label (an HTTP URL rule, a gRPC method): requests are counted by it, never by path.
        self.route = route
        # An HTTP status, or a gRPC code's name.
        self.status: int | str = 500
        self.started = time.perf_counter()
        self.model: str | None = None
        self.rows: int | None = None
        self.batch_rows: int | None = None
        self.batch_requests: int | None = None
        # The server's REQUEST_TIMEOUT_MS: every call built from this exchange has it at most.
        self.timeout_s = timeout_s
        # The request's trace (app/ops/tracing.py), or None: tracing off, or a probe.
        self.trace = trace
        self.client_gone = client_gone

    def call(self, model: ModelSpec = ANY_MODEL, *, signature: str = "", outputs: tuple[str, ...] = (),
             client_timeout_s: float | None = None, priority: int = 0,
             parameters: Mapping[str, Any] = NO_PARAMETERS) -> Call:
        """The request's Call: its deadline is set now, REQUEST_TIMEOUT_MS or the client's if less."""
        trace = self.trace
        # A trace sampled out is not linked to by any predict span.
        if trace is not None and not trace.recording:
            trace = None
        timeout_s = deadline_s(self.timeout_s, client_timeout_s)
        # Call.within's deadline, made here: its **fields would pass every keyword twice, per request.
        return Call(model, signature, outputs, deadline=None if timeout_s is None else time.monotonic() + timeout_s,
                    client_gone=self.client_gone, priority=priority, exchange=self, trace=trace, timeout_s=timeout_s,
                    parameters=parameters)

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    @property
    def path(self) -> str:
        """The path the access line names (the transport's: a URL's path, a gRPC method)."""
        return self._path

    @property
    def metric_method(self) -> str:
        """The request metrics' method label (a transport keeps a client from making up its own)."""
        return self.method

    @property
    def logged(self) -> bool:
        """Whether the access log writes this request's line (a transport may leave probes out)."""
        return True

    def access_fields(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "latency_ms": round((time.perf_counter() - self.started) * 1000, 3),
            "rows": self.rows,
            "batch_rows": self.batch_rows,
            "batch_requests": self.batch_requests,
            "model": self.model,
            "request_id": self.request_id,
        }
