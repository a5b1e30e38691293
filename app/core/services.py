"""The parts of one server process, built once at start and handed to whatever serves.

    services = services.start(settings, warm_up=warmup.replay, to_record=prediction_log.record)
    http.app.build(services)     GrpcServer(services, ...)     ModelProcess: its own, models only

Each part is a typed field: nothing finds another through a string key. What a part needs from
a layer above (warm-up's replay, the payload log's record format) is handed to `start`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from app.core import loading
from app.core import registry as registries
from app.core.batching import Batcher
from app.core.exchange import Exchanges
from app.core.registry import ModelRegistry
from app.core.repository import Repository
from app.core.serving import RequestLayer
from app.ops import logs
from app.ops import payload_log as payload_logs
from app.ops.metrics import Metrics
from app.ops.payload_log import Entry, PayloadLog
from app.ops.settings import Settings

if TYPE_CHECKING:
    from app.ops.tracing import Tracing


@dataclasses.dataclass(eq=False)
class Services:
    settings: Settings
    metrics: Metrics
    # The models this process serves: loaded here, or a model process's (app/model_process/client.py).
    registry: ModelRegistry
    layer: RequestLayer
    # Every request's exchange is opened and closed by these: metrics, access line, trace.
    exchanges: Exchanges
    # Triton's model repository extension, for the v2 doors of both transports.
    repository: Repository
    # With TRACING on: the tracer, the REST layer and the gRPC spans (app/ops/tracing.py).
    tracing: Tracing | None = None
    payload_log: PayloadLog | None = None
    # What the process set up TensorFlow with (app/ops/runtime.py; Gunicorn's post_fork), for /readyz.
    tensorflow: dict[str, Any] = dataclasses.field(default_factory=dict)
    # How this process asks to be replaced once a model's batch thread died; None: it never ends
    # itself. Gunicorn's post_worker_init sets it in each worker, a model process to its own stop.
    replace_worker: Callable[[], None] | None = None


def start(settings: Settings, *, warm_up: registries.WarmUp | None = None,
          to_record: Callable[[Entry], bytes] | None = None, registry: ModelRegistry | None = None,
          replace_worker: Callable[[], None] | None = None) -> Services:
    """This process's services: its models loaded (unless `registry` is given: MODEL_PROCESSES'
    workers' comes from their model process), replayed through `warm_up` as they load; sampled
    predictions written by `to_record` (None: no payload log, as in a model process, which
    answers no request itself)."""
    metrics = Metrics()
    tracing = _tracing(settings)
    services: Services | None = None

    def batch_thread_died(_batcher: Batcher) -> None:
        # Asked when it happens (the services are made by then): Gunicorn's post_worker_init
        # names replace_worker once the models are loaded.
        if services is not None and services.replace_worker is not None:
            services.replace_worker()

    if registry is None:
        registry = registries.start(settings, metrics, loading=loading.steps(settings, warm_up=warm_up),
                                    on_broken=batch_thread_died)
    layer = RequestLayer.from_settings(settings, registry)
    sampled = payload_logs.start(settings, metrics, to_record) if to_record is not None else None
    layer.payload_log = sampled
    services = Services(settings, metrics, registry, layer, Exchanges(metrics, writer=logs.start_access_writer()),
                        Repository(settings, registry),
                        tracing=tracing, payload_log=sampled, replace_worker=replace_worker)
    return services


def _tracing(settings: Settings) -> Tracing | None:
    if not settings.tracing_on:
        return None
    from app.ops.tracing import Tracing  # only when on: a server without tracing never imports it

    return Tracing(settings)
