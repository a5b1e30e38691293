"""A real `gunicorn -c gunicorn.conf.py wsgi:app` on a free loopback port: start, wait until ready, stop.

The tests (tests/conftest.py) and the benchmark (scripts/benchmark/) both start servers with it,
so that what the tests check is the server the benchmark measures.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import IO

import psutil
import requests

REPO = Path(__file__).resolve().parent.parent
# The exact command the Dockerfile runs; the deployment tests check that they agree.
SERVER_COMMAND = ("gunicorn", "-c", "gunicorn.conf.py", "wsgi:app")
# Each server gets its own metrics folder (gunicorn.conf.py makes one) unless its caller names it.
DROPPED_BY_DEFAULT = frozenset({"PROMETHEUS_MULTIPROC_DIR"})


def free_ports(count: int) -> list[int]:
    """Distinct free ports, each held bound until all are: the kernel may hand a released one out again."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


class LiveServer:
    """One Gunicorn master and its workers, in this process's group, its output in `log_dir`/`log_name`.

    `env` is laid over this process's environment less `drop_env`. Every server gets its own gRPC port
    unless `env` names one: with SO_REUSEPORT, two servers on one port would share it. `python` is
    the interpreter (another venv's: tests/test_jax.py). A subclass whose processes must be signalled
    together sets `own_group`: the server then leads a process group (and session) of its own."""

    own_group = False

    def __init__(self, log_dir: Path, env: Mapping[str, str] | None = None, *, args: Sequence[str] = (),
                 app: Sequence[str] = SERVER_COMMAND[-1:], cwd: Path = REPO,
                 drop_env: Collection[str] = DROPPED_BY_DEFAULT, log_name: str | None = None,
                 python: str = sys.executable) -> None:
        self.port, grpc_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / (log_name or f"gunicorn-{self.port}.log")
        inherited = {key: value for key, value in os.environ.items() if key not in drop_env}
        # READYZ_DETAIL: wait_ready tells the workers apart by the pid /readyz then shows.
        self.env = {**inherited, "BIND": f"127.0.0.1:{self.port}", "GRPC_BIND": f"127.0.0.1:{grpc_port}",
                    "TF_CPP_MIN_LOG_LEVEL": "2", "READYZ_DETAIL": "true", **(env or {})}
        self.grpc_target = self.env["GRPC_BIND"]
        self.args = tuple(args)
        self.app = tuple(app)
        self.cwd = cwd
        self.python = python
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    def command(self, *, workers: int) -> list[str]:
        return [self.python, "-m", *SERVER_COMMAND[:-1], *self.app, f"--workers={workers}", *self.args]

    def start(self, *, workers: int = 1, ready_within_s: float = 180) -> LiveServer:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(workers=workers), cwd=self.cwd, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=self.own_group)
        self.wait_ready(workers=workers, within_s=ready_within_s)
        return self

    def wait_ready(self, *, workers: int = 1, within_s: float = 180) -> set[int]:
        """Poll /readyz until `workers` distinct worker pids have answered ready."""
        assert self.proc is not None, "start() first"
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
                        # Without READYZ_DETAIL (or in an older tree) there is no pid: one worker only.
                        seen.add(answer.json().get("pid", 0))
                except requests.Timeout:
                    pass  # accepted into the backlog while every worker was still loading
                except requests.ConnectionError:
                    time.sleep(0.1)  # nothing listens yet: there is no event to wait on
        return seen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send(self, signum: int) -> None:
        assert self.proc is not None, "start() first"
        self.proc.send_signal(signum)

    def processes(self) -> list[psutil.Process]:
        """The master and every worker, alive now."""
        if self.proc is None:
            return []
        try:
            master = psutil.Process(self.proc.pid)
            return [master, *master.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, *, signum: int = signal.SIGTERM, within_s: float = 60) -> int:
        """Send `signum` (SIGTERM: Gunicorn drains and stops its workers) and wait for the master; past
        `within_s`, SIGKILL to the master and every worker, then TimeoutExpired."""
        if self.proc is None:
            return 0
        try:
            if self.proc.poll() is not None:
                return self.proc.returncode
            processes = self.processes()
            self.proc.send_signal(signum)
            try:
                return self.proc.wait(within_s)
            except subprocess.TimeoutExpired:
                for process in processes:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
                self.proc.wait()
                raise
        finally:
            if self._log is not None:
                self._log.close()
