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

The gthread keep-alive patch lives in app/patches.py. Imports nothing of TensorFlow:
Gunicorn's master loads the worker class.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from gunicorn.workers import base, gthread

from app import patches
from app.patches import body_fully_read

__all__ = ["ThreadWorker", "body_fully_read"]


class ThreadWorker(patches.KeepAliveWithoutDrain, gthread.ThreadWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stop_asked = False
        self._quitting = False  # SystemExit raised for a quick stop, or the exit path began
        self._stop_writers: list[int] = []

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
