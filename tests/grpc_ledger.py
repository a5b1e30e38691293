"""What a live server logged and counted for its gRPC calls, held against what its clients got.

`Ledger` reads, since it was opened, the access lines of gRPC calls and the change in
model_server_requests_total{method="GRPC"}, each as a count per (route, status).

`siege` is the one set of assertions every attack test makes, around the attack:

- the worker's pid is unchanged: no client made it exit;
- the health Check answers SERVING and a normal Predict answers the model's own scores
  while the attack holds (the test calls `serving()` at that point), on a channel that
  connected before the attack;
- the worker's resident memory (VmRSS) after the attack is at most RSS_GROWTH (a quarter)
  above what it was before: what an attack makes the server hold is bounded;
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
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from tests.conftest import Server, integer_rows, wait_for

PREDICT = "/tensorflow.serving.PredictionService/Predict"
# Growth of the worker's resident memory an attack may leave, as a share of where it started.
# A loaded worker holds about 550 MiB; glibc and grpc-core keep freed memory for reuse, and
# the first 50,000-stream reset storm leaves 64-90 MiB more, later storms 0-28 MiB each
# (docs/reliability.md); a leak of a few KiB a call would pass 138 MiB within a storm or two.
RSS_GROWTH = 0.25
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
        try:
            wait_for(lambda: self.logged() == expected and self.counted() == expected, within_s=within_s)
        except TimeoutError:
            pass  # the assertion says how they differ
        logged, counted = self.logged(), self.counted()
        assert logged == counted == expected, f"logged {dict(logged)}, counted {dict(counted)}, " \
                                              f"expected {dict(expected)}"


def worker_pid(server: Server) -> int:
    return requests.get(server.url + "/readyz", timeout=10).json()["pid"]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        [line] = [line for line in status if line.startswith("VmRSS:")]
    return int(line.split()[1]) * 1024


class Siege:
    """One attack's watch: what its clients got, and the server still serving while it holds.

    Its own channel connects before the attack, as a client's kept channel would: an attack
    on connections may well stop new ones, as it should.
    """

    def __init__(self, server: Server, model, *, ledger: bool) -> None:
        self.server = server
        self.model = model
        self.pid = worker_pid(server)
        self.channel = grpc.insecure_channel(server.grpc_target)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._predict = prediction_service_pb2_grpc.PredictionServiceStub(self.channel)
        self._check_health()
        self.rss_before = rss_bytes(self.pid)
        self.ledger = Ledger(server) if ledger else None
        self.expected: Counts = collections.Counter()
        self.predicted = 0

    def got(self, route: str, status: grpc.StatusCode | str, count: int = 1) -> None:
        """`count` calls to `route` whose clients got `status`."""
        self.expected[route, status.name if isinstance(status, grpc.StatusCode) else status] += count

    def _check_health(self) -> None:
        answer = self._health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING

    def serving(self, *, predict: bool = True, recover_within_s: float = 0) -> None:
        """Health answers SERVING and (unless the attack holds every call slot by design) a
        normal Predict the model's own scores: now, or with `recover_within_s`, within that
        long, the Predicts refused on the way not counted (an attack whose aftermath drains)."""
        self._check_health()
        if not predict:
            return
        if recover_within_s:
            wait_for(self._predicted_unless_refused, within_s=recover_within_s, what="a Predict answered")
        else:
            self._predict_exact()
        self.got(PREDICT, grpc.StatusCode.OK)
        self.predicted += 1

    def _predict_exact(self) -> None:
        import tensorflow as tf

        rows = integer_rows(3, seed=100 + self.predicted)
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "default"
        request.inputs["features"].CopyFrom(tf.make_tensor_proto(rows))
        answer = self._predict.Predict(request, timeout=30)
        assert tf.make_ndarray(answer.outputs["scores"]).tolist() == self.model(rows).numpy().tolist()

    def _predicted_unless_refused(self) -> bool:
        try:
            self._predict_exact()
        except grpc.RpcError as refused:
            if refused.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise
            return False
        return True

    def check(self) -> None:
        self.channel.close()
        assert self.predicted, "no Predict was answered while the attack held"
        rss_after = rss_bytes(self.pid)
        assert rss_after <= self.rss_before * (1 + RSS_GROWTH), f"VmRSS {self.rss_before} -> {rss_after} bytes"
        assert worker_pid(self.server) == self.pid, "the worker was replaced"
        if self.ledger is not None:
            self.ledger.settle(self.expected)


@contextmanager
def siege(server: Server, model, *, ledger: bool = True) -> Iterator[Siege]:
    """Watch an attack on `server`; on a clean exit, make every assertion of the module docstring.
    With ledger=False (an attack whose calls no client can count), the log and counts are not compared."""
    watch = Siege(server, model, ledger=ledger)
    try:
        yield watch
    except BaseException:
        watch.channel.close()
        raise
    watch.check()
