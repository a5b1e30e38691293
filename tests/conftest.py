"""Shared fixtures: small real Keras models on disk, and real Gunicorn servers on loopback."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests

REPO = Path(__file__).resolve().parent.parent
# The exact command the Dockerfile runs; the deployment tests check that they agree.
SERVER_COMMAND = ("gunicorn", "-c", "gunicorn.conf.py", "wsgi:app")
FEATURES = 4
# The address TensorFlow Serving's docs send their curl lines to.
TF_SERVING_DOCS_URL = "http://localhost:8501"


def wait_for(predicate, *, within_s: float = 30, what: str = "a condition"):
    """Poll a condition where there is no event to wait on (a live server, another thread's state)."""
    deadline = time.monotonic() + within_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {within_s} s")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_exact_model(features: int = FEATURES, hidden: int = 16, outputs: int = 3, seed: int = 7):
    """A small dense model with small-integer weights.

    With integer inputs every product and sum is an integer far below 2**24, so float32
    results are exact whatever the batch size or summation order: served predictions
    can be compared to the model's own output with ==.
    """
    import keras

    rng = np.random.default_rng(seed)
    inputs = keras.Input((features,), name="features")
    hidden_layer = keras.layers.Dense(hidden, activation="relu", name="hidden")
    output_layer = keras.layers.Dense(outputs, name="scores")
    model = keras.Model(inputs, output_layer(hidden_layer(inputs)))
    hidden_layer.set_weights([rng.integers(-3, 4, (features, hidden)).astype("float32"),
                              rng.integers(-3, 4, hidden).astype("float32")])
    output_layer.set_weights([rng.integers(-3, 4, (hidden, outputs)).astype("float32"),
                              rng.integers(-3, 4, outputs).astype("float32")])
    return model


def integer_rows(count: int, features: int = FEATURES, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-9, 10, (count, features)).astype("float32")


@pytest.fixture(scope="session")
def exact_model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "exact.keras"
    build_exact_model().save(path)
    return path


@pytest.fixture(scope="session")
def exact_model(exact_model_path):
    import keras

    return keras.models.load_model(exact_model_path, compile=False)


class Server:
    """A real `gunicorn -c gunicorn.conf.py wsgi:app` on a free loopback port."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"gunicorn-{self.port}.log"
        inherited = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        # Each server gets its own metrics folder (gunicorn.conf.py makes one) unless a test names it.
        # READYZ_DETAIL: wait_ready tells the workers apart by the pid /readyz then shows.
        self.env = {**inherited, "BIND": f"127.0.0.1:{self.port}", "TF_CPP_MIN_LOG_LEVEL": "2",
                    "READYZ_DETAIL": "true", **(env or {})}
        self.args = args
        self.proc: subprocess.Popen | None = None
        # Every server its own gRPC port (unless a test names one): with SO_REUSEPORT, two
        # servers on one port would share it.
        self.env["GRPC_BIND"] = (env or {}).get("GRPC_BIND", f"127.0.0.1:{free_port()}")
        self.grpc_target = self.env["GRPC_BIND"]

    def start(self, *, workers: int = 1, ready_within_s: float = 180) -> Server:
        command = [sys.executable, "-m", *SERVER_COMMAND[:1], *SERVER_COMMAND[1:], f"--workers={workers}", *self.args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_ready(workers=workers, within_s=ready_within_s)
        return self

    def wait_ready(self, *, workers: int = 1, within_s: float = 180) -> set[int]:
        """Poll /readyz until `workers` distinct worker pids have answered ready."""
        seen: set[int] = set()
        deadline = time.monotonic() + within_s
        with requests.Session() as session:
            while len(seen) < workers:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"gunicorn exited with {self.proc.returncode}:\n{self.log()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gunicorn not ready within {within_s} s:\n{self.log()}")
                try:
                    # A fresh connection each time, so that the kernel may hand it to any worker.
                    answer = session.get(self.url + "/readyz", timeout=10, headers={"Connection": "close"})
                    if answer.status_code == 200:
                        # Without READYZ_DETAIL there is no pid: one worker only.
                        seen.add(answer.json().get("pid", 0))
                except requests.Timeout:
                    pass  # accepted into the backlog while every worker was still loading
                except requests.ConnectionError:
                    time.sleep(0.1)  # nothing listens yet: there is no event to wait on
        return seen

    def predict(self, rows, *, path: str = "/predict", **kwargs) -> requests.Response:
        body = {"instances": np.asarray(rows).tolist()}
        return requests.post(self.url + path, json=body, timeout=kwargs.pop("timeout", 60), **kwargs)

    def curl(self, documented: str, *, timeout_s: float = 60) -> str:
        """Run a curl line as TensorFlow Serving's docs write it (to localhost:8501), pointed at this server."""
        args = shlex.split(documented.replace(TF_SERVING_DOCS_URL, self.url))
        assert args[0] == "curl"
        done = subprocess.run([*args, "--silent", "--show-error"], capture_output=True, text=True,
                              timeout=timeout_s, check=True)
        return done.stdout

    def metric(self, name: str, **labels: str) -> float:
        """The sum over workers of the /metrics samples named `name` whose labels include `labels`."""
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(self.url + "/metrics", timeout=30).text
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self, *, signum: int = signal.SIGTERM, within_s: float = 60) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is not None:
            self._log.close()
            return self.proc.returncode
        self.proc.send_signal(signum)
        try:
            return self.proc.wait(within_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self._log.close()


@pytest.fixture
def start_server(tmp_path) -> Iterator:
    """start_server(env=..., workers=..., args=...) -> a running Server, stopped afterwards."""
    servers: list[Server] = []

    def start(env: dict[str, str] | None = None, *, workers: int = 1, args: tuple[str, ...] = ()) -> Server:
        server = Server(tmp_path, env, args)
        servers.append(server)
        return server.start(workers=workers)

    yield start
    for server in servers:
        server.stop()
