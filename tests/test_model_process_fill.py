"""MODEL_PROCESSES: a model process's batch waits for the requests its workers are still reading.

A model process's batch thread has a core of its own, so it is idle when a row arrives and
ran each row alone (1.4 to 2.2 rows a call under 32 connections, docs/model-processes-benchmark.md).
Each worker counts the requests it has resolved to a model and not yet handed over; each
predict frame carries that count, and the fill policy waits, briefly, for them.

The engine's part is checked with a fake predict and a frozen clock; the count with a real
server: a client that sends half a body holds one request "coming", and /readyz, which asks
the model process, shows what the last predict frame said.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import requests
from prometheus_client import CollectorRegistry
from tensorflow_serving.apis import prediction_service_pb2_grpc

from app.batching import Batcher, CallStats, FillPolicy, FillWait
from app.batching.fill import FILL_COMING_S
from app.errors import Unavailable
from app.logs import RequestRecord
from app.metrics import Metrics
from app.model_process.client import RemoteModels, RemoteRegistry
from app.model_process.link import ModelProcessLink
from app.serving import ModelSpec, RequestLayer
from tests.conftest import Server, integer_rows, wait_for
from tests.test_grpc import predict_request

# What a model process says it serves (app/model_process/meta.py): one model, one signature.
TENSOR = {"shape": [-1, 4], "dtype": "float32", "tf_dtype": 1, "dims": None}
DESCRIPTION = {"default": "m", "models": [{"name": "m", "labels": {}, "states": [], "versions": [{
    "version": 1, "source": "test", "load_s": 0.0, "warmup_s": 0.0, "default_signature": "serving_default",
    "signatures": [{"name": "serving_default", "method_name": "tensorflow/serving/predict",
                    "inputs": [{"name": "x", "tensor_name": "x:0", **TENSOR}],
                    "outputs": [{"name": "y", "tensor_name": "y:0", **TENSOR}]}],
    "batchers": {"serving_default": {"name": "m", "max_request_rows": 8, "max_batch_size": 8, "batch_timeout_s": 0.0,
                                     "fill_under_load": True, "whole": False, "padded": False}}}]}]}


def test_a_batch_waits_briefly_for_requests_coming():
    policy = FillPolicy(max_batch_size=32, coming=lambda: 3)
    assert policy.decide(oldest_enqueued_at=1.0, now=1.0, requests=2) == FillWait(until=1.0 + FILL_COMING_S, requests=5)
    # A call that took longer than that bounds the wait instead (the model idles no longer than it ran).
    policy.record(CallStats(requests=1, predict_s=0.05, ended_at=0.9, waiting=0))
    assert policy.decide(oldest_enqueued_at=1.0, now=1.0, requests=1) == FillWait(until=1.05, requests=4)


def test_nothing_coming_or_no_fill_under_load_goes_at_once():
    assert FillPolicy(max_batch_size=32, coming=lambda: 0).decide(oldest_enqueued_at=1.0, now=1.0) is None
    assert FillPolicy(max_batch_size=32, coming=lambda: 3,
                      fill_under_load=False).decide(oldest_enqueued_at=1.0, now=1.0) is None
    # A batch window, where set, is the wait: the hint does not shorten or lengthen it.
    assert FillPolicy(max_batch_size=32, batch_timeout_s=0.5,
                      coming=lambda: 3).decide(oldest_enqueued_at=1.0, now=1.2) == FillWait(until=1.5, requests=32)


def test_the_batch_thread_runs_the_first_request_with_those_coming():
    calls: list[int] = []
    coming = [2]
    submitted = threading.Event()

    def predict(inputs):
        calls.append(len(inputs["x"]))
        return {"y": inputs["x"] * 2}

    batcher = Batcher(predict, max_batch_size=8, coming=lambda: coming[0], clock=lambda: 0.0)
    # A last call of a minute bounds the wait: it ends when the two coming requests arrive.
    batcher.fill_policy.record(CallStats(requests=1, predict_s=60.0, ended_at=-100.0, waiting=0))
    try:
        first = batcher.submit({"x": np.array([[1.0]], np.float32)}, timeout_s=None)
        first.add_done_callback(lambda _: submitted.set())
        wait_for(lambda: batcher.queue.wake_requests is not None, what="the batch thread waiting for company")
        assert not submitted.is_set()
        coming[0] = 0
        rest = [batcher.submit({"x": np.array([[value]], np.float32)}, timeout_s=None) for value in (2.0, 3.0)]
        answers = [future.result(10).outputs["y"].tolist() for future in [first, *rest]]
    finally:
        batcher.close()
    assert answers == [[[2.0]], [[4.0]], [[6.0]]]
    assert calls == [4]  # one predict call for the three requests, padded to the bucket of 4
    assert [future.result().batch_requests for future in [first, *rest]] == [3, 3, 3]


def test_a_request_counts_as_coming_from_its_model_until_handed_over_or_ended():
    link = ModelProcessLink("unconnected", arena_bytes=1 << 20, on_meta=lambda _description: None)
    registry = RemoteRegistry("")
    RemoteModels(registry, link).apply(DESCRIPTION)
    registry.link = link
    layer = RequestLayer(registry, timeout_s=30, max_request_bytes=1 << 20, metrics=Metrics(CollectorRegistry()))
    records = [RequestRecord(str(number)) for number in range(3)]
    servables = [layer.model(ModelSpec("m"), record) for record in records]
    assert link.coming_count("m") == 3
    # Handed over: the layer says so before the rows leave (here the link refuses them: not connected).
    with pytest.raises(Unavailable, match="restarting"):
        layer.predict(servables[0], servables[0].signature(""), {"x": np.zeros((1, 4), np.float32)},
                      record=records[0], pinned=False)
    assert link.coming_count("m") == 2
    # Ended before it was handed over (a refusal): the front door's end of the record says so, once.
    layer.requests.finish(records[1])
    layer.requests.finish(records[1])
    records[2].arrive()
    assert link.coming_count("m") == 0
    # Metadata reads name no record: nothing counts.
    layer.model(ModelSpec("m"))
    assert link.coming_count("m") == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory, exact_model_path):
    served = Server(tmp_path_factory.mktemp("model-process-fill"),
                    {"MODEL_PATH": str(exact_model_path), "MODEL_PROCESSES": "1"})
    served.start(workers=1)
    yield served
    served.stop()


def model_process_link(server: Server) -> ModelProcessLink:
    """A link to the server's model process, as a worker's: the test speaks for one more worker."""
    socket_path = next(process.cmdline()[process.cmdline().index("--socket") + 1] for process in server.processes()
                       if "app.model_process.server" in process.cmdline())
    link = ModelProcessLink(socket_path, arena_bytes=1 << 20, on_meta=lambda _description: None)
    link.connect()
    return link


def test_workers_count_the_requests_they_are_reading(server, exact_model):
    rows = integer_rows(2)

    def predict_and_coming() -> int:
        answer = server.predict(rows, path="/v1/models/default:predict")
        assert answer.status_code == 200, answer.text
        assert answer.json()["predictions"] == exact_model(rows).numpy().tolist()
        return requests.get(server.url + "/readyz", timeout=30).json()["models"]["default"]["requests_coming"]

    # A request is not counted by its own frame, nor is one that already ended.
    assert predict_and_coming() == 0
    for body in (b"{not json", b'{"instances": [[1, 2]]}', b'{"inputs": {"nope": [1]}, "instances": [1]}'):
        refused = requests.post(server.url + "/v1/models/default:predict", data=body, timeout=30)
        assert refused.status_code == 400, refused.text
    assert predict_and_coming() == 0

    # gRPC's refusals after the model was resolved end their count too.
    with grpc.insecure_channel(server.env["GRPC_BIND"]) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for request in (predict_request("default", integer_rows(2, features=3)), predict_request("default")):
            try:
                stub.Predict(request, timeout=30)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            else:
                raise AssertionError("a predict with the wrong inputs was answered")
    assert predict_and_coming() == 0

    # The model process adds up what each worker's last frame said: a second link, as a worker's.
    version = requests.get(server.url + "/readyz", timeout=30).json()["models"]["default"]["version"]
    link = model_process_link(server)
    try:
        for coming in (5, 0):
            header = {"op": "predict", "model": "default", "version": version, "signature": "serving_default",
                      "pinned": False, "timeout_s": 30.0, "coming": coming}
            _answer, outputs = link.request(header, {"features": rows}).result(30)
            assert outputs["scores"].tolist() == exact_model(rows).numpy().tolist()
            assert requests.get(server.url + "/readyz", timeout=30).json()["models"]["default"]["requests_coming"] \
                == coming
    finally:
        link.close()


def test_a_frame_the_model_process_does_not_know_is_answered_not_left_waiting(server):
    link = model_process_link(server)
    try:
        with pytest.raises(Unavailable, match="the model process has no operation 'rewind'"):
            link.request({"op": "rewind"}).result(30)
    finally:
        link.close()
