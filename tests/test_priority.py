"""Priority levels: the engine takes the highest level first, FIFO within a level, with a queue
limit and a queue timeout per level; the doors read a request's priority (the v2 `priority`
parameter, the TF Serving APIs' X-Priority header / x-priority metadata) or refuse it by name.

Engine tests drive a Batcher with a fake predict gated by an Event; door tests run in-process
over a model whose level 2 times out at once (so a request's level shows in its answer); one
live server serves a model slow by construction (its graph sleeps) for the flood test and
the gRPC doors.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import grpc
import numpy as np
import pytest
import requests
from prometheus_client import CollectorRegistry

from app.core.batching import Batcher
from app.core.call import Call
from app.core.errors import BadRequest, DeadlineExceeded, QueueFull
from app.ops.metrics import Metrics
from app.ops.queue_policy import Priorities, QueuePolicy, from_entry
from app.ops.settings import Settings, SettingsError, configs_from_document
from app.wire import priority
from tests.conftest import Server, integer_rows

WAIT_S = 30  # upper bound for answers that should come at once; never reached when passing


class GatedModel:
    """y = x * 10; the first call waits for `release` so that requests queue behind it."""

    def __init__(self) -> None:
        self.running = threading.Event()
        self.release = threading.Event()
        self.batches: list[list[int]] = []

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.batches.append([int(value) for value in batch["x"][:, 0]])
        self.running.set()
        assert self.release.wait(WAIT_S)
        return {"y": batch["x"] * 10}


def rows(value: int, count: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.full((count, 1), value, np.float32)}


def submit(batcher: Batcher, inputs, *, priority: int = 0, timeout_s: float | None = None):
    """The engine's submit with a call of this priority; a deadline `timeout_s` after 0 on the fake clock."""
    return batcher.submit(Call(priority=priority, deadline=timeout_s), inputs)


@pytest.fixture
def gated():
    """make(priorities, **knobs) -> (batcher, model): the model already holds one call (value 0)."""
    made = []

    def make(priorities: Priorities, **knobs):
        model = GatedModel()
        batcher = Batcher(model, name="m", priorities=priorities, fill_under_load=False, **knobs)
        made.append((batcher, model))
        submit(batcher, rows(0))
        assert model.running.wait(WAIT_S)
        return batcher, model

    yield make
    for batcher, model in made:
        model.release.set()
        batcher.close(drain=False, timeout_s=WAIT_S)


# -- the engine ---------------------------------------------------------------------------

def test_batches_take_the_highest_level_first_and_each_level_in_order(gated) -> None:
    batcher, model = gated(Priorities(levels=3, default_level=2), max_batch_size=2)
    # (value, priority): 0 and 9 (no such level) mean the default level, 2.
    submitted = [(1, 3), (2, 3), (3, 0), (4, 1), (5, 9), (6, 1)]
    futures = [(value, submit(batcher, rows(value), priority=level)) for value, level in submitted]
    model.release.set()
    for value, future in futures:
        assert future.result(WAIT_S).outputs["y"].tolist() == [[value * 10.0]]
    assert model.batches == [[0], [4, 6], [3, 5], [1, 2]]


def test_a_full_level_refuses_its_own_requests_only(gated) -> None:
    registry = CollectorRegistry()
    observer = Metrics(registry).observer("m")
    batcher, model = gated(Priorities(levels=2, default_level=2, policies=(QueuePolicy(), QueuePolicy(2))),
                           max_batch_size=4, observer=observer)
    low = submit(batcher, rows(1, 2), priority=2)
    with pytest.raises(QueueFull, match=r"^model 'm' is overloaded at priority level 2: 2 rows of that level are "
                                        r"waiting and at most 2 may; retry later$"):
        submit(batcher, rows(2), priority=0)
    high = submit(batcher, rows(3, 3), priority=1)

    def sample(name: str, level: str) -> float | None:
        return registry.get_sample_value(name, {"model": "m", "priority": level})

    assert (sample("model_server_priority_queue_rows", "1"), sample("model_server_priority_queue_rows", "2")) == (3, 2)
    assert sample("model_server_priority_queue_full_total", "2") == 1
    assert sample("model_server_priority_queue_full_total", "1") is None
    assert registry.get_sample_value("model_server_rejections_total", {"model": "m", "reason": "queue_full"}) == 1
    model.release.set()
    assert high.result(WAIT_S).outputs["y"].tolist() == [[30.0]] * 3
    assert low.result(WAIT_S).outputs["y"].tolist() == [[10.0]] * 2
    assert model.batches[1] == [3, 3, 3, 1]
    batcher.close()
    assert (sample("model_server_priority_queue_rows", "1"), sample("model_server_priority_queue_rows", "2")) == (0, 0)


