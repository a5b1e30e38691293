"""The one place HTTP errors become answers: every error leaves as {"error": "..."} with its status.

app/core/errors.py's tree gives the status; Werkzeug's own 404, 405 and 413 are answered here
too, with TensorFlow Serving's words where its URLs are concerned.
"""

from __future__ import annotations

import logging
import re

import orjson
from flask import Flask, Response, current_app, has_request_context, request
from werkzeug.exceptions import HTTPException

from app.core.errors import PredictFailed, ServingError, unreadable_version
from app.http.layers import current_request_id
from app.ops.numerals import INT64_MAX, whole_number

log = logging.getLogger(__name__)


def _answer(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps({"error": message}), status=status, mimetype="application/json", headers=headers)


def handle_serving_error(exc: ServingError) -> Response:
    return serving_error_answer(exc, current_request_id())


def serving_error_answer(exc: ServingError, request_id: str | None) -> Response:
    if isinstance(exc, PredictFailed) and exc.detail:
        log.error("predict failed, request_id=%s: %s", request_id, exc.detail)
    return _answer(exc.status_code, exc.message, exc.headers)


# TF Serving's URL patterns (model_servers/http_rest_api_util.cc): under /v1/, a path that
# fits neither is "Malformed request" (400), one that fits but names nothing is 404.
_V1_PATH = re.compile(r"(?i)/v1/.*")


_V1_PREDICT = re.compile(
    r"(?i)/v1/models/([^/:]+)(?:(?:/versions/([0-9]+))|(?:/labels/([^/:]+)))?:(classify|regress|predict)")


_V1_STATUS = re.compile(
    r"(?i)/v1/models(?:/([^/:]+))?(?:(?:/versions/([0-9]+))|(?:/labels/([^/:]+)))?(?:\/(metadata))?")


def handle_http_error(exc: HTTPException) -> Response:
    headers = {key: value for key, value in exc.get_headers() if key.lower() == "allow"}
    message = exc.description or exc.name
    if exc.code == 413:
        limit = current_app.config.get("MAX_CONTENT_LENGTH")
        message = f"the request body is larger than {limit} bytes (MAX_REQUEST_BYTES)"
    if exc.code == 404 and has_request_context():
        # The path as sent, before percent-decoding: TF Serving matches that.
        path = (request.environ.get("RAW_URI") or request.path).split("?", 1)[0]
        pattern = {"POST": _V1_PREDICT, "GET": _V1_STATUS}.get(request.method)
        match = pattern.fullmatch(path) if pattern is not None else None
        if _V1_PATH.fullmatch(path) and match is None:
            return _answer(400, f"Malformed request: {request.method} {path}")
        if match is not None and not match.group(1):
            return _answer(400, "Missing model name in request.")
        if match is not None and match.group(2) and whole_number(match.group(2), INT64_MAX) is None:
            return _answer(400, unreadable_version(match.group(2)).message)
    return _answer(exc.code or 500, message, headers)


def handle_unexpected(exc: Exception) -> Response:
    return unexpected_answer(exc, current_request_id())


def unexpected_answer(exc: Exception, request_id: str | None) -> Response:
    log.exception("unhandled error, request_id=%s", request_id, exc_info=exc)
    return _answer(500, f"internal error: {type(exc).__name__}")


def answer_for(exc: Exception, request_id: str | None) -> Response:
    """The answer the handlers below give `exc`, for a route answered outside Flask (app/http/routes.py,
    whose functions raise no Werkzeug HTTPException)."""
    if isinstance(exc, ServingError):
        return serving_error_answer(exc, request_id)
    return unexpected_answer(exc, request_id)


def init_app(app: Flask) -> None:
    app.register_error_handler(ServingError, handle_serving_error)
    app.register_error_handler(HTTPException, handle_http_error)
    app.register_error_handler(Exception, handle_unexpected)
