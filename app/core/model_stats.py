"""Per-version statistics in the shape of Triton's statistics extension, kept as metric families.

The batch thread reports each request and each predict call to a `StatsObserver`, which adds
them to app/ops/metrics.py's `model_server_stats_*` counters, labelled by model and version. Under
Gunicorn those are files in PROMETHEUS_MULTIPROC_DIR, one per process, so `read` sums every
worker's and every model process's counts, as /metrics does, whichever worker answers.

What each figure covers here (the engine's clock, per signature's batcher):

- queue: from a request's rows being queued to the predict call that takes its first rows;
  counted once a request, as it is taken.
- compute_input: joining the requests' rows into one batch and padding it (rows, lengths).
- compute_infer: the predict call, with the check of its outputs.
- compute_output: slicing each request's rows back out of the outputs and handing them over.
  The three compute stages count once per request in the call (a request split over calls,
  once per call), each adding the call's whole duration, as Triton does.
- success: requests answered, from queued to answered; fail: requests failed because the model
  raised (refusals and drops before a call are `model_server_rejections`, not failures).
- batch_stats: predict calls that answered, by their real rows (padding rows left out).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, multiprocess

from app.core.batching import BatchObserver
from app.core.errors import Unavailable
from app.core.models import LoadedModel
from app.core.registry import ObserverFactory
from app.ops.metrics import Metrics, multiprocess_dir
from app.ops.settings import Settings

SUCCESS, FAIL, QUEUE = "success", "fail", "queue"
COMPUTE = ("compute_input", "compute_infer", "compute_output")
STAGES = (SUCCESS, FAIL, QUEUE, *COMPUTE)
NS = 1e9


class StatsObserver(BatchObserver):
    """A batcher's observer adding its version's statistics, around the observer it wraps."""

    def __init__(self, observer: BatchObserver, metrics: Metrics, *, model: str, version: int) -> None:
        self._observer = observer
        self.traces = observer.traces
        self._metrics = metrics
        self._labels = (model, str(version))
        # Children looked up once: labels() takes a lock and builds a key on each call.
        self._requests = {stage: metrics.stats_requests.labels(*self._labels, stage) for stage in STAGES}
        self._seconds = {stage: metrics.stats_seconds.labels(*self._labels, stage) for stage in STAGES}
        self._last = metrics.stats_last_inference.labels(*self._labels)
        self._batches: dict[int, tuple[Any, tuple[Any, ...]]] = {}

    def queue_depth(self, rows: int) -> None:
        self._observer.queue_depth(rows)

    def queue_wait(self, seconds: float) -> None:
        self._add(QUEUE, 1, seconds)
        self._observer.queue_wait(seconds)

    def batch_done(self, *, rows: int, requests: int, padded_rows: int, predict_s: float) -> None:
        self._observer.batch_done(rows=rows, requests=requests, padded_rows=padded_rows, predict_s=predict_s)

    def length_padding(self, *, real_elements: int, padded_elements: int) -> None:
        self._observer.length_padding(real_elements=real_elements, padded_elements=padded_elements)

    def rejected(self, reason: str) -> None:
        self._observer.rejected(reason)

    def level_depth(self, level: int, rows: int) -> None:
        self._observer.level_depth(level, rows)

    def level_rejected(self, level: int) -> None:
        self._observer.level_rejected(level)

    def predict_call(self, traces: list[Any], *, rows: int, padded_rows: int, predict_s: float,
                     error: BaseException | None) -> None:
        self._observer.predict_call(traces, rows=rows, padded_rows=padded_rows, predict_s=predict_s, error=error)

    def call_answered(self, *, rows: int, requests: int, input_s: float, infer_s: float, output_s: float,
                      finished_s: list[float]) -> None:
        durations = (input_s, infer_s, output_s)
        executions, stage_seconds = self._batch(rows)
        executions.inc()
        for stage, child, seconds in zip(COMPUTE, stage_seconds, durations, strict=True):
            seconds = max(0.0, seconds)  # a clock that went back (a test's) must not make inc() raise
            child.inc(seconds)
            self._add(stage, requests, requests * seconds)
        if finished_s:
            self._add(SUCCESS, len(finished_s), sum(finished_s))
        self._last.set(time.time())
        self._observer.call_answered(rows=rows, requests=requests, input_s=input_s, infer_s=infer_s,
                                     output_s=output_s, finished_s=finished_s)

    def requests_failed(self, waited_s: list[float]) -> None:
        if waited_s:
            self._add(FAIL, len(waited_s), sum(waited_s))
        self._observer.requests_failed(waited_s)

    def _add(self, stage: str, count: int, seconds: float) -> None:
        self._requests[stage].inc(count)
        self._seconds[stage].inc(seconds)

    def _batch(self, rows: int) -> tuple[Any, tuple[Any, ...]]:
        children = self._batches.get(rows)
        if children is None:
            size = str(rows)
            children = self._batches[rows] = (
                self._metrics.stats_batches.labels(*self._labels, size),
                tuple(self._metrics.stats_batch_seconds.labels(*self._labels, size, stage) for stage in COMPUTE))
        return children


def _samples(metrics: Metrics | None) -> Iterable[tuple[str, dict[str, str], float]]:
    """Every sample of the stats families: from the multiprocess files (every process), or else
    from `metrics`' own registry (one process, no Gunicorn)."""
    if multiprocess_dir():
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    elif metrics is not None:
        registry = metrics.registry
    else:
        raise Unavailable("statistics here are read from PROMETHEUS_MULTIPROC_DIR, which only a Gunicorn "
                          "server sets")
    for family in registry.collect():
        if family.name.startswith("model_server_stats_"):
            for sample in family.samples:
                yield sample.name, sample.labels, sample.value


