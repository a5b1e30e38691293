"""Payload logging: sampled predictions, written as TF Serving's PredictionLog records.

TF Serving logs a request and its response when the model's `logging_config` asks
(core/request_logger.cc: each request is kept with probability `sampling_rate`). Here the
rate is the model's `payload_log_sampling_rate` in MODEL_CONFIG (a ModelServerConfig's
`logging_config.sampling_config.sampling_rate`), or PAYLOAD_LOG_SAMPLING_RATE.

A kept prediction becomes one `tensorflow.serving.PredictionLog` with `predict_log` (the
request's inputs and the answer's outputs as TensorProtos, the model spec of the version
that answered) and `log_metadata` (built by app/wire/prediction_log.py, handed in as `to_record`),
written to TFRecord files under PAYLOAD_LOG_DIR, the format warm-up reads (app/wire/warmup.py).
Every protocol is logged as a predict: a v2 request's tensors map one to one onto the inputs,
and classify or regress log their serialized examples as the `inputs` tensor. With
PAYLOAD_LOG_URL each one is also posted as two CloudEvents (binary mode, as KServe's logger
sends them): the request, then the response.

Logging never slows or fails a request: the request thread only draws the sample and puts
the arrays on each destination's bounded buffer; a full buffer drops the entry and counts it.
The files and the CloudEvents each have their own buffer and daemon thread, so a sink that
stalls or refuses costs the files nothing. Each process writes its own files (host, pid and
start time in the name), rotated at PAYLOAD_LOG_MAX_FILE_BYTES; TensorFlow's TFRecordWriter
writes them where the process has TensorFlow, records framed here where not.
"""

from __future__ import annotations

import atexit
import base64
import dataclasses
import datetime
import json
import logging
import os
import queue
import random
import socket
import struct
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from app.ops.metrics import Metrics
from app.ops.settings import Settings, SettingsError, model_configs

log = logging.getLogger(__name__)

