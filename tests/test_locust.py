"""The locustfile against a real server, and its step shape.

Locust monkey-patches the standard library with gevent when imported, so it never runs
inside the pytest process: the load test is a `locust` subprocess, and the shape is
imported in a short-lived Python subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import REPO, Server, wait_for

LOCUST_TIMEOUT_S = 90
USERS = 5


def locust_env(**overrides: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("LOCUST_")}
    env.update(overrides)
    return env


def locust_until_served(url: str, csv_prefix: Path, env: dict[str, str], served, *,
                        args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run headless Locust until `served()` (the server's own count) says enough was answered,
    then stop it as a user would (SIGTERM: Locust writes its stats and exits with its own code).
    No clock decides it: on a loaded machine a timed run can end before Locust has sent anything."""
    command = [sys.executable, "-m", "locust", "-f", str(REPO / "locustfile.py"), "--headless",
               "-u", str(USERS), "-r", str(USERS), "-t", f"{LOCUST_TIMEOUT_S}s", "--host", url,
               "--json-file", str(csv_prefix), "--only-summary", *args]
    locust = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: served() or locust.poll() is not None, within_s=LOCUST_TIMEOUT_S, what="enough answers")
        locust.terminate()
        output, _ = locust.communicate(timeout=LOCUST_TIMEOUT_S)
    finally:
        if locust.poll() is None:
            locust.kill()
            locust.wait()
    return subprocess.CompletedProcess(command, locust.returncode, output, "")


def json_totals(prefix: Path) -> dict[str, int]:
    """Every request Locust finished, from the JSON file it writes once, at exit (its CSV is
    rewritten once a second and may miss the last calls, or all of them in a short run)."""
    entries = json.loads(prefix.with_suffix(".json").read_text())
    return {key: sum(entry[key] for entry in entries) for key in ("num_requests", "num_failures")}


def answered(server: Server, route: str, more_than: int, **labels: str):
    """A predicate: the server has answered more than `more_than` requests on `route` since now."""
    before = server.metric("model_server_requests_total", route=route, **labels)
    return lambda: server.metric("model_server_requests_total", route=route, **labels) > before + more_than


# Answers of each kind a fake server gives before its Locust run is stopped; no clock decides it
# (a timed run on a loaded machine could end before Locust had sent anything). A user sends its
# next request only once it has counted the last one, so at most USERS answers go uncounted:
# of each kind's USERS + 1, Locust has counted at least one.
ANSWERS_PER_KIND = USERS + 1


class Answers:
    """The fake server's bad answers, taken in turn; `enough` is set once each was given ANSWERS_PER_KIND times.
    One Locust run then shows how it counts every kind: one counted as a success would make
    num_failures fall short of num_requests."""

    def __init__(self, kinds: int) -> None:
        self.kinds = kinds
        self.count = 0
        self.enough = threading.Event()
        self._lock = threading.Lock()

    def next_kind(self) -> int:
        """The kind of the answer about to be given (counted as given)."""
        with self._lock:
            kind = self.count % self.kinds
            self.count += 1
            if self.count >= self.kinds * ANSWERS_PER_KIND:
                self.enough.set()
            return kind


def locust_until_answered(url: str, stats_path: Path, env: dict[str, str], answers: Answers) -> tuple[int, dict]:
    """Run headless Locust against a fake server until it has given each kind of answer ANSWERS_PER_KIND times.
    Returns the exit code and the aggregated stats of every request Locust finished."""
    run = locust_until_served(url, stats_path, env, answers.enough.is_set)
    assert answers.enough.is_set(), f"the fake server answered {answers.count} requests:\n{run.stdout}"
    return run.returncode, json_totals(stats_path)


PROTOCOLS = ("http", "grpc", "v2", "v2-grpc")


@pytest.fixture(scope="module")
def counted_server(tmp_path_factory, exact_model_path):
    """One copy of the exact model per protocol (the HTTP one is the default model, which /predict
    serves): each test counts its own route's requests and its own model's rows, as on a fresh server."""
    folder = tmp_path_factory.mktemp("locust-counted")
    config = folder / "models.json"
    config.write_text(json.dumps({"default": "http", "models": [
        {"name": protocol, "path": str(exact_model_path)} for protocol in PROTOCOLS]}))
    running = Server(folder, {"MODEL_CONFIG": str(config), "MODEL_POLL_SECONDS": "0"}).start()
    yield running
    running.stop()