def _duration(count: float, seconds: float) -> dict[str, int]:
    return {"count": int(count), "ns": round(seconds * NS)}


def read(metrics: Metrics | None, versions: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Triton's model_stats for each (model, version), in the order given; zeros where none ran."""
    requests: dict[tuple[str, str, str], float] = {}
    seconds: dict[tuple[str, str, str], float] = {}
    batches: dict[tuple[str, str], dict[int, list[float]]] = {}
    last: dict[tuple[str, str], float] = {}
    for name, labels, value in _samples(metrics):
        key = (labels.get("model", ""), labels.get("version", ""))
        if name == "model_server_stats_requests_total":
            requests[(*key, labels["stage"])] = value
        elif name == "model_server_stats_seconds_total":
            seconds[(*key, labels["stage"])] = value
        elif name == "model_server_stats_batches_total":
            batches.setdefault(key, {}).setdefault(int(labels["batch_size"]), [0.0] * 4)[0] = value
        elif name == "model_server_stats_batch_seconds_total":
            row = batches.setdefault(key, {}).setdefault(int(labels["batch_size"]), [0.0] * 4)
            row[1 + COMPUTE.index(labels["stage"])] = value
        elif name == "model_server_stats_last_inference_timestamp_seconds":
            last[key] = value
    stats = []
    for model, number in versions:
        key = (model, str(number))
        sizes = batches.get(key, {})
        stats.append({
            "name": model,
            "version": str(number),
            "last_inference": round(last.get(key, 0.0) * 1000),
            "inference_count": int(sum(size * row[0] for size, row in sizes.items())),
            "execution_count": int(sum(row[0] for row in sizes.values())),
            "inference_stats": {
                **{stage: _duration(requests.get((*key, stage), 0), seconds.get((*key, stage), 0.0))
                   for stage in STAGES},
                "cache_hit": _duration(0, 0.0),  # no response cache here
            },
            "batch_stats": [
                {"batch_size": size,
                 **{stage: _duration(row[0], row[1 + index]) for index, stage in enumerate(COMPUTE)}}
                for size, row in sorted(sizes.items())
            ],
        })
    return stats


def observed(factory: ObserverFactory) -> ObserverFactory:
    """`factory`'s observers, each with its version's statistics added around it."""

    def make(metrics: Metrics, settings: Settings, model: LoadedModel, signature: str) -> BatchObserver:
        return StatsObserver(factory(metrics, settings, model, signature), metrics, model=model.name,
                             version=model.version)

    return make