def test_a_level_timeout_expires_its_requests_still_queued() -> None:
    now = [0.0]
    model = GatedModel()
    levels = Priorities(levels=2, default_level=1, policies=(QueuePolicy(), QueuePolicy(default_timeout_s=0.5)))
    batcher = Batcher(model, name="m", priorities=levels, fill_under_load=False, clock=lambda: now[0])
    try:
        submit(batcher, rows(0))
        assert model.running.wait(WAIT_S)
        late = submit(batcher, rows(1), priority=2, timeout_s=60)
        early = submit(batcher, rows(2), priority=2, timeout_s=0.25)  # its own deadline, shorter, stands
        kept = submit(batcher, rows(3), priority=1, timeout_s=60)
        assert (late.deadline, early.deadline, kept.deadline) == (0.5, 0.25, 60)
        now[0] = 0.5
        model.release.set()
        with pytest.raises(DeadlineExceeded):
            late.result(WAIT_S)
        with pytest.raises(DeadlineExceeded):
            early.result(WAIT_S)
        assert kept.result(WAIT_S).outputs["y"].tolist() == [[30.0]]
    finally:
        model.release.set()
        batcher.close()


def test_one_level_keeps_one_queue_in_arrival_order(gated) -> None:
    batcher, model = gated(Priorities(), max_batch_size=8)
    futures = [submit(batcher, rows(value), priority=level) for value, level in ((1, 5), (2, 1), (3, 0), (4, 2))]
    model.release.set()
    assert [future.result(WAIT_S).outputs["y"].tolist() for future in futures] == [[[10.0]], [[20.0]], [[30.0]],
                                                                                   [[40.0]]]
    assert model.batches == [[0], [1, 2, 3, 4]]


# -- MODEL_CONFIG ---------------------------------------------------------------------------

def test_model_config_reads_triton_priority_fields() -> None:
    [config] = configs_from_document({"models": [{
        "name": "m", "priority_levels": 3, "default_priority_level": 2,
        "default_queue_policy": {"default_timeout_microseconds": 250000},
        "priority_queue_policy": {"1": {"max_queue_size": 64}}}]}, Settings(), "MODEL_CONFIG")
    assert config.priorities == Priorities(3, 2, (QueuePolicy(64, 0.0), QueuePolicy(0, 0.25), QueuePolicy(0, 0.25)))
    assert from_entry({}) == Priorities()


@pytest.mark.parametrize(("entry", "message"), [
    ({"priority_levels": -1}, "priority_levels must be a whole number of 0 or more; got -1"),
    ({"priority_levels": 2}, "default_priority_level must be one of 1..2 (1 is the highest); got None"),
    ({"priority_levels": 2, "default_priority_level": 3}, "default_priority_level must be one of 1..2"),
    ({"default_priority_level": 1}, "default_priority_level needs priority_levels (1 or more)"),
    ({"priority_levels": 2, "default_priority_level": 1, "priority_queue_policy": {"3": {}}},
     "priority_queue_policy['3']: a level must be one of 1..2"),
    ({"priority_levels": 2, "default_priority_level": 1, "priority_queue_policy": {"9" * 5000: {}}},
     f"priority_queue_policy['{'9' * 5000}']: a level must be one of 1..2"),  # past int()'s 4,300 digits
    ({"priority_levels": 2, "default_priority_level": 1, "default_queue_policy": {"timeout_action": "DELAY"}},
     "default_queue_policy has unsupported key(s) ['timeout_action']; allowed: max_queue_size, "
     "default_timeout_microseconds"),
    ({"priority_levels": 1, "default_priority_level": 1, "priority_queue_policy": {"1": {"max_queue_size": 1.5}}},
     "priority_queue_policy['1'].max_queue_size must be a whole number of 0 or more; got 1.5"),
])
def test_model_config_refuses_bad_priority_fields(entry, message) -> None:
    with pytest.raises(SettingsError) as refused:
        configs_from_document({"models": [{"name": "m", **entry}]}, Settings(), "MODEL_CONFIG")
    assert str(refused.value).startswith(f"MODEL_CONFIG: models[0].{message}")


