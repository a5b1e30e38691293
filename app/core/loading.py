"""The steps a model load takes from above the registry, chosen once from the settings.

The registry loads versions (at start, on a reload, on a version poll) without importing what
sits above it: warm-up (TF Serving's warm-up records, replayed through the request layer) is
handed in, and with TRACING on each batcher's observer is a tracer around the batch metrics. Both callers
that start a registry, a worker in the default mode (app/__init__.py) and a model process
(app/model_process/server.py), take their steps from here, so both modes load alike.
"""

from __future__ import annotations

from app.core import model_stats, registry
from app.ops.settings import Settings


def steps(settings: Settings, *, warm_up: registry.WarmUp | None = None) -> registry.Loading:
    """The registry's Loading: `warm_up` (app/wire/warmup.py's replay, from whoever starts the models)
    and each batcher's observer: its model's metrics and statistics, with tracing on a tracer around them."""
    observer: registry.ObserverFactory = registry.metrics_observer
    if settings.tracing_on:
        from app.ops import tracing  # only when on: a server without tracing never imports it

        observer = tracing.batch_observer
    return registry.Loading(warm_up=warm_up, observer=model_stats.observed(observer))
