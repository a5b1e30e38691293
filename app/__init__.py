"""The model server: `create_app()` reads as its start-up sequence."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Flask

from app.settings import Settings

# How this worker process asks to be replaced once a model's batch thread has died. Gunicorn's
# post_fork sets it in each worker; elsewhere (tests, one process) it stays None: the app never
# ends a process it was not told how to end.
replace_worker: Callable[[], None] | None = None


class _Flask(Flask):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sync: dict[Callable[..., Any], Callable[..., Any]] = {}

    def ensure_sync(self, func: Callable[..., Any]) -> Callable[..., Any]:
        # Flask asks inspect.iscoroutinefunction of every view and hook on every call; the
        # answer never changes for a function, so it is asked once per function.
        sync = self._sync.get(func)
        if sync is None:
            sync = self._sync[func] = super().ensure_sync(func)
        return sync


def create_app(settings: Settings | None = None) -> Flask:
    from app import api, errors, limits, logs, metrics, openapi, registry, runtime, serving

    settings = settings or Settings.from_env()
    logs.configure_logging(settings.log_level, settings.log_format)
    app = _Flask(__name__)
    # Flask would take FLASK_DEBUG from the environment: a production server never debugs.
    app.debug = False
    app.extensions["settings"] = settings
    runtime.configure(settings)
    logs.init_app(app, access=settings.access_log, probes=settings.access_log_probes,
                  writer=logs.start_access_writer())
    serving_metrics = metrics.init_app(app)
    models = registry.init_app(app, settings, serving_metrics)
    limits.init_app(app, settings, models)
    serving.init_app(app, settings, models)
    api.init_app(app)
    openapi.init_app(app)
    errors.init_app(app)
    return app


def shutdown_app(app: Flask, *, timeout_s: float | None = None) -> None:
    """Stop accepting predictions and answer every accepted one (Gunicorn's worker_exit)."""
    from app import logs
    from app.registry import get_registry

    get_registry(app).close(drain=True, timeout_s=timeout_s)
    logs.flush_access_log()


def batcher_broken(_batcher: Any) -> None:
    """A batch thread died (its requests are answered): this worker cannot serve that model again."""
    if replace_worker is not None:
        replace_worker()
