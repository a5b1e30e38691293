"""Changes to Flask's and Gunicorn's own behaviour, each measured on the version
app/ops/patches.py's `MEASURED_ON` names (tests/test_patches.py checks it).

- `CachedEnsureSync` (Flask): Flask asks `inspect.iscoroutinefunction` of every view and
  hook on every request; the answer never changes for a function, so it is asked once.
  And a request thread (Gunicorn's, never the main thread, where tests and tools push and pop
  their own) keeps one application context pushed for its life, which Flask reuses, instead of
  making, pushing and popping one per request (about 15 calls and 3 signals). So `flask.g` is
  per thread, not per request, and teardown_appcontext functions would never run: the app
  uses neither, and must not start to.
- `NoSessions` (Flask): the server keeps no sessions; instead of asking for a secret key and
  making a new empty null session on every request, each request gets the same one.
- `KeepAliveWithoutDrain` (Gunicorn's gthread worker): after each response gthread drains
  what the application left unread of the body, bounded by a socket timeout: `settimeout`
  before and after, each an `ioctl` that releases the GIL and, under load, hands the
  interpreter to another request thread. The body-limits layer (app/http/bodies.py) reads every
  body to its end, so a body known to be read to its last byte skips the drain. Anything
  else (a chunked body, a body left unread, a failed read) takes Gunicorn's own path.
- `NextRequestInPlace` (Gunicorn's gthread worker): after a keep-alive response gthread hands
  the connection back to its main thread, which registers it with its poller, wakes when the
  next request arrives, unregisters it and queues it for a request thread: two wake-ups of
  the main thread, each needing the GIL, and a thread hand-off, for every request. The main
  thread serves every connection, so under load requests queue behind it. Here the thread
  that answered waits up to `NEXT_REQUEST_WAIT_S` on the connection itself and answers the
  next request at once; a client that does not send within it goes back to the poller as
  before. It does not wait while requests wait for a thread. A request read so during a stop is
  answered with "Connection: close", as gthread answers one on a kept-alive connection then.
- `request_environ` (Flask): the current request's WSGI environ from Flask's own context
  variable, not through `has_request_context()` and the `request` proxy (four calls).

Imports nothing of TensorFlow: Gunicorn's master loads the worker class.
"""

from __future__ import annotations

import select
import threading
from collections.abc import Callable
from typing import Any

from flask import Flask
from flask.globals import _cv_app, _cv_request
from flask.sessions import NullSession, SessionInterface
from gunicorn.http.body import LengthReader


class CachedEnsureSync(Flask):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sync: dict[Callable[..., Any], Callable[..., Any]] = {}

    def ensure_sync(self, func: Callable[..., Any]) -> Callable[..., Any]:
        sync = self._sync.get(func)
        if sync is None:
            sync = self._sync[func] = super().ensure_sync(func)
        return sync

    def wsgi_app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if _cv_app.get(None) is None and threading.current_thread() is not threading.main_thread():
            # Left pushed for the thread's life: Flask reuses an active context of its app.
            self.app_context().push()
        return super().wsgi_app(environ, start_response)


class NoSessions(SessionInterface):
    """One shared empty session, read-only as Flask's null session is (a write raises), never saved."""

    def __init__(self) -> None:
        self._session = NullSession()

    def open_session(self, app: Flask, request: Any) -> NullSession:
        return self._session


def request_environ() -> dict[str, Any] | None:
    """The WSGI environ of the request this thread is handling; None outside a request."""
    context = _cv_request.get(None)
    return context.request.environ if context is not None else None


class KeepAliveWithoutDrain:
    """Mixed in before gunicorn.workers.gthread.ThreadWorker."""

    def _keepalive_after(self, conn: Any, keepalive: bool) -> bool:
        if keepalive and body_fully_read(conn.parser):
            # What the drain would find and return: nothing left, so the connection is reusable.
            return True
        return super()._keepalive_after(conn, keepalive)  # type: ignore[misc]


# A client in a closed loop sends its next request within a millisecond or two of reading the
# answer (longer when its own host is loaded). Waiting costs a parked thread, no CPU.
NEXT_REQUEST_WAIT_S = 0.01


class NextRequestInPlace:
    """Mixed in before gunicorn.workers.gthread.ThreadWorker."""

    def handle(self, conn: Any) -> Any:
        result = super().handle(conn)  # type: ignore[misc]
        while result is True and self._next_request_soon(conn):
            result = super().handle(conn)  # type: ignore[misc]
        return result

    def _next_request_soon(self, conn: Any) -> bool:
        # A thread waiting here while requests wait for a thread would hold them up.
        if self.tpool._work_queue.qsize():  # type: ignore[attr-defined]
            return False
        if conn.parser.unreader.buf.getvalue():
            return True  # the parser already read into it
        try:
            poller = select.poll()
            poller.register(conn.sock, select.POLLIN)
            return bool(poller.poll(NEXT_REQUEST_WAIT_S * 1000))
        except (OSError, ValueError):  # closed meanwhile: gthread's own path closes it
            return False


def body_fully_read(parser: Any) -> bool:
    """True when the current request's body of known length was read to its end, nothing of it
    buffered and no read of it failed: Gunicorn's drain would read nothing and answer True."""
    body = getattr(getattr(parser, "mesg", None), "body", None)
    if body is None:
        return False
    reader = getattr(body, "reader", None)
    return (isinstance(reader, LengthReader) and reader.length == 0
            and not body.failed and body.buf.tell() == 0)
