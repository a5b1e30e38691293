"""Logs as an operator reads them: with LOG_FORMAT=json every line a server writes is JSON.

One real `gunicorn -c gunicorn.conf.py wsgi:app` with two workers, started without
TF_CPP_MIN_LOG_LEVEL (TensorFlow's C++ start-up lines ignore it anyway), serves a few
requests and stops; then each line of its stdout and stderr must parse as a JSON object
with a UTC timestamp that carries its zone, Gunicorn's own lines included. The rest are
unit checks of the formatters and of the access log's probe rule, on Flask's test client.
"""

from __future__ import annotations

import io
import json
import logging
import logging.config
import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta

import pytest
import requests
from flask import Flask
from prometheus_client import CollectorRegistry

from app.core.exchange import Exchanges
from app.http.layers import ExchangeLayer
from app.ops import logs, runtime
from app.ops.metrics import Metrics
from tests.conftest import REPO, Server, integer_rows

WORKERS = 2


@pytest.fixture(scope="module")
def json_log_lines(tmp_path_factory, exact_model_path) -> list[dict]:
    server = Server(tmp_path_factory.mktemp("json-logs"), {"LOG_FORMAT": "json", "MODEL_PATH": str(exact_model_path),
                                                            "MAX_BATCH_SIZE": "4", "MAX_QUEUE_ROWS": "16"})
    server.env.pop("TF_CPP_MIN_LOG_LEVEL")
    # oneDNN on, so that TensorFlow has a native I-level line to print on any CPU (see
    # test_tensorflow_native_lines_are_json_and_shown_only_at_debug): at INFO it must not show.
    server.env["TF_ENABLE_ONEDNN_OPTS"] = "1"
    try:
        server.start(workers=WORKERS)
        assert server.predict(integer_rows(2)).status_code == 200
        assert requests.get(server.url + "/no-such-route", timeout=30).status_code == 404
        for probe in sorted(logs.PROBE_PATHS):
            assert requests.get(server.url + probe, timeout=30).status_code == 200
    finally:
        assert server.stop(signum=signal.SIGTERM) == 0
    text = server.log()
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, text
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not JSON: {line!r}\n--- whole log ---\n{text}")
    return parsed


def test_every_line_is_a_json_object_with_a_utc_time(json_log_lines):
    for entry in json_log_lines:
        assert isinstance(entry, dict)
        assert {"time", "level", "logger", "pid", "message"} <= entry.keys(), entry
        stamp = datetime.fromisoformat(entry["time"])
        assert stamp.utcoffset() == timedelta(0), entry["time"]


def test_gunicorn_lines_are_json_too(json_log_lines):
    messages = [entry["message"] for entry in json_log_lines if entry["logger"] == "gunicorn.error"]
    assert any(message.startswith("Starting gunicorn") for message in messages)
    assert sum(message.startswith("Booting worker with pid") for message in messages) == WORKERS


def test_tensorflow_configured_once_per_worker(json_log_lines):
    configured = [entry["pid"] for entry in json_log_lines
                  if entry["logger"] == "app.ops.runtime" and entry["message"].startswith("tensorflow configured")]
    assert len(configured) == len(set(configured)) == WORKERS


def test_tensorflow_native_start_up_lines_are_not_logged_at_info(json_log_lines):
    assert not [entry for entry in json_log_lines if "oneDNN" in entry["message"] or "absl" in entry["message"]]


def test_one_access_line_per_request_and_none_for_probes(json_log_lines):
    access = [entry for entry in json_log_lines if entry["message"] == "access"]
    assert sorted((entry["method"], entry["path"], entry["status"]) for entry in access) == [
        ("GET", "/no-such-route", 404), ("POST", "/predict", 200)]
    assert all(entry["logger"] == "app.access" and entry["request_id"] for entry in access)


