"""Gunicorn's gthread worker, less two system calls per kept-alive request.

After each response, gthread drains whatever the application left unread of the request
body before the connection goes back to the poller, and bounds that drain with a socket
timeout: `settimeout` before the read, `settimeout` back after it, even when there is
nothing left to read. Each is an `ioctl` that releases the GIL, and under load every GIL
release hands the interpreter to another request thread and costs this one a wait for it.
The body-limits layer (app/limits.py) reads every body to its end, so for this server the
drain almost never has anything to do: a body known to be read to its last byte skips it.
Anything else (a chunked body, a body left unread, a failed read) takes Gunicorn's own path.

Imports nothing of TensorFlow: Gunicorn's master loads the worker class.
"""

from __future__ import annotations

from typing import Any

from gunicorn.http.body import LengthReader
from gunicorn.workers import gthread


class ThreadWorker(gthread.ThreadWorker):
    def _keepalive_after(self, conn: Any, keepalive: bool) -> bool:
        if keepalive and body_fully_read(conn.parser):
            # What the drain would find and return: nothing left, so the connection is reusable.
            return True
        return super()._keepalive_after(conn, keepalive)


def body_fully_read(parser: Any) -> bool:
    """True when the current request's body of known length was read to its end, nothing of it
    buffered and no read of it failed: Gunicorn's drain would read nothing and answer True."""
    body = getattr(getattr(parser, "mesg", None), "body", None)
    reader = getattr(body, "reader", None)
    return (isinstance(reader, LengthReader) and reader.length == 0
            and not body.failed and body.buf.tell() == 0)
