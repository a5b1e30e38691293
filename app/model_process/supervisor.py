"""The supervisor: starts the model processes, restarts any that dies, stops them all at the end.

Gunicorn's master starts it (`start`, from on_starting) as a fresh interpreter in a session
of its own, before any worker forks, and waits until every model process has loaded and
warmed its models. Why a process between them: Gunicorn's master reaps every child it has
(waitpid(-1)), so it could not wait on model processes of its own; and in its own session,
a stop signalled to Gunicorn's whole process group (Ctrl-C, `docker stop`) does not reach
the model processes while workers still drain through them. The master stops it from
on_exit, once the workers are gone; if the master dies, the supervisor sees its pipe close.

GPUs: the supervisor asks the CUDA driver how many it shows (`gpu_placements`) and starts each
model process with CUDA_VISIBLE_DEVICES naming one of them, so that TensorFlow in it sees that
GPU alone and GPU_MEMORY_LIMIT_MB or GPU_MEMORY_FRACTION caps it there. Without a GPU each
model process takes its share of the CPUs (runtime.configure).

This module imports nothing of TensorFlow (nor does app.ops.runtime at import): the master imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from app.ops import runtime
from app.ops.settings import Settings

log = logging.getLogger(__name__)

# Where gunicorn.conf.py tells its workers the model processes listen (not a setting: the master sets it).
FOLDER_VARIABLE = "MODEL_PROCESS_FOLDER"
# Between two restarts of a model process that keeps dying, so that a broken model does not spin.
RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)


def socket_path(folder: str, index: int) -> str:
    return os.path.join(folder, f"model-{index}.sock")


class PlacementError(ValueError):
    """MODEL_PROCESSES does not fit the GPUs there are: start-up stops with this message."""


def gpu_placements(count: int, gpus: int, environ: Mapping[str, str], *,
                   memory_fraction: float = 0.0) -> list[str]:
    """The CUDA_VISIBLE_DEVICES of each of `count` model processes; [] where no GPU is visible.

    `gpus`: how many the CUDA driver shows (CUDA_VISIBLE_DEVICES applied). The i-th of them is
    the i-th entry of CUDA_VISIBLE_DEVICES where it is set (an index, a GPU-... or MIG-... UUID,
    passed on as written), else index i (in the order CUDA_DEVICE_ORDER gives, which the model
    processes inherit). Model process i holds GPU i mod `gpus`: `count` must be a multiple of
    `gpus`, so that every GPU holds as many; GPU_MEMORY_FRACTION caps each of them.
    """
    if gpus == 0:
        return []
    named = environ.get("CUDA_VISIBLE_DEVICES")
    devices = [entry.strip() for entry in named.split(",")][:gpus] if named is not None else \
        [str(index) for index in range(gpus)]
    shown = f" (CUDA_VISIBLE_DEVICES={named})" if named is not None else ""
    if count % len(devices):
        raise PlacementError(
            f"MODEL_PROCESSES={count} with {len(devices)} visible GPUs{shown}: set it to a multiple of "
            f"{len(devices)} ({len(devices)} for one model process per GPU), or name the GPUs to use in "
            "CUDA_VISIBLE_DEVICES")
    per_gpu = count // len(devices)
    if memory_fraction * per_gpu > 1:
        raise PlacementError(
            f"GPU_MEMORY_FRACTION={memory_fraction:g} for each of the {per_gpu} model processes on a GPU "
            f"(MODEL_PROCESSES={count}, {len(devices)} visible GPUs{shown}) is more than the GPU: "
            f"at most {1 / per_gpu:.4g}")
    return [devices[index % len(devices)] for index in range(count)]


@dataclass
class Supervisor:
    """The master's handle on the supervisor process."""

    process: subprocess.Popen[bytes]
    folder: str
    gpus: list[str] = field(default_factory=list)  # each model process's CUDA_VISIBLE_DEVICES; []: no GPU

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
    """Start `count` model processes and wait until all serve; SystemExit if one cannot start,
    or if `count` does not fit the visible GPUs (gpu_placements' message)."""
    folder = tempfile.mkdtemp(prefix="model-server-processes-")
    ready_read, ready_write = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-m", "app.model_process.supervisor", "--count", str(count), "--folder", folder,
         "--ready-fd", str(ready_write), "--drain-s", str(drain_s)],
        stdin=subprocess.PIPE, pass_fds=[ready_write], env=dict(environ), start_new_session=True)
    os.close(ready_write)
    with os.fdopen(ready_read, "rb") as ready:
        said = ready.read()
    try:
        answer = json.loads(said)
    except ValueError:
        answer = {}
    if "gpus" not in answer:
        process.wait()
        raise SystemExit(answer.get("error") or
                         f"the model processes did not start (supervisor exit code {process.returncode}); "
                         "their log lines above say why")
    return Supervisor(process, folder, answer["gpus"])


class _Keeper:
    """One model process, started again whenever it dies, until the supervisor stops."""

    def __init__(self, index: int, folder: str, drain_s: float, stopping: threading.Event,
                 environ: Mapping[str, str] | None = None) -> None:
        self.index = index
        self.environ = None if environ is None else dict(environ)  # None: the supervisor's own
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
                 "--ready-fd", str(ready_write), "--drain-s", str(self.drain_s)], pass_fds=[ready_write],
                env=self.environ)
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


def place(count: int) -> list[str]:
    """Each model process's GPU (gpu_placements), and its memory cap logged as it will apply."""
    settings = Settings.from_env()
    visible = runtime.cuda_device_count()
    gpus = gpu_placements(count, visible, os.environ, memory_fraction=settings.gpu_memory_fraction)
    if not gpus:
        log.info("no GPU visible: each of the %d model processes takes a share of the CPUs", count)
    for index, device in enumerate(gpus):
        # The model process sees this GPU alone, as its GPU 0: the cap it sets there is this one.
        limit = runtime.gpu_memory_limit_mb(settings, index % visible, total_bytes=runtime.cuda_total_memory)
        log.info("model process %d: GPU %s of %d (CUDA_VISIBLE_DEVICES=%s), %s", index, index % visible, visible,
                 device, f"memory capped at {limit} MiB" if limit else "memory grows as needed")
    return gpus


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
    try:
        gpus = place(args.count)
    except (PlacementError, runtime.GpuMemoryError) as exc:
        # The master stops with this message (SystemExit), as for its own refusals.
        os.write(args.ready_fd, json.dumps({"error": str(exc)}).encode())
        raise SystemExit(1) from None
    keepers = [_Keeper(index, args.folder, args.drain_s, stopping,
                       {**os.environ, "CUDA_VISIBLE_DEVICES": gpus[index]} if gpus else None)
               for index in range(args.count)]
    if not all(keeper.launch() for keeper in keepers):
        for keeper in keepers:
            keeper.stop()
        raise SystemExit(1)
    os.write(args.ready_fd, json.dumps({"gpus": gpus}).encode())
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
