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

import atexit
import collections
import logging
import math
import os
import random
import re
import threading
import time
import traceback
from datetime import UTC, datetime
from typing import Any

import orjson

from app.ops import patches

access_log = logging.getLogger("app.access")

REQUEST_ID_HEADER = "X-Request-ID"
# Matched with fullmatch: "$" would also match before a final newline.
_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Asked every few seconds by orchestrators and Prometheus: not worth a line each.
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Marks the handler this module installs, so configuring again never adds a second one.
_HANDLER_MARK = "model_server"


# The text of the last second a line was stamped in: the lines of one second share it.
_second_text: tuple[int, str] = (-1, "")


def utc_timestamp(created: float) -> str:
    """ISO 8601 in UTC with its zone, to the millisecond: 2026-11-23T12:00:00.123+00:00.

    What datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds") writes (the
    microseconds rounded half to even, then cut to milliseconds), with the date and time of
    day made once per second: every log line pays for this, the access lines most of all.
    """
    global _second_text
    fraction, whole = math.modf(created)
    second, micro = int(whole), round(fraction * 1e6)
    if micro >= 1_000_000:
        second, micro = second + 1, micro - 1_000_000
    elif micro < 0:
        second, micro = second - 1, micro + 1_000_000
    cached = _second_text
    if cached[0] != second:
        cached = _second_text = (second, datetime.fromtimestamp(second, tz=UTC).isoformat()[:19])
    return f"{cached[1]}.{micro // 1000:03d}+00:00"


# What JSON lets through raw, but a reader may take for a line break (NEL, U+2028, U+2029) or
# a terminal for a control (the C1 set, DEL): orjson writes them as they are, and only inside
# strings, where a \u escape means the same to any JSON parser.
_JSON_RAW = re.compile("[\x7f-\x9f\u2028\u2029]")


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
        try:
            line = orjson.dumps(entry).decode()
        except (TypeError, ValueError):
            # A lone surrogate or a value orjson cannot write: the record is still one line,
            # never a "--- Logging error ---" that loses it.
            line = orjson.dumps({key: _json_safe(value) for key, value in entry.items()}).decode()
        return _JSON_RAW.sub(lambda found: f"\\u{ord(found.group()):04x}", line)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return utc_timestamp(record.created)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{key}={text_value(value)}" for key, value in fields.items() if value is not None)
        # A lone surrogate anywhere (a message quoting a client's text) would make the stream's
        # encoder fail and the record be lost.
        return line if line.isascii() else line.encode("utf-8", "backslashreplace").decode("utf-8")


# What a client could use to start a line of its own or to drive a terminal: C0 and C1 controls
# (ESC, CR, LF, NEL \x85), DEL, the Unicode line and paragraph separators, and lone surrogates.
# Backslash and quote are escaped too, so an escape in a value cannot be forged either.
_TEXT_ESCAPES = {code: f"\\x{code:02x}" for code in [*range(0x20), *range(0x7f, 0xa0)]}
_TEXT_ESCAPES.update({0x2028: "\\u2028", 0x2029: "\\u2029", ord("\\"): "\\\\", ord('"'): '\\"'})
_NEEDS_QUOTES = re.compile(r'[\s="\\]|^$')
_SURROGATE = re.compile("[\ud800-\udfff]")


def text_value(value: Any) -> str:
    """A field's value as one token of a text line: escaped, and quoted if it holds a space or '='."""
    if isinstance(value, (int, float)):
        return str(value)
    text = str(value)
    if text.isascii() and text.isprintable() and " " not in text and "=" not in text and '"' not in text \
            and "\\" not in text and text:
        return text
    escaped = _SURROGATE.sub(lambda found: f"\\u{ord(found.group()):04x}", text.translate(_TEXT_ESCAPES))
    return f'"{escaped}"' if _NEEDS_QUOTES.search(escaped) else escaped


def _json_safe(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return _json_safe(repr(value))


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


# New request ids: 128 random bits from a generator of this module's own, not uuid4, whose
# os.urandom is a system call that hands the GIL to another thread under load. Seeded from
# the OS, and again in each forked worker; its own instance, so that a library seeding the
# shared `random` (Keras' set_random_seed does) cannot give every worker the same ids.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def accept_request_id(given: str) -> str:
    """The client's X-Request-ID (or gRPC's x-request-id metadata) if it is a sane token, else a new id."""
    return given if given and _SANE_ID.fullmatch(given) else f"{_ids.getrandbits(128):032x}"


class AccessWriter:
    """Access lines made into log records and handed to the handlers by one background thread.

    A request thread only appends its fields to a deque: making the record, formatting it and
    writing it (a write and a flush per line) happen here, in batches. The thread wakes for the
    first line of a batch, lingers `linger_s` while more arrive, then writes them all: under load
    that is one wake-up per batch, not per request. Lines are never dropped: past `max_pending`
    unwritten lines (a stalled stderr), request threads write their own, as they did before.
    """

    def __init__(self, logger: logging.Logger, *, linger_s: float = 0.02, max_pending: int = 10_000) -> None:
        self._logger = logger
        self._linger_s = linger_s
        self._max_pending = max_pending
        self._pending: collections.deque[tuple[float, dict[str, Any]]] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # Held while records are handed over, so that flush() and the thread keep the lines in order.
        self._writing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="access-log", daemon=True)
        self._thread.start()

    def put(self, created: float, fields: dict[str, Any]) -> None:
        if len(self._pending) >= self._max_pending:
            with self._writing:
                self._write_pending()
                self._write(created, fields)
            return
        self._pending.append((created, fields))
        if not self._wake.is_set():
            self._wake.set()

    def flush(self) -> None:
        """Write every line put so far, from the calling thread."""
        with self._writing:
            self._write_pending()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)
        self.flush()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._stop.wait(self._linger_s)  # returns at once when stopping
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # a failing handler reports through handleError; this is anything else
                traceback.print_exc()

    def _write_pending(self) -> None:
        with patches.batched_writes(self._logger):
            while True:
                try:
                    created, fields = self._pending.popleft()
                except IndexError:
                    return
                self._write(created, fields)

    def _write(self, created: float, fields: dict[str, Any]) -> None:
        entry = self._logger.makeRecord(self._logger.name, logging.INFO, "", 0, "access", (), None,
                                        extra={"fields": fields})
        # The time the request ended, not the time this thread got to it.
        entry.relativeCreated += (created - entry.created) * 1000
        entry.created = created
        entry.msecs = int((created - int(created)) * 1000) + 0.0
        self._logger.handle(entry)


_writer: AccessWriter | None = None
_writer_lock = threading.Lock()


def start_access_writer() -> AccessWriter:
    """The process's one access-log thread (started once, however many apps the process makes)."""
    global _writer
    with _writer_lock:
        if _writer is None:
            _writer = AccessWriter(access_log)
            atexit.register(_writer.close)
        return _writer


def flush_access_log() -> None:
    if _writer is not None:
        _writer.flush()


def log_access(fields: dict[str, Any], *, writer: AccessWriter | None = None) -> None:
    if writer is not None:
        writer.put(time.time(), fields)
    else:
        access_log.info("access", extra={"fields": fields})
