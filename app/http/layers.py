"""HTTP's exchange: opened by the outermost WSGI layer, read by every layer and view inside it.

`ExchangeLayer` gives every request its `HttpExchange` (app/core/call.py's Exchange, with the
WSGI environ it came with): its id (the client's X-Request-ID when it is a sane token, a new one
otherwise, echoed in the answer), its trace when TRACING is on, and, once the answer's status
is known, its close (app/core/exchange.py): the request metrics, the access line (probes left
out unless ACCESS_LOG_PROBES) and the trace's end. Inside it, the body limits leave the body
(or their refusal) on the exchange, the direct routes and Flask's views read it, and a door
builds the request's Call from it.

A WSGI layer rather than Flask before/after hooks: a hook costs Flask an `iscoroutinefunction`
check and the request-local proxies on every call, and this is all per-request work.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from app.core.call import ANY_MODEL, NO_PARAMETERS, Call, ClientGonePredicate, Exchange, ModelSpec
from app.core.errors import ServingError
from app.core.exchange import Exchanges
from app.http import patches
from app.ops.logs import PROBE_PATHS, REQUEST_ID_HEADER, accept_request_id
from app.ops.metrics import HTTP_METHODS, OTHER

if TYPE_CHECKING:
    from app.ops.tracing import Tracing

# Where the request's exchange lives in its WSGI environ, as Werkzeug keeps its request there.
EXCHANGE_KEY = "model_server.exchange"
_REQUEST_ID_ENVIRON = "HTTP_" + REQUEST_ID_HEADER.upper().replace("-", "_")


class HttpExchange(Exchange):
    """An HTTP request's exchange: its environ, and the body the body limits read (or their refusal)."""

    def __init__(self, environ: dict[str, Any], *, timeout_s: float | None, probes: bool) -> None:
        super().__init__(accept_request_id(environ.get(_REQUEST_ID_ENVIRON, "")), environ.get("REQUEST_METHOD", ""),
                         timeout_s=timeout_s)
        self.environ = environ
        # Read whole by the body limits (app/http/bodies.py): the views take it from here.
        self.body = b""
        self.refusal: ServingError | None = None
        self._probes = probes

    @property
    def path(self) -> str:
        # As Werkzeug's request.path reads it (werkzeug.wsgi.get_path_info, and a leading "/"):
        # made only for the access line (and whether it is written), once.
        if not self._path:
            self._path = "/" + self.environ.get("PATH_INFO", "").encode("latin1").decode(errors="replace").lstrip("/")
        return self._path

    @property
    def metric_method(self) -> str:
        # Label values come only from this set: a client choosing the method must not create a series.
        return self.method if self.method in HTTP_METHODS else OTHER

    @property
    def logged(self) -> bool:
        return self._probes or self.path not in PROBE_PATHS

    def call(self, model: ModelSpec = ANY_MODEL, *, signature: str = "", outputs: tuple[str, ...] = (),
             client_timeout_s: float | None = None, priority: int = 0,
             parameters: Mapping[str, Any] = NO_PARAMETERS) -> Call:
        # Made for a call only: a GET never needs it. Gunicorn hands the app the client's socket;
        # Flask's test client has none.
        self.client_gone = socket_client_gone(self.environ.get("gunicorn.socket"))
        return super().call(model, signature=signature, outputs=outputs, client_timeout_s=client_timeout_s,
                            priority=priority, parameters=parameters)


class ExchangeLayer:
    """The outermost WSGI layer: one exchange per request, closed once its status is known."""

    def __init__(self, app: Callable[..., Iterable[bytes]], *, exchanges: Exchanges, timeout_s: float | None,
                 probes: bool, tracing: Tracing | None = None) -> None:
        self.app = app
        self.exchanges = exchanges
        self.timeout_s = timeout_s
        self.probes = probes
        self.tracing = tracing

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        exchange = self.exchanges.open(HttpExchange(environ, timeout_s=self.timeout_s, probes=self.probes))
        if self.tracing is not None and environ.get("PATH_INFO", "") not in PROBE_PATHS:
            exchange.trace = self.tracing.http_span(environ)
        environ[EXCHANGE_KEY] = exchange

        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            exchange.status = int(status[:3])
            headers.append((REQUEST_ID_HEADER, exchange.request_id))
            if exchange.route is None:
                # Flask answers inside its request context, so its request (and the rule it matched,
                # None for a 404 or 405) is still in the environ here, and no longer once it returns.
                # A route answered below Flask (app/http/routes.py) has named its rule already.
                flask_request = environ.get("werkzeug.request")
                rule = flask_request.url_rule if flask_request is not None else None
                exchange.route = rule.rule if rule is not None else None
            return start_response(status, headers, exc_info)

        try:
            return self.app(environ, start)
        finally:
            self.exchanges.close(exchange)
            # The exchange holds the environ: left here too, the pair would be a reference cycle
            # (with the body and the socket's poller) that only the cyclic garbage collector
            # frees, in collections that come several times as often and cost far more.
            del environ[EXCHANGE_KEY]


def exchange_of(environ: dict[str, Any]) -> HttpExchange:
    """The request's exchange (ExchangeLayer's)."""
    exchange: HttpExchange = environ[EXCHANGE_KEY]
    return exchange


def current_request_id() -> str | None:
    """The current request's id, for an answer made outside a door (Flask's error handlers)."""
    environ = patches.request_environ()
    exchange = environ.get(EXCHANGE_KEY) if environ is not None else None
    return exchange.request_id if exchange is not None else None


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
