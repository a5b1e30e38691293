"""One exception tree for everything the server answers with an error.

    ServingError (500)
    ├── BadRequest (400)
    │   ├── InvalidInput (400)          body parsed, but not what the model takes
    │   ├── UnsupportedEncoding (415)   a Content-Encoding the server does not decode
    │   └── SignatureNotFound (400)     gRPC answers it FAILED_PRECONDITION, as TF Serving
    ├── Forbidden (403)                 a restricted call without its header; gRPC: UNAVAILABLE (Triton's)
    ├── NotFound (404)
    ├── MethodNotAllowed (405)
    ├── PayloadTooLarge (413)
    ├── PredictFailed (500)             the model raised; carries the cause's class and message
    ├── HandlerFailed (500)             a model's handler raised, or broke its contract; names the request id
    ├── Unavailable (503)               carries Retry-After
    │   ├── QueueFull (503)
    │   ├── ShuttingDown (503)
    │   └── BatcherBroken (503)
    ├── DeadlineExceeded (504)
    └── ClientGone (499)                the client left before its rows ran; gRPC answers CANCELLED

The batching engine raises these too, so a request thread re-raises whatever its future
holds and the one handler at the bottom answers it, as it answers Werkzeug's 404, 405 and
413: every error leaves as {"error": "..."} with its status.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


# Messages quote what the client sent (a signature name, an input's name, a value): cut
# here, once for every error, so no client can have its own 60 KB string echoed back, nor
# push a gRPC status past the 8 to 16 KiB of metadata clients accept (grpc-message is
# percent-encoded: up to 12 bytes a character).
MAX_MESSAGE_CHARS = 1000


def bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"


class ServingError(Exception):
    status_code = 500
    reason = "internal"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadRequest(ServingError):
    status_code = 400
    reason = "bad_request"


class InvalidInput(BadRequest):
    reason = "invalid_input"


class UnsupportedEncoding(BadRequest):
    status_code = 415
    reason = "unsupported_encoding"


class SignatureNotFound(BadRequest):
    """A signature name the model does not have; `key` is the name asked for."""

    reason = "signature_not_found"

    def __init__(self, message: str, *, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class Forbidden(ServingError):
    status_code = 403
    reason = "forbidden"


class NotFound(ServingError):
    status_code = 404
    reason = "not_found"


class MethodNotAllowed(ServingError):
    status_code = 405
    reason = "method_not_allowed"


class PayloadTooLarge(ServingError):
    status_code = 413
    reason = "payload_too_large"


FIRST_LINE_CHARS = 300
# TensorFlow heads an op's error with where it was defined; the line after says what failed.
_TF_PREAMBLE = ("Graph execution error:", "Detected at node ", "<stack traces unavailable>")


def _says_what_failed(line: str) -> bool:
    # Indented lines are stack frames, and they carry install paths.
    return bool(line.strip()) and not line[0].isspace() and not line.startswith(_TF_PREAMBLE)


class PredictFailed(ServingError):
    status_code = 500
    reason = "predict_failed"

    def __init__(self, message: str, *, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail

    @classmethod
    def from_exception(cls, exc: BaseException) -> PredictFailed:
        # TensorFlow's messages run to pages of graph context and install paths: the client
        # gets the class and the first line, the log gets the rest (handle_serving_error).
        text = str(exc)
        first = next((line.rstrip() for line in text.splitlines() if _says_what_failed(line)), "")
        if len(first) > FIRST_LINE_CHARS:
            first = first[:FIRST_LINE_CHARS] + " ..."
        return cls(f"model raised {type(exc).__name__}: {first}", detail=f"{type(exc).__name__}: {text}")


class HandlerFailed(ServingError):
    """A handler's own fault (app/core/handlers.py): its request alone fails, its traceback logged once."""

    status_code = 500
    reason = "handler_failed"


class Unavailable(ServingError):
    status_code = 503
    reason = "unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class QueueFull(Unavailable):
    reason = "queue_full"


class ShuttingDown(Unavailable):
    reason = "shutting_down"


class BatcherBroken(Unavailable):
    reason = "batcher_broken"


class DeadlineExceeded(ServingError):
    status_code = 504
    reason = "deadline"


class ClientGone(ServingError):
    # Nobody reads this answer; 499 is the status nginx logs for a client that closed the
    # connection first, so access logs and request metrics tell these apart from errors.
    status_code = 499
    reason = "client_gone"


def unreadable_version(text: str) -> BadRequest:
    """TF Serving's answer to a URL's version that absl::SimpleAtoi cannot read as an int64."""
    return BadRequest(f"Failed to convert version: {text} to numeric.")
