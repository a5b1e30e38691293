"""The prediction routes, answered below Flask.

A POST to a predict or infer URL is the one request a server takes thousands of times a
second, and Flask's own work for it (a request context, URL matching, a Response object, its
headers and the after-request steps) is about a tenth of the Python it costs. `DirectRoutes`
sits just above Flask, inside the access, metrics, limits and tracing layers, matches such a
POST against the same URL rules with one regular expression each, and calls the front door's
function with the WSGI environ; every other request, and any POST it does not match, goes to
Flask. Flask keeps the same rules, so the other methods get its 405 with Allow, /openapi.json
lists them, and the two tables are checked against each other (tests/test_direct.py).

An error is answered by app/http/errors.py's handlers, the same body, status and headers Flask
would send; the access line, the request metrics (under the Flask rule's name) and the trace
are the outer layers', as for any request.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, cast

from flask import Response, current_app

from app.core.services import Services
from app.http import bodies as limits
from app.http import errors
from app.http.layers import HttpExchange, exchange_of


def services() -> Services:
    """The services of the app handling the current request (for a Flask view)."""
    return cast(Services, current_app.services)  # type: ignore[attr-defined]


class Reply(NamedTuple):
    """A front door's successful answer, before any framework sees it."""

    body: bytes
    headers: list[tuple[str, str]]
    content_type: str = "application/json"

    def response(self) -> Response:
        """The same answer as a Flask view returns it."""
        return Response(self.body, content_type=self.content_type, headers=self.headers)


# handler(request layer, the request's exchange, the match's groups) -> the answer.
Handler = Callable[[Any, HttpExchange, Sequence[Any]], Reply]


class Route(NamedTuple):
    rule: str  # the Flask rule's text: the route label of the request metrics and traces
    pattern: str  # what the rule matches, as a regular expression over the whole path
    handler: Handler


class DirectRoutes:
    """WSGI layer: POSTs to `routes` answered without Flask; everything else passed to `app`."""

    def __init__(self, app: Callable[..., Iterable[bytes]], *, services: Services, routes: Sequence[Route]) -> None:
        self.app = app
        self.services = services
        self.routes = [(re.compile(route.pattern), route.rule, route.handler) for route in routes]

    def match(self, environ: dict[str, Any]) -> tuple[str, Handler, Sequence[Any]] | None:
        path = environ.get("PATH_INFO", "")
        # ASCII only: there the raw PATH_INFO is what Werkzeug decodes it to.
        if environ.get("REQUEST_METHOD") != "POST" or not path.isascii():
            return None
        for pattern, rule, handler in self.routes:
            found = pattern.fullmatch(path)
            if found is not None:
                return rule, handler, found.groups()
        return None

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        matched = self.match(environ)
        if matched is None:
            return self.app(environ, start_response)
        rule, handler, groups = matched
        exchange = exchange_of(environ)
        exchange.route = rule
        try:
            limits.raise_refusal(exchange)
            reply = handler(self.services.layer, exchange, groups)
        except Exception as exc:  # noqa: BLE001 - answered as Flask's error handlers answer it
            answer = errors.answer_for(exc, exchange.request_id or None)
            return answer(environ, start_response)
        body = reply.body
        start_response("200 OK", [*reply.headers, ("Content-Type", reply.content_type),
                                  ("Content-Length", str(len(body)))])
        return [body]