class FakeServer(ThreadingHTTPServer):
    """Serves the default model's metadata, and to the predicts each canned answer in turn."""

    def __init__(self, canned: list[tuple[int, dict]]) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.canned = canned
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.answers = Answers(len(canned))


class FakeHandler(BaseHTTPRequestHandler):
    METADATA = {"metadata": {"signature_def": {"signature_def": {"serving_default": {"inputs": {
        "features": {"dtype": "DT_FLOAT", "tensor_shape": {"dim": [{"size": "-1"}, {"size": "4"}]}}}}}}}}

    def do_GET(self) -> None:
        self.answer(200, self.METADATA)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.answer(*self.server.canned[self.server.answers.next_kind()])

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_server():
    servers = []

    def start(canned: list[tuple[int, dict]]) -> FakeServer:
        server = FakeServer(canned)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_locust_counts_every_bad_answer_as_a_failure(fake_server, tmp_path):
    server = fake_server([
        (200, {"predictions": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]}),  # two predictions for one row
        (200, {"outputs": [[1.0, 2.0, 3.0]]}),                          # no predictions at all
        (503, {"error": "queue full"}),
    ])
    env = locust_env(LOCUST_WAIT_MIN="0.05", LOCUST_WAIT_MAX="0.1")

    returncode, total = locust_until_answered(server.url, tmp_path / "run", env, server.answers)

    assert returncode != 0
    assert total["num_failures"] == total["num_requests"] > 0, total


# Per protocol one Locust run, checked for all it shows: it ran, none failed, every call held the
# rows asked for, and the HTTP doors' batch headers were tallied into the summary file.
@pytest.mark.parametrize("protocol, route, ok, batch_headers", [
    ("http", "/predict", "200", True),
    ("grpc", "/tensorflow.serving.PredictionService/Predict", "OK", False),
    ("v2", "/v2/models/<model_name:name>/infer", "200", True),
    ("v2-grpc", "/inference.GRPCInferenceService/ModelInfer", "OK", False),
])
def test_locust_rows_match_what_the_server_received(counted_server, tmp_path, protocol, route, ok, batch_headers):
    server = counted_server
    host = f"grpc://{server.grpc_target}" if protocol in ("grpc", "v2-grpc") else server.url
    summary = tmp_path / "batches.json"
    env = locust_env(LOCUST_PROTOCOL=protocol, LOCUST_MODEL=protocol, LOCUST_ROWS="3", LOCUST_WAIT_MIN="0.01",
                     LOCUST_WAIT_MAX="0.05", LOCUST_SUMMARY_FILE=str(summary))

    # The JSON file is written once, at exit, with every call counted (the CSV is rewritten
    # once a second and may miss the last one).
    run = locust_until_served(host, tmp_path / "run", env, answered(server, route, 50 + USERS, status=ok),
                              args=("--stop-timeout", "30"))

    assert run.returncode == 0, run.stdout + run.stderr
    (entry,) = json.loads((tmp_path / "run.json").read_text())
    counted = entry["num_requests"]
    assert entry["num_failures"] == 0 and counted > 50, entry
    batches = json.loads(summary.read_text())
    if batch_headers:  # every answer came from a batch of at least its own 3 rows
        assert batches["answers_with_batch_headers"] > 0 and batches["mean_batch_rows"] >= 3, batches
    else:
        assert batches["answers_with_batch_headers"] == 0, batches
    received = server.metric("model_server_requests_total", route=route, status=ok)
    # A call cut off as Locust stops its users can reach the server uncounted: one per user at most.
    assert counted <= received <= counted + USERS
    # Every call the server received held the rows Locust was asked to send: its batches'
    # real rows add up to 3 per call. A gRPC call Locust cut off as it stopped may have run and
    # still be recorded CANCELLED, the status its client got (app/grpc/exchange.py).
    cut_off = server.metric("model_server_requests_total", route=route, status="CANCELLED")
    assert cut_off <= USERS
    assert 3 * received <= server.metric("model_server_batch_size_rows_sum", model=protocol) <= 3 * (received + cut_off)