# -- the wire: parsing ------------------------------------------------------------------------

@pytest.mark.parametrize("value", [-1, 1.5, "1", True, None, 2**64, [1]])
def test_a_bad_v2_priority_parameter_is_refused_by_name(value) -> None:
    with pytest.raises(BadRequest, match=r"^the parameter 'priority' must be a whole number from 0 to "
                                         r"18446744073709551615 \(1 is the highest level\)$"):
        priority.from_v2_rest({"priority": value})


def test_v2_grpc_priority_takes_uint64_or_int64() -> None:
    from tritonclient.grpc import service_pb2

    parameters = service_pb2.ModelInferRequest().parameters
    assert priority.from_v2_grpc(parameters) == 0
    parameters["priority"].uint64_param = 2**64 - 1
    assert priority.from_v2_grpc(parameters) == 2**64 - 1
    parameters["priority"].int64_param = 3
    assert priority.from_v2_grpc(parameters) == 3
    for kind, value in (("int64_param", -1), ("bool_param", True), ("string_param", "1"), ("double_param", 1.0)):
        setattr(parameters["priority"], kind, value)
        with pytest.raises(BadRequest, match="^the parameter 'priority' must be a whole number"):
            priority.from_v2_grpc(parameters)


@pytest.mark.parametrize(("value", "level"), [(None, 0), ("2", 2), (" 1 ", 1), (str(2**64 - 1), 2**64 - 1)])
def test_the_header_gives_a_level(value, level) -> None:
    assert priority.from_header(value) == level
    assert priority.from_metadata([("x-request-id", "r"), *([] if value is None else [("x-priority", value)])]) == level


@pytest.mark.parametrize("value", ["", "high", "-1", "1.0", "²", "1_0", "１", str(2**64), "9" * 5000])
def test_a_bad_header_is_refused_by_name(value) -> None:
    with pytest.raises(BadRequest, match=r"^the X-Priority header must be a whole number from 0 to "):
        priority.from_header(value)
    with pytest.raises(BadRequest, match=r"^the X-Priority header must be"):
        priority.from_metadata([("x-priority", value)])


# -- the doors, in-process: level 2 times out at once, level 1 does not --------------------

def expiring_config(folder, model_path) -> str:
    """A model whose default level, 2, gives a request 1 µs in the queue: an answer shows the level."""
    path = folder / "priorities.json"
    path.write_text(json.dumps({"models": [{
        "name": "default", "path": str(model_path), "priority_levels": 2, "default_priority_level": 2,
        "priority_queue_policy": {"2": {"default_timeout_microseconds": 1}}}]}))
    return str(path)


@pytest.fixture
def client(in_process_app, tmp_path, exact_model_path):
    return in_process_app(model_config=expiring_config(tmp_path, exact_model_path)).test_client()


def v2_body(values: np.ndarray, **parameters) -> dict:
    return {"inputs": [{"name": "features", "datatype": "FP32", "shape": list(values.shape),
                        "data": values.ravel().tolist()}], "parameters": parameters}


