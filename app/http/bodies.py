"""Request bodies, read here before Flask sees them: size limit, framing, memory budget.

`BodyLimits` wraps the Flask app's WSGI callable. It reads every request body itself, so that:

- a body over MAX_REQUEST_BYTES, declared (Content-Length) or chunked, is refused with 413
  after reading and discarding it up to `DISCARD_BYTES`: a client writes its whole body
  before it reads an answer, and closing on a body still being sent resets the connection
  before the client can read the 413 (Werkzeug's docs on `get_input_stream` warn of this);
- a body that breaks its framing (an invalid chunk size, a body cut short) is a 400, not an
  exception from the WSGI server's reader that would become a 500;
- at most LARGE_BODY_SLOTS bodies over LARGE_BODY_BYTES are read and handled at once in a
  worker: a JSON body costs many times its size once parsed, so this slot count, not the
  thread count, bounds a worker's memory. A body waits for a slot at most until its
  request's deadline, then gets 503 with Retry-After. Chunked bodies take a slot once they
  grow past LARGE_BODY_BYTES.

A refusal is not answered here: it is left on the request's exchange and raised once a POST
route matched (by the direct routes, or a before_request hook for Flask's), so that it gets the
same JSON body, request id, access line and metrics as any error.
Gunicorn sends "100 Continue" itself before the app runs, so `Expect: 100-continue` cannot
spare a client sending an over-limit body: a buffering proxy in front (nginx's
client_max_body_size) refuses those before they are sent.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from app.core.errors import BadRequest, PayloadTooLarge, ServingError, Unavailable, UnsupportedEncoding
from app.http.layers import HttpExchange, exchange_of
from app.ops.numerals import INT64_MAX, whole_number

try:
    from gunicorn.http.errors import NoMoreData, ParseException
    _FRAMING_ERRORS: tuple[type[BaseException], ...] = (ParseException, NoMoreData, OSError, ValueError)
except ImportError:  # another WSGI server: its readers raise OSError or ValueError on bad framing
    _FRAMING_ERRORS = (OSError, ValueError)

# An over-limit body is read and discarded up to this much, so the client reads the 413;
# beyond, it is answered at once and the connection closes (the client may see a reset).
DISCARD_BYTES = 64 * 1024 * 1024
READ_STEP = 64 * 1024


class BodyLimits:
    def __init__(self, app: Callable[..., Iterable[bytes]], *, max_bytes: int, large_bytes: int,
                 large_slots: int, wait_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.large_bytes = large_bytes
        self.wait_s = wait_s
        self._slots = threading.BoundedSemaphore(large_slots)
        self._lock = threading.Lock()
        self._held = 0

    @property
    def large_bodies_in_flight(self) -> int:
        return self._held

    def _take_slot(self, deadline: float) -> bool:
        if not self._slots.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            return False
        with self._lock:
            self._held += 1
        return True

    def _give_slot(self) -> None:
        with self._lock:
            self._held -= 1
        self._slots.release()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        chunked = "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        length = _content_length(environ)
        if not chunked and not length:
            return self.app(environ, start_response)
        deadline = time.monotonic() + self.wait_s
        stream = environ["wsgi.input"]
        holding = False
        try:
            if not chunked and length > self.max_bytes:
                _discard(stream, length)
                return self._refuse(environ, start_response, self._too_large())
            if chunked or length > self.large_bytes:
                body, holding = self._read(stream, None if chunked else length, deadline)
            else:
                body = _read_exactly(stream, length)
        except ServingError as exc:
            return self._refuse(environ, start_response, exc)
        try:
            environ["wsgi.input"] = io.BytesIO(body)
            environ["CONTENT_LENGTH"] = str(len(body))
            environ.pop("HTTP_TRANSFER_ENCODING", None)
            # The views take it from the exchange rather than through Werkzeug's stream wrappers again.
            exchange_of(environ).body = body
            del body
            return self.app(environ, start_response)
        finally:
            if holding:
                self._give_slot()

    def _read(self, stream: Any, length: int | None, deadline: float) -> tuple[bytes, bool]:
        """Read a large or chunked body, taking a slot before it grows past LARGE_BODY_BYTES.

        Returns the body and whether a slot is held; on a refusal no slot is held.
        """
        if length is not None:
            if not self._take_slot(deadline):
                _discard(stream, length)
                raise self._busy()
            try:
                return _read_exactly(stream, length), True
            except ServingError:
                self._give_slot()
                raise
        free = min(self.large_bytes, self.max_bytes)
        head = _read_up_to(stream, free)
        if len(head) <= free:
            return head, False  # it ended before it needed a slot
        if len(head) > self.max_bytes:
            _discard(stream, None)
            raise self._too_large()
        if not self._take_slot(deadline):
            _discard(stream, None)
            raise self._busy()
        try:
            rest = _read_up_to(stream, self.max_bytes - len(head))
            if len(head) + len(rest) > self.max_bytes:
                _discard(stream, None)
                raise self._too_large()
            return head + rest, True
        except ServingError:
            self._give_slot()
            raise

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"the request body is larger than {self.max_bytes} bytes (MAX_REQUEST_BYTES)")

    def _busy(self) -> Unavailable:
        return Unavailable("too many large request bodies are being handled; retry later")

    def _refuse(self, environ: dict[str, Any], start_response: Callable[..., Any],
                exc: ServingError) -> Iterable[bytes]:
        exchange_of(environ).refusal = exc
        environ["wsgi.input"] = io.BytesIO(b"")
        environ["CONTENT_LENGTH"] = "0"
        environ.pop("HTTP_TRANSFER_ENCODING", None)
        return self.app(environ, start_response)


def _content_length(environ: dict[str, Any]) -> int:
    # The WSGI server has checked the header's syntax (Gunicorn answers 400 otherwise, and past
    # 4,300 digits); past int64, a length is over any limit all the same.
    text = environ.get("CONTENT_LENGTH") or "0"
    if not (text.isascii() and text.isdigit()):
        return 0
    length = whole_number(text, INT64_MAX)
    return INT64_MAX if length is None else length


def _read_exactly(stream: Any, length: int) -> bytes:
    parts = []
    got = 0
    while got < length:
        part = _read(stream, min(READ_STEP, length - got))
        if not part:
            raise BadRequest(f"the request body ended after {got} of the {length} bytes its Content-Length announced")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _read_up_to(stream: Any, limit: int) -> bytes:
    """Up to `limit` + 1 bytes of a chunked body: one more than allowed tells it is too long."""
    parts = []
    got = 0
    while got <= limit:
        part = _read(stream, min(READ_STEP, limit + 1 - got))
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _discard(stream: Any, left: int | None) -> None:
    """Read and drop the rest of a refused body (None: chunked, to its end), up to DISCARD_BYTES."""
    left = DISCARD_BYTES if left is None else min(left, DISCARD_BYTES)
    try:
        while left > 0:
            part = stream.read(min(READ_STEP, left))
            if not part:
                return
            left -= len(part)
    except _FRAMING_ERRORS:
        return


def _read(stream: Any, size: int) -> bytes:
    try:
        return stream.read(size)
    except _FRAMING_ERRORS as exc:
        raise BadRequest(f"the request body is malformed: {_framing_message(exc)}") from None


_FRAMING_MESSAGES = {
    "NoMoreData": "the connection ended before the body did",
    "InvalidChunkSize": "invalid chunk size",
    "ChunkMissingTerminator": "a chunk is not followed by CRLF",
    "InvalidChunkExtension": "invalid chunk extension",
}


def _framing_message(exc: BaseException) -> str:
    # By name: the app imports no Gunicorn class it does not need.
    return _FRAMING_MESSAGES.get(type(exc).__name__, type(exc).__name__)


def body(exchange: HttpExchange) -> bytes:
    """The request's body as BodyLimits read it (none there: the request has no body)."""
    encoding = exchange.environ.get("HTTP_CONTENT_ENCODING", "").strip()
    if encoding.lower() not in ("", "identity"):
        # Read as it is, a compressed body would fail as malformed JSON, and an uncompressed one
        # labelled so would be served: neither says what the server does not do.
        raise UnsupportedEncoding(f"Content-Encoding {encoding!r} is not supported: send the body uncompressed")
    # BodyLimits reads every body with a length or chunks; a request with neither has none.
    return exchange.body


def raise_refusal(exchange: HttpExchange) -> None:
    """The body's refusal (too large, broken framing, no slot), for a POST route that matched."""
    if exchange.refusal is not None:
        raise exchange.refusal
