"""Live workers whose batch thread dies, and the app's own drain when Gunicorn does not wait.

Real `gunicorn` processes on loopback serving the exact model (integer weights: every 200
is compared with the model's own output, value for value).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import signal
import time

import numpy as np
import psutil
import pytest
import requests

from tests.conftest import integer_rows, wait_for

TEST_HOOKS = ("-c", "tests/gunicorn_test_hooks.py")
CLIENT_TIMEOUT_S = 60  # far above REQUEST_TIMEOUT_MS: a request the server forgot shows as a timeout


def readyz(server) -> requests.Response:
    return requests.get(server.url + "/readyz", timeout=CLIENT_TIMEOUT_S)


def exact(answer: requests.Response, rows: np.ndarray, model) -> bool:
    return answer.status_code == 200 and answer.json()["predictions"] == model(rows).numpy().tolist()


# A batch of this many rows goes at once; fewer wait for the window (BATCH_TIMEOUT_MS) below.
FULL_BATCH = 8


@pytest.fixture(scope="module")
def _windowed_servers() -> list:
    servers: list = []
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def windowed_server(_windowed_servers, tmp_path_factory, exact_model_path):
    """One worker with a 20 s batch window and the test hooks: one server for the batch thread's
    death and the quick shutdown, in that order. The death ends with a fresh replacement worker,
    serving as the first did; the quick shutdown stops the server, last. A test that finds it
    stopped (run alone, or in another order) starts another."""
    from tests.conftest import Server

    if not _windowed_servers or _windowed_servers[-1].proc.poll() is not None:
        server = Server(tmp_path_factory.mktemp("windowed-server"), {
            "MODEL_PATH": str(exact_model_path), "BATCH_TIMEOUT_MS": "20000", "GRACEFUL_TIMEOUT": "60",
            "REQUEST_TIMEOUT_MS": "10000", "MAX_BATCH_SIZE": str(FULL_BATCH), "HOLD_REPLACEMENT": "1"},
            args=TEST_HOOKS)
        _windowed_servers.append(server.start())
    return _windowed_servers[-1]


def test_worker_whose_batch_thread_dies_answers_everyone_and_is_replaced(windowed_server, exact_model):
    server = windowed_server
    first_pid = readyz(server).json()["pid"]
    # Full batches wherever the worker serves: they wait for no window.
    rows = integer_rows(FULL_BATCH)
    assert exact(server.predict(rows), rows, exact_model)

    psutil.Process(first_pid).send_signal(signal.SIGUSR2)
    # The next request wakes the batch thread, which dies at once: every request it holds,
    # queued or arriving, gets an answer, none waits for its deadline.
    bodies = [integer_rows(1 + i % 3, seed=i) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        started = time.monotonic()
        answers = list(pool.map(lambda rows: server.predict(rows, timeout=CLIENT_TIMEOUT_S), bodies))
        took_s = time.monotonic() - started
    statuses = [answer.status_code for answer in answers]
    assert set(statuses) <= {200, 503}, statuses
    for answer, rows in zip(answers, bodies, strict=True):
        if answer.status_code == 200:  # served before the thread woke to its death
            assert exact(answer, rows, exact_model)
        else:
            assert "batch thread died" in answer.json()["error"]
            assert answer.headers["Retry-After"] == "1"
    refused = server.predict(integer_rows(1))  # the worker is held broken: later requests too
    assert refused.status_code == 503 and "batch thread died" in refused.json()["error"]
    print(f"6 requests around the thread's death: statuses {statuses}, all answered within {took_s:.2f} s")

    # Held (HOLD_REPLACEMENT) before it goes: readiness and liveness both say so.
    broken_ready = readyz(server)
    assert broken_ready.status_code == 503
    assert broken_ready.json()["pid"] == first_pid and broken_ready.json()["ready"] is False
    assert broken_ready.json()["models"]["default"]["alive"] is False
    broken_live = requests.get(server.url + "/healthz", timeout=CLIENT_TIMEOUT_S)
    assert broken_live.status_code == 503 and "default" in broken_live.json()["error"]

    # Let the worker's own request to be replaced go: it stops, and Gunicorn starts a fresh one.
    let_go_at = time.monotonic()
    psutil.Process(first_pid).send_signal(signal.SIGRTMIN)
    psutil.Process(first_pid).wait(CLIENT_TIMEOUT_S)  # the worker exits (not our child: no status)
    new_pids = server.wait_ready(workers=1, within_s=120)
    print(f"replacement ready {time.monotonic() - let_go_at:.1f} s after the broken worker was let go")
    assert first_pid not in new_pids
    assert requests.get(server.url + "/healthz", timeout=CLIENT_TIMEOUT_S).status_code == 200
    for seed in range(5):
        rows = integer_rows(FULL_BATCH, seed=100 + seed)
        assert exact(server.predict(rows), rows, exact_model)
    assert "batch thread of model 'default' died" in server.log()


def test_quick_shutdown_answers_a_request_held_in_its_batch_window(windowed_server, exact_model):
    """SIGINT to the master is Gunicorn's quick shutdown: each worker gets SIGQUIT and exits at
    once, without the graceful wait for open connections. Only the app's own drain, in
    worker_exit, can answer the request that sits in its batch window: closing the batcher
    runs the forming batch at once. Without that drain the request would wait for its window
    (20 s), past its deadline (10 s), and get 504.
    """
    server = windowed_server
    rows = integer_rows(2, seed=3)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = held_in_window(pool, server, rows)
        stopped_at = time.monotonic()
        server.send(signal.SIGINT)
        answer = waiting.result(CLIENT_TIMEOUT_S)
    answered_s = time.monotonic() - stopped_at
    assert exact(answer, rows, exact_model), (answer.status_code, answer.text)
    assert answer.headers["X-Batch-Requests"] == "1"
    assert server.proc.wait(CLIENT_TIMEOUT_S) == 0
    print(f"quick shutdown: the request held in its window answered {answered_s:.2f} s after SIGINT")


def held_in_window(pool: concurrent.futures.Executor, server, rows) -> concurrent.futures.Future:
    """A predict of `rows`, sent from `pool` and waiting in its batch window (the queue holds its rows)."""
    waiting = pool.submit(server.predict, rows, timeout=CLIENT_TIMEOUT_S)
    wait_for(lambda: waiting.done() or server.metric("model_server_queue_rows", model="default") == len(rows),
             within_s=CLIENT_TIMEOUT_S, what="the request held in its batch window")
    assert not waiting.done(), waiting.result()
    return waiting


def test_sigterm_answers_at_once_a_request_held_in_its_window_and_one_read_after_the_stop(
        start_server, exact_model_path, exact_model):
    """SIGTERM to the master is Gunicorn's graceful stop: gthread waits for its open connections
    before worker_exit drains the batchers, so a request held in its batch window would wait out
    the whole window (5 minutes here, far past the client's timeout). The worker's when_stopping
    flush runs the forming batch as soon as the stop arrives.

    A stopping worker still answers the connections it has. A request whose body was still
    arriving when SIGTERM came reaches its batcher after the stop: it runs at once too, not
    after its window. The held request is the witness: once it is answered, the stop's flush
    has run. Both cases need a stop of their own server, and the first is all in the held
    request, so one server shows both.
    """
    # Every body here is "large" and holds one of two slots while it is read and answered: /readyz
    # counts them, which shows when the worker is inside the late request, reading its body.
    server = start_server({"MODEL_PATH": str(exact_model_path), "BATCH_TIMEOUT_MS": "300000",
                           "GRACEFUL_TIMEOUT": "600", "REQUEST_TIMEOUT_MS": "600000", "MAX_BATCH_SIZE": "8",
                           "LARGE_BODY_BYTES": "16", "LARGE_BODY_SLOTS": "2"})
    held_rows, late_rows = integer_rows(2, seed=5), integer_rows(3, seed=6)
    body = json.dumps({"instances": late_rows.tolist()}).encode()
    late = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    with concurrent.futures.ThreadPoolExecutor(1) as pool, contextlib.closing(late):
        held = held_in_window(pool, server, held_rows)
        assert readyz(server).json()["large_bodies_in_flight"] == 1
        # The late request's head and one byte of its body: the worker takes its slot, then waits for the rest.
        late.putrequest("POST", "/predict")
        late.putheader("Content-Type", "application/json")
        late.putheader("Content-Length", str(len(body)))
        late.endheaders(body[:1])
        wait_for(lambda: readyz(server).json()["large_bodies_in_flight"] == 2,
                 within_s=CLIENT_TIMEOUT_S, what="the worker reading the late request's body")
        stopped_at = time.monotonic()
        server.send(signal.SIGTERM)
        held_answer = held.result(CLIENT_TIMEOUT_S)
        answered_s = time.monotonic() - stopped_at
        assert exact(held_answer, held_rows, exact_model), (held_answer.status_code, held_answer.text)
        assert held_answer.headers["X-Batch-Requests"] == "1"
        late.send(body[1:])
        answer = late.getresponse()
        assert answer.status == 200, answer.read()
        assert json.loads(answer.read())["predictions"] == exact_model(late_rows).numpy().tolist()
        assert answer.getheader("X-Batch-Requests") == "1"
    assert server.proc.wait(CLIENT_TIMEOUT_S) == 0
    print(f"SIGTERM: the request held in its 300 s window answered {answered_s:.2f} s after the stop")
