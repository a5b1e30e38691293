"""The models a worker serves, each with its own batcher; kept in app.extensions."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from flask import Flask

from app import models
from app.batching import Batcher, bucket_sizes
from app.errors import NotFound
from app.metrics import Metrics
from app.settings import Settings

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Servable:
    model: models.LoadedModel
    batcher: Batcher

    def status(self) -> dict[str, Any]:
        return {
            "version": self.model.version,
            "source": self.model.source,
            "alive": self.batcher.alive,
            "queued_rows": self.batcher.queued_rows,
            "batches_run": self.batcher.batches_run,
            "max_batch_size": self.batcher.max_batch_size,
            "load_seconds": round(self.model.load_s, 3),
            "warmup_seconds": round(self.model.warmup_s, 3),
        }


class ModelRegistry:
    def __init__(self, default_name: str) -> None:
        self.default_name = default_name
        self._servables: dict[str, Servable] = {}

    def add(self, servable: Servable) -> None:
        self._servables[servable.model.name] = servable

    def get(self, name: str | None = None, version: int | None = None) -> Servable:
        servable = self._servables.get(name or self.default_name)
        if servable is None:
            raise NotFound(f"no model named {name!r}; this server has {sorted(self._servables)}")
        if version is not None and version != servable.model.version:
            raise NotFound(f"model {servable.model.name!r} has no version {version}; it serves {servable.model.version}")
        return servable

    def items(self) -> list[tuple[str, Servable]]:
        return sorted(self._servables.items())

    @property
    def ready(self) -> bool:
        return bool(self._servables) and all(s.batcher.alive for s in self._servables.values())

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        for servable in self._servables.values():
            servable.batcher.close(drain=drain, timeout_s=timeout_s)


def load_servable(settings: Settings, *, name: str, path: str | None, metrics: Metrics) -> Servable:
    model = models.load_model(path, name=name, method=settings.predict_method)
    buckets = bucket_sizes(settings.max_batch_size)
    models.warm_up(model, buckets)
    metrics.load_seconds.labels(name).set(model.load_s)
    metrics.warmup_seconds.labels(name).set(model.warmup_s)
    batcher = Batcher(
        model.predict,
        name=name,
        max_batch_size=settings.max_batch_size,
        batch_timeout_ms=settings.batch_timeout_ms,
        max_queue_rows=settings.max_queue_rows,
        batching=settings.batching,
        buckets=buckets,
        observer=metrics.observer(name),
    )
    log.info("model '%s' v%d from %s loaded in %.2f s", name, model.version, model.source, model.load_s)
    return Servable(model, batcher)


def init_app(app: Flask, settings: Settings, metrics: Metrics) -> ModelRegistry:
    registry = ModelRegistry(settings.model_name)
    registry.add(load_servable(settings, name=settings.model_name, path=settings.model_path, metrics=metrics))
    app.extensions["models"] = registry
    return registry


def get_registry(app: Flask) -> ModelRegistry:
    return app.extensions["models"]
