"""What a run measures, as typed records; `results.json` and `model_alone.json` are their dataclasses.asdict."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class CallTiming:
    """Back-to-back calls of one predict path at one batch size (part 1)."""

    calls: int
    median_ms: float
    mean_ms: float
    items_per_s: float
    cpu_ms_per_call: float
    cpu_ms_per_row: float


@dataclasses.dataclass(frozen=True)
class BatchTiming:
    batch: int
    function: CallTiming  # the server's compiled predict path
    keras_predict: CallTiming | None = None  # Keras' model.predict, where the model is a Keras one

    def path(self, name: str) -> CallTiming | None:
        """The timing of the predict path a configuration uses (Config.predict_path)."""
        return self.keras_predict if name == "keras_predict" else self.function


@dataclasses.dataclass(frozen=True)
class AfterIdle:
    """Batch-1 calls, each after an idle pause like a user's think time."""

    calls: int
    think_s: tuple[float, float]
    mean_ms: float
    median_ms: float
    wall_ms: list[float]


@dataclasses.dataclass(frozen=True)
class ModelAlone:
    batches: list[BatchTiming]
    after_idle: AfterIdle

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelAlone:
        batches = [BatchTiming(row["batch"], CallTiming(**row["function"]),
                               CallTiming(**row["keras_predict"]) if row.get("keras_predict") else None)
                   for row in data["batches"]]
        idle = data["after_idle"]
        return cls(batches, AfterIdle(**{**idle, "think_s": tuple(idle["think_s"])}))

    def timings(self, predict_path: str) -> dict[int, CallTiming]:
        """Per batch size, the timing of one predict path, where it was timed."""
        return {row.batch: timing for row in self.batches if (timing := row.path(predict_path)) is not None}


@dataclasses.dataclass(frozen=True)
class MetricSnapshot:
    """The batch-size histogram and predict time of one /metrics page, added up over models and labels."""

    buckets: dict[float, float] = dataclasses.field(default_factory=dict)  # le -> cumulative predict calls
    rows: float = 0.0
    calls: float = 0.0
    predict_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class BatchDelta:
    """The predict calls a server ran between two snapshots, by the batch size they were padded to."""

    calls_per_bucket: dict[int, int]
    rows: int
    calls: int
    predict_s: float


@dataclasses.dataclass(frozen=True)
class Ceiling:
    """The model alone at the batches a server ran, beside the server's own figures; None where unknown."""

    mean_batch_rows: float | None = None
    predict_wall_ms_per_request: float | None = None
    cpu_ms_per_request: float | None = None
    ceiling_rows_per_s: float | None = None
    ratio: float | None = None
    predict_cpu_ms_per_request: float | None = None
    other_cpu_ms_per_request: float | None = None


@dataclasses.dataclass
class LoadStats:
    """One load point: Locust's figures, Locust's own CPU, and the server's CPU and batches over it."""

    requests: int = 0
    failures: int = 0
    mean_ms: float | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    rps: float = 0.0
    locust_exit_code: int | None = None
    locust_wall_s: float = 0.0
    locust_cpu_s: float = 0.0
    locust_cpu_share: float = 0.0
    locust_peak_share: float = 0.0
    # From locustfile.py's summary (LOCUST_SUMMARY_FILE): the batch headers of the answers.
    answers_with_batch_headers: int | None = None
    mean_batch_rows: float | None = None
    mean_batch_requests: float | None = None
    server_batches: BatchDelta | None = None
    server_cpu_s: float | None = None
    server_cpu_ms_per_request: float | None = None
    server_cpu_share: float | None = None


@dataclasses.dataclass
class ConfigResult:
    """One configuration's server and its load points, by load label; `error` where it failed."""

    config: str
    loads: dict[str, LoadStats] = dataclasses.field(default_factory=dict)
    start_s: float | None = None
    cwd: str | None = None  # the tree the server really ran, as the OS saw it
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class ProtocolLoad:
    protocol: str  # "http" or "grpc"
    users: int
    stats: LoadStats


@dataclasses.dataclass
class ProtocolResult:
    """The reference configuration loaded over REST and over gRPC."""

    config: str
    loads: list[ProtocolLoad] = dataclasses.field(default_factory=list)
    start_s: float | None = None
    error: str | None = None
