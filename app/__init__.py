"""The model server: `create_app()` reads as its start-up sequence."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from app.ops.settings import Settings

if TYPE_CHECKING:
    from app.http.app import HttpApp


def create_app(settings: Settings | None = None, *, replace_worker: Callable[[], None] | None = None) -> HttpApp:
    """The app, its models loaded and warmed, its services in `app.services`.

    `replace_worker` is how this process asks to be replaced once a model's batch thread has
    died (Gunicorn's post_worker_init sets it in each worker). None: the app never ends a
    process it was not told how to end. TensorFlow's thread pools are the caller's to size
    first (`runtime.configure`, Gunicorn's post_fork); what it set goes in
    `app.services.tensorflow`, which /readyz shows.
    """
    from app.core import services
    from app.http import app as http
    from app.ops import logs, runtime

    settings = settings or Settings.from_env()
    logs.configure_logging(settings.log_level, settings.log_format)
    if settings.model_processes:
        # The models load in the model processes (warmed there); this worker imports no TensorFlow.
        from app.model_process import client  # only in this mode: the default never imports it

        registry, warm_up = client.connect(settings), None
    else:
        runtime.import_tensorflow(settings)
        from app.wire import warmup

        registry, warm_up = None, warmup.replay
    from app.wire import prediction_log

    return http.build(services.start(settings, warm_up=warm_up, to_record=prediction_log.record, registry=registry,
                                     replace_worker=replace_worker))


def shutdown_app(app: HttpApp, *, timeout_s: float | None = None) -> None:
    """Stop accepting predictions and answer every accepted one (Gunicorn's worker_exit)."""
    from app.ops import logs

    # With MODEL_PROCESSES the registry's close drains this worker's link to its model process.
    app.services.registry.close(drain=True, timeout_s=timeout_s)
    logs.flush_access_log()
