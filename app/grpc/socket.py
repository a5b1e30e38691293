"""gRPC on a Unix socket (GRPC_SOCKET_PATH, TF Serving's --grpc_socket_path), one worker at a time.

TF Serving is one process: it binds `unix:PATH` beside its TCP port. Here every Gunicorn worker
runs a gRPC server of its own, and they share the TCP port through SO_REUSEPORT, which Unix
sockets lack: a second bind of PATH fails, or, since grpc-core unlinks the path before it
binds, silently takes the socket from the first worker. So one worker at a time serves PATH:

- the owner is the worker that holds an exclusive flock on PATH.lock. Every other worker waits
  for the lock on a thread of its own, so when the owner exits, stopped or killed, the kernel
  hands the lock to a waiting worker; a worker started to replace one joins the wait;
- the new owner starts a gRPC server on PATH.<pid>.<n> and renames that socket to PATH. The rename
  is atomic: a client finds the old socket or the new one at PATH, never no file, and a killed
  owner's socket left there is replaced the same way. PATH itself is never bound: grpc-core
  unlinks the path it bound when its server stops, which would remove the next owner's socket;
- an owner that stops removes PATH if it is still its own socket, releases the lock, then
  drains the calls it accepted. Until the next owner has renamed its socket in (a few
  milliseconds: its gRPC server's start), a client connecting to PATH is refused.

Calls on the Unix socket are one worker's: its batches, and a call limit of its own (THREADS).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import IO, Any

log = logging.getLogger(__name__)
# Private names differ between owners of one process too (tests): grpc-core unlinks its own at stop.
_owners = itertools.count()


class SocketOwner:
    """Waits to own the socket path, then serves it until stopped. `serve(bind)` returns a started
    server with `stop(grace_s=...) -> threading.Event` (app.grpc_server.GrpcServer)."""

    def __init__(self, path: str, serve: Callable[[str], Any]) -> None:
        self.path = os.path.abspath(path)
        self._serve = serve
        self._lock = threading.Lock()
        self._lock_file: IO[str] | None = None
        self._server: Any = None
        self._inode: int | None = None
        self._stopped: threading.Event | None = None
        self.serving = threading.Event()
        # Ends once this owner serves, or gave up; it may wait on the lock as long as the worker lives.
        self.thread = threading.Thread(target=self._wait_then_serve, name="grpc-socket-owner", daemon=True)

    def start(self) -> SocketOwner:
        self.thread.start()
        return self

    def _wait_then_serve(self) -> None:
        try:
            lock_file = open(f"{self.path}.lock", "a")  # noqa: SIM115  (held open while this worker owns PATH)
        except OSError as exc:
            log.error("GRPC_SOCKET_PATH=%s: cannot open its lock file: %s", self.path, exc)
            return
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # blocks until no other worker owns PATH
        with self._lock:
            if self._stopped is not None:
                lock_file.close()  # stopping: the next worker takes it
                return
            self._lock_file = lock_file
            private = f"{self.path}.{os.getpid()}.{next(_owners)}"
            try:
                self._server = self._serve(f"unix:{private}")
                os.rename(private, self.path)
                self._inode = os.stat(self.path).st_ino
            except (OSError, RuntimeError) as exc:
                log.error("GRPC_SOCKET_PATH=%s: cannot serve gRPC there: %s", self.path, exc)
                if self._server is not None:
                    self._server.stop(grace_s=0)
                    self._server = None
                self._release()
                return
        log.info("gRPC on the Unix socket %s, pid %d", self.path, os.getpid())
        self.serving.set()

    def stop(self, *, grace_s: float) -> threading.Event:
        """Give PATH up to the next worker at once, then let accepted calls finish. Safe to call twice."""
        with self._lock:
            if self._stopped is None:
                self._release()
                self._stopped = self._server.stop(grace_s=grace_s) if self._server is not None else threading.Event()
                if self._server is None:
                    self._stopped.set()
            return self._stopped

    def drain(self, *, timeout_s: float) -> bool:
        return self.stop(grace_s=timeout_s).wait(timeout_s)

    def _release(self) -> None:
        if self._lock_file is None:
            return
        try:
            # Only the lock's holder renames into PATH, so what is there now cannot change under us.
            if self._inode is not None and os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except OSError:
            pass  # removed by hand: nothing to give up
        self._lock_file.close()
        self._lock_file = None
