"""Logging, configured once: app logs, and one access-log line per request.

Every request gets an id: the client's X-Request-ID when it is a sane token, a new one
otherwise. It is echoed in the response and written in the access line, which also holds
the rows the request carried and the size of the batch that served it. Probe requests
(/healthz, /readyz, /metrics: every few seconds from each orchestrator and scraper) are left
out of the access log unless ACCESS_LOG_PROBES is true.

Under Gunicorn, gunicorn.conf.py hands `gunicorn_logconfig()` to Gunicorn's logconfig_dict:
the master sets up the one handler before any worker forks, so Gunicorn's own lines, the
app's, and TensorFlow's Python loggers all come out in LOG_FORMAT, with UTC timestamps
that carry their zone.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import orjson
from flask import Flask, Response, current_app, g, request

access_log = logging.getLogger("app.access")

REQUEST_ID_HEADER = "X-Request-ID"
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Asked every few seconds by orchestrators and Prometheus: not worth a line each.
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_PROBES_KEY = "ACCESS_LOG_PROBES"
# Marks the handler this module installs, so configuring again never adds a second one.
_HANDLER_MARK = "model_server"


def utc_timestamp(created: float) -> str:
    """ISO 8601 in UTC with its zone, to the millisecond: 2026-11-23T12:00:00.123+00:00."""
    return datetime.fromtimestamp(created, tz=timezone.utc).isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return utc_timestamp(record.created)

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

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return utc_timestamp(record.created)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{key}={value}" for key, value in fields.items() if value is not None)
        return line


def _formatter_class(fmt: str) -> type[logging.Formatter]:
    return JsonFormatter if fmt == "json" else TextFormatter


def _root_level(level: str) -> str:
    # Libraries' INFO chatter stays out unless DEBUG is asked for; the app's own follows LOG_LEVEL.
    return level if logging.getLevelName(level) >= logging.WARNING or level == "DEBUG" else "WARNING"


def configure_logging(level: str, fmt: str = "text") -> None:
    """Give the root logger one handler in the chosen format; later calls only adjust."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, _HANDLER_MARK, False)), None)
    if handler is None:
        handler = logging.StreamHandler()
        setattr(handler, _HANDLER_MARK, True)
        root.addHandler(handler)
        root.setLevel(_root_level(level))
    handler.setFormatter(_formatter_class(fmt)())
    logging.getLogger("app").setLevel(level)
    # warnings.warn would print plain text to stderr; as log records they keep the format.
    logging.captureWarnings(True)


def gunicorn_logconfig(level: str, fmt: str = "text") -> dict[str, Any]:
    """Gunicorn's logconfig_dict: its error and access loggers, the app's and the root's."""
    formatter = _formatter_class(fmt)
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"model_server": {"()": f"{formatter.__module__}.{formatter.__qualname__}"}},
        "handlers": {
            "model_server": {
                "class": "logging.StreamHandler",
                "formatter": "model_server",
                "stream": "ext://sys.stderr",
                ".": {_HANDLER_MARK: True},
            },
        },
        "root": {"level": _root_level(level), "handlers": ["model_server"]},
        "loggers": {
            # No handlers of their own: they propagate to the root's one handler.
            "gunicorn.error": {"level": level, "handlers": [], "propagate": True},
            # Gunicorn logs access whenever logconfig_dict is set; the app's own line (app.access:
            # request id, rows, batch, model) already says all its line would, so it goes nowhere.
            "gunicorn.access": {"level": "INFO", "handlers": [], "propagate": False},
            "app": {"level": level, "handlers": [], "propagate": True},
        },
    }


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
    probe = request.path in PROBE_PATHS
    if access_log.isEnabledFor(logging.INFO) and (not probe or current_app.config[_PROBES_KEY]):
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


def init_app(app: Flask, *, access: bool = True, probes: bool = False) -> None:
    app.config[_PROBES_KEY] = probes
    app.before_request(_start)
    app.after_request(_finish)
    access_log.disabled = not access
