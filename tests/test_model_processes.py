"""MODEL_PROCESSES=1: the models in a process of their own, two Gunicorn workers in front of it.

One real server for the module (real Gunicorn, real TensorFlow in the model process, real
REST and gRPC), stopped by the last test; the test that kills the model process runs just
before it. Answers are compared exactly with the model's own output.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
import requests
from tensorflow_serving.apis import prediction_service_pb2_grpc

from tests.conftest import Server, integer_rows, wait_for
from tests.test_grpc import access_line, predict_request, scores
from tests.tfs_models import save_half_plus_two_tf2

# Two requests fill a batch of "paired", which otherwise waits this long for a second one.
PAIRED_WINDOW_MS = 20_000
TF_RUNTIME = "_pywrap_tensorflow_internal"


@pytest.fixture(scope="module")
def config(tmp_path_factory, exact_model_path) -> Path:
    root = tmp_path_factory.mktemp("model-processes")
    save_half_plus_two_tf2(root / "hp2" / "1")
    shutil.copytree(root / "hp2" / "1", root / "hp2" / "2")
    document = {"models": [
        {"name": "exact", "path": str(exact_model_path)},
        {"name": "paired", "path": str(exact_model_path), "max_batch_size": 2, "batch_timeout_ms": PAIRED_WINDOW_MS},
        {"name": "hp2", "path": str(root / "hp2"), "model_version_policy": {"all": {}},
         "version_labels": {"stable": 1, "canary": 2}},
    ]}
    path = root / "models.json"
    path.write_text(json.dumps(document))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, config):
    served = Server(tmp_path_factory.mktemp("model-processes-logs"),
                    {"MODEL_CONFIG": str(config), "MODEL_PROCESSES": "1", "MODEL_POLL_SECONDS": "1",
                     "LOG_FORMAT": "json"})
    served.start(workers=2)
    yield served
    served.stop()


def workers(server: Server) -> list[psutil.Process]:
    """The live workers (a killed one, not yet reaped, is a zombie without a command line)."""
    found = []
    for child in psutil.Process(server.proc.pid).children():
        try:
            if "gunicorn" in " ".join(child.cmdline()):
                found.append(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return found


def model_process(server: Server) -> psutil.Process:
    for process in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "app.model_process.server" in process.cmdline():
                return process
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    raise LookupError("no model process")


def loaded_libraries(process: psutil.Process) -> str:
    return Path(f"/proc/{process.pid}/maps").read_text()


def post(server: Server, path: str, body: dict, **kwargs) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=60, **kwargs)


def test_rest_predictions_equal_the_models_own_output(server, exact_model):
    # 40 rows: more than a batch (32), so the model process splits them and joins the answer.
    for rows in (integer_rows(1, seed=1), integer_rows(40, seed=2)):
        answer = server.predict(rows, path="/v1/models/exact:predict")
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"predictions": exact_model(rows).numpy().tolist()}


def test_grpc_predictions_equal_the_models_own_output(server, exact_model):
    rows = integer_rows(5, seed=3)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        response = stub.Predict(predict_request("exact", rows), timeout=60)
    assert np.array_equal(scores(response), exact_model(rows).numpy())
    assert response.model_spec.version.value == 1


def test_workers_load_no_tensorflow_runtime_while_the_model_process_does(server):
    # After the gRPC test: its front door imported TF Serving's protos in the workers.
    served = workers(server)
    assert len(served) == 2
    for worker in served:
        assert TF_RUNTIME not in loaded_libraries(worker), f"worker {worker.pid} loaded TensorFlow"
    assert TF_RUNTIME in loaded_libraries(model_process(server))


def test_versions_and_labels_are_served_as_pinned(server):
    examples = {"signature_name": "regress_x_to_y", "examples": [{"x": [1.0]}, {"x": [3.0]}]}
    for path, version in (("/v1/models/hp2/versions/1:regress", "1"), ("/v1/models/hp2/labels/canary:regress", "2"),
                          ("/v1/models/hp2:regress", "2")):
        answer = post(server, path, examples)
        assert answer.status_code == 200, answer.text
        # Serialized tf.Examples in, string tensors through the hand-off: y = 0.5 x + 2.
        assert answer.json() == {"results": [2.5, 3.5]}
        assert answer.headers["X-Model-Version"] == version
    # An unbatched signature ([1], no batch dimension) is one request per call, as sent.
    assert post(server, "/v1/models/hp2/versions/1:predict", {"instances": [4.0]}).json() == {"predictions": [4.0]}


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/v1/models/hp2/versions/3:regress", {"examples": [{"x": [1.0]}]}, 404,
     "Servable not found for request: Specific(hp2, 3)"),
    ("/v1/models/hp2/labels/beta:predict", {"instances": [1.0]}, 400, "Unrecognized servable version label: beta"),
    ("/v1/models/nothing:predict", {"instances": [[1, 2, 3, 4]]}, 404, "Servable not found"),
    ("/v1/models/exact:predict", {"instances": [[1, 2, 3]]}, 400, "features"),
    ("/v1/models/exact:predict", {"instances": [[1, 2, 3, 4]], "signature_name": "nope"}, 400, "nope"),
    ("/v1/models/exact:predict", {"instances": [[1, 2, 3, 4]] * 2000}, 413, "MAX_REQUEST_ROWS"),
])
def test_bad_requests_are_refused_in_the_worker_with_the_default_modes_words(server, path, body, status, words):
    answer = post(server, path, body)
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]


def test_a_version_added_to_the_folder_reaches_every_worker(server, config):
    """The model process polls the folder; both workers learn of version 3 from it."""
    shutil.copytree(config.parent / "hp2" / "1", config.parent / "hp2" / "3")
    examples = {"signature_name": "regress_x_to_y", "examples": [{"x": [5.0]}]}
    serving: set[int] = set()

    def every_worker_serves_it() -> bool:
        answer = post(server, "/v1/models/hp2/versions/3:regress", examples, headers={"Connection": "close"})
        if answer.status_code == 200:
            assert answer.json() == {"results": [4.5]}
            serving.add(access_line(server, answer.headers["X-Request-ID"])["pid"])
        return serving == {worker.pid for worker in workers(server)}

    wait_for(every_worker_serves_it, within_s=120, what="version 3 served by both workers")
    status = requests.get(server.url + "/v1/models/hp2", timeout=30).json()["model_version_status"]
    assert [(entry["version"], entry["state"]) for entry in status] == [("3", "AVAILABLE"), ("2", "AVAILABLE"),
                                                                        ("1", "AVAILABLE")]


def test_requests_from_two_workers_share_one_predict_call(server, exact_model):
    """'paired' runs a batch once it holds two requests: each pair is one predict call, and at
    least one pair must have come through two different workers (the kernel spreads the
    connections; a worker's pid is in its access lines)."""
    calls = server.metric("model_server_batch_size_requests_count", model="paired")
    batched = server.metric("model_server_batch_size_requests_sum", model="paired")
    rows = [integer_rows(1, seed=10 + index) for index in range(2)]
    pairs = 0
    with ThreadPoolExecutor(2) as pool:
        while True:
            pairs += 1
            ids = [uuid.uuid4().hex for _ in rows]
            answers = list(pool.map(lambda row, rid: server.predict(
                row, path="/v1/models/paired:predict", headers={"X-Request-ID": rid, "Connection": "close"}),
                rows, ids))
            for row, answer in zip(rows, answers, strict=True):
                assert answer.status_code == 200, answer.text
                assert answer.json() == {"predictions": exact_model(row).numpy().tolist()}
                assert answer.headers["X-Batch-Requests"] == "2"
            if len({access_line(server, rid)["pid"] for rid in ids}) == 2 or pairs == 30:
                break
    assert len({access_line(server, rid)["pid"] for rid in ids}) == 2, "30 pairs, none over two workers"
    assert server.metric("model_server_batch_size_requests_count", model="paired") - calls == pairs
    assert server.metric("model_server_batch_size_requests_sum", model="paired") - batched == 2 * pairs


def test_a_killed_worker_leaves_the_model_process_serving(server, exact_model):
    kept = model_process(server)
    victim = workers(server)[0]
    victim.send_signal(signal.SIGKILL)
    wait_for(lambda: victim.pid not in {worker.pid for worker in workers(server)} and len(workers(server)) == 2,
             what="the killed worker replaced")
    server.wait_ready(workers=2)
    rows = integer_rows(2, seed=30)
    for _ in range(6):
        answer = server.predict(rows, path="/v1/models/exact:predict", headers={"Connection": "close"})
        assert answer.json() == {"predictions": exact_model(rows).numpy().tolist()}
    assert model_process(server).pid == kept.pid


def test_a_killed_model_process_fails_its_requests_with_503_and_a_new_one_serves_exact_answers(server, exact_model):
    rows = integer_rows(3, seed=20)
    expected = {"predictions": exact_model(rows).numpy().tolist()}
    statuses: list[int] = []
    wrong: list[str] = []
    resumed, killed, stop = threading.Event(), threading.Event(), threading.Event()

    def load() -> None:
        with requests.Session() as session:
            while not stop.is_set():
                answer = session.post(server.url + "/v1/models/exact:predict", json={"instances": rows.tolist()},
                                      timeout=60)
                statuses.append(answer.status_code)
                if answer.status_code == 200 and answer.json() != expected:
                    wrong.append(answer.text)
                if answer.status_code == 503:
                    assert answer.headers["Retry-After"]
                if killed.is_set() and answer.status_code == 200 and statuses.count(503):
                    resumed.set()

    first = model_process(server)
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(load) for _ in range(4)]
        wait_for(lambda: len(statuses) >= 20, what="20 answers under load")
        first.send_signal(signal.SIGKILL)
        killed.set()
        resumed.wait(180)
        stop.set()
        for future in running:
            future.result()
    assert resumed.is_set(), "no answer after the model process was killed"
    assert set(statuses) == {200, 503}
    assert wrong == []
    assert model_process(server).pid != first.pid
    # Every worker serves again, exact answers included. A worker reconnects on its own backoff,
    # so it may still answer "restarting" (503) after another worker served: wait for ten in a row.
    def ten_answers() -> list[dict] | None:
        answers = [server.predict(rows, path="/v1/models/exact:predict", headers={"Connection": "close"}).json()
                   for _ in range(10)]
        return answers if all("error" not in answer for answer in answers) else None

    answers = wait_for(ten_answers, within_s=60, what="ten answers in a row from every worker")
    assert answers == [expected] * 10


def test_sigterm_stops_workers_then_model_processes(server):
    processes = [model_process(server), *psutil.Process(server.proc.pid).children(recursive=True)]
    assert server.stop() == 0
    gone, alive = psutil.wait_procs(processes, timeout=30)
    assert alive == []
