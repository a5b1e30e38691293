"""Changes to the frameworks' own behaviour, each measured on one pinned version.

Each patch overrides a private detail of Flask, Gunicorn or logging that a new release may
change or make unneeded. `MEASURED_ON` names the version each was measured on, and
tests/test_patches.py fails when the installed version differs: then re-measure the patch
(docs/performance.md says how) and either move the pin here or drop the patch.

- `CachedEnsureSync` (Flask): Flask asks `inspect.iscoroutinefunction` of every view and
  hook on every request; the answer never changes for a function, so it is asked once.
- `KeepAliveWithoutDrain` (Gunicorn's gthread worker): after each response gthread drains
  what the application left unread of the body, bounded by a socket timeout: `settimeout`
  before and after, each an `ioctl` that releases the GIL and, under load, hands the
  interpreter to another request thread. The body-limits layer (app/limits.py) reads every
  body to its end, so a body known to be read to its last byte skips the drain. Anything
  else (a chunked body, a body left unread, a failed read) takes Gunicorn's own path.
- `batched_writes` (logging): access lines reach each plain StreamHandler's stream in a
  few large writes instead of one write and flush per line (app/logs.py's access writer).

Imports nothing of TensorFlow: Gunicorn's master loads the worker class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Flask
from gunicorn.http.body import LengthReader

MEASURED_ON = {"flask": "3.1.3", "gunicorn": "27.0.1", "python": "3.11"}


class CachedEnsureSync(Flask):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sync: dict[Callable[..., Any], Callable[..., Any]] = {}

    def ensure_sync(self, func: Callable[..., Any]) -> Callable[..., Any]:
        sync = self._sync.get(func)
        if sync is None:
            sync = self._sync[func] = super().ensure_sync(func)
        return sync


class KeepAliveWithoutDrain:
    """Mixed in before gunicorn.workers.gthread.ThreadWorker."""

    def _keepalive_after(self, conn: Any, keepalive: bool) -> bool:
        if keepalive and body_fully_read(conn.parser):
            # What the drain would find and return: nothing left, so the connection is reusable.
            return True
        return super()._keepalive_after(conn, keepalive)  # type: ignore[misc]


def body_fully_read(parser: Any) -> bool:
    """True when the current request's body of known length was read to its end, nothing of it
    buffered and no read of it failed: Gunicorn's drain would read nothing and answer True."""
    body = getattr(getattr(parser, "mesg", None), "body", None)
    reader = getattr(body, "reader", None)
    return (isinstance(reader, LengthReader) and reader.length == 0
            and not body.failed and body.buf.tell() == 0)
