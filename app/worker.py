"""Gunicorn's gthread worker, less two system calls per kept-alive request, and never killed by accept.

After each response, gthread drains whatever the application left unread of the request
body before the connection goes back to the poller, and bounds that drain with a socket
timeout: `settimeout` before the read, `settimeout` back after it, even when there is
nothing left to read. Each is an `ioctl` that releases the GIL, and under load every GIL
release hands the interpreter to another request thread and costs this one a wait for it.
The body-limits layer (app/limits.py) reads every body to its end, so for this server the
drain almost never has anything to do: a body known to be read to its last byte skips it.
Anything else (a chunked body, a body left unread, a failed read) takes Gunicorn's own path.

Gunicorn's `accept` re-raises every error but EAGAIN and ECONNABORTED, and the exception
ends the worker (exit code 255). Out of file descriptors (EMFILE, ENFILE) or kernel memory
(ENOBUFS, ENOMEM) is a state a client can cause, for instance with connections held open on
the gRPC port of the same process: the worker stops accepting for ACCEPT_BACKOFF_S, kept-alive
connections it holds go first, and the connections waiting in the listen backlog are accepted
once descriptors are free again. The worker's open connections (REST, and gRPC when it serves
it) are sampled into model_server_connections once a second.

Imports nothing of TensorFlow: Gunicorn's master loads the worker class.
"""

from __future__ import annotations

import errno
import os
import resource
import threading
import time
from typing import Any

from gunicorn.http.body import LengthReader
from gunicorn.workers import gthread

# Errors of accept() that say "not now" about this process or the machine, not about the
# listener: backed off, never raised.
RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF_S = 0.5
SAMPLE_EVERY_S = 1.0


class ThreadWorker(gthread.ThreadWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._accept_paused_until = 0.0
        self._next_sample = 0.0
        self.accept_backoffs = 0

    def _keepalive_after(self, conn: Any, keepalive: bool) -> bool:
        if keepalive and body_fully_read(conn.parser):
            # What the drain would find and return: nothing left, so the connection is reusable.
            return True
        return super()._keepalive_after(conn, keepalive)

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
        metrics = getattr(getattr(self, "wsgi", None), "extensions", {}).get("metrics")
        if metrics is None:
            return
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


def body_fully_read(parser: Any) -> bool:
    """True when the current request's body of known length was read to its end, nothing of it
    buffered and no read of it failed: Gunicorn's drain would read nothing and answer True."""
    body = getattr(getattr(parser, "mesg", None), "body", None)
    reader = getattr(body, "reader", None)
    return (isinstance(reader, LengthReader) and reader.length == 0
            and not body.failed and body.buf.tell() == 0)
