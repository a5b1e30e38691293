"""What a live server logged and counted for its gRPC calls, held against what its clients got.

`Ledger` reads, since it was opened, the access lines of gRPC calls and the change in
model_server_requests_total{method="GRPC"}, each as a count per (route, status).

`siege` is the one set of assertions every attack test makes, around the attack:

- the worker's pid is unchanged: no client made it exit;
- the health Check answers SERVING and a normal Predict answers the model's own scores
  while the attack holds (the test calls `serving()` at that point);
- the worker's resident memory (VmRSS) after the attack is at most RSS_GROWTH above what it
  was before: what an attack makes the server hold is bounded, and let go;
- every call the attack's clients made has exactly one access line and one count, each
  with the status its client got (`got`), and nothing else was logged or counted.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import numpy as np
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from tests.conftest import Server, integer_rows, wait_for

PREDICT = "/tensorflow.serving.PredictionService/Predict"
# Growth of the worker's resident memory an attack may leave: a loaded TensorFlow worker
# holds a few hundred MiB, and glibc keeps freed memory in its arenas for reuse.
RSS_GROWTH = 64 * 1024 * 1024
_TEXT_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')

Counts = collections.Counter[tuple[str, str]]


def access_lines(text: str) -> list[dict[str, str]]:
    """The gRPC access lines in a server's log text, JSON or text format, as fields."""
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("logger") != "app.access":
                continue
        elif " app.access: access " in line:
            entry = {key: value.strip('"') for key, value in _TEXT_FIELD.findall(line.split(" app.access: ", 1)[1])}
        else:
            continue
        if entry.get("method") == "GRPC":
            found.append({key: str(value) for key, value in entry.items()})
    return found


def grpc_counts(server: Server) -> Counts:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.url + "/metrics", timeout=30).text
    counts: Counts = collections.Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "model_server_requests_total" and sample.labels.get("method") == "GRPC":
                counts[sample.labels["route"], sample.labels["status"]] += int(sample.value)
    return counts


class Ledger:
    def __init__(self, server: Server) -> None:
        self.server = server
        self._counts = grpc_counts(server)
        self._log_at = len(server.log())

    def lines(self) -> list[dict[str, str]]:
        return access_lines(self.server.log()[self._log_at:])

    def logged(self) -> Counts:
        return collections.Counter((line["path"], line["status"]) for line in self.lines())

    def counted(self) -> Counts:
        now = grpc_counts(self.server)
        return collections.Counter({key: now[key] - self._counts[key] for key in now if now[key] != self._counts[key]})

    def settle(self, expected: Counts, *, within_s: float = 30) -> None:
        """Wait until the log and the counts reach `expected` (lines are written off the call's
        thread, after its end), then assert both equal it."""
        expected = +expected
        wait_for(lambda: self.logged() == expected and self.counted() == expected, within_s=within_s,
                 what=f"gRPC calls logged and counted as {dict(expected)}")


def worker_pid(server: Server) -> int:
    return requests.get(server.url + "/readyz", timeout=10).json()["pid"]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        [line] = [line for line in status if line.startswith("VmRSS:")]
    return int(line.split()[1]) * 1024


def health(server: Server, *, timeout_s: float = 10) -> int:
    with grpc.insecure_channel(server.grpc_target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status


def predict_scores(server: Server, rows: np.ndarray, *, timeout_s: float = 30) -> list[list[float]]:
    import tensorflow as tf

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "default"
    request.inputs["features"].CopyFrom(tf.make_tensor_proto(rows))
    with grpc.insecure_channel(server.grpc_target) as channel:
        answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=timeout_s)
    return tf.make_ndarray(answer.outputs["scores"]).tolist()


class Siege:
    """One attack's watch: what its clients got, and the server still serving while it holds."""

    def __init__(self, server: Server, model, *, ledger: bool) -> None:
        self.server = server
        self.model = model
        self.pid = worker_pid(server)
        self.rss_before = rss_bytes(self.pid)
        self.ledger = Ledger(server) if ledger else None
        self.expected: Counts = collections.Counter()
        self.served = 0

    def got(self, route: str, status: grpc.StatusCode | str, count: int = 1) -> None:
        """`count` calls to `route` whose clients got `status`."""
        self.expected[route, status.name if isinstance(status, grpc.StatusCode) else status] += count

    def serving(self) -> None:
        """Health answers SERVING and a normal Predict the model's own scores, now."""
        assert health(self.server) == health_pb2.HealthCheckResponse.SERVING
        rows = integer_rows(3, seed=100 + self.served)
        assert predict_scores(self.server, rows) == self.model(rows).numpy().tolist()
        self.got(PREDICT, grpc.StatusCode.OK)
        self.served += 1

    def check(self) -> None:
        assert self.served, "serving() was not called while the attack held"
        assert worker_pid(self.server) == self.pid
        assert rss_bytes(self.pid) <= self.rss_before + RSS_GROWTH
        if self.ledger is not None:
            self.ledger.settle(self.expected)


@contextmanager
def siege(server: Server, model, *, ledger: bool = True) -> Iterator[Siege]:
    """Watch an attack on `server`; on a clean exit, make every assertion of the module docstring.
    With ledger=False (an attack whose calls no client can count), the log and counts are not compared."""
    watch = Siege(server, model, ledger=ledger)
    yield watch
    watch.check()