REQUEST_TYPE = "org.kubeflow.serving.inference.request"
RESPONSE_TYPE = "org.kubeflow.serving.inference.response"
EVENT_TYPES = (REQUEST_TYPE, RESPONSE_TYPE)  # a record's two CloudEvents, in the order they are sent
SEND_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class Entry:
    """One sampled prediction, as the request thread hands it over: nothing serialized yet."""

    request_id: str
    model_name: str
    version: int
    signature_name: str
    rate: float
    timestamp: float
    inputs: Mapping[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    tf_dtypes: dict[str, str]


class PayloadLog:
    """Samples predictions and hands each kept one to the files and to the CloudEvents sender."""

    def __init__(self, *, rates: dict[str, float], default_rate: float, files: FileWriter | None,
                 events: EventSender | None, sample: Callable[[], float] = random.random) -> None:
        self._rates = rates
        self._default_rate = default_rate
        self._sample = sample
        self._files = files
        self._events = events
        self._destinations = [destination for destination in (files, events) if destination is not None]

    def rate(self, model_name: str) -> float:
        return self._rates.get(model_name, self._default_rate)

    def offer(self, inputs: Mapping[str, np.ndarray], answer: Any, request_id: str) -> None:
        """Keep this prediction with the model's sampling rate; never blocks, never raises."""
        model = answer.servable.model
        rate = self.rate(model.name)
        if rate <= 0 or self._sample() >= rate:
            return
        signature = answer.signature
        tf_dtypes = {spec.name: spec.tf_dtype for spec in (*signature.inputs, *signature.outputs)}
        entry = Entry(request_id, model.name, model.version, signature.name, rate, time.time(), inputs,
                      answer.outputs, tf_dtypes)
        for destination in self._destinations:
            destination.put(entry)

    def close(self, timeout_s: float = SEND_TIMEOUT_S) -> None:
        """Write what the files' buffer holds and close them, and send what the sender's holds, within
        `timeout_s`; the sender has at most its `stop_timeout_s`, so a stalled sink cannot hold up a
        stop: what it has not sent by then counts as not sent, and its thread is left behind."""
        start = time.monotonic()
        for destination in self._destinations:
            destination.close()
        if self._files is not None:
            self._files.join(start + timeout_s)
        if self._events is not None and not self._events.join(start + min(timeout_s, self._events.stop_timeout_s)):
            self._events.abandon()


class _Destination:
    """One destination of sampled entries, with its own bounded buffer and daemon thread: the
    request thread never waits on it (a full buffer drops and counts), nor does any other one."""

    def __init__(self, name: str, *, buffer_records: int) -> None:
        self._queue: queue.Queue[Entry | None] = queue.Queue(maxsize=buffer_records)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, entry: Entry) -> None:
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self._dropped("buffer_full")

    def close(self) -> None:
        """Take no more; the thread finishes what its buffer holds, then ends."""
        self._closing = True
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # the thread is busy, not waiting: it sees _closing once its buffer is empty

    def join(self, deadline: float) -> bool:
        """Wait for the thread to end, until `deadline` (time.monotonic); True if it ended."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            try:
                entry = self._queue.get(block=not self._closing)
            except queue.Empty:
                break
            if entry is None:
                break
            self._take(entry)
            if self._queue.empty():
                self._idle()
        self._finish()

    def _dropped(self, reason: str) -> None:
        raise NotImplementedError

    def _take(self, entry: Entry) -> None:
        raise NotImplementedError

    def _idle(self) -> None:
        pass

    def _finish(self) -> None:
        pass


class FileWriter(_Destination):
    """Writes each entry as the record `to_record` makes of it (a PredictionLog's bytes:
    app/wire/prediction_log.py); `count_drop(reason)` once per record not written."""

    def __init__(self, files: RecordFiles, *, buffer_records: int, count_drop: Callable[[str], None],
                 to_record: Callable[[Entry], bytes]) -> None:
        self._files = files
        self._count_drop = count_drop
        self._to_record = to_record
        super().__init__("payload-log-files", buffer_records=buffer_records)

    def _dropped(self, reason: str) -> None:
        self._count_drop(reason)

    def _take(self, entry: Entry) -> None:
        # Anything may go wrong with a disk; the thread must outlive it.
        try:
            self._files.write(self._to_record(entry))
        except Exception:
            log.exception("payload log: a record could not be written")
            self._count_drop("write_failed")

    def _idle(self) -> None:
        try:
            self._files.flush()  # a reader sees whole records whenever the writer is idle
        except Exception:
            log.exception("payload log: the records could not be flushed")

    def _finish(self) -> None:
        self._files.close()


class EventSender(_Destination):
    """Posts each entry as two CloudEvents, request then response; `count_drop(reason)` once per
    event not sent. A failure is logged when sending starts failing, not for every event."""

    def __init__(self, url: str, *, buffer_records: int, count_drop: Callable[[str], None],
                 send: Callable[[str, dict[str, str], bytes], None] | None = None,
                 stop_timeout_s: float = SEND_TIMEOUT_S) -> None:
        self._url = url
        self.stop_timeout_s = stop_timeout_s
        self._count_drop = count_drop
        self._send = send or post_event
        self._failing = False
        self._abandoned = False
        super().__init__("payload-log-events", buffer_records=buffer_records)

    def abandon(self) -> None:
        """The stop's time is up: count what is buffered (and, when its send returns, what the
        thread holds) as not sent. The thread is a daemon: it does not hold up the exit."""
        self._abandoned = True
        while True:
            try:
                entry = self._queue.get_nowait()
            except queue.Empty:
                return
            if entry is not None:
                self._dropped("send_failed")

    def _dropped(self, reason: str) -> None:
        for _ in EVENT_TYPES:
            self._count_drop(reason)

    def _take(self, entry: Entry) -> None:
        # Anything may go wrong with an entry or a receiver; the thread must outlive it.
        try:
            events = cloud_events(entry)
        except Exception:
            log.exception("payload log: a record's CloudEvents could not be made")
            self._dropped("send_failed")
            return
        for headers, body in events:
            if self._abandoned:
                self._count_drop("send_failed")
            else:
                self._send_one(headers, body)

    def _send_one(self, headers: dict[str, str], body: bytes) -> None:
        try:
            self._send(self._url, headers, body)
        except Exception as exc:
            self._count_drop("send_failed")
            if not self._failing:
                log.warning("payload log: CloudEvents to %s failed (counted; logged again once one is sent): %s",
                            self._url, exc)
            self._failing = True
        else:
            if self._failing:
                log.info("payload log: CloudEvents to %s are sent again", self._url)
            self._failing = False


RECORD_OVERHEAD = 16  # a TFRecord's length, its CRC and the data's CRC


class FramedFile:
    """A TFRecord file framed here, CRCs in Python: for a process without TensorFlow's runtime
    (a worker of MODEL_PROCESSES). Slower than TensorFlow's writer, which also lets go of the GIL."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "xb")

    def write(self, data: bytes) -> None:
        self._file.write(tfrecord(data))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def record_writer() -> Callable[[str], Any]:
    """TensorFlow's TFRecordWriter where this process has TensorFlow's runtime, else FramedFile."""
    tensorflow = sys.modules.get("tensorflow")
    # A worker of MODEL_PROCESSES has only a bare package for the protos (app/model_process/protos.py).
    if tensorflow is not None and hasattr(tensorflow, "io"):
        return cast(Callable[[str], Any], tensorflow.io.TFRecordWriter)
    return FramedFile


