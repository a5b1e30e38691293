"""scripts/live_server.py, the one way the tests and the benchmark start a real server."""

from __future__ import annotations

import os
import signal
import subprocess

import psutil
import pytest

from tests.conftest import Server, wait_for


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_server_that_does_not_stop_in_time_is_killed_with_its_workers(tmp_path, exact_model_path):
    """A worker that cannot stop (here: SIGSTOPped, so it neither drains nor sees its master die)
    must not outlive the server: past `within_s` the master and every worker get SIGKILL."""
    server = Server(tmp_path, {"MODEL_PATH": str(exact_model_path)}).start()  # any model: the small one loads fast
    worker = next(process.pid for process in server.processes()[1:])
    os.kill(worker, signal.SIGSTOP)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            server.stop(within_s=1)
        assert server.proc.poll() is not None
        wait_for(lambda: gone(worker), what=f"worker {worker} gone")
    finally:
        if not gone(worker):
            os.kill(worker, signal.SIGKILL)