# At INFO, the server above shows none: each level costs a TensorFlow import, and a server's
# workers import it at INFO anyway.
@pytest.mark.parametrize("level", ["DEBUG"])
def test_tensorflow_native_lines_are_json_and_shown_only_at_debug(level):
    code = ("from app.ops import logs, runtime; from app.ops.settings import Settings; "
            f"logs.configure_logging({level!r}, 'json'); runtime.import_tensorflow(Settings(log_level={level!r}))")
    environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    # TensorFlow prints its 'oneDNN custom operations are on' line (an I-level native line) only
    # when oneDNN is on, and by default that depends on the CPU: on one without AVX-512 (an AMD
    # EPYC here) it is off and nothing native is printed at I level. On, the line is printed anywhere.
    environ["TF_ENABLE_ONEDNN_OPTS"] = "1"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environ, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    entries = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
    native = [entry for entry in entries if "oneDNN custom operations are on" in entry["message"]]
    assert all(entry["level"] == "DEBUG" and entry["logger"] == "app.ops.runtime" for entry in native)
    assert bool(native) == (level == "DEBUG")


# ---------------------------------------------------------------------------- units


def record(message: str = "hello", created: float = 0.0) -> logging.LogRecord:
    entry = logging.LogRecord("app.test", logging.INFO, __file__, 1, message, None, None)
    entry.created = created
    return entry


def test_json_and_text_lines_carry_utc_time_with_zone():
    assert json.loads(logs.JsonFormatter().format(record(created=1.25)))["time"] == "1970-01-01T00:00:01.250+00:00"
    assert logs.TextFormatter().format(record(created=1.25)).startswith("1970-01-01T00:00:01.250+00:00 INFO")


def test_gunicorn_logconfig_gives_every_logger_the_one_json_handler():
    root, app_logger = logging.getLogger(), logging.getLogger("app")
    saved = (root.handlers[:], root.level, app_logger.level)
    root.handlers.clear()
    try:
        logging.config.dictConfig(logs.gunicorn_logconfig("INFO", "json"))
        [handler] = root.handlers
        assert isinstance(handler.formatter, logs.JsonFormatter)
        assert handler.model_server is True
        assert logging.getLogger("gunicorn.error").handlers == []
        assert logging.getLogger("gunicorn.error").propagate
        # The worker's configure_logging finds that handler and adds no second one.
        logs.configure_logging("INFO", "json")
        assert root.handlers == [handler]
    finally:
        root.handlers[:], _, _ = saved
        root.setLevel(saved[1])
        app_logger.setLevel(saved[2])


@pytest.mark.parametrize("line, level", [
    ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR", logging.DEBUG),
    ("I0000 00:00:1795436698.854311    6199 port.cc:153] oneDNN custom operations are on.", logging.DEBUG),
    ("E0000 00:00:1795436698.854311    6199 cuda_dnn.cc:8] Unable to register cuDNN factory", logging.WARNING),
    ("ImportError: libcudart.so.12: cannot open shared object file", logging.WARNING),
])
def test_native_lines_are_debug_only_when_known_noise(caplog, line, level):
    with caplog.at_level(logging.DEBUG, logger="app.ops.runtime"):
        runtime.log_native_lines(line + "\n\n")
    assert [(entry.levelno, entry.getMessage()) for entry in caplog.records] == [(level, f"tensorflow: {line}")]


@pytest.mark.parametrize("text, levels", [
    # TensorFlow's CPU-features INFO is two lines; the second has no prefix and is still INFO.
    ("I0000 00:00:1.0 1 cpu_feature_guard.cc:227] This TensorFlow binary is optimized ...\n"
     "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow ...\n",
     [logging.DEBUG, logging.DEBUG]),
    ("E0000 00:00:1.0 1 cuda_dnn.cc:8] Unable to register cuDNN factory\nsecond line\n",
     [logging.WARNING, logging.WARNING]),
    # After absl's one-line banner, an unprefixed line is a record of its own: not noise.
    ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
     "ImportError: libcudart.so.12: cannot open shared object file\n", [logging.DEBUG, logging.WARNING]),
    ("I0000 00:00:1.0 1 port.cc:153] oneDNN custom operations are on.\n"
     "W0000 00:00:1.0 1 gpu_device.cc:2] Cannot dlopen some GPU libraries\n", [logging.DEBUG, logging.WARNING]),
])
def test_a_native_records_later_lines_take_its_level(caplog, text, levels):
    with caplog.at_level(logging.DEBUG, logger="app.ops.runtime"):
        runtime.log_native_lines(text)
    assert [(entry.levelno, entry.getMessage()) for entry in caplog.records] == [
        (level, f"tensorflow: {line}") for level, line in zip(levels, text.splitlines(), strict=True)]