class RecordFiles:
    """TFRecord files of one process, a new one when the current one would pass `max_bytes`."""

    def __init__(self, directory: str, max_bytes: int, *, open_file: Callable[[str], Any] = FramedFile) -> None:
        os.makedirs(directory, exist_ok=True)
        self._directory = directory
        self._max_bytes = max_bytes
        self._open = open_file
        # Host, pid and start time: no two processes, nor a restarted one, ever share a file.
        started = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
        self._stem = f"prediction_log.{socket.gethostname()}.{os.getpid()}.{started}"
        self._index = 0
        self._file: Any = None
        self._size = 0

    @property
    def path(self) -> str:
        return os.path.join(self._directory, f"{self._stem}.{self._index:05d}.tfrecord")

    def write(self, data: bytes) -> None:
        size = len(data) + RECORD_OVERHEAD
        if self._file is not None and self._size and self._size + size > self._max_bytes:
            self.close()
            self._index += 1
        if self._file is None:
            self._file = self._open(self.path)
            self._size = 0
        self._file.write(data)
        self._size += size

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def _crc32c_python(data: bytes) -> int:
    crc = 0xFFFFFFFF
    table = _CRC32C_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


try:  # the C implementation where it is installed; the records are the same
    import google_crc32c

    def crc32c(data: bytes) -> int:
        return int(google_crc32c.value(data))
except ImportError:
    crc32c = _crc32c_python


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC-32C, the data, its masked CRC-32C (TensorFlow's
    record_writer.cc); written here so that a worker of MODEL_PROCESSES needs no TensorFlow."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data))


def tensors_json(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """TF Serving's columnar JSON of named tensors; bytes as {"b64": ...}, as its REST API writes them."""
    return {name: _jsonable(array) for name, array in arrays.items()}


def _jsonable(array: np.ndarray) -> Any:
    if array.dtype == object:  # a string tensor's bytes
        flat = [{"b64": base64.b64encode(item if isinstance(item, bytes) else str(item).encode()).decode()}
                for item in array.flat]
        return np.array(flat, dtype=object).reshape(array.shape).tolist() if array.ndim else flat[0]
    return array.tolist()


def cloud_events(entry: Entry) -> list[tuple[dict[str, str], bytes]]:
    """The request and the response, each one CloudEvent in HTTP binary mode: headers and body."""
    events = []
    for kind, body in zip(EVENT_TYPES, ({"inputs": tensors_json(entry.inputs)},
                                        {"outputs": tensors_json(entry.outputs)}), strict=True):
        headers = {
            "Content-Type": "application/json",
            "ce-specversion": "1.0",
            "ce-id": entry.request_id,
            "ce-type": kind,
            "ce-source": f"http://{socket.gethostname()}/",
            "ce-time": datetime.datetime.fromtimestamp(entry.timestamp, datetime.UTC).isoformat(),
            "ce-inferenceservicename": entry.model_name,
            "ce-namespace": os.environ.get("POD_NAMESPACE", ""),
            "ce-component": "predictor",
            "ce-endpoint": "",
            "ce-modelversion": str(entry.version),
        }
        events.append((headers, json.dumps(body).encode()))
    return events


def post_event(url: str, headers: dict[str, str], body: bytes) -> None:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=SEND_TIMEOUT_S) as response:
        response.read()


def start(settings: Settings, metrics: Metrics, to_record: Callable[[Entry], bytes]) -> PayloadLog | None:
    """This process's payload log, or None where no model is sampled; SettingsError where one is
    sampled and there is nowhere to log to (TF Serving refuses a logging_config without a logger)."""
    rates = {config.name: config.payload_log_sampling_rate for config in model_configs(settings)}
    if not any(rate > 0 for rate in (*rates.values(), settings.payload_log_sampling_rate)):
        return None
    if not settings.payload_log_dir and not settings.payload_log_url:
        sampled = sorted(name for name, rate in rates.items() if rate > 0) or ["(PAYLOAD_LOG_SAMPLING_RATE)"]
        raise SettingsError(f"payload logging is asked for {', '.join(sampled)} but neither PAYLOAD_LOG_DIR "
                            "nor PAYLOAD_LOG_URL says where to")
    files = events = None
    if settings.payload_log_dir:
        records = RecordFiles(settings.payload_log_dir, settings.payload_log_max_file_bytes, open_file=record_writer())
        files = FileWriter(records, buffer_records=settings.payload_log_buffer_records,
                           count_drop=lambda reason: metrics.payload_log_dropped.labels(reason).inc(),
                           to_record=to_record)
    if settings.payload_log_url:
        events = EventSender(settings.payload_log_url, buffer_records=settings.payload_log_buffer_records,
                             count_drop=lambda reason: metrics.payload_log_dropped_events.labels(reason).inc())
    payload_log = PayloadLog(rates=rates, default_rate=settings.payload_log_sampling_rate, files=files,
                             events=events)
    atexit.register(payload_log.close)
    return payload_log
