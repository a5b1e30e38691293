"""The checks of tests/ledger.py around an attack on a live server's gRPC port.

`siege` is the one set of assertions every gRPC attack test makes, around the attack:

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

from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from tests import ledger
from tests.conftest import Server, integer_rows, wait_for
from tests.ledger import GRPC, watching

PREDICT = "/tensorflow.serving.PredictionService/Predict"


class Ledger(ledger.Ledger):
    """The gRPC calls' access lines and counts, per method path and status."""

    def __init__(self, server: Server) -> None:
        super().__init__(server, GRPC)


class Siege(ledger.Watch):
    """One attack's watch: what its clients got, and the server still serving while it holds.

    Its own channel connects before the attack, as a client's kept channel would: an attack
    on connections may well stop new ones, as it should.
    """

    def __init__(self, server: Server, model, *, ledger: bool) -> None:
        self.model = model
        self.channel = grpc.insecure_channel(server.grpc_target)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._predict = prediction_service_pb2_grpc.PredictionServiceStub(self.channel)
        self._check_health()
        super().__init__(server, GRPC, ledger=ledger)

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

    def close(self) -> None:
        self.channel.close()


@contextmanager
def siege(server: Server, model, *, ledger: bool = True) -> Iterator[Siege]:
    """Watch an attack on `server`; on a clean exit, make every assertion of the module docstring.
    With ledger=False (an attack whose calls no client can count), the log and counts are not compared."""
    with watching(Siege(server, model, ledger=ledger)) as watch:
        yield watch
