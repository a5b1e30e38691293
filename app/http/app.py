"""The HTTP app: Flask with the server's services, its doors' routes, and the WSGI layers around it.

    app = build(services)      # create_app's last step
    app.services               # what the handlers and the layers read; nothing in app.extensions

`DOORS` lists each door's route table; `wsgi_layers` lists the layers, outermost first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, cast

from flask import Response, current_app
from prometheus_client import CONTENT_TYPE_LATEST

from app.core.services import Services
from app.http import errors, openapi, routes, tfs, v2, v2_repository
from app.http.bodies import BodyLimits
from app.http.layers import ExchangeLayer
from app.http.patches import NoSessions
from app.http.routes import DirectRoutes, HttpApp, Route
from app.ops import logs

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
# A WSGI layer: made with the app inside it.
Layer = Callable[[WsgiApp], WsgiApp]

# Each door and its one route table (app/http/routes.py): a new door is a module and a line here.
DOORS: tuple[tuple[str, list[Route]], ...] = (
    ("tfs", tfs.ROUTES),
    ("v2", v2.ROUTES),
    ("v2_repository", v2_repository.ROUTES),
)


def build(services: Services) -> HttpApp:
    settings = services.settings
    app = HttpApp("app")
    app.services = services
    app.session_interface = NoSessions()
    # Flask would take FLASK_DEBUG from the environment: a production server never debugs.
    app.debug = False
    routes.init_app(app)
    for name, table in DOORS:
        routes.register(app, services, name, table)
    app.add_url_rule("/metrics", "metrics", metrics_view, methods=["GET"])
    if settings.metrics_path and settings.metrics_path != "/metrics":
        # METRICS_PATH: where TF Serving's --monitoring_config_file puts them, same exposition.
        app.add_url_rule(settings.metrics_path, "metrics_path", metrics_view, methods=["GET"])
    openapi.init_app(app)
    errors.init_app(app)
    # Werkzeug's own check answers the same 413, should anything reach it.
    app.config["MAX_CONTENT_LENGTH"] = services.layer.max_request_bytes
    logs.access_log.disabled = not settings.access_log
    wsgi: WsgiApp = app.wsgi_app
    for layer in reversed(wsgi_layers(services)):
        wsgi = layer(wsgi)
        if isinstance(wsgi, BodyLimits):
            app.body_limits = wsgi
    app.wsgi_app = wsgi  # type: ignore[method-assign,assignment]
    return app


def wsgi_layers(services: Services) -> list[Layer]:
    """The WSGI layers around the Flask app, outermost first."""
    settings = services.settings
    return [
        # The exchange, from the socket in: request id, trace, metrics, access line.
        functools.partial(ExchangeLayer, exchanges=services.exchanges, timeout_s=services.layer.timeout_s,
                          probes=settings.access_log_probes, tracing=services.tracing),
        functools.partial(BodyLimits, max_bytes=services.layer.max_request_bytes,
                          large_bytes=settings.large_body_bytes, large_slots=settings.large_body_slots,
                          wait_s=services.layer.timeout_s),
        # Innermost, so the layers above wrap these routes as any other.
        functools.partial(DirectRoutes, services=services, routes=[route for _, table in DOORS for route in table]),
    ]


def metrics_view() -> Response:
    return Response(cast(HttpApp, current_app).services.metrics.exposition(), content_type=CONTENT_TYPE_LATEST)
