"""The model config a server's workers share: a reload applied by one worker is applied by all.

TF Serving is one process: once HandleReloadConfigRequest answers OK, every request sees the
new config. Here each Gunicorn worker holds its own models, so the worker that answers the
call makes the config the server's:

- The master makes a run folder per server (gunicorn.conf.py's on_starting) and names it to
  the workers in RUN_DIR_ENV; on_exit removes it.
- Each worker listens on a Unix socket there, `<pid>.sock`. It is named only once it listens,
  and before the worker reads the config it starts with: a reload either reaches the worker
  or wrote the config before the worker read it.
- The answering worker takes the folder's lock (one reload at a time, as TF Serving's config
  mutex), writes the config with the next generation number (`config.json`, replaced
  atomically), connects to every sibling's socket, applies the config itself, and waits,
  within the call's deadline, for each sibling to answer what it applied and what failed.
  Connecting is the wake-up: a sibling applies the newest generation and answers on the
  same connection. A sibling that has exited refuses the connection or drops it: it serves
  nothing, and the worker Gunicorn starts in its place reads the newest generation.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import selectors
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

from app.core import errors

log = logging.getLogger(__name__)

RUN_DIR_ENV = "MODEL_SERVER_RUN_DIR"
_STATE = "config.json"
_LOCK = "reload.lock"
_SOCKET = ".sock"
# AF_UNIX paths are at most 107 bytes on Linux.
_MAX_SOCKET_PATH = 107


@dataclasses.dataclass(frozen=True)
class Generation:
    """A model config document, as published by the reload that made it, and its number."""

    number: int
    document: dict[str, Any]


# What applying a generation reports: the number applied, and what failed ("" if nothing).
Apply = Callable[[Generation], tuple[int, str]]


def prepare_run_dir(environ: MutableMapping[str, str]) -> str:
    """The master's part (on_starting): a fresh folder, named to the workers it will fork."""
    folder = tempfile.mkdtemp(prefix="model-server-run-")
    if len(os.path.join(folder, f"{2**32}{_SOCKET}")) > _MAX_SOCKET_PATH:
        os.rmdir(folder)
        raise SystemExit(f"TMPDIR={tempfile.gettempdir()!r} is too long a path for the workers' sockets")
    environ[RUN_DIR_ENV] = folder
    return folder


def remove_run_dir(environ: MutableMapping[str, str], folder: str | None) -> None:
    """on_exit's part: the folder and its name go; a later server in this process makes its own."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        if environ.get(RUN_DIR_ENV) == folder:
            del environ[RUN_DIR_ENV]


def join(environ: MutableMapping[str, str] = os.environ) -> SharedConfig | None:
    """This worker's end of the run folder; None outside Gunicorn (one process: nothing to share)."""
    folder = environ.get(RUN_DIR_ENV)
    if not folder:
        return None
    if not os.path.isdir(folder):
        log.warning("%s names no folder: a reload reaches this process only", RUN_DIR_ENV)
        return None
    return SharedConfig(Path(folder))


