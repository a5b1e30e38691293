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
the arrays on a bounded queue; a full queue drops the record and counts it. One daemon
thread per process serializes, writes and sends. Each process writes its own files
(host, pid and start time in the name), rotated at PAYLOAD_LOG_MAX_FILE_BYTES; TensorFlow's
TFRecordWriter writes them where the process has TensorFlow, records framed here where not.
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
    """Samples predictions onto a bounded queue; a daemon thread writes and sends them."""

    def __init__(self, *, rates: dict[str, float], default_rate: float, directory: str | None, url: str,
                 max_file_bytes: int, buffer_records: int, count_drop: Callable[[str], None],
                 to_record: Callable[[Entry], bytes], sample: Callable[[], float] = random.random) -> None:
        self._rates = rates
        # An entry's serialized PredictionLog (app/wire/prediction_log.py): the record format is the wire's.
        self._to_record = to_record
        self._default_rate = default_rate
        self._sample = sample
        self._count_drop = count_drop
        self._queue: queue.Queue[Entry | None] = queue.Queue(maxsize=buffer_records)
        self._files = RecordFiles(directory, max_file_bytes, open_file=record_writer()) if directory else None
        self._url = url
        self._thread = threading.Thread(target=self._run, name="payload-log", daemon=True)
        self._thread.start()

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
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self._count_drop("buffer_full")

    def close(self, timeout_s: float | None = 5.0) -> None:
        """Write what is queued (if the queue has room for the stop mark), then stop the thread."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                break
            self._handle(entry)
            if self._files is not None and self._queue.empty():
                self._files.flush()  # a reader sees whole records whenever the writer is idle
        if self._files is not None:
            self._files.close()

    def _handle(self, entry: Entry) -> None:
        # Anything may go wrong with a disk or a receiver; the thread must outlive it.
        if self._files is not None:
            try:
                self._files.write(self._to_record(entry))
            except Exception:
                log.exception("payload log: a record could not be written")
                self._count_drop("write_failed")
        if self._url:
            try:
                send_cloud_events(self._url, entry)
            except Exception as exc:
                log.warning("payload log: CloudEvents to %s failed: %s", self._url, exc)
                self._count_drop("send_failed")






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


def send_cloud_events(url: str, entry: Entry) -> None:
    """The request and the response, each one CloudEvent in HTTP binary mode."""
    for kind, body in ((REQUEST_TYPE, {"inputs": tensors_json(entry.inputs)}),
                       (RESPONSE_TYPE, {"outputs": tensors_json(entry.outputs)})):
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
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
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
    dropped = metrics.payload_log_dropped
    payload_log = PayloadLog(rates=rates, default_rate=settings.payload_log_sampling_rate,
                             directory=settings.payload_log_dir, url=settings.payload_log_url,
                             max_file_bytes=settings.payload_log_max_file_bytes,
                             buffer_records=settings.payload_log_buffer_records,
                             count_drop=lambda reason: dropped.labels(reason).inc(), to_record=to_record)
    atexit.register(payload_log.close)
    return payload_log