def test_v2_rest_priority_picks_the_level(client, exact_model) -> None:
    values = integer_rows(2)
    answer = client.post("/v2/models/default/infer", json=v2_body(values, priority=1))
    assert answer.status_code == 200, answer.get_json()
    assert answer.get_json()["outputs"][0]["data"] == exact_model(values).numpy().ravel().tolist()
    for level in ({}, {"priority": 0}, {"priority": 2}, {"priority": 3}):
        expired = client.post("/v2/models/default/infer", json=v2_body(values, **level))
        assert (expired.status_code, expired.get_json()) == (
            504, {"error": "the request's deadline passed before it ran"}), level


def test_v2_rest_refuses_a_bad_priority(client) -> None:
    refused = client.post("/v2/models/default/infer", json=v2_body(integer_rows(1), priority="1"))
    assert (refused.status_code, refused.get_json()["error"]) == (400, priority.PARAMETER_ERROR)


def test_tf_serving_rest_reads_x_priority(client, exact_model) -> None:
    values = integer_rows(2)
    body = {"instances": values.tolist()}
    answer = client.post("/v1/models/default:predict", json=body, headers={"X-Priority": "1"})
    assert answer.status_code == 200, answer.get_json()
    assert answer.get_json()["predictions"] == exact_model(values).numpy().tolist()
    assert client.post("/v1/models/default:predict", json=body).status_code == 504
    refused = client.post("/v1/models/default:predict", json=body, headers={"X-Priority": "urgent"})
    assert (refused.status_code, refused.get_json()["error"]) == (400, priority.HEADER_ERROR)


# -- a live server ------------------------------------------------------------------------------

# The slow model's graph sleeps this long (twice, as tf.data looks for a second element) per
# call: a batch takes ~0.6 s, far above what the server's own work per request costs under load.
SLEEP_US = 250_000
SLOW_BATCH = 4
FLOOD_CLIENTS = 3 * SLOW_BATCH  # a batch running and two queued: in arrival order, a request waits ~2.5 batches
# Requests timed idle, and under the flood at as many evenly spaced points of a batch: their mean
# stands for a request coming at any point (half a batch to wait, on average). Five points keep that
# mean exact; each costs about two batches of the flood, so more would only lengthen it.
SAMPLES = 5


def save_slow_model(path) -> None:
    """A SavedModel whose every call sleeps in its graph (a tf.data sleep): y = 2x + 1, slowly."""
    import tensorflow as tf

    class Slow(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
        def serve(self, x):
            source = tf.data.Dataset.range(1)
            slept = tf.raw_ops.SleepDataset(input_dataset=source._variant_tensor,
                                            sleep_microseconds=tf.constant(SLEEP_US, tf.int64),
                                            output_types=[tf.int64], output_shapes=[[]])
            pause = tf.data.experimental.from_variant(slept, source.element_spec)
            waited = pause.reduce(tf.constant(0, tf.int64), lambda total, item: total + item)
            with tf.control_dependencies([waited]):
                return {"y": x * 2.0 + 1.0}

    module = Slow()
    tf.saved_model.save(module, str(path / "1"), signatures={"serving_default": module.serve})


@pytest.fixture(scope="module")
def served(tmp_path_factory, exact_model_path):
    folder = tmp_path_factory.mktemp("priority")
    save_slow_model(folder / "slow")
    config = folder / "models.json"
    config.write_text(json.dumps({"default": "slow", "models": [
        {"name": "slow", "path": str(folder / "slow"), "max_batch_size": SLOW_BATCH, "priority_levels": 2,
         "default_priority_level": 2},
        {"name": "expiring", "path": str(exact_model_path), "priority_levels": 2, "default_priority_level": 2,
         "priority_queue_policy": {"2": {"default_timeout_microseconds": 1}}},
    ]}))
    server = Server(folder, {"MODEL_CONFIG": str(config), "MODEL_POLL_SECONDS": "0", "REQUEST_TIMEOUT_MS": "60000"})
    server.start()
    yield server
    server.stop()


def slow_infer(session: requests.Session, url: str, value: float, level: int) -> float:
    """One v2 REST call at `level`; its latency, once its answer is checked."""
    values = np.full((1, 4), value, np.float32)
    started = time.monotonic()
    answer = session.post(url + "/v2/models/slow/infer", json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": values.ravel().tolist()}],
        "parameters": {"priority": level}}, timeout=60)
    latency = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == (values * 2 + 1).ravel().tolist()
    return latency


