"""Prometheus metrics, correct under several Gunicorn workers.

Under Gunicorn, gunicorn.conf.py points PROMETHEUS_MULTIPROC_DIR at a fresh directory
before any worker starts: each worker's values go to files there and /metrics adds them
up across workers (prometheus_client's multiprocess mode). Without it (tests, a plain
`flask run`) the metrics live in the registry given to `Metrics`. METRICS_PATH serves the same
page at a second path (TF Serving's monitoring config).
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from app.ops import patches
from app.ops.observer import BatchObserver

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
WASTE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # In multiprocess mode values are files; registering them would only duplicate them.
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = None if multiprocess_dir() else self.registry
        self._declare_requests(reg)
        self._declare_batches(reg)
        self._declare_process(reg)
        self._declare_statistics(reg)

    def _declare_requests(self, reg: CollectorRegistry | None) -> None:
        self.requests = Counter("model_server_requests", "HTTP requests answered.",
                                ["route", "method", "status"], registry=reg)
        self.request_seconds = Histogram("model_server_request_duration_seconds", "Time to answer a request.",
                                         ["route"], buckets=LATENCY_BUCKETS, registry=reg)
        self.in_flight = Gauge("model_server_requests_in_flight", "Requests being handled.",
                               registry=reg, multiprocess_mode="livesum")
        self.queue_wait = Histogram("model_server_queue_wait_seconds", "Time from queueing to the predict call.",
                                    ["model"], buckets=LATENCY_BUCKETS, registry=reg)
        self.rejections = Counter("model_server_rejections", "Requests refused or dropped, by reason.",
                                  ["model", "reason"], registry=reg)

    def _declare_batches(self, reg: CollectorRegistry | None) -> None:
        self.batch_rows = Histogram("model_server_batch_size_rows", "Real rows per predict call.",
                                    ["model"], buckets=SIZE_BUCKETS, registry=reg)
        self.batch_requests = Histogram("model_server_batch_size_requests", "Requests per predict call.",
                                        ["model"], buckets=SIZE_BUCKETS, registry=reg)
        self.padding_rows = Counter("model_server_padding_rows", "Rows added to reach a bucket size.",
                                    ["model"], registry=reg)
        # Variable-length padding: waste = padded ÷ real input elements, per call and in all.
        self.length_real_elements = Counter("model_server_length_padding_real_elements",
                                            "Input elements of real rows sent to padded calls.", ["model"],
                                            registry=reg)
        self.length_padded_elements = Counter("model_server_length_padding_padded_elements",
                                              "Input elements added to pad variable lengths.", ["model"],
                                              registry=reg)
        self.length_waste = Histogram("model_server_length_padding_waste_ratio",
                                      "Padded ÷ real input elements of one call with variable-length padding.",
                                      ["model"], buckets=WASTE_BUCKETS, registry=reg)
        self.predict_seconds = Histogram("model_server_predict_duration_seconds", "Time of one predict call.",
                                         ["model"], buckets=LATENCY_BUCKETS, registry=reg)
        self.queue_rows = Gauge("model_server_queue_rows", "Rows waiting for a predict call.",
                                ["model"], registry=reg, multiprocess_mode="livesum")
        # Models with priority levels only: one series per level (1 is the highest).
        self.priority_queue_rows = Gauge("model_server_priority_queue_rows", "Rows waiting, by priority level.",
                                         ["model", "priority"], registry=reg, multiprocess_mode="livesum")
        self.priority_queue_full = Counter("model_server_priority_queue_full",
                                           "Requests refused because their priority level's queue was full.",
                                           ["model", "priority"], registry=reg)

    def _declare_process(self, reg: CollectorRegistry | None) -> None:
        self.load_seconds = Gauge("model_server_model_load_seconds", "Time to load the model.",
                                  ["model"], registry=reg, multiprocess_mode="max")
        self.warmup_seconds = Gauge("model_server_model_warmup_seconds", "Time to warm every bucket size.",
                                    ["model"], registry=reg, multiprocess_mode="max")
        # One series per worker pid, dead ones kept ("all"): a start long after the first one is a
        # restarted worker (deploy/prometheus/alerts.yml).
        self.worker_started = Gauge("model_server_worker_start_time_seconds",
                                    "When each worker process started serving (Unix time).",
                                    registry=reg, multiprocess_mode="all")
        self.worker_started.set_to_current_time()
        # Per worker (pid label), live workers only: one worker near its descriptor limit is
        # what to see, not the sum. Sampled by the worker's loop (app/worker.py).
        self.connections = Gauge("model_server_connections", "Open client connections of each worker, by protocol.",
                                 ["protocol"], registry=reg, multiprocess_mode="liveall")
        # Payload logging (app/ops/payload_log.py) drops rather than slow a request: each drop, by why. The
        # files and the CloudEvents have a buffer each, so a counter each; an event is half a record.
        self.payload_log_dropped = Counter("model_server_payload_log_dropped_records",
                                           "Sampled payload records not written to the files: buffer_full or "
                                           "write_failed.", ["reason"], registry=reg)
        self.payload_log_dropped_events = Counter("model_server_payload_log_dropped_events",
                                                  "CloudEvents of sampled payloads not sent, two per record: "
                                                  "buffer_full or send_failed.", ["reason"], registry=reg)

    def _declare_statistics(self, reg: CollectorRegistry | None) -> None:
        # The v2 statistics extension (app/core/model_stats.py) is read back from these, per version,
        # so a worker answering it sees every worker's and model process's counts, as /metrics does.
        self.stats_requests = Counter("model_server_stats_requests", "Requests per version, by statistics stage.",
                                      ["model", "version", "stage"], registry=reg)
        self.stats_seconds = Counter("model_server_stats_seconds", "Time of requests per version, by statistics stage.",
                                     ["model", "version", "stage"], registry=reg)
        self.stats_batches = Counter("model_server_stats_batches", "Predict calls that answered, by real rows.",
                                     ["model", "version", "batch_size"], registry=reg)
        self.stats_batch_seconds = Counter("model_server_stats_batch_seconds",
                                           "Time of predict calls that answered, by real rows and stage.",
                                           ["model", "version", "batch_size", "stage"], registry=reg)
        self.stats_last_inference = Gauge("model_server_stats_last_inference_timestamp_seconds",
                                          "When a predict call of the version last answered (Unix time).",
                                          ["model", "version"], registry=reg, multiprocess_mode="max")

    def observer(self, model: str) -> BatchObserver:
        return _ModelObserver(self, model)

    def exposition(self) -> bytes:
        if multiprocess_dir():
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


class _ModelObserver(BatchObserver):
    """A model's series, each child looked up once (labels() takes a lock and builds a key) and
    written directly (app/ops/patches.py): every request and every batch updates several."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self._queue_rows = patches.value_of(metrics.queue_rows.labels(model))
        self._queue_wait = patches.HistogramCounts(metrics.queue_wait.labels(model))
        self._batch_rows = patches.HistogramCounts(metrics.batch_rows.labels(model))
        self._batch_requests = patches.HistogramCounts(metrics.batch_requests.labels(model))
        self._padding = patches.value_of(metrics.padding_rows.labels(model))
        self._predict = patches.HistogramCounts(metrics.predict_seconds.labels(model))
        self._length_real = patches.value_of(metrics.length_real_elements.labels(model))
        self._length_padded = patches.value_of(metrics.length_padded_elements.labels(model))
        self._length_waste = patches.HistogramCounts(metrics.length_waste.labels(model))
        self._rejections = metrics.rejections
        self._metrics = metrics
        self._level_reported: dict[int, int] = {}
        self._level_series: set[int] = set()
        self._model = model
        self._reported_rows = 0
        # Every reason's series exists from the start, at 0: dashboards show 0 rather than
        # "No data", and rate() and increase() count the very first rejection.
        self._rejected = {reason: metrics.rejections.labels(model, reason)
                          for reason in ("queue_full", "deadline", "shutting_down", "client_gone")}

    def queue_depth(self, rows: int) -> None:
        # Each batcher has its own observer, but a model's versions and signatures share one
        # series: each adds its change, so the gauge is their sum, not the last one to write.
        # The batcher calls this under its own lock, so its changes arrive in order.
        delta, self._reported_rows = rows - self._reported_rows, rows
        self._queue_rows.inc(delta)

    def queue_wait(self, seconds: float) -> None:
        self._queue_wait.observe(seconds)

    def level_depth(self, level: int, rows: int) -> None:
        # A change, as queue_depth's: the model's versions and signatures add up in one series.
        delta = rows - self._level_reported.get(level, 0)
        self._level_reported[level] = rows
        if delta or level not in self._level_series:
            self._level_series.add(level)
            self._metrics.priority_queue_rows.labels(self._model, str(level)).inc(delta)

    def level_rejected(self, level: int) -> None:
        self._metrics.priority_queue_full.labels(self._model, str(level)).inc()

    def batch_done(self, *, rows: int, requests: int, padded_rows: int, predict_s: float) -> None:
        self._batch_rows.observe(rows)
        self._batch_requests.observe(requests)
        if padded_rows:  # never negative; adding 0 would only write the same value again
            self._padding.inc(padded_rows)
        self._predict.observe(predict_s)

    def length_padding(self, *, real_elements: int, padded_elements: int) -> None:
        self._length_real.inc(real_elements)
        self._length_padded.inc(padded_elements)
        self._length_waste.observe(padded_elements / real_elements if real_elements else 0.0)

    def rejected(self, reason: str) -> None:
        # A burst of them is what an overloaded server does: the known reasons' children are kept.
        child = self._rejected.get(reason)
        (child if child is not None else self._rejections.labels(self._model, reason)).inc()




# Label values come only from these sets: a client choosing the method or the path must not
# create a series per request. gRPC calls are counted under the method GRPC, which no HTTP
# request can claim.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
OTHER = "other"




class RequestCounts:
    """Each answer counted and timed by route, method and status, for every front door.

    Label children are looked up once per label set and kept: prometheus_client's labels()
    takes a lock and builds a key on every call; they are written directly (app/ops/patches.py).
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._counters: dict[tuple[str, str, str], Any] = {}
        self._timers: dict[str, patches.HistogramCounts] = {}

    def count(self, route: str, method: str, status: str, seconds: float) -> None:
        key = (route, method, status)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = patches.value_of(self.metrics.requests.labels(route, method, status))
        counter.inc(1)
        timer = self._timers.get(route)
        if timer is None:
            timer = self._timers[route] = patches.HistogramCounts(self.metrics.request_seconds.labels(route))
        timer.observe(seconds)






