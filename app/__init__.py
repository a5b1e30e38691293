"""The model server: `create_app()` reads as its start-up sequence."""

from __future__ import annotations

from flask import Flask

from app.settings import Settings


def create_app(settings: Settings | None = None) -> Flask:
    from app import api, errors, limits, logs, metrics, openapi, registry, runtime

    settings = settings or Settings.from_env()
    logs.configure_logging(settings.log_level, settings.log_format)
    app = Flask(__name__)
    # Flask would take FLASK_DEBUG from the environment: a production server never debugs.
    app.debug = False
    app.extensions["settings"] = settings
    runtime.configure(settings)
    logs.init_app(app, access=settings.access_log, probes=settings.access_log_probes)
    serving_metrics = metrics.init_app(app)
    models = registry.init_app(app, settings, serving_metrics)
    limits.init_app(app, settings, models)
    api.init_app(app)
    openapi.init_app(app)
    errors.init_app(app)
    return app


def shutdown_app(app: Flask, *, timeout_s: float | None = None) -> None:
    """Stop accepting predictions and answer every accepted one (Gunicorn's worker_exit)."""
    from app.registry import get_registry

    get_registry(app).close(drain=True, timeout_s=timeout_s)
