"""A server's own batching figures, read from its /metrics page, and the model's ceiling at those batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from .configs import SERVER_BUCKETS
from .results import BatchDelta, CallTiming, Ceiling, MetricSnapshot

BATCH_ROWS_METRIC = "model_server_batch_size_rows"
PREDICT_SECONDS_METRIC = "model_server_predict_duration_seconds"


def metric_snapshot(text: str) -> MetricSnapshot:
    """The batch-size histogram and predict time from a /metrics page, added up over models and labels."""
    buckets: dict[float, float] = {}
    rows = calls = predict_s = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == PREDICT_SECONDS_METRIC + "_sum":
                predict_s += sample.value
            elif sample.name == BATCH_ROWS_METRIC + "_bucket":
                upper = float(sample.labels["le"])
                buckets[upper] = buckets.get(upper, 0.0) + sample.value
            elif sample.name == BATCH_ROWS_METRIC + "_sum":
                rows += sample.value
            elif sample.name == BATCH_ROWS_METRIC + "_count":
                calls += sample.value
    return MetricSnapshot(buckets, rows, calls, predict_s)


def batch_delta(before: MetricSnapshot, after: MetricSnapshot, buckets: Sequence[int] = SERVER_BUCKETS) -> BatchDelta:
    """Predict calls per padded batch size, real rows and predict seconds between two snapshots.

    The histogram counts real rows per call, cumulatively (le=1, 2, 4, ...): the calls in
    (lower, upper] are the ones the server padded up to the smallest bucket size >= upper
    (or its largest, which no call exceeds).
    """
    calls: dict[int, int] = {}
    previous = 0.0
    for upper in sorted(after.buckets):
        cumulative = after.buckets[upper] - before.buckets.get(upper, 0.0)
        count = round(cumulative - previous)
        previous = cumulative
        if count:
            padded = next((size for size in buckets if size >= upper), buckets[-1])
            calls[padded] = calls.get(padded, 0) + count
    return BatchDelta(calls_per_bucket=calls, rows=round(after.rows - before.rows),
                      calls=round(after.calls - before.calls), predict_s=after.predict_s - before.predict_s)


def ceiling_figures(batches: BatchDelta, timings: Mapping[int, CallTiming], *, requests: int, rps: float,
                    server_cpu_s: float) -> Ceiling:
    """The model alone's throughput at the batches the server ran, and the server's CPU split.

    `timings` is part 1's figures per batch size for the server's predict path. Ceiling: the real
    rows served ÷ the time the model alone takes to run the same calls back to back. Predict
    CPU: the model's own CPU for those calls; everything else is the server's CPU less that.
    """
    measured = Ceiling(
        mean_batch_rows=batches.rows / batches.calls if batches.calls else None,
        predict_wall_ms_per_request=batches.predict_s / requests * 1000 if requests else None,
        cpu_ms_per_request=server_cpu_s / requests * 1000 if requests else None)
    calls = batches.calls_per_bucket
    if not calls or not requests or any(size not in timings for size in calls):
        return measured
    alone_s = sum(count * timings[size].median_ms for size, count in calls.items()) / 1000
    predict_cpu_s = sum(count * timings[size].cpu_ms_per_call for size, count in calls.items()) / 1000
    ceiling = batches.rows / alone_s
    return dataclasses.replace(measured, ceiling_rows_per_s=ceiling, ratio=rps / ceiling,
                               predict_cpu_ms_per_request=predict_cpu_s / requests * 1000,
                               other_cpu_ms_per_request=(server_cpu_s - predict_cpu_s) / requests * 1000)
