"""Gunicorn's gthread worker, with stop signals that are safe to receive twice.

A stop signal usually reaches a worker twice: systemd (KillMode=control-group), Docker's
process-group kill and a terminal's Ctrl-C signal the whole group, and the master then
signals each worker again. Python runs a signal handler in the main thread between two
bytecodes of whatever it was doing, the first signal's handler included. So a handler
here takes no lock and starts no thread (both can wait on a lock its own interrupted frame
holds, which hangs the worker until the master kills it at the graceful timeout), and a
quick stop raises SystemExit once only, never into the worker's exit path (the drain in
Gunicorn's worker_exit hook).

Work that must start as soon as a stop is asked (gRPC refusing new calls) registers with
`when_stopping`: the handler writes a byte to a pipe, and a thread waiting on it does the work.

Until Gunicorn installs the worker's own handlers, a forked worker runs the master's, which
only queue the signal in the master's (copied) state: post_fork calls `catch_early_stops`
first, as it may import TensorFlow for seconds. A worker asked to stop before it serves
(importing TensorFlow, loading models) has accepted nothing and exits at once.

Gunicorn's `accept` re-raises every error but EAGAIN and ECONNABORTED, and the exception
ends the worker (exit code 255). Out of file descriptors (EMFILE, ENFILE) or kernel memory
(ENOBUFS, ENOMEM) is a state a client can cause, for instance with connections held open on
the gRPC port of the same process: the worker stops accepting for ACCEPT_BACKOFF_S, kept-alive
connections it holds go first, and the connections waiting in the listen backlog are accepted
once descriptors are free again. The worker's open connections (REST, and gRPC when it serves
it) are sampled into model_server_connections once a second.

The gthread keep-alive patches live in app/ops/patches.py. Imports nothing of TensorFlow:
Gunicorn's master loads the worker class.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from gunicorn.workers import base, gthread

from app.http import patches
from app.http.patches import body_fully_read

__all__ = ["ThreadWorker", "body_fully_read", "raise_descriptor_limit"]

# Errors of accept() that say "not now" about this process or the machine, not about the
# listener: backed off, never raised.
RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF_S = 0.5
SAMPLE_EVERY_S = 1.0


class ThreadWorker(patches.NextRequestInPlace, patches.KeepAliveWithoutDrain, gthread.ThreadWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stop_asked = False
        self._quitting = False  # SystemExit raised for a quick stop, or the exit path began
        self._stop_writers: list[int] = []
        self._accept_paused_until = 0.0
        self._next_sample = 0.0
        self.accept_backoffs = 0

    def catch_early_stops(self) -> None:
        """Act on stop signals from now on, before Gunicorn installs the worker's own handlers."""
        signal.signal(signal.SIGTERM, self.handle_exit)
        for signum in (signal.SIGINT, signal.SIGQUIT):
            signal.signal(signum, self.handle_quit)

    def run(self) -> None:
        try:
            super().run()
        finally:
            self._quitting = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Not gthread's: it wakes the main loop through a queue.Queue, whose lock the main
        # loop itself may hold at the moment the signal interrupts it.
        self.alive = False
        self._notify_stop()
        if not self.booted:
            # Still importing TensorFlow or loading models: no connection accepted, nothing to
            # drain, so the stop is quick rather than seconds of loading for nothing.
            self.handle_quit(sig, frame)

    def handle_quit(self, sig: int, frame: Any) -> None:
        self.alive = False
        self._notify_stop()
        if self._quitting:
            return
        self._quitting = True
        # Not gthread's either: its tpool.shutdown() takes the lock the main loop holds while
        # it submits a connection. The pool's threads still finish every connection handed to
        # them before the process ends (concurrent.futures joins them at exit).
        base.Worker.handle_quit(self, sig, frame)

    def when_stopping(self, callback: Callable[[], None]) -> None:
        """Call `callback` on a thread of its own once a stop signal arrives (soon, if one has)."""
        read_end, write_end = os.pipe()

        def wait_then_call() -> None:
            # The read end stays open: a later signal's write must not fail on a closed pipe.
            os.read(read_end, 1)
            callback()

        threading.Thread(target=wait_then_call, name="when-stopping", daemon=True).start()
        self._stop_writers.append(write_end)
        if self._stop_asked:
            os.write(write_end, b"\0")

    def _notify_stop(self) -> None:
        # Runs in a signal handler: os.write takes no lock, and nothing here may raise into
        # the code the signal interrupted (the drain, say). A second write is never read.
        self._stop_asked = True
        for write_end in list(self._stop_writers):
            try:
                os.write(write_end, b"\0")
            except OSError:
                pass
        # A byte on the pipe of gthread's method queue wakes its poller, as its own defer()
        # does, without the queue: its loop then sees `alive` is False at once, not at its
        # next 1 s timeout. Before init_process made the pipe there is no loop to wake.
        wake_fd = getattr(getattr(self, "method_queue", None), "_write_fd", None)
        if wake_fd is not None:
            try:
                os.write(wake_fd, b"\0")
            except OSError:
                pass  # full: the loop has wake-ups enough

    def accept(self, listener: Any) -> None:
        try:
            super().accept(listener)
        except OSError as exc:
            if exc.errno not in RESOURCE_ERRORS:
                raise
            self._back_off(exc)

    def _back_off(self, exc: OSError) -> None:
        self.accept_backoffs += 1
        if self.accept_backoffs == 1 or self.accept_backoffs % 100 == 0:
            self.log.warning("accept failed (%s), %d time(s): not accepting for %.1f s",
                             os.strerror(exc.errno or 0), self.accept_backoffs, ACCEPT_BACKOFF_S)
        # Idle kept-alive connections are the descriptors this loop can give back at once.
        self.murder_keepalived(force=True)
        self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF_S
        self.set_accept_enabled(False)
        # The loop sleeps up to a second in select: wake it when the pause ends.
        timer = threading.Timer(ACCEPT_BACKOFF_S, self.method_queue.defer, args=(_nothing,))
        timer.daemon = True
        timer.start()

    def set_accept_enabled(self, enabled: bool) -> None:
        if enabled and time.monotonic() < self._accept_paused_until:
            return
        super().set_accept_enabled(enabled)

    def wait_for_and_dispatch_events(self, timeout: float) -> None:
        super().wait_for_and_dispatch_events(timeout)
        now = time.monotonic()
        if now >= self._next_sample:
            self._next_sample = now + SAMPLE_EVERY_S
            self._sample_connections()

    def _sample_connections(self) -> None:
        services = getattr(getattr(self, "wsgi", None), "services", None)
        if services is None:
            return
        metrics = services.metrics
        metrics.connections.labels("rest").set(self.nr_conns)
        grpc_server = getattr(self, "grpc_server", None)
        if grpc_server is not None:
            metrics.connections.labels("grpc").set(open_connections(grpc_server.port))


def _nothing() -> None:
    pass


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (workers inherit it); the new (soft, hard).

    Every connection, REST or gRPC, is a descriptor, and the soft limit is often 1024 where
    the hard one allows far more: the server should run out of neither before it must.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # a hard limit the kernel refuses as a soft one (over fs.nr_open): keep the soft one
    return soft, hard


def open_connections(port: int) -> int:
    """TCP connections of this process whose local port is `port` (the gRPC server's), from /proc."""
    inodes = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return 0
    wanted = f":{port:04X}"
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines, None)
                for line in lines:
                    fields = line.split()
                    # local address, state 01 (ESTABLISHED), inode
                    if fields[1].endswith(wanted) and fields[3] == "01" and fields[9] in inodes:
                        count += 1
        except OSError:
            continue
    return count
