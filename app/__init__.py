"""The model server: `create_app()` reads as its start-up sequence."""

from __future__ import annotations

from collections.abc import Callable

from flask import Flask

from app.ops.settings import Settings


def create_app(settings: Settings | None = None, *, replace_worker: Callable[[], None] | None = None) -> Flask:
    """The app, its models loaded and warmed.

    `replace_worker` is how this process asks to be replaced once a model's batch thread has
    died (app.extensions["replace_worker"]; Gunicorn's post_worker_init sets it in each worker).
    None: the app never ends a process it was not told how to end. TensorFlow's thread pools
    are the caller's to size first (`runtime.configure`, Gunicorn's post_fork); what it set
    goes in app.extensions["tensorflow"], which /readyz shows.
    """
    from app.core import errors, loading, registry, serving
    from app.http import bodies as limits
    from app.http import openapi
    from app.http import tfs as api
    from app.http import v2 as v2_rest
    from app.http.routes import DirectRoutes
    from app.ops import logs, metrics, patches, runtime

    settings = settings or Settings.from_env()
    logs.configure_logging(settings.log_level, settings.log_format)
    app = patches.CachedEnsureSync(__name__)
    app.session_interface = patches.NoSessions()
    # Flask would take FLASK_DEBUG from the environment: a production server never debugs.
    app.debug = False
    app.extensions["settings"] = settings
    app.extensions["replace_worker"] = replace_worker
    app.extensions["tensorflow"] = {}
    if not settings.model_processes:
        runtime.import_tensorflow(settings)
    # Innermost, so the access, metrics, limits and tracing layers wrap these routes as any other.
    routes = [*api.PREDICT_ROUTES, *v2_rest.INFER_ROUTES]
    app.wsgi_app = DirectRoutes(app.wsgi_app, app, routes)  # type: ignore[method-assign]
    logs.init_app(app, access=settings.access_log, probes=settings.access_log_probes,
                  writer=logs.start_access_writer())
    serving_metrics = metrics.init_app(app)
    if settings.model_processes:
        from app.model_process import client  # only in this mode: the default never imports it

        models = client.init_app(app, settings)
    else:
        models = registry.init_app(app, settings, serving_metrics, loading=loading.steps(settings))
    limits.init_app(app, settings, models)
    if settings.tracing_on:
        from app.ops import tracing  # only when on: a server without tracing never imports it

        serving.init_app(app, settings, models, make_layer=tracing.init_app(app, settings))
    else:
        serving.init_app(app, settings, models)
    api.init_app(app)
    v2_rest.init_app(app)
    openapi.init_app(app)
    errors.init_app(app)
    return app


def shutdown_app(app: Flask, *, timeout_s: float | None = None) -> None:
    """Stop accepting predictions and answer every accepted one (Gunicorn's worker_exit)."""
    from app.core.registry import get_registry
    from app.ops import logs

    get_registry(app).close(drain=True, timeout_s=timeout_s)
    if "model_process_link" in app.extensions:
        from app.model_process import client

        client.shutdown(app, timeout_s)
    logs.flush_access_log()

