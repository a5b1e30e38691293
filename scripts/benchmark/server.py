"""A configuration's server under measurement: its CPU, its batching figures, and when it is idle."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil
import requests

from scripts.live_server import LiveServer

from .configs import LOCUST_VARIABLES, SERVER_VARIABLES, Config
from .metrics import metric_snapshot
from .results import MetricSnapshot
from .runlog import log


class Server(LiveServer):
    """A configuration's `gunicorn -c gunicorn.conf.py` on a free loopback port, from the configuration's tree.

    The caller's server and Locust variables are not inherited: each configuration runs with its
    own settings only. LOG_LEVEL and ACCESS_LOG stay the server's defaults: writing the access log
    is part of a request's cost. It stays in this process group, so that whoever stops the
    benchmark as a group (a test's timeout) stops the servers too.
    """

    def __init__(self, config: Config, *, model_path: str | None, log_path: Path) -> None:
        env = dict(config.env)
        if model_path:
            env["MODEL_PATH"] = model_path
        super().__init__(log_path.parent, env, app=config.app, cwd=config.tree,
                         drop_env=SERVER_VARIABLES | LOCUST_VARIABLES, log_name=log_path.name)
        self.config = config

    def start(self, *, workers: int | None = None, ready_within_s: float = 300) -> Server:
        super().start(workers=workers or self.config.workers, ready_within_s=ready_within_s)
        return self

    def metrics(self) -> MetricSnapshot | None:
        """The batching figures of /metrics (all workers added up), or None where it cannot be read."""
        try:
            answer = requests.get(self.url + "/metrics", timeout=10)
        except (requests.ConnectionError, requests.Timeout):
            return None
        return metric_snapshot(answer.text) if answer.status_code == 200 else None

    def cpu_seconds(self) -> float:
        """User + system CPU of the master and every worker, alive now."""
        return cpu_seconds(self.processes())

    def wait_quiet(self, *, within_s: float, idle_share: float = 0.05, window_s: float = 0.5) -> float:
        """Wait until the server uses under `idle_share` of a core: the last load's backlog is done."""
        started = time.monotonic()
        before = self.cpu_seconds()
        while time.monotonic() - started < within_s:
            time.sleep(window_s)  # a CPU rate needs a window; there is no event for "idle"
            now = self.cpu_seconds()
            if now - before < idle_share * window_s:
                break
            before = now
        return time.monotonic() - started

    def stop(self, *, signum: int = signal.SIGTERM, within_s: float = 60) -> int:
        """Stop it; one that had to be killed is logged, not raised: the other configurations still run."""
        try:
            return super().stop(signum=signum, within_s=within_s)
        except subprocess.TimeoutExpired:
            log(f"{self.config.name}: killed after it did not stop within {within_s:g} s; see {self.log_path.name}")
            return -signal.SIGKILL


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU of these processes; one that has exited counts nothing."""
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total
