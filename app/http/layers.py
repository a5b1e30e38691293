"""The WSGI layers around the Flask app, and what they leave for the views."""

from __future__ import annotations

import logging
import select
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from app.core.call import Call, ClientGonePredicate, ModelSpec
from app.core.serving import RequestLayer
from app.http import patches
from app.ops.logs import (
    PROBE_PATHS,
    REQUEST_ID_HEADER,
    AccessWriter,
    RequestRecord,
    accept_request_id,
    access_log,
    log_access,
)
from app.ops.metrics import HTTP_METHODS, OTHER, Metrics, RequestCounts
from app.ops.patches import value_of

# Where a request's RequestRecord lives in its WSGI environ.
RECORD_KEY = "model_server.request"


_REQUEST_ID_ENVIRON = "HTTP_" + REQUEST_ID_HEADER.upper().replace("-", "_")


def record() -> RequestRecord:
    """The current request's record (a detached one outside the access-log layer)."""
    environ = patches.request_environ()
    found = environ.get(RECORD_KEY) if environ is not None else None
    return found if found is not None else RequestRecord("")


def current_request_id() -> str | None:
    return record().request_id or None


class AccessLayer:
    """WSGI layer: every request gets an id, echoed in X-Request-ID, and one access line.

    A WSGI layer rather than Flask before/after hooks: a hook costs Flask an
    `iscoroutinefunction` check and the request-local proxies on every call, and this is
    all per-request work.
    """

    def __init__(self, app: Callable[..., Iterable[bytes]], *, probes: bool, writer: AccessWriter | None) -> None:
        self.app = app
        self.probes = probes
        self.writer = writer

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        entry = RequestRecord(accept_request_id(environ.get(_REQUEST_ID_ENVIRON, "")),
                              environ.get("REQUEST_METHOD", ""))
        environ[RECORD_KEY] = entry

        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            entry.status = int(status[:3])
            headers.append((REQUEST_ID_HEADER, entry.request_id))
            return start_response(status, headers, exc_info)

        try:
            return self.app(environ, start)
        finally:
            self._log(environ, entry)

    def _log(self, environ: dict[str, Any], entry: RequestRecord) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        # As Werkzeug's request.path reads it (werkzeug.wsgi.get_path_info, and a leading "/").
        entry.path = "/" + environ.get("PATH_INFO", "").encode("latin1").decode(errors="replace").lstrip("/")
        if entry.path in PROBE_PATHS and not self.probes:
            return
        log_access(entry.access_fields(), writer=self.writer)


# Where the matched URL rule of a request is left for other layers (tracing names its span by
# it): Flask clears environ["werkzeug.request"] when its request context ends.
ROUTE_KEY = "model_server.route"


class MetricsLayer:
    """WSGI layer: HTTP requests in flight, and each answer counted by its URL rule (RequestCounts)."""

    def __init__(self, app: Callable[..., Iterable[bytes]], metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        self._in_flight = value_of(metrics.in_flight)
        self._counts = RequestCounts(metrics)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        started = time.perf_counter()
        status = [500]

        def start(line: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            status[0] = int(line[:3])
            # Flask answers inside its request context, so its request (and the rule it matched,
            # None for a 404 or 405) is still in the environ here, and no longer once it returns.
            # A route answered below Flask (app/http/routes.py) has left its rule's text already.
            if ROUTE_KEY not in environ:
                flask_request = environ.get("werkzeug.request")
                rule = flask_request.url_rule if flask_request is not None else None
                environ[ROUTE_KEY] = rule.rule if rule is not None else None
            return start_response(line, headers, exc_info)

        self._in_flight.inc(1)
        try:
            return self.app(environ, start)
        finally:
            self._in_flight.inc(-1)
            self._count(environ, status[0], time.perf_counter() - started)

    def _count(self, environ: dict[str, Any], status: int, seconds: float) -> None:
        # The URL rule, not the path: unknown paths must not grow a series each.
        route = environ.get(ROUTE_KEY) or OTHER
        method = environ.get("REQUEST_METHOD", "")
        if method not in HTTP_METHODS:
            method = OTHER
        self._counts.count(route, method, str(status), seconds)


# The WSGI environ key under which tracing's layer leaves a request's trace (app/ops/tracing.py).
TRACE_KEY = "model_server.trace"


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


def http_call(layer: RequestLayer, environ: dict[str, Any], spec: ModelSpec, signature: str,
              outputs: tuple[str, ...] = (), client_timeout_s: float | None = None, priority: int = 0) -> Call:
    """An HTTP front door's Call for the request of `environ`: its record, its trace, and a
    client_gone that watches its connection (Gunicorn hands the app the client's socket;
    Flask's test client has none)."""
    return Call.within(layer.deadline_s(client_timeout_s), model=spec, signature=signature, outputs=outputs,
                       client_gone=socket_client_gone(environ.get("gunicorn.socket")),
                       record=environ.get(RECORD_KEY) or RequestRecord(""),
                       trace=environ.get(TRACE_KEY), priority=priority)
