"""The supervisor: starts the model processes, restarts any that dies, stops them all at the end.

Gunicorn's master starts it (`start`, from on_starting) as a fresh interpreter in a session
of its own, before any worker forks, and waits until every model process has loaded and
warmed its models. Why a process between them: Gunicorn's master reaps every child it has
(waitpid(-1)), so it could not wait on model processes of its own; and in its own session,
a stop signalled to Gunicorn's whole process group (Ctrl-C, `docker stop`) does not reach
the model processes while workers still drain through them. The master stops it from
on_exit, once the workers are gone; if the master dies, the supervisor sees its pipe close.

This module imports nothing of TensorFlow, nor of the app: the master imports it.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Where gunicorn.conf.py tells its workers the model processes listen (not a setting: the master sets it).
FOLDER_VARIABLE = "MODEL_PROCESS_FOLDER"
# Between two restarts of a model process that keeps dying, so that a broken model does not spin.
RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)


def socket_path(folder: str, index: int) -> str:
    return os.path.join(folder, f"model-{index}.sock")


@dataclass
class Supervisor:
    """The master's handle on the supervisor process."""

    process: subprocess.Popen[bytes]
    folder: str

    def stop(self, *, timeout_s: float) -> None:
        """Stop every model process (they drain first) and the supervisor; kill past `timeout_s`."""
        if self.process.stdin is not None:
            self.process.stdin.close()  # the supervisor's cue, even if a signal is lost
        try:
            self.process.terminate()
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.error("model processes still running after %.0f s: killed", timeout_s)
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ChildProcessError, ProcessLookupError):
            pass  # Gunicorn's master reaped it already


def start(count: int, *, drain_s: float, environ: Mapping[str, str]) -> Supervisor:
    """Start `count` model processes and wait until all serve; SystemExit if one cannot start."""
    folder = tempfile.mkdtemp(prefix="model-server-processes-")
    ready_read, ready_write = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-m", "app.model_process.supervisor", "--count", str(count), "--folder", folder,
         "--ready-fd", str(ready_write), "--drain-s", str(drain_s)],
        stdin=subprocess.PIPE, pass_fds=[ready_write], env=dict(environ), start_new_session=True)
    os.close(ready_write)
    with os.fdopen(ready_read, "rb") as ready:
        said = ready.read()
    if said != b"ready":
        process.wait()
        raise SystemExit(f"the model processes did not start (supervisor exit code {process.returncode}); "
                         "their log lines above say why")
    return Supervisor(process, folder)


class _Keeper:
    """One model process, started again whenever it dies, until the supervisor stops."""

    def __init__(self, index: int, folder: str, drain_s: float, stopping: threading.Event) -> None:
        self.index = index
        self.path = socket_path(folder, index)
        self.drain_s = drain_s
        self.stopping = stopping
        self.process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def launch(self) -> bool:
        """Start the model process and wait until it serves; False if it died first."""
        ready_read, ready_write = os.pipe()
        with self._lock:
            if self.stopping.is_set():
                os.close(ready_read)
                os.close(ready_write)
                return False
            self.process = subprocess.Popen(
                [sys.executable, "-m", "app.model_process.server", "--socket", self.path,
                 "--ready-fd", str(ready_write), "--drain-s", str(self.drain_s)], pass_fds=[ready_write])
        os.close(ready_write)
        with os.fdopen(ready_read, "rb") as ready:
            return ready.read() == b"ready"

    def keep(self) -> None:
        failures = 0
        while self.process is not None:
            code = self.process.wait()
            _mark_dead(self.process.pid)
            if self.stopping.is_set():
                return
            log.error("model process %d (pid %d) exited with %s; starting a new one", self.index, self.process.pid,
                      code)
            if self.stopping.wait(RESTART_BACKOFF_S[min(failures, len(RESTART_BACKOFF_S) - 1)]):
                return
            failures = 0 if self.launch() else failures + 1

    def stop(self) -> None:
        with self._lock:
            if self.process is not None and self.process.poll() is None:
                self.process.terminate()


def _mark_dead(pid: int) -> None:
    # Its live gauges (rows queued) stop counting, as Gunicorn's child_exit does for a worker.
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--drain-s", type=float, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(process)d] [%(levelname)s] %(message)s")
    stopping = threading.Event()
    # The handler only writes a byte (no lock: see app/worker.py); the main thread waits for it.
    wake_read, wake_write = os.pipe()
    signal.signal(signal.SIGTERM, lambda *_: os.write(wake_write, b"x"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the master decides when model processes stop
    keepers = [_Keeper(index, args.folder, args.drain_s, stopping) for index in range(args.count)]
    if not all(keeper.launch() for keeper in keepers):
        for keeper in keepers:
            keeper.stop()
        raise SystemExit(1)
    os.write(args.ready_fd, b"ready")
    os.close(args.ready_fd)
    threads = [threading.Thread(target=keeper.keep, daemon=True) for keeper in keepers]
    for thread in threads:
        thread.start()
    # Stop on SIGTERM, or when stdin ends: the master closes it when it stops, the kernel when it dies.
    select.select([sys.stdin.fileno(), wake_read], [], [])
    stopping.set()
    for keeper in keepers:
        keeper.stop()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main()
