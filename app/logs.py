"""Logging, configured once: app logs, and one access-log line per request.

Every request gets an id: the client's X-Request-ID when it is a sane token, a new one
otherwise. It is echoed in the response and written in the access line, which also holds
the rows the request carried and the size of the batch that served it.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

import orjson
from flask import Flask, Response, g, request

access_log = logging.getLogger("app.access")

REQUEST_ID_HEADER = "X-Request-ID"
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{key}={value}" for key, value in fields.items() if value is not None)
        return line


def configure_logging(level: str, fmt: str = "text") -> None:
    """Give the root logger one handler in the chosen format; later calls only adjust."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, "model_server", False)), None)
    if handler is None:
        handler = logging.StreamHandler()
        handler.model_server = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.getLogger("app").setLevel(level)


def _request_id() -> str:
    given = request.headers.get(REQUEST_ID_HEADER, "")
    return given if _SANE_ID.match(given) else uuid.uuid4().hex


def accept_request_id(given: str) -> str:
    """gRPC's x-request-id metadata, by the same rule as the header: kept if sane, else a new id."""
    return given if _SANE_ID.match(given) else uuid.uuid4().hex


def _start() -> None:
    g.request_id = _request_id()
    g.access_started = time.perf_counter()


def _finish(response: Response) -> Response:
    response.headers[REQUEST_ID_HEADER] = g.request_id
    if access_log.isEnabledFor(logging.INFO):
        fields = {
            "method": request.method,
            "path": request.path,
            "status": response.status_code,
            "latency_ms": round((time.perf_counter() - g.access_started) * 1000, 3),
            "rows": g.get("rows"),
            "batch_rows": g.get("batch_rows"),
            "batch_requests": g.get("batch_requests"),
            "model": g.get("model"),
            "request_id": g.request_id,
        }
        access_log.info("access", extra={"fields": fields})
    return response


def init_app(app: Flask, *, access: bool = True) -> None:
    app.before_request(_start)
    app.after_request(_finish)
    access_log.disabled = not access
