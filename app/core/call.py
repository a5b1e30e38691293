"""The call: one request as every layer below its front door sees it.

A front door parses its wire format and builds one `Call`; the request layer, the registry
and the engine read it, and the queued work item keeps it. Nothing below a front door takes
these values as separate parameters: a new per-request field is one field here.

    Call(model=ModelSpec(name, version, label),   # pinned: a version or a label was named
         signature="", outputs=(),                # as the request names them ('': the default)
         deadline=..., timeout_s=...,             # one absolute time.monotonic() instant, and
                                                  # the time it gave the call (for messages only)
         client_gone=..., priority=0, record=..., trace=...)

With MODEL_PROCESSES the call crosses into the model process once, as `frame()` in the
predict frame's header, and comes back out there as a Call (`from_frame`) with that side's
client-gone check and trace. The deadline travels as it is: CLOCK_MONOTONIC is one clock for
every process of the host, and a worker and its model process share a host.

Both are NamedTuples: immutable, and built several times faster than a frozen dataclass
(whose __init__ sets each field through object.__setattr__), which counts once per request.
This module imports nothing of the app: the engine below and every layer above read it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from app.ops.logs import RequestRecord

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


_ANY_MODEL = ModelSpec()


class Call(NamedTuple):
    """One request, built once by its front door and read by every layer below it."""

    model: ModelSpec = _ANY_MODEL
    # The signature and outputs the request names; the request layer resolves them once.
    signature: str = ""
    outputs: tuple[str, ...] = ()
    # When the answer is no longer wanted, on time.monotonic()'s clock; None: never.
    deadline: float | None = None
    # Asked once, just before the request's first rows run (app/core/serving.py, socket_client_gone).
    client_gone: ClientGonePredicate | None = None
    # Higher runs sooner; carried to the queued work item, which the row queue reads.
    priority: int = 0
    # The access line's and the request metrics' record; None where no front door keeps one.
    record: RequestRecord | None = None
    # The request's trace (app/ops/tracing.py), opaque below the request layer.
    trace: Any = None
    # How long the call was given when its deadline was set: what a timeout's message names
    # (the deadline, not this, is what every layer acts on).
    timeout_s: float | None = None

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

    def frame(self) -> list[Any]:
        """What a model process needs of the call, as JSON values: the model it names (its
        pinning), the deadline, the priority and the trace's link (a trace's `frame_fields`)."""
        model = self.model
        trace = None if self.trace is None else self.trace.frame_fields()
        return [model.name, model.version, model.label, self.deadline, self.priority, trace]

    @classmethod
    def from_frame(cls, fields: list[Any], *, signature: str, client_gone: ClientGonePredicate | None = None,
                   trace: Callable[[Any], Any] | None = None) -> Call:
        """The call `frame()` wrote, on the model process's side: its own client-gone check, and
        its trace made by `trace` from the fields (None: the call is not traced there)."""
        name, version, label, deadline, priority, link = fields
        return cls(ModelSpec(name, version, label), signature, (), deadline, client_gone, priority, None,
                   None if link is None or trace is None else trace(link))