def test_python_records_made_while_native_lines_are_captured_go_out_as_themselves():
    """The TensorFlow import logs through Python too (h5py, matplotlib at DEBUG): those records
    are written as they are, not captured with the native lines and re-logged as warnings."""
    code = (
        "import logging, os\n"
        "from app.ops import logs, runtime\n"
        "logs.configure_logging('DEBUG', 'json')\n"
        "with runtime.native_stderr_logged():\n"
        "    logging.getLogger('some.library').debug('a python record')\n"
        "    os.write(2, b'I0000 00:00:1.0 1 cpu_feature_guard.cc:227] optimized\\nTo enable: AVX2 FMA\\n')\n"
        "logging.getLogger('some.library').info('after')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    entries = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
    assert [(entry["logger"], entry["level"], entry["message"]) for entry in entries] == [
        ("some.library", "DEBUG", "a python record"),
        ("app.ops.runtime", "DEBUG", "tensorflow: I0000 00:00:1.0 1 cpu_feature_guard.cc:227] optimized"),
        ("app.ops.runtime", "DEBUG", "tensorflow: To enable: AVX2 FMA"),
        ("some.library", "INFO", "after"),
    ]


@pytest.mark.parametrize("probes, logged", [
    (False, ["/predict"]),
    (True, ["/healthz", "/metrics", "/predict", "/readyz"]),
])
def test_probes_are_access_logged_only_when_asked(caplog, probes, logged):
    app = Flask("probe-logs")
    app.wsgi_app = ExchangeLayer(app.wsgi_app, exchanges=Exchanges(Metrics(CollectorRegistry())), timeout_s=None,  # type: ignore[method-assign]
                                 probes=probes)
    for path in ("/healthz", "/readyz", "/metrics", "/predict"):
        app.add_url_rule(path, path, lambda: "ok")
    with caplog.at_level(logging.INFO, logger="app.access"), app.test_client() as client:
        for path in ("/healthz", "/readyz", "/metrics", "/predict"):
            assert client.get(path).status_code == 200
    assert sorted(entry.fields["path"] for entry in caplog.records if entry.name == "app.access") == logged


@pytest.mark.parametrize("created", [
    1_000_000.9999995, 1_000_000.0004999, 1_000_000.9995, 1_000_000.0005, 59.9999995, 0.0, -0.5, -1.0000004,
    1_795_810_714.123456, 1_795_810_714.9999996, 1_795_810_715.0004,
])
def test_timestamps_are_what_datetime_writes_to_the_millisecond(created):
    # Microseconds round half to even before the cut to milliseconds: .9999995 is the next second.
    for when in (created, created + 1):  # the next second's text is made anew
        assert logs.utc_timestamp(when) == datetime.fromtimestamp(when, tz=UTC).isoformat(timespec="milliseconds")


def test_access_fields_of_the_real_app_in_process(in_process_app, exact_model_path, caplog):
    client = in_process_app(model_path=str(exact_model_path), access_log=True).test_client()
    rows = {"instances": integer_rows(2).tolist()}
    with caplog.at_level(logging.INFO, logger="app.access"):
        given = client.post("/predict", json=rows, headers={"X-Request-ID": "trace-7"})
        made = client.post("/v1/models/default:predict", json=rows)
        lost = client.get("/caf%C3%A9/%FF")  # a path that is not UTF-8 is logged as Werkzeug reads it
        logs.flush_access_log()
    assert (given.status_code, made.status_code, lost.status_code) == (200, 200, 404)
    assert given.headers["X-Request-ID"] == "trace-7"
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["X-Request-ID"])
    lines = [dict(entry.fields) for entry in caplog.records if entry.name == "app.access"]
    assert all(line.pop("latency_ms") > 0 for line in lines)
    served = {"status": 200, "rows": 2, "batch_rows": 2, "batch_requests": 1, "model": "default"}
    assert lines == [
        {"method": "POST", "path": "/predict", **served, "request_id": "trace-7"},
        {"method": "POST", "path": "/v1/models/default:predict", **served, "request_id": made.headers["X-Request-ID"]},
        {"method": "GET", "path": "/caf\u00e9/\ufffd", "status": 404, "rows": None, "batch_rows": None,
         "batch_requests": None, "model": None, "request_id": lost.headers["X-Request-ID"]},
    ]