class FakePredictionService:
    """A gRPC server answering GetModelMetadata with the default model's inputs, and Predict with each canned
    answer in turn: that many rows, or RESOURCE_EXHAUSTED for None."""

    def __init__(self, answer_rows: list[int | None]) -> None:
        from concurrent import futures

        import grpc
        from tensorflow_serving.apis import prediction_service_pb2_grpc

        self.answer_rows = answer_rows
        self.answers = Answers(len(answer_rows))
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        servicer = prediction_service_pb2_grpc.PredictionServiceServicer()
        servicer.GetModelMetadata = self.metadata
        servicer.Predict = self.predict
        prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(servicer, self.server)
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def metadata(self, request, context):
        from tensorflow_serving.apis import get_model_metadata_pb2

        signatures = get_model_metadata_pb2.SignatureDefMap()
        features = signatures.signature_def["serving_default"].inputs["features"]
        features.dtype = 1  # DT_FLOAT
        for size in (-1, 4):
            features.tensor_shape.dim.add().size = size
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        response.metadata["signature_def"].Pack(signatures)
        return response

    def predict(self, request, context):
        import grpc
        import numpy as np
        import tensorflow as tf
        from tensorflow_serving.apis import predict_pb2

        rows = self.answer_rows[self.answers.next_kind()]  # counted before it is sent, as Locust may stop
        if rows is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        response = predict_pb2.PredictResponse()
        response.outputs["scores"].CopyFrom(tf.make_tensor_proto(np.zeros((rows, 3), np.float32)))
        return response


def test_locust_grpc_user_counts_every_bad_answer_as_a_failure(tmp_path):
    fake = FakePredictionService([2, None])  # two rows for one, and RESOURCE_EXHAUSTED
    env = locust_env(LOCUST_PROTOCOL="grpc", LOCUST_WAIT_MIN="0.05", LOCUST_WAIT_MAX="0.1")
    try:
        returncode, total = locust_until_answered(f"grpc://{fake.target}", tmp_path / "run", env, fake.answers)
    finally:
        fake.server.stop(None)

    assert returncode != 0
    assert total["num_failures"] == total["num_requests"] > 0, total


class FakeInferenceService:
    """A v2 gRPC server answering ModelMetadata with one FP32 input, and ModelInfer with each canned answer in
    turn: that many rows, or RESOURCE_EXHAUSTED for None."""

    def __init__(self, answer_rows: list[int | None]) -> None:
        from concurrent import futures

        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.answer_rows = answer_rows
        self.answers = Answers(len(answer_rows))
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        servicer = service_pb2_grpc.GRPCInferenceServiceServicer()
        servicer.ModelMetadata = self.metadata
        servicer.ModelInfer = self.infer
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self.server)
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def metadata(self, request, context):
        from tritonclient.grpc import service_pb2

        response = service_pb2.ModelMetadataResponse(name=request.name)
        response.inputs.add(name="features", datatype="FP32", shape=[-1, 4])
        return response

    def infer(self, request, context):
        import grpc
        from tritonclient.grpc import service_pb2

        rows = self.answer_rows[self.answers.next_kind()]  # counted before it is sent, as Locust may stop
        if rows is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        response = service_pb2.ModelInferResponse(model_name=request.model_name)
        response.outputs.add(name="scores", datatype="FP32", shape=[rows, 3])
        response.raw_output_contents.append(bytes(4 * 3 * rows))
        return response


def test_locust_v2_grpc_user_counts_every_bad_answer_as_a_failure(tmp_path):
    fake = FakeInferenceService([2, None])  # two rows for one, and RESOURCE_EXHAUSTED
    env = locust_env(LOCUST_PROTOCOL="v2-grpc", LOCUST_WAIT_MIN="0.05", LOCUST_WAIT_MAX="0.1")
    try:
        returncode, total = locust_until_answered(f"grpc://{fake.target}", tmp_path / "run", env, fake.answers)
    finally:
        fake.server.stop(None)

    assert returncode != 0
    assert total["num_failures"] == total["num_requests"] > 0, total


