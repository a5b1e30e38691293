"""Each door's routes, declared once: the table makes both Flask's rules and the direct router.

    ROUTES = [Route("POST", "/v1/models/<model_name:name>:predict", predict, direct=True), ...]
    handler(services, exchange, **values) -> Reply      # the URL's values, converted as Flask does

`register` adds a table's rules to the Flask app, each with a view that hands the handler the
request's exchange. `DirectRoutes` answers the routes marked `direct` below Flask: a POST to a
predict or infer URL is the one request a server takes thousands of times a second, and Flask's
own work for it (a request context, URL matching, a Response object, its headers and the
after-request steps) is about a tenth of the Python it costs. It sits just inside the exchange
and the body limits, matches such a POST against a regular expression made from the same rule,
and calls the same handler; every other request, and any POST it does not match, goes to Flask,
which keeps every rule: the other methods get its 405 with Allow, and /openapi.json lists them.
tests/test_direct.py checks the expressions against Werkzeug's own matching, and both paths'
answers.

A route's `category` is its category of Triton's restricted APIs: where HTTP_RESTRICTED_API (or
RESTRICTED_MODEL_CONTROL) restricts it, both paths call its handler behind the check (`guarded`).

An error is answered by app/http/errors.py's handlers, the same body, status and headers on
either path; the access line, the request metrics (under the rule's text) and the trace are
the exchange's, as for any request.
"""

from __future__ import annotations

import http
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from flask import Flask, Response, request
from werkzeug.routing import BaseConverter, IntegerConverter, ValidationError

from app.core.errors import unreadable_version
from app.core.services import Services
from app.http import bodies, errors
from app.http.bodies import BodyLimits
from app.http.layers import HttpExchange, exchange_of
from app.http.patches import CachedEnsureSync
from app.ops.numerals import INT64_MAX, whole_number
from app.ops.settings import MODEL_NAME_PATTERN
from app.wire.restricted import Restriction, http_restrictions


class HttpApp(CachedEnsureSync):
    """Flask, with the services of the server it serves (app/http/app.py builds it)."""

    services: Services
    # The body limits' layer, whose large bodies in flight /readyz shows.
    body_limits: BodyLimits


class Reply(NamedTuple):
    """A door's answer, before any framework sees it."""

    body: bytes
    headers: Sequence[tuple[str, str]] = ()
    content_type: str = "application/json"
    status: int = 200

    def response(self) -> Response:
        """The same answer as a Flask view returns it."""
        return Response(self.body, status=self.status, content_type=self.content_type, headers=self.headers)


# handler(the server's services, the request's exchange, **the URL's values) -> the answer.
Handler = Callable[..., Reply]


class Route(NamedTuple):
    method: str
    # The Flask rule's text: what Flask matches, what the direct router's expression is made from,
    # and the route label of the request metrics and traces.
    rule: str
    handler: Handler
    # Also answered below Flask (DirectRoutes): the predictions, taken thousands of times a second.
    direct: bool = False
    # Triton's restricted API category (app/wire/restricted.py); '' for a route no setting restricts.
    category: str = ""


class ModelNameConverter(BaseConverter):
    # Stops at ':' so that '/v1/models/<name>:predict' parses; the name never reaches a path.
    regex = MODEL_NAME_PATTERN.pattern.strip("^$")


class AsciiIntConverter(IntegerConverter):
    """A URL's version: ASCII digits up to int64 ('\\d' and int() also take '１' and Arabic-Indic
    digits), or no match (app/http/errors.py then answers TF Serving's 400)."""

    regex = r"[0-9]+"

    def to_python(self, value: str) -> int:
        number = whole_number(value, INT64_MAX)
        if number is None:
            raise ValidationError()
        return number


def _url_version(text: str) -> int:
    """The direct router's reading of a version: TF Serving's 400 past int64, as Flask's path gives."""
    number = whole_number(text, INT64_MAX)
    if number is None:
        raise unreadable_version(text)
    return number


# The rules' converters: Werkzeug's for Flask, and (expression, to the value) for the direct router.
CONVERTERS: dict[str, type[BaseConverter]] = {"model_name": ModelNameConverter, "int": AsciiIntConverter}
_VALUES: dict[str, Callable[[str], Any]] = {"int": _url_version}
_PART = re.compile(r"<(?:(\w+):)?(\w+)>")
# Each status's line ("200 OK"), made once: http.HTTPStatus(status) is an Enum call per request.
STATUS_LINES = {status.value: f"{status.value} {status.phrase}" for status in http.HTTPStatus}


