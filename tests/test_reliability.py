"""Reliability against live servers: poisoned inputs, overload, worker death, graceful stop, soak, security.

Every server is a real `gunicorn -c gunicorn.conf.py wsgi:app` on loopback, serving a
SavedModel whose outputs are exact in float32 (integer weights, integer inputs), so each
200 is checked value for value. Load comes from closed-loop client threads that are bounded
in count and in time; every request has a client timeout, and every outcome is recorded:
status, latency, or the kind of connection failure.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import orjson
import psutil
import pytest
import requests

from tests.conftest import REPO, integer_rows

FEATURES, OUTPUTS = 4, 3
POISON = 1000.0  # the model refuses any input value at or above this
JSON = {"Content-Type": "application/json"}


# -- the model ---------------------------------------------------------------------------

def _weights(seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(-3, 4, (FEATURES, OUTPUTS)).astype(np.float32),
            rng.integers(-3, 4, OUTPUTS).astype(np.float32))


def expected_scores(rows: np.ndarray) -> np.ndarray:
    weights, bias = _weights()
    return rows.astype(np.float32) @ weights + bias  # integers far below 2**24: exact


def save_guarded_model(path: Path, *, burn_steps: int = 0) -> Path:
    """A SavedModel: scores = x @ W + b, exact for integer x.

    Its signature asserts every input is below POISON, so one bad row makes the whole
    predict call raise (InvalidArgumentError), as a real model's check would. With
    burn_steps > 0 each call first spends CPU on a chain of matrix products, which makes
    capacity small and known; the burn is added as 0.0 * (a finite number), which leaves
    the scores exact.
    """
    import tensorflow as tf

    weights, bias = _weights()
    burn = tf.constant(np.random.default_rng(1).standard_normal((192, 192)).astype(np.float32) / 14)

    class Guarded(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, FEATURES], tf.float32, name="features")])
        def serve(self, features):
            tf.debugging.assert_less(features, POISON, message="input at or above the poison value")
            scores = tf.matmul(features, weights) + bias
            if burn_steps:
                _, spent = tf.while_loop(lambda step, m: step < burn_steps,
                                         lambda step, m: (step + 1, tf.tanh(tf.matmul(m, burn))),
                                         (tf.constant(0), burn))
                scores = scores + 0.0 * tf.reduce_sum(spent)
            return {"scores": scores}

    module = Guarded()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})
    return path


@pytest.fixture(scope="module")
def guarded_model_path(tmp_path_factory) -> Path:
    return save_guarded_model(tmp_path_factory.mktemp("guarded") / "model")


@pytest.fixture(scope="module")
def slow_model_path(tmp_path_factory) -> Path:
    return save_guarded_model(tmp_path_factory.mktemp("slow") / "model", burn_steps=BURN_STEPS)


BURN_STEPS = 40


# -- closed-loop load --------------------------------------------------------------------

BODIES = [integer_rows(1 + i % 3, seed=100 + i) for i in range(32)]
EXPECTED = [expected_scores(rows).tolist() for rows in BODIES]
ENCODED = [orjson.dumps({"instances": rows.tolist()}) for rows in BODIES]


@dataclasses.dataclass
class Outcome:
    started: float  # time.monotonic() when the request was sent
    seconds: float
    status: int | None = None  # None: no HTTP answer (see failure)
    failure: str | None = None  # "refused", "dropped" or "timeout"
    exact: bool = False
    retry_after: str | None = None


def _failure_kind(exc: requests.RequestException) -> str:
    if isinstance(exc, requests.Timeout):
        return "timeout"
    return "refused" if "Connection refused" in repr(exc) or "ConnectionRefusedError" in repr(exc) else "dropped"


class Load:
    """`clients` threads, each sending one request at a time, until stopped or out of count or time.

    Every request opens its own connection (Connection: close), so the kernel spreads
    them over the workers and a worker's death only drops the requests it holds.
    """

    def __init__(self, url: str, *, clients: int, timeout_s: tuple[float, float], max_requests_per_client: int,
                 max_seconds: float, stop_on_refused: bool = False) -> None:
        self.url = url + "/predict"
        self.clients = clients
        self.timeout_s = timeout_s
        self.max_requests_per_client = max_requests_per_client
        self.max_seconds = max_seconds
        self.stop_on_refused = stop_on_refused
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._pool = concurrent.futures.ThreadPoolExecutor(clients)
        self._done: list[concurrent.futures.Future] = []

    def __enter__(self) -> Load:
        self._ends_at = time.monotonic() + self.max_seconds
        self._done = [self._pool.submit(self._client, index) for index in range(self.clients)]
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for future in concurrent.futures.as_completed(self._done, timeout=self.max_seconds + sum(self.timeout_s)):
            future.result()
        self._pool.shutdown()
        return self.outcomes

    def _client(self, index: int) -> None:
        with requests.Session() as session:
            for count in range(self.max_requests_per_client):
                if self._stop.is_set() or time.monotonic() > self._ends_at:
                    return
                outcome = self._send(session, (index * 7 + count) % len(BODIES))
                with self._changed:
                    self.outcomes.append(outcome)
                    self._changed.notify_all()
                if outcome.failure == "refused" and self.stop_on_refused:
                    return

    def _send(self, session: requests.Session, which: int) -> Outcome:
        started = time.monotonic()
        try:
            answer = session.post(self.url, data=ENCODED[which], timeout=self.timeout_s,
                                  headers={**JSON, "Connection": "close"})
        except requests.RequestException as exc:
            return Outcome(started, time.monotonic() - started, failure=_failure_kind(exc))
        seconds = time.monotonic() - started
        exact = answer.status_code == 200 and orjson.loads(answer.content)["predictions"] == EXPECTED[which]
        return Outcome(started, seconds, answer.status_code, exact=exact, retry_after=answer.headers.get("Retry-After"))

    def wait_for(self, condition, *, within_s: float) -> None:
        """Block until condition(outcomes) holds (woken by each new outcome), at most within_s."""
        with self._changed:
            if not self._changed.wait_for(lambda: condition(self.outcomes), timeout=within_s):
                raise TimeoutError(f"load condition not met within {within_s} s; {summary(self.outcomes)}")

    def count(self, status: int) -> int:
        return sum(1 for outcome in self.outcomes if outcome.status == status)


def summary(outcomes: list[Outcome]) -> dict:
    statuses: dict = {}
    for outcome in outcomes:
        key = outcome.status if outcome.status is not None else outcome.failure
        statuses[key] = statuses.get(key, 0) + 1
    return statuses


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


# -- servers -----------------------------------------------------------------------------

def worker_pids(server) -> set[int]:
    return {child.pid for child in psutil.Process(server.proc.pid).children()}


def readyz(server) -> dict:
    return requests.get(server.url + "/readyz", timeout=10, headers={"Connection": "close"}).json()


def wait_for_ready_pid(server, pid: int, *, within_s: float = 120) -> None:
    """Poll /readyz (fresh connections, so any worker may answer) until `pid` answers ready."""
    deadline = time.monotonic() + within_s
    with requests.Session() as session:
        while True:
            assert time.monotonic() < deadline, f"worker {pid} not ready within {within_s} s"
            answer = session.get(server.url + "/readyz", timeout=10, headers={"Connection": "close"})
            if answer.status_code == 200 and answer.json()["pid"] == pid:
                return


def wait_for_new_worker(server, old: set[int], *, workers: int, within_s: float = 120) -> int:
    """The pid of the worker Gunicorn started in place of a dead one, once it answers ready."""
    deadline = time.monotonic() + within_s
    while True:
        current = worker_pids(server)
        new = current - old
        if new and len(current) == workers:
            (pid,) = new
            wait_for_ready_pid(server, pid, within_s=max(1.0, deadline - time.monotonic()))
            return pid
        assert time.monotonic() < deadline, f"no new worker within {within_s} s: {current}"
        time.sleep(0.1)  # a fork has no event a client can wait on


def metric(server, name: str, **labels: str) -> float:
    """One sample of /metrics (summed over workers), 0 if absent."""
    text = requests.get(server.url + "/metrics", timeout=10).text
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            sample, value = line.rsplit(" ", 1)
            found = ",".join(sorted(sample[len(name) + 1:-1].split(","))) if "{" in sample else ""
            if found == wanted:
                return float(value)
    return 0.0


# -- 1. a poisoned input fails alone -----------------------------------------------------

BATCH_WINDOW_MS = 2000


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory, guarded_model_path):
    from tests.conftest import Server

    running = Server(tmp_path_factory.mktemp("guarded-server"), {
        "MODEL_PATH": str(guarded_model_path),
        # A window long enough that every request sent at once joins one batch.
        "BATCH_TIMEOUT_MS": str(BATCH_WINDOW_MS),
        "MAX_BATCH_SIZE": "16",
        # Debug must stay off even when the environment asks Flask for it.
        "FLASK_DEBUG": "1",
    }).start()
    yield running
    running.stop()


@pytest.mark.parametrize("poisoned_index", [0, 5])
def test_poisoned_request_fails_alone_and_its_batch_mates_get_exact_answers(guarded_server, poisoned_index):
    server = guarded_server
    bodies = [integer_rows(1, seed=200 + i) for i in range(8)]
    bodies[poisoned_index] = bodies[poisoned_index].copy()
    bodies[poisoned_index][0, 2] = 5000.0
    batches_before = readyz(server)["models"]["default"]["batches_run"]
    calls_before = metric(server, "model_server_batch_size_requests_count", model="default")
    requests_before = metric(server, "model_server_batch_size_requests_sum", model="default")

    start = threading.Barrier(len(bodies))

    def send(rows):
        start.wait(30)
        return requests.post(server.url + "/predict", json={"instances": rows.tolist()}, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(send, bodies))

    poisoned = answers[poisoned_index]
    assert poisoned.status_code == 500
    assert poisoned.headers["Content-Type"] == "application/json"
    error = poisoned.json()["error"]
    assert "InvalidArgumentError" in error and "poison" in error
    assert "Traceback" not in poisoned.text and 'File "' not in poisoned.text

    good = [(rows, answer) for index, (rows, answer) in enumerate(zip(bodies, answers)) if index != poisoned_index]
    for rows, answer in good:
        assert answer.status_code == 200, answer.text
        assert answer.json()["predictions"] == expected_scores(rows).tolist()
    # The eight were gathered into one batch (one batch run), which failed; its halves were
    # retried, and the good ones answered from halves of 4, 2 and 1 requests: 3 predict calls.
    assert readyz(server)["models"]["default"]["batches_run"] == batches_before + 1
    assert sorted(int(answer.headers["X-Batch-Requests"]) for _, answer in good) == [1, 2, 2, 4, 4, 4, 4]
    assert metric(server, "model_server_batch_size_requests_count", model="default") == calls_before + 3
    assert metric(server, "model_server_batch_size_requests_sum", model="default") == requests_before + 7
    # And the server goes on serving.
    assert readyz(server)["ready"] is True
    rows = integer_rows(2, seed=9)
    after = requests.post(server.url + "/predict", json={"instances": rows.tolist()}, timeout=60)
    assert after.status_code == 200 and after.json()["predictions"] == expected_scores(rows).tolist()