class _Collecting(logging.Handler):
    """Keeps the records it is handed; `gate` (when set) holds each emit until it opens."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.arrived = threading.Condition()
        self.gate = gate

    def emit(self, record: logging.LogRecord) -> None:
        if self.gate is not None:
            self.gate.wait()
        with self.arrived:
            self.records.append(record)
            self.arrived.notify_all()

    def wait_for(self, count: int) -> None:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.records) >= count, timeout=30), len(self.records)


@pytest.fixture
def access_logger():
    logger = logging.getLogger("test.access-writer")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    yield logger
    logger.handlers.clear()


def test_access_writer_writes_every_line_off_the_request_threads_in_order(access_logger):
    handler = _Collecting()
    access_logger.addHandler(handler)
    writer = logs.AccessWriter(access_logger)
    per_thread = 250

    def put(thread: int) -> None:
        for index in range(per_thread):
            writer.put(1_000_000.0 + index / 1000, {"thread": thread, "index": index})

    threads = [threading.Thread(target=put, args=(number,)) for number in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    handler.wait_for(4 * per_thread)  # no flush(): the writer's own thread delivers them
    writer.close()
    assert len(handler.records) == 4 * per_thread
    assert {record.threadName for record in handler.records} == {"access-log"}
    for number in range(4):
        mine = [record for record in handler.records if record.fields["thread"] == number]
        assert [record.fields["index"] for record in mine] == list(range(per_thread))
        # The time a line carries is the request's, not the time the writer reached it.
        assert [record.created for record in mine] == [1_000_000.0 + index / 1000 for index in range(per_thread)]
    assert {(record.name, record.levelno, record.getMessage()) for record in handler.records} == {
        ("test.access-writer", logging.INFO, "access")}


def test_access_writer_holds_a_bounded_backlog_when_its_output_stalls(access_logger):
    gate = threading.Event()
    handler = _Collecting(gate)
    access_logger.addHandler(handler)
    writer = logs.AccessWriter(access_logger, linger_s=0, max_pending=3)
    putter = threading.Thread(target=lambda: [writer.put(float(index), {"index": index}) for index in range(10)])
    putter.start()
    # The writer is stuck in the handler with one line; three more may wait; the putter then
    # writes its own line, which waits on the stalled output too, rather than piling up.
    putter.join(0.5)
    assert putter.is_alive() and len(writer._pending) <= 3
    gate.set()
    putter.join(30)
    writer.close()
    assert [record.fields["index"] for record in handler.records] == list(range(10))


def test_close_writes_what_is_still_pending(access_logger):
    handler = _Collecting()
    access_logger.addHandler(handler)
    writer = logs.AccessWriter(access_logger, linger_s=60)  # would not write for a minute by itself
    for index in range(5):
        writer.put(float(index), {"index": index})
    writer.close()
    assert [record.fields["index"] for record in handler.records] == list(range(5))


class _CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[str] = []

    @property
    def writes(self) -> int:
        return len(self.pieces)

    def write(self, text: str) -> int:
        self.pieces.append(text)
        return super().write(text)


def _stream_handler(logger: logging.Logger, handler_class: type = logging.StreamHandler) -> _CountingStream:
    stream = _CountingStream()
    handler = handler_class(stream)
    handler.setFormatter(logs.TextFormatter())
    logger.addHandler(handler)
    return stream


def test_access_writer_writes_a_batch_of_lines_to_a_stream_in_one_write(access_logger):
    stream = _stream_handler(access_logger)
    writer = logs.AccessWriter(access_logger, linger_s=60)  # only flush() writes
    for index in range(5):
        writer.put(1_000_000.0 + index, {"index": index})
    writer.flush()
    # A write (and a flush) per line would be a system call per request, each handing the GIL
    # to another thread under load.
    assert stream.writes == 1
    lines = stream.getvalue().splitlines()
    assert [line.rsplit(" ", 1)[1] for line in lines] == [f"index={index}" for index in range(5)]
    assert [line.split(" ", 1)[0] for line in lines] == [logs.utc_timestamp(1_000_000.0 + index) for index in range(5)]
    # The handler writes to its own stream again afterwards, a line at a time.
    access_logger.info("after", extra={"fields": {"index": 5}})
    assert stream.writes == 2 and stream.getvalue().splitlines()[-1].endswith("after index=5")
    writer.close()


def test_more_lines_than_a_pipe_takes_at_once_go_in_whole_lines_of_at_most_pipe_buf(access_logger):
    stream = _stream_handler(access_logger)
    writer = logs.AccessWriter(access_logger, linger_s=60)
    for index in range(40):
        writer.put(1_000_000.0 + index, {"index": index, "padding": "x" * 250})
    writer.flush()
    writer.close()
    # Every worker writes to one stderr pipe: a write of at most PIPE_BUF bytes lands whole,
    # a longer one may be cut by another process's lines when the pipe is full.
    assert stream.writes > 1
    assert all(len(piece.encode()) <= select.PIPE_BUF and piece.endswith("\n") for piece in stream.pieces)
    lines = "".join(stream.pieces).splitlines()
    assert [line.split(" index=")[1].split(" ")[0] for line in lines] == [str(index) for index in range(40)]


def test_a_handler_reached_twice_writes_to_its_own_stream_afterwards(access_logger):
    stream = _CountingStream()
    handler = logging.StreamHandler(stream)
    access_logger.addHandler(handler)
    child = access_logger.getChild("twice")
    child.addHandler(handler)  # the same handler on the logger and on its parent
    writer = logs.AccessWriter(child, linger_s=60)
    writer.put(1_000_000.0, {"index": 0})
    writer.flush()
    writer.close()
    assert handler.stream is stream
    assert stream.getvalue() == "access\naccess\n"  # logging calls it once per logger, as ever
    child.removeHandler(handler)


def test_a_stream_handler_subclass_keeps_its_own_writes(access_logger):
    class Decorated(logging.StreamHandler):
        pass

    stream = _stream_handler(access_logger, Decorated)
    writer = logs.AccessWriter(access_logger, linger_s=60)
    for index in range(3):
        writer.put(1_000_000.0 + index, {"index": index})
    writer.flush()
    writer.close()
    # A subclass may size, rotate or decorate its stream (RotatingFileHandler, pytest's live
    # log): its stream is never swapped, and it writes each record itself.
    assert stream.writes == 3


@pytest.fixture
def shared_random_state():
    state = random.getstate()
    yield
    random.setstate(state)  # the tests after this one get the shared generator as it was


def test_request_ids_do_not_follow_the_shared_random_seed(shared_random_state):
    # Keras' set_random_seed seeds Python's shared generator: ids must not repeat after it.
    random.seed(7)
    first = logs.accept_request_id("")
    random.seed(7)
    assert logs.accept_request_id("") != first


def test_request_ids_of_forked_workers_differ():
    """Ids come from the module's random generator: each forked worker must draw its own."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one id, then out without running the parent's clean-up
        try:
            os.write(write, logs.accept_request_id("").encode())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    parent = logs.accept_request_id("")
    assert re.fullmatch(r"[0-9a-f]{32}", parent) and re.fullmatch(r"[0-9a-f]{32}", child)
    assert child != parent


def test_gunicorn_builds_no_access_line_of_its_own():
    """gunicorn.conf.py's logger: with logconfig_dict set, Gunicorn's own would build an access
    line's atoms for every request (a few % of a request thread's time) only to drop them."""
    script = (
        "import runpy\n"
        "from gunicorn.config import Config\n"
        "conf = runpy.run_path('gunicorn.conf.py')\n"
        "cfg = Config()\n"
        "cfg.set('logconfig_dict', conf['logconfig_dict'])\n"
        "class Untouchable:\n"
        "    def __getattr__(self, name):\n"
        "        raise AssertionError(f'the access line read {name}')\n"
        "logger = conf['logger_class'](cfg)\n"
        "logger.access(Untouchable(), Untouchable(), {}, None)\n"
        "print(logger.access_log_enabled)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"