def init_app(app: Flask) -> None:
    """The converters the tables' rules use, and no redirect for '//' (Werkzeug's would build
    its Location from the client's Host header)."""
    app.url_map.converters.update(CONVERTERS)
    app.url_map.merge_slashes = False


def register(app: Flask, services: Services, name: str, routes: Sequence[Route]) -> None:
    """Flask's rules for a door's table: one view per handler, which hands it the request's exchange."""
    views: dict[Handler, Callable[..., Response]] = {}
    restrictions = http_restrictions(services.settings)
    for route in routes:
        view = views.get(route.handler)
        if view is None:
            view = views[route.handler] = _view(services, guarded(route, restrictions), post=route.method == "POST")
            view.__name__ = route.handler.__name__.lstrip("_")
        app.add_url_rule(route.rule, f"{name}.{view.__name__}", view, methods=[route.method])


def guarded(route: Route, restrictions: dict[str, Restriction]) -> Handler:
    """The route's handler, behind its category's restriction where a setting restricts it (403
    without the header, in Triton's words)."""
    restriction = restrictions.get(route.category) if route.category else None
    if restriction is None:
        return route.handler
    handler = route.handler
    # The header as request.headers reads it from the environ.
    environ_key = "HTTP_" + restriction.header.upper().replace("-", "_")

    def restricted(services: Services, exchange: HttpExchange, **values: Any) -> Reply:
        sent = restriction.header_values(exchange.environ.get(environ_key))
        restriction.check(exchange.path, sent, noun="API")
        return handler(services, exchange, **values)

    return restricted


def _view(services: Services, handler: Handler, *, post: bool) -> Callable[..., Response]:
    def view(**values: Any) -> Response:
        exchange = exchange_of(request.environ)
        if post:  # only POST routes read a body: the others answer as if it was empty
            bodies.raise_refusal(exchange)
        return handler(services, exchange, **values).response()

    return view


def _pattern(rule: str) -> tuple[re.Pattern[str], list[Callable[[str], Any]]]:
    """The rule as one expression over the whole path, and what makes each group its value."""
    parts, converts, position = [], [], 0
    for found in _PART.finditer(rule):
        converter = found.group(1) or "default"
        parts += [re.escape(rule[position:found.start()]), f"({CONVERTERS[converter].regex})"
                  if converter in CONVERTERS else "([^/]+)"]
        converts.append(_VALUES.get(converter, str))
        position = found.end()
    return re.compile("".join([*parts, re.escape(rule[position:])])), converts


class DirectRoutes:
    """WSGI layer: POSTs to the `direct` routes answered without Flask; everything else passed to `app`."""

    def __init__(self, app: Callable[..., Iterable[bytes]], *, services: Services, routes: Sequence[Route]) -> None:
        self.app = app
        self.services = services
        self.routes = []
        self._names: dict[str, tuple[list[str], list[Callable[[str], Any]]]] = {}
        restrictions = http_restrictions(services.settings)
        for route in routes:
            if route.direct and route.method == "POST":
                pattern, converts = _pattern(route.rule)
                self.routes.append((pattern, route.rule, guarded(route, restrictions)))
                self._names[route.rule] = ([found.group(2) for found in _PART.finditer(route.rule)], converts)

    def match(self, environ: dict[str, Any]) -> tuple[str, Handler, Sequence[str]] | None:
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
            bodies.raise_refusal(exchange)
            if groups:
                names, converts = self._names[rule]
                reply = handler(self.services, exchange, **{name: convert(group) for name, convert, group
                                                           in zip(names, converts, groups, strict=True)})
            else:
                reply = handler(self.services, exchange)
        except Exception as exc:  # noqa: BLE001 - answered as Flask's error handlers answer it
            return errors.answer_for(exc, exchange.request_id or None)(environ, start_response)
        body = reply.body
        start_response(STATUS_LINES[reply.status],
                       [*reply.headers, ("Content-Type", reply.content_type), ("Content-Length", str(len(body)))])
        return [body]