# What the locustfile computes, checked below: each snippet runs with it imported as `lf` and sets
# `value`. Importing Locust costs seconds (gevent patches the standard library as it loads), so
# all snippets share one Python per LOCUST_SHAPE (read at import), not one each.
SNIPPETS = {
    "v2_grpc_request": (
        "import numpy as np\n"
        "specs = {'features': ((2, 3), 'FP32'), 'ids': ((1,), 'INT64'), 'text': ((2,), 'BYTES')}\n"
        "request = lf.v2_grpc_request(specs, 4, np.random.default_rng(0))\n"
        "value = {'model': request.model_name,\n"
        "    'inputs': [[t.name, t.datatype, list(t.shape)] for t in request.inputs],\n"
        "    'sizes': [len(raw) for raw in request.raw_input_contents],\n"
        "    'text': request.raw_input_contents[2][:13].decode('latin-1')}"),
    "step_ticks": (
        "shape = lf.StepShape(step_seconds=10, max_users=3, hold_seconds=5)\n"
        "value = {}\n"
        "for t in (0, 9.9, 10, 19.9, 20, 29.9, 30, 34.9, 35, 100):\n"
        "    shape.get_run_time = lambda t=t: t\n"
        "    value[str(t)] = shape.tick()"),
    "step_settings": (
        "shape = lf.StepShape()\n"
        "value = [shape.step_seconds, shape.max_users, shape.hold_seconds]"),
    # Locust runs the first non-abstract shape class it finds in the locustfile.
    "shape_seen": (
        "from locust.util.load_locustfile import is_shape_class\n"
        "value = is_shape_class(lf.StepShape)"),
    "random_instances": (
        "import numpy as np\n"
        "metadata = {'metadata': {'signature_def': {'signature_def': {'serving_default': {'inputs': {\n"
        "    'features': {'dtype': 'DT_FLOAT', 'tensor_shape': {'dim': [{'size': '-1'}, {'size': '6'}]}},\n"
        "    'ids': {'dtype': 'DT_INT64', 'tensor_shape': {'dim': [{'size': '-1'}, {'size': '-1'}]}}}}}}}}\n"
        "specs = lf.input_specs(metadata)\n"
        "value = lf.random_instances(specs, 2, np.random.default_rng(0))"),
}
SNIPPET_RUNNER = """\
import json, sys
import locustfile as lf
values = {}
for name, body in json.loads(sys.argv[1]).items():
    scope = {"lf": lf, "json": json}
    exec(body, scope)
    values[name] = scope["value"]
print(json.dumps(values))
"""
SNIPPET_ENV = {"LOCUST_PROTOCOL": "v2-grpc", "LOCUST_STEP_SECONDS": "2.5", "LOCUST_STEP_USERS_MAX": "7"}


@pytest.fixture(scope="module")
def locustfile_values() -> dict[str, dict]:
    """Each snippet's value by LOCUST_SHAPE ("" and "step"), from two Pythons run side by side."""
    runs = {shape: subprocess.Popen([sys.executable, "-c", SNIPPET_RUNNER, json.dumps(SNIPPETS)], cwd=REPO,
                                    env=locust_env(**SNIPPET_ENV, LOCUST_SHAPE=shape), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            for shape in ("", "step")}
    values = {}
    for shape, run in runs.items():
        output, errors = run.communicate(timeout=60)
        assert run.returncode == 0, errors
        values[shape] = json.loads(output.strip().splitlines()[-1])
    return values


def test_v2_grpc_request_carries_every_input_raw(locustfile_values):
    sent = locustfile_values[""]["v2_grpc_request"]
    assert sent["model"] == "default"
    assert sent["inputs"] == [["features", "FP32", [4, 2, 3]], ["ids", "INT64", [4, 1]], ["text", "BYTES", [4, 2]]]
    # 4 x 2 x 3 floats; 4 int64s; 8 strings, each a 4-byte length and "load-test".
    assert sent["sizes"] == [4 * 2 * 3 * 4, 4 * 8, 8 * (4 + 9)]
    assert sent["text"] == "\t\x00\x00\x00load-test"


def test_step_shape_adds_one_user_per_step_then_holds_then_stops(locustfile_values):
    assert locustfile_values[""]["step_ticks"] == {
        "0": [1, 3.0], "9.9": [1, 3.0], "10": [2, 3.0], "19.9": [2, 3.0], "20": [3, 3.0],
        "29.9": [3, 3.0], "30": [3, 3.0], "34.9": [3, 3.0], "35": None, "100": None,
    }


def test_step_shape_reads_its_settings_from_the_environment(locustfile_values):
    # LOCUST_STEP_SECONDS=2.5 and LOCUST_STEP_USERS_MAX=7 (SNIPPET_ENV); the hold defaults to a step.
    assert locustfile_values[""]["step_settings"] == [2.5, 7, 2.5]


@pytest.mark.parametrize("shape, locust_sees_it", [("", False), ("step", True)])
def test_step_shape_takes_over_only_when_asked(locustfile_values, shape, locust_sees_it):
    assert locustfile_values[shape]["shape_seen"] is locust_sees_it


def test_random_instances_follow_the_metadata(locustfile_values):
    body = locustfile_values[""]["random_instances"]
    assert len(body) == 2
    for row in body:
        assert set(row) == {"features", "ids"}
        assert len(row["features"]) == 6 and all(isinstance(value, float) for value in row["features"])
        assert len(row["ids"]) == 1 and isinstance(row["ids"][0], int)