def test_high_priority_waits_at_most_one_batch_behind_a_low_priority_flood(served) -> None:
    high = requests.Session()
    slow_infer(high, served.url, 0, 1)
    calls = [served.metric(f"model_server_predict_duration_seconds_{part}", model="slow") for part in ("sum", "count")]
    idle = [slow_infer(high, served.url, value, 1) for value in range(SAMPLES)]
    predict_sum, predict_count = (served.metric(f"model_server_predict_duration_seconds_{part}", model="slow") - before
                                  for part, before in zip(("sum", "count"), calls, strict=True))
    batch_s = predict_sum / predict_count
    stop, answered, failures = threading.Event(), [0] * FLOOD_CLIENTS, []

    def flood(client: int) -> None:
        with requests.Session() as session:
            try:
                while not stop.is_set():
                    slow_infer(session, served.url, 100 + client, 2)
                    answered[client] += 1
            except Exception as exc:  # reported below: a thread's assert would not fail the test
                failures.append(exc)
                stop.set()

    threads = [threading.Thread(target=flood, args=(client,)) for client in range(FLOOD_CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        # The flood keeps the queue holding several batches of low-priority rows.
        wait_started = time.monotonic()
        while served.metric("model_server_priority_queue_rows", model="slow", priority="2") < 2 * SLOW_BATCH:
            assert time.monotonic() - wait_started < WAIT_S and not failures, failures
        before, started = sum(answered), time.monotonic()
        under_flood = []
        for sample in range(SAMPLES):
            # The high-priority client thinks before each request, for a share of a batch that
            # differs each time: sent as its last answer came, it would always come just after
            # the next batch formed (the worst case), never at another point of a batch.
            time.sleep(batch_s * (sample + 0.5) / SAMPLES)
            under_flood.append(slow_infer(high, served.url, sample, 1))
        low_per_s = (sum(answered) - before) / (time.monotonic() - started)
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_S)
    assert not failures, failures
    print(f"\nbatch {batch_s * 1000:.0f} ms; high priority idle {statistics.mean(idle) * 1000:.0f} ms, "
          f"under the flood {statistics.mean(under_flood) * 1000:.0f} ms (max {max(under_flood) * 1000:.0f}); "
          f"low priority {low_per_s:.1f} req/s")
    # By level, a request waits for the rest of the batch running when it came (half a batch on
    # average over the five points of a batch it came at) and then runs; in arrival order it
    # would wait for two more batches.
    assert statistics.mean(under_flood) <= statistics.mean(idle) + batch_s
    assert low_per_s > 0


def test_grpc_doors_read_the_priority(served) -> None:
    import tritonclient.grpc as triton_grpc
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    from app.wire import tensor_proto

    values = integer_rows(2)
    client = triton_grpc.InferenceServerClient(served.grpc_target)
    tensor = triton_grpc.InferInput("features", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values.astype(np.float32))
    assert client.infer("expiring", [tensor], priority=1).as_numpy("scores").shape == (2, 3)
    with pytest.raises(Exception, match="the request's deadline passed before it ran"):
        client.infer("expiring", [tensor], priority=2)
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "expiring"
        tensor_proto.from_ndarray(values.astype(np.float32), "DT_FLOAT", request.inputs["features"])
        assert stub.Predict(request, timeout=60, metadata=[("x-priority", "1")]).outputs["scores"].tensor_shape
        for metadata, code in (([], grpc.StatusCode.DEADLINE_EXCEEDED),
                               ([("x-priority", "x")], grpc.StatusCode.INVALID_ARGUMENT),
                               ([("x-priority", "9" * 5000)], grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Predict(request, timeout=60, metadata=metadata)
            assert refused.value.code() == code
