"""Integration: real `gunicorn -c gunicorn.conf.py wsgi:app` processes, real Keras models, real HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading

import numpy as np
import pytest
import requests

from tests.conftest import Server, integer_rows, wait_for

CLIENT_TIMEOUT_S = 60
# The batch windows of the shared server's models (their tests say why each is as long as it is).
WINDOWED_MS, BOUNDED_MS = 2000, 3000


@pytest.fixture(scope="module")
def server(tmp_path_factory, exact_model_path):
    """The exact model three times on one worker, one configuration per model, so that one server
    start serves every test here that needs a live server but the README's command:

    - "default" batches as it would by default (POST /predict), for the tests that only read;
    - "windowed" holds a batch open 2 s, so that concurrent requests share calls and requests wait
      queued when the master gets SIGTERM;
    - "bounded" takes 4 queued rows at most, and holds them 3 s.

    One worker: the tests that poll the queue read it from /readyz, which is one worker's. The
    SIGTERM test stops the server and so runs last; the ones before it leave nothing queued.
    BATCH_FILL_UNDER_LOAD is off here (its test reads it back); it changes nothing the other tests
    check (it concerns waiting to fill a batch with no window set, and theirs is set or unused).
    """
    folder = tmp_path_factory.mktemp("server")
    config = folder / "models.json"
    config.write_text(json.dumps({"models": [
        {"name": "default", "path": str(exact_model_path)},
        {"name": "windowed", "path": str(exact_model_path), "batch_timeout_ms": WINDOWED_MS},
        {"name": "bounded", "path": str(exact_model_path), "max_queue_rows": 4, "batch_timeout_ms": BOUNDED_MS,
         "max_batch_size": 64},
    ]}))
    running = Server(folder, {"MODEL_CONFIG": str(config), "BATCH_FILL_UNDER_LOAD": "false"}).start()
    yield running
    running.stop()


def _post_all(server, bodies, path: str) -> list[requests.Response]:
    """Send every body at once from its own thread (and connection)."""
    start = threading.Barrier(len(bodies))

    def send(rows):
        start.wait(CLIENT_TIMEOUT_S)
        return server.predict(rows, path=path, timeout=CLIENT_TIMEOUT_S)

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(send, bodies))


def _status(server) -> dict:
    return requests.get(server.url + "/readyz", timeout=CLIENT_TIMEOUT_S).json()


def _wait_queued(server, model: str, rows: int) -> None:
    """Poll the (single) worker until exactly `rows` rows of `model` wait in its queue."""
    with requests.Session() as session:
        wait_for(lambda: session.get(server.url + "/readyz", timeout=10).json()["models"][model]["queued_rows"]
                 == rows, within_s=60, what=f"{rows} rows of {model} queued")


def test_concurrent_requests_get_the_models_own_output_in_fewer_calls(server, exact_model):
    # A batch window makes batch formation certain; the default (0) batches too, but only
    # as much as requests happen to overlap.
    before = _status(server)["models"]["windowed"]["batches_run"]
    bodies = [integer_rows(1 + i % 3, seed=i) for i in range(32)]
    answers = _post_all(server, bodies, "/v1/models/windowed:predict")
    for rows, answer in zip(bodies, answers, strict=True):
        assert answer.status_code == 200, answer.text
        expected = exact_model(rows).numpy()
        np.testing.assert_array_equal(np.asarray(answer.json()["predictions"], dtype=np.float32), expected)
    batch_requests = [int(answer.headers["X-Batch-Requests"]) for answer in answers]
    batches_run = _status(server)["models"]["windowed"]["batches_run"] - before
    assert max(batch_requests) > 1
    assert batches_run < len(bodies)


def test_columnar_and_row_formats_agree(server, exact_model):
    rows = integer_rows(5, seed=3)
    columnar = requests.post(server.url + "/predict", json={"inputs": rows.tolist()}, timeout=CLIENT_TIMEOUT_S)
    tf_serving = requests.post(server.url + "/v1/models/default:predict", json={"instances": rows.tolist()},
                               timeout=CLIENT_TIMEOUT_S)
    assert columnar.status_code == tf_serving.status_code == 200
    expected = exact_model(rows).numpy().tolist()
    assert columnar.json() == {"outputs": expected}
    assert tf_serving.json() == {"predictions": expected}


def test_readme_command_serves_the_default_model_on_two_workers(start_server):
    from app.core.models import build_default_model

    server = start_server(args=("--threads=20",), workers=2)
    status = _status(server)
    cores = len(os.sched_getaffinity(0))
    if server.model_processes:
        # The workers run no TensorFlow; the model processes size their own thread pools.
        assert status["tensorflow"] == {"model_processes": server.model_processes, "model_process_gpus": []}
    else:
        assert status["tensorflow"]["intra_op_threads"] == max(1, cores // 2)
    rows = np.array([[0.1, 0.2, 0.3, 0.4], [1.0, -1.0, 0.5, 2.0]], dtype=np.float32)
    answer = server.predict(rows)
    assert answer.status_code == 200, answer.text
    served = np.asarray(answer.json()["predictions"], dtype=np.float32)
    assert served.shape == (2, 3)
    # The default model is rebuilt here from the same seeds. The server's worker uses fewer
    # TensorFlow threads than this process, and a 4096-wide float sum may round differently
    # when split differently; the weights themselves are identical.
    np.testing.assert_allclose(served, build_default_model()(rows).numpy(), rtol=1e-5, atol=1e-7)


def test_batch_fill_under_load_setting_reaches_the_batcher(server):
    assert _status(server)["models"]["default"]["fill_under_load"] is False


def test_master_never_imports_tensorflow(server):
    with open(f"/proc/{server.proc.pid}/maps") as maps:
        master_libraries = maps.read()
    worker_pid = _status(server)["pid"]
    with open(f"/proc/{worker_pid}/maps") as maps:
        worker_libraries = maps.read()
    if server.model_processes:
        # The models run in the model process alone: neither the master nor a worker maps TensorFlow.
        for model_process in server.model_process_pids():
            with open(f"/proc/{model_process}/maps") as maps:
                assert "tensorflow" in maps.read()
        assert "tensorflow" not in worker_libraries
    else:
        assert "tensorflow" in worker_libraries
    assert "tensorflow" not in master_libraries


def test_full_queue_answers_503_at_once_and_queued_requests_still_succeed(server, exact_model):
    path = "/v1/models/bounded:predict"
    bodies = [integer_rows(2, seed=1), integer_rows(2, seed=2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(server.predict, rows, path=path, timeout=CLIENT_TIMEOUT_S) for rows in bodies]
        _wait_queued(server, "bounded", 4)
        rejected = server.predict(integer_rows(1, seed=3), path=path)
        assert rejected.status_code == 503
        assert rejected.headers["Retry-After"] == "1"
        assert "overloaded" in rejected.json()["error"]
        for rows, future in zip(bodies, pending, strict=True):
            answer = future.result(CLIENT_TIMEOUT_S)
            assert answer.status_code == 200
            np.testing.assert_array_equal(np.asarray(answer.json()["predictions"], np.float32),
                                          exact_model(rows).numpy())


def test_request_past_its_deadline_answers_504_and_never_runs(in_process_app, exact_model_path):
    # In-process: the deadline and the batch that leaves the request out are the app's, not
    # Gunicorn's (tests/test_grpc.py and tests/test_v2.py check deadlines with model processes).
    # The batch window (1 s) outlasts the deadline (300 ms): the request expires while its
    # batch forms, and must be left out when the batch goes.
    client = in_process_app(model_path=str(exact_model_path), request_timeout_ms=300, batch_timeout_ms=1000,
                            max_batch_size=64).test_client()

    def model() -> dict:
        return client.get("/readyz").json["models"]["default"]

    answer = client.post("/predict", json={"instances": integer_rows(1).tolist()})
    assert answer.status_code == 504
    assert "300 ms" in answer.json["error"]
    wait_for(lambda: model()["queued_rows"] == 0, what="the expired request gone from the queue")
    assert model()["batches_run"] == 0


def test_sigterm_answers_every_accepted_request(server, exact_model):
    # Requests wait in the queue (batch window 2 s) when the master gets SIGTERM: each must
    # still be answered, from the model, before the worker exits. This stops the shared server.
    bodies = [integer_rows(1, seed=i) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        pending = [pool.submit(server.predict, rows, path="/v1/models/windowed:predict", timeout=CLIENT_TIMEOUT_S)
                   for rows in bodies]
        _wait_queued(server, "windowed", len(bodies))
        server.send(signal.SIGTERM)
        answers = [future.result(CLIENT_TIMEOUT_S) for future in pending]
    for rows, answer in zip(bodies, answers, strict=True):
        assert answer.status_code == 200, answer.text
        np.testing.assert_array_equal(np.asarray(answer.json()["predictions"], np.float32), exact_model(rows).numpy())
    assert server.proc.wait(CLIENT_TIMEOUT_S) == 0
    with pytest.raises(requests.ConnectionError):
        server.predict(integer_rows(1), timeout=5)


# The server's own command, refused at start-up (in either mode: the MODEL_PROCESSES pass runs it too).
@pytest.mark.server
@pytest.mark.parametrize("variable,value,message", [
    ("MAX_BATCH_SIZE", "lots", "MAX_BATCH_SIZE='lots' is not valid: expected a whole number of 1 or more"),
    ("WORKERS", "0", "WORKERS='0' is not valid: expected a whole number of 1 or more"),
    ("BATCH_TIMEOUT_MS", "40000", "BATCH_TIMEOUT_MS=40000 must stay below GRACEFUL_TIMEOUT=30 s"),
    ("MODEL_CONFIG", "/nonexistent.json", "MODEL_CONFIG='/nonexistent.json': cannot read it as JSON"),
])
def test_bad_setting_stops_start_up_naming_variable_and_value(variable, value, message):
    import subprocess
    import sys

    from tests.conftest import REPO, SERVER_COMMAND

    env = {**os.environ, variable: value, "BIND": "127.0.0.1:0"}
    done = subprocess.run([sys.executable, "-m", *SERVER_COMMAND], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr
