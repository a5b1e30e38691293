"""The models a worker serves, each with its own batcher, and their version swaps.

A model whose path is a TensorFlow Serving base folder (numbered sub-folders) is polled:
when a newer version appears it is loaded and warmed beside the old one, then swapped
in. Requests already queued on the old batcher finish there (it is closed with drain); a
request that reached the old batcher just after the swap is sent on to the new one, so
no request fails because of a swap.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from flask import Flask

from app import batcher_broken, models
from app.batching import Batcher, BatchResult, Tensors, bucket_sizes
from app.errors import NotFound, ShuttingDown
from app.metrics import Metrics
from app.settings import ModelConfig, Settings, model_configs

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
            "batch_timeout_ms": self.batcher.batch_timeout_s * 1000,
            "load_seconds": round(self.model.load_s, 3),
            "warmup_seconds": round(self.model.warmup_s, 3),
        }


def load_servable(config: ModelConfig, settings: Settings, metrics: Metrics) -> Servable:
    model = models.load_model(config.path, name=config.name, method=settings.predict_method)
    buckets = bucket_sizes(config.max_batch_size)
    models.warm_up(model, buckets)
    metrics.load_seconds.labels(config.name).set(model.load_s)
    metrics.warmup_seconds.labels(config.name).set(model.warmup_s)
    batcher = Batcher(
        model.predict,
        name=config.name,
        max_batch_size=config.max_batch_size,
        batch_timeout_ms=config.batch_timeout_ms,
        max_queue_rows=config.max_queue_rows,
        max_request_rows=config.max_request_rows,
        batching=settings.batching,
        buckets=buckets,
        observer=metrics.observer(config.name),
        on_broken=batcher_broken,
    )
    log.info("model '%s' v%d from %s loaded in %.2f s", config.name, model.version, model.source, model.load_s)
    return Servable(model, batcher)


class ModelRegistry:
    def __init__(self, default_name: str) -> None:
        self.default_name = default_name
        self._servables: dict[str, Servable] = {}
        self.poller: VersionPoller | None = None

    def add(self, servable: Servable) -> None:
        self._servables[servable.model.name] = servable

    def get(self, name: str | None = None, version: int | None = None) -> Servable:
        servable = self._servables.get(name or self.default_name)
        if servable is None:
            raise NotFound(f"no model named {name!r}; this server has {sorted(self._servables)}")
        if version is not None and version != servable.model.version:
            raise NotFound(f"model {servable.model.name!r} has no version {version}; it serves {servable.model.version}")
        return servable

    def predict(self, servable: Servable, inputs: Tensors, *, timeout_s: float) -> tuple[Servable, BatchResult]:
        """Predict on the servable, or on the one that replaced it if it was swapped out meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return servable, servable.batcher.predict(inputs, timeout_s=max(0.0, deadline - time.monotonic()))
            except ShuttingDown:
                current = self._servables.get(servable.model.name)
                if current is None or current is servable:
                    raise
                servable = current

    def swap(self, new: Servable) -> None:
        old = self._servables.get(new.model.name)
        self._servables[new.model.name] = new
        if old is not None:
            old.batcher.close(drain=True)
            log.info("model '%s' now serves v%d (was v%d)", new.model.name, new.model.version, old.model.version)

    def items(self) -> list[tuple[str, Servable]]:
        return sorted(self._servables.items())

    @property
    def ready(self) -> bool:
        return bool(self._servables) and all(s.batcher.alive for s in self._servables.values())

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        if self.poller is not None:
            self.poller.stop()
        for servable in list(self._servables.values()):
            servable.batcher.close(drain=drain, timeout_s=timeout_s)


class VersionPoller:
    """Checks versioned base folders every `interval_s` and swaps in the newest version."""

    def __init__(self, registry: ModelRegistry, configs: list[ModelConfig], settings: Settings, metrics: Metrics,
                 interval_s: float) -> None:
        self._registry = registry
        self._configs = configs
        self._settings = settings
        self._metrics = metrics
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._failed: set[tuple[str, int]] = set()
        self._thread = threading.Thread(target=self._run, name="version-poller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            for config in self._configs:
                try:
                    self.check(config)
                except Exception:
                    log.exception("version check of model '%s' failed", config.name)

    def check(self, config: ModelConfig) -> None:
        versions = models.available_versions(config.path)
        if not versions:
            return
        newest = max(versions)
        if newest == self._registry.get(config.name).model.version or (config.name, newest) in self._failed:
            return
        try:
            servable = load_servable(config, self._settings, self._metrics)
        except Exception:
            self._failed.add((config.name, newest))
            log.exception("cannot load version %d of model '%s'; keeping the one served", newest, config.name)
            return
        if not self._stopped.is_set():
            self._registry.swap(servable)
        else:
            servable.batcher.close(drain=False)


def init_app(app: Flask, settings: Settings, metrics: Metrics) -> ModelRegistry:
    configs = model_configs(settings)
    registry = ModelRegistry(configs[0].name)
    for config in configs:
        registry.add(load_servable(config, settings, metrics))
    versioned = [config for config in configs if config.path and models.available_versions(config.path)]
    if versioned and settings.model_poll_seconds > 0:
        registry.poller = VersionPoller(registry, versioned, settings, metrics, settings.model_poll_seconds)
    app.extensions["models"] = registry
    return registry


def get_registry(app: Flask) -> ModelRegistry:
    return app.extensions["models"]