class SharedConfig:
    def __init__(self, folder: Path, *, worker: int | None = None) -> None:
        self.folder = folder
        self.worker = worker or os.getpid()
        self._path = folder / f"{self.worker}{_SOCKET}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound under a name no sibling looks for, then renamed once it listens: a sibling never
        # finds a socket that refuses it while it is alive.
        binding = folder / f"{self.worker}.binding"
        with contextlib.suppress(FileNotFoundError):
            binding.unlink()  # left by an earlier process of the same pid
        self._listener.bind(str(binding))
        self._listener.listen(8)
        os.replace(binding, self._path)
        self._thread: threading.Thread | None = None

    def latest(self) -> Generation | None:
        """The newest generation a reload published; None before the first."""
        try:
            state = json.loads((self.folder / _STATE).read_bytes())
        except FileNotFoundError:
            return None
        return Generation(state["generation"], state["document"])

    def listen(self, apply: Apply) -> None:
        """Answer siblings' reloads from now on (once the worker's models are loaded)."""
        self._thread = threading.Thread(target=self._serve, args=(apply,), name="shared-config", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Leave: reloads no longer wait for this worker (it is stopping)."""
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() below
        self._listener.close()

    def _serve(self, apply: Apply) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            with connection:
                latest = self.latest()
                if latest is None:
                    continue
                try:
                    number, error = apply(latest)
                except Exception as exc:  # the listener must live on: the reload gets the error
                    log.exception("model config generation %d not applied", latest.number)
                    number, error = latest.number, f"{type(exc).__name__}: {exc}"
                with contextlib.suppress(OSError):  # the reload gave up: nobody reads the answer
                    connection.sendall(json.dumps({"generation": number, "error": error}).encode())

    def publish(self, document: dict[str, Any] | Callable[[Generation | None], dict[str, Any]], apply: Apply, *,
                timeout_s: float | None) -> None:
        """Make `document` the server's config: this worker and every live sibling apply it. A
        callable makes it from the newest generation, under the lock (LiveConfig.edit).

        Returns once all did. Raises BadRequest with what failed here (the siblings applied
        the same config), DeadlineExceeded naming the siblings that had not answered within
        `timeout_s` (None: no limit), ServingError naming a sibling where it failed.
        """
        if timeout_s is not None and timeout_s >= threading.TIMEOUT_MAX:
            timeout_s = None  # gRPC reports a call without a deadline as one 2**63 ns away: no limit
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with _exclusive(self.folder / _LOCK, timeout_s):
            latest = self.latest()
            if callable(document):
                document = document(latest)
            generation = Generation((latest.number if latest else 0) + 1, document)
            _write_atomically(self.folder / _STATE, {"generation": generation.number, "document": document})
            siblings = self._wake(deadline)
            try:
                _, error = apply(generation)  # while the siblings apply it too
                answers, silent = _collect(siblings, deadline)
            finally:
                for connection in siblings:
                    connection.close()
        log.info("model config generation %d published; workers %s answered, %s did not", generation.number,
                 sorted(answers) or "none", silent or "none")
        if error:
            raise errors.BadRequest(error)
        if silent:
            raise errors.DeadlineExceeded(f"the model config was applied by this worker, but worker(s) {silent} "
                                          "had not reported it applied within the call's deadline; they go on")
        failed = [f"worker {worker}: {answer['error']}" for worker, answer in sorted(answers.items())
                  if answer["error"]]
        if failed:
            raise errors.ServingError("the model config was applied by this worker, but not by "
                                      + "; ".join(failed))

    def _wake(self, deadline: float | None) -> dict[socket.socket, int]:
        """A connection to each live sibling; connecting asks it to apply the newest generation."""
        siblings = {}
        for path in self.folder.glob(f"*{_SOCKET}"):
            worker = int(path.name.removesuffix(_SOCKET))
            if worker == self.worker:
                continue
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connection.settimeout(_remaining(deadline))
                connection.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                connection.close()
                # Named only while its worker listens: refused means the worker was killed.
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            except OSError:
                connection.close()
                raise
            siblings[connection] = worker
        return siblings


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _collect(siblings: dict[socket.socket, int],
             deadline: float | None) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """Each sibling's answer, read until it closes; and the siblings still silent at the deadline.
    A sibling that closes without an answer has exited: it is neither."""
    received = {connection: b"" for connection in siblings}
    answers = {}
    with selectors.DefaultSelector() as selector:
        for connection in siblings:
            connection.setblocking(False)
            selector.register(connection, selectors.EVENT_READ, connection)
        while received:
            remaining = _remaining(deadline)
            if remaining == 0:
                break
            for key, _ in selector.select(remaining):
                connection = key.data
                try:
                    chunk = connection.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    received[connection] += chunk
                    continue
                selector.unregister(connection)
                if answer := received.pop(connection):
                    answers[siblings[connection]] = json.loads(answer)
    silent = sorted(siblings[connection] for connection in received)
    return answers, silent


@contextlib.contextmanager
def _exclusive(path: Path, timeout_s: float | None) -> Iterator[None]:
    """The run folder's lock, waited for at most `timeout_s`. flock has no timeout, so a helper
    thread waits for it; a call that leaves first has the lock released as soon as it is taken."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    taken: concurrent.futures.Future[None] = concurrent.futures.Future()

    def take() -> None:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        taken.set_result(None)

    threading.Thread(target=take, name="shared-config-lock", daemon=True).start()
    try:
        taken.result(timeout_s)
    except concurrent.futures.TimeoutError:
        taken.add_done_callback(lambda _: os.close(descriptor))  # closing releases the lock
        raise errors.DeadlineExceeded("another reload of the model config was still running at the call's "
                                      "deadline") from None
    try:
        yield
    finally:
        os.close(descriptor)


def _write_atomically(path: Path, state: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(state))
    os.replace(partial, path)  # a reader sees the old state or the new one, never half of one
