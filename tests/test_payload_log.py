"""Payload logging: sampled predictions as TF Serving PredictionLog records, and as CloudEvents.

In-process (the real app and engine, Flask's test client) for sampling, the records' content,
rotation, drops and CloudEvents; the files and the sender alone, each held by a gate, for what
one must not wait on; one live Gunicorn server with two workers, its CloudEvents sink stalled,
for the files of each process under a flow of requests and TF Serving's logging_config read
from a ModelServerConfig.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import requests
from conftest import Server, integer_rows, wait_for

from app.core.models import TensorInfo
from app.ops import payload_log, tfs_config
from app.ops.settings import Settings, SettingsError, configs_from_document
from app.wire import prediction_log

NAME = "exact"


def read_records(directory: Path) -> dict[str, list]:
    """Every PredictionLog under `directory`, by file name (TFRecordDataset checks each record's CRCs)."""
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_log_pb2

    return {path.name: [prediction_log_pb2.PredictionLog.FromString(raw.numpy())
                        for raw in tf.data.TFRecordDataset(str(path))]
            for path in sorted(directory.glob("*.tfrecord"))}


def tensor(proto) -> np.ndarray:
    import tensorflow as tf

    return tf.make_ndarray(proto)


@pytest.fixture
def exact_app(in_process_app, exact_model_path, tmp_path):
    def make(**settings):
        app = in_process_app(model_path=str(exact_model_path), model_name=NAME, **settings)
        return app, app.test_client()
    return make


class Receiver:
    """An HTTP endpoint in a thread that keeps what is posted to it; `gate` holds each answer back."""

    def __init__(self) -> None:
        self.events: list[tuple[dict[str, str], dict]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.arrived = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.events.append(({k.lower(): v for k, v in self.headers.items()}, json.loads(body)))
                receiver.arrived.set()
                receiver.gate.wait()
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/events"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.close()


def test_records_hold_what_was_sent_and_answered(exact_app, exact_model, tmp_path):
    app, client = exact_app(payload_log_sampling_rate=1.0, payload_log_dir=str(tmp_path / "log"))
    rows = integer_rows(3)
    rest = client.post(f"/v1/models/{NAME}:predict", json={"instances": rows.tolist()})
    v2 = client.post(f"/v2/models/{NAME}/infer", json={"inputs": [
        {"name": "features", "shape": [2, 4], "datatype": "FP32", "data": rows[:2].reshape(-1).tolist()}]})
    assert rest.status_code == 200 and v2.status_code == 200, (rest.json, v2.json)
    app.services.payload_log.close()

    (name, records), = read_records(tmp_path / "log").items()
    assert re.fullmatch(rf"prediction_log\.[^.]+\.{os.getpid()}\.\d{{8}}T\d+Z\.00000\.tfrecord", name)
    assert [record.WhichOneof("log_type") for record in records] == ["predict_log", "predict_log"]
    expected = exact_model(rows).numpy()
    for record, sent, answered in ((records[0], rows, np.asarray(rest.json["predictions"], np.float32)),
                                   (records[1], rows[:2], np.asarray(v2.json["outputs"][0]["data"], np.float32)
                                    .reshape(2, 3))):
        request, response = record.predict_log.request, record.predict_log.response
        assert record.log_metadata.model_spec.name == NAME
        assert record.log_metadata.model_spec.signature_name == "serving_default"
        assert record.log_metadata.sampling_config.sampling_rate == 1.0
        assert request.model_spec.name == response.model_spec.name == NAME
        assert list(request.inputs) == ["features"]
        np.testing.assert_array_equal(tensor(request.inputs["features"]), sent)
        (output,) = response.outputs.values()
        np.testing.assert_array_equal(tensor(output), answered)
        np.testing.assert_array_equal(tensor(output), expected[:len(sent)])


def test_sampling_keeps_a_request_when_its_draw_is_under_the_rate(tmp_path):
    draws = iter([0.1, 0.5, 0.49, 0.9, 0.0])
    drops: list[str] = []
    records = payload_log.RecordFiles(str(tmp_path), 1 << 20, open_file=payload_log.record_writer())
    files = payload_log.FileWriter(records, buffer_records=10, count_drop=drops.append,
                                   to_record=prediction_log.record)
    log = payload_log.PayloadLog(rates={"a": 0.5, "off": 0.0}, default_rate=0.0, files=files, events=None,
                                 sample=lambda: next(draws))
    for index in range(4):
        log.offer({"x": np.array([[float(index)]], np.float32)}, fake_answer("a", index), f"id-{index}")
    log.offer({"x": np.array([[9.0]], np.float32)}, fake_answer("off", 9), "id-off")  # rate 0: no draw taken
    log.close()
    (records,) = read_records(tmp_path).values()
    assert [tensor(record.predict_log.request.inputs["x"]).item() for record in records] == [0.0, 2.0]
    assert [record.log_metadata.sampling_config.sampling_rate for record in records] == [0.5, 0.5]
    assert next(draws) == 0.0 and drops == []


def fake_answer(model: str, value: float) -> SimpleNamespace:
    spec = TensorInfo(name="y", shape=(1,), dtype=np.dtype("float32"), tf_dtype="DT_FLOAT")
    signature = SimpleNamespace(name="serving_default", inputs=[dataclasses.replace(spec, name="x")], outputs=[spec])
    return SimpleNamespace(servable=SimpleNamespace(model=SimpleNamespace(name=model, version=1)),
                           signature=signature, outputs={"y": np.array([[value]], np.float32)})


@pytest.mark.parametrize("writer", ["tensorflow", "python"])
def test_files_rotate_before_passing_the_size(tmp_path, writer):
    import tensorflow as tf

    # TensorFlow's writer where its runtime is loaded; records framed here in a worker without it.
    open_file = tf.io.TFRecordWriter if writer == "tensorflow" else payload_log.FramedFile
    files = payload_log.RecordFiles(str(tmp_path), max_bytes=100, open_file=open_file)
    for index in range(5):
        files.write(bytes([index]) * 30)  # 46 bytes framed: two per file
    files.close()
    contents = {path.name: [raw.numpy() for raw in tf.data.TFRecordDataset(str(path))]
                for path in sorted(tmp_path.iterdir())}
    assert [name.rsplit(".", 2)[1] for name in contents] == ["00000", "00001", "00002"]
    assert list(contents.values()) == [[b"\0" * 30, b"\1" * 30], [b"\2" * 30, b"\3" * 30], [b"\4" * 30]]
    assert all(path.stat().st_size <= 100 for path in tmp_path.iterdir())


def test_full_buffer_drops_and_counts_without_delaying_requests(exact_app, receiver):
    receiver.gate.clear()  # the receiver holds the writer on the first event
    app, client = exact_app(payload_log_sampling_rate=1.0, payload_log_url=receiver.url, payload_log_buffer_records=1)
    metrics = app.services.metrics
    rows = integer_rows(1)
    try:
        assert client.post(f"/v1/models/{NAME}:predict", json={"instances": rows.tolist()}).status_code == 200
        assert receiver.arrived.wait(30)  # the writer holds entry 1; the buffer is empty
        statuses = [client.post(f"/v1/models/{NAME}:predict", json={"instances": rows.tolist()}).status_code
                    for _ in range(3)]  # entry 2 fills the buffer, 3 and 4 are dropped
        assert statuses == [200, 200, 200]
        assert metrics.registry.get_sample_value("model_server_payload_log_dropped_events_total",
                                                 {"reason": "buffer_full"}) == 4  # two events each
    finally:
        receiver.gate.set()
    app.services.payload_log.close()
    assert len(receiver.events) == 4  # entries 1 and 2, request and response each


# -- the files and the sender, each held by a gate: neither waits on the other -------------------

class Held:
    """The far end of one destination (a sink, a disk): takes each item, but only once `gate` is set.
    `arrived` is set as the first comes in; `wait_taken(n)` waits until n were taken."""

    def __init__(self, *, held: bool) -> None:
        self.gate = threading.Event()
        if not held:
            self.gate.set()
        self.arrived = threading.Event()
        self.taken: list = []
        self._count = threading.Semaphore(0)

    def take(self, item) -> None:
        self.arrived.set()
        self.gate.wait()
        self.taken.append(item)
        self._count.release()

    def wait_taken(self, count: int) -> bool:
        return all(self._count.acquire(timeout=30) for _ in range(count))


class HeldFile:
    """A record file (RecordFiles' open_file) whose writes go to `disk`."""

    def __init__(self, disk: Held) -> None:
        self.write = disk.take

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def gated_log(tmp_path, *, sink: Held, disk: Held, files_buffer: int = 10, events_buffer: int = 10,
              stop_timeout_s: float = 5.0) -> tuple[payload_log.PayloadLog, list[str], list[str]]:
    """A payload log at rate 1 whose files write to `disk` and whose events go to `sink`; with the
    reasons of the records and of the events it dropped."""
    records_dropped: list[str] = []
    events_dropped: list[str] = []
    records = payload_log.RecordFiles(str(tmp_path), 1 << 20, open_file=lambda path: HeldFile(disk))
    files = payload_log.FileWriter(records, buffer_records=files_buffer, count_drop=records_dropped.append,
                                   to_record=prediction_log.record)
    events = payload_log.EventSender("http://sink.invalid/", buffer_records=events_buffer,
                                     count_drop=events_dropped.append, stop_timeout_s=stop_timeout_s,
                                     send=lambda url, headers, body: sink.take((headers["ce-type"], json.loads(body))))
    log = payload_log.PayloadLog(rates={"a": 1.0}, default_rate=0.0, files=files, events=events)
    return log, records_dropped, events_dropped


def offer(log: payload_log.PayloadLog, value: int) -> None:
    log.offer({"x": np.array([[float(value)]], np.float32)}, fake_answer("a", value), f"id-{value}")


def record_values(taken: list[bytes]) -> list[float]:
    from tensorflow_serving.apis import prediction_log_pb2

    return [tensor(prediction_log_pb2.PredictionLog.FromString(data).predict_log.request.inputs["x"]).item()
            for data in taken]


def event_values(taken: list[tuple[str, dict]]) -> list[tuple[str, float]]:
    return [(kind.rsplit(".", 1)[1], next(iter((body.get("inputs") or body["outputs"]).values()))[0][0])
            for kind, body in taken]


def test_files_take_every_record_while_the_sink_holds_the_sender(tmp_path):
    sink, disk = Held(held=True), Held(held=False)
    log, records_dropped, events_dropped = gated_log(tmp_path, sink=sink, disk=disk, events_buffer=2)
    try:
        offer(log, 0)
        assert sink.arrived.wait(30)  # the sender holds record 0's request event; its buffer is empty
        for value in range(1, 5):
            offer(log, value)  # the sender's buffer takes 1 and 2; 3 and 4 are dropped there
        assert disk.wait_taken(5)  # and the files took all five meanwhile
        assert record_values(disk.taken) == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert records_dropped == [] and events_dropped == ["buffer_full"] * 4
    finally:
        sink.gate.set()
    log.close()
    assert event_values(sink.taken) == [("request", 0.0), ("response", 0.0), ("request", 1.0), ("response", 1.0),
                                        ("request", 2.0), ("response", 2.0)]


def test_events_are_sent_while_the_disk_holds_the_files(tmp_path):
    sink, disk = Held(held=False), Held(held=True)
    log, records_dropped, events_dropped = gated_log(tmp_path, sink=sink, disk=disk, files_buffer=2)
    try:
        offer(log, 0)
        assert disk.arrived.wait(30)  # the files hold record 0; their buffer is empty
        for value in range(1, 5):
            offer(log, value)  # the files' buffer takes 1 and 2; 3 and 4 are dropped there
        assert sink.wait_taken(10)  # and the sender sent all five meanwhile
        assert event_values(sink.taken)[::2] == [("request", float(value)) for value in range(5)]
        assert records_dropped == ["buffer_full"] * 2 and events_dropped == []
    finally:
        disk.gate.set()
    log.close()
    assert record_values(disk.taken) == [0.0, 1.0, 2.0]


def test_stop_writes_the_files_and_leaves_a_stalled_sink_behind(tmp_path):
    sink, disk = Held(held=True), Held(held=False)
    log, records_dropped, events_dropped = gated_log(tmp_path, sink=sink, disk=disk, stop_timeout_s=0.0)
    try:
        for value in range(3):
            offer(log, value)
        assert sink.arrived.wait(30)  # record 0's request event is in flight, 1 and 2 are buffered
        stopped = threading.Event()
        threading.Thread(target=lambda: (log.close(timeout_s=60), stopped.set()), daemon=True).start()
        assert stopped.wait(30)  # while the sink still holds the sender
        assert record_values(disk.taken) == [0.0, 1.0, 2.0]
        assert events_dropped == ["send_failed"] * 4  # records 1 and 2: never sent
    finally:
        sink.gate.set()
    assert log._events is not None and log._events.join(time.monotonic() + 30)
    # The send in flight returned; record 0's response event was not tried after the stop.
    assert event_values(sink.taken) == [("request", 0.0)]
    assert events_dropped == ["send_failed"] * 5 and records_dropped == []


def test_send_failed_counts_each_event_not_sent(tmp_path):
    sent: list[tuple[str, dict]] = []

    def send(url: str, headers: dict[str, str], body: bytes) -> None:
        if headers["ce-type"] == payload_log.REQUEST_TYPE:
            raise ConnectionResetError("the sink refused the request event")
        sent.append((headers["ce-type"], json.loads(body)))

    events_dropped: list[str] = []
    events = payload_log.EventSender("http://sink.invalid/", buffer_records=10, count_drop=events_dropped.append,
                                     send=send)
    log = payload_log.PayloadLog(rates={"a": 1.0}, default_rate=0.0, files=None, events=events)
    for value in range(3):
        offer(log, value)
    log.close()
    assert events_dropped == ["send_failed"] * 3
    assert event_values(sent) == [("response", 0.0), ("response", 1.0), ("response", 2.0)]  # each tried


def test_a_refusing_sink_counts_both_events_of_each_record():
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]  # a port nothing listens on once this is closed
    events_dropped: list[str] = []
    events = payload_log.EventSender(f"http://127.0.0.1:{port}/", buffer_records=10, count_drop=events_dropped.append)
    log = payload_log.PayloadLog(rates={"a": 1.0}, default_rate=0.0, files=None, events=events)
    for value in range(3):
        offer(log, value)
    log.close(timeout_s=60)
    assert events_dropped == ["send_failed"] * 6


def test_cloud_events_carry_request_and_response(exact_app, receiver, exact_model):
    app, client = exact_app(payload_log_sampling_rate=1.0, payload_log_url=receiver.url)
    rows = integer_rows(2)
    answer = client.post(f"/v1/models/{NAME}:predict", json={"instances": rows.tolist()},
                         headers={"X-Request-ID": "trace-me-1"})
    assert answer.status_code == 200
    app.services.payload_log.close()

    (request_headers, request_body), (response_headers, response_body) = receiver.events
    for headers, kind in ((request_headers, "org.kubeflow.serving.inference.request"),
                          (response_headers, "org.kubeflow.serving.inference.response")):
        assert headers["ce-type"] == kind
        assert headers["ce-specversion"] == "1.0"
        assert headers["ce-id"] == "trace-me-1"
        assert headers["ce-inferenceservicename"] == NAME
        assert headers["ce-component"] == "predictor"
        assert headers["content-type"] == "application/json"
        assert headers["ce-source"].startswith("http://") and headers["ce-time"]
    assert request_body == {"inputs": {"features": rows.tolist()}}
    (output,) = response_body["outputs"].values()
    assert output == answer.json["predictions"]
    np.testing.assert_array_equal(np.asarray(output, np.float32), exact_model(rows).numpy())


def test_sampling_with_nowhere_to_log_stops_start_up():
    with pytest.raises(SettingsError, match="payload logging is asked for default but neither PAYLOAD_LOG_DIR "
                                            "nor PAYLOAD_LOG_URL says where to"):
        payload_log.start(Settings(payload_log_sampling_rate=0.5), None, None)  # type: ignore[arg-type]


def test_logging_config_sampling_rate_is_the_models_rate():
    text = ('model_config_list { config { name: "a" base_path: "/m/a" logging_config { sampling_config '
            '{ sampling_rate: 0.25 } } } config { name: "b" base_path: "/m/b" } }')
    document = tfs_config.model_config_json(text)
    configs = configs_from_document(document, Settings(payload_log_sampling_rate=0.5), "MODEL_CONFIG")
    assert [(config.name, config.payload_log_sampling_rate) for config in configs] == [("a", 0.25), ("b", 0.5)]
    with pytest.raises(SettingsError, match=r"models\[0\]\.payload_log_sampling_rate='1\.5' is not valid"):
        configs_from_document(tfs_config.model_config_json(text.replace("0.25", "1.5")), Settings(), "MODEL_CONFIG")


# -- one live server: two workers, the rate from a ModelServerConfig, a stalled sink --------------

class StalledSink:
    """A CloudEvents sink, a real socket, that accepts every connection and never reads nor answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/events"
        self.connections: list[socket.socket] = []
        self.accepted = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:  # closed
                return
            self.connections.append(connection)
            self.accepted.set()

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.listener.close()
        self.thread.join()
        for connection in self.connections:
            connection.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, exact_model_path):
    folder = tmp_path_factory.mktemp("payload")
    config = folder / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "{NAME}" base_path: "{exact_model_path}" '
                      'model_platform: "tensorflow" logging_config { sampling_config { sampling_rate: 1.0 } } } }')
    sink = StalledSink()
    server = Server(tmp_path_factory.mktemp("payload-server"), {
        "MODEL_CONFIG": str(config), "PAYLOAD_LOG_DIR": str(folder / "payload"), "PAYLOAD_LOG_URL": sink.url})
    try:
        server.start(workers=2)
        yield server, folder / "payload", sink
    finally:
        sink.close()  # first: sends then fail at once, and the workers' stop has nothing to wait out
        server.stop()


def record_counts(directory: Path) -> dict[str, int]:
    return {name: len(records) for name, records in read_records(directory).items()}


def records_since(directory: Path, before: dict[str, int], count: int) -> dict[str, list] | None:
    """The records written since `before` (each file's count then), by file, once there are `count`."""
    try:
        records = {name: file_records[before.get(name, 0):] for name, file_records in read_records(directory).items()}
    except Exception:  # a record being written: read again
        return None
    return records if sum(map(len, records.values())) == count else None


def grpc_predict(server: Server, rows: np.ndarray) -> np.ndarray:
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    request = predict_pb2.PredictRequest()
    request.model_spec.name = NAME
    request.inputs["features"].CopyFrom(tf.make_tensor_proto(rows))
    with grpc.insecure_channel(server.grpc_target) as channel:
        prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=60)
    return rows


@pytest.mark.server
def test_each_worker_writes_its_own_files(served, exact_model):
    server, directory, _ = served
    before = record_counts(directory)
    sent: list[np.ndarray] = []

    def pids_written() -> set[int]:
        records = wait_for(lambda: records_since(directory, before, len(sent)), what="the records sent")
        return {int(name.split(".")[2]) for name, file_records in records.items() if file_records}

    def send_until_two_workers_wrote() -> bool:
        rows = integer_rows(1, seed=len(sent))
        # A fresh connection each time: the kernel hands it to either worker.
        assert requests.post(f"{server.url}/v1/models/{NAME}:predict", json={"instances": rows.tolist()},
                             timeout=60).status_code == 200
        sent.append(rows)
        return len(pids_written()) == 2

    wait_for(send_until_two_workers_wrote, within_s=120, what="records from both workers")
    sent.append(grpc_predict(server, integer_rows(2, seed=1000)))  # TF Serving's own client, gRPC
    workers = {process.pid for process in server.processes()} - set(server.model_process_pids())
    assert pids_written() <= workers

    records = wait_for(lambda: records_since(directory, before, len(sent)), what="every sampled record written")
    assert len(read_records(directory)) == 2  # one file per worker
    logged = sorted(tensor(record.predict_log.request.inputs["features"]).tolist()
                    for file_records in records.values() for record in file_records)
    assert logged == sorted(rows.tolist() for rows in sent)  # HTTP's and gRPC's, each once
    for file_records in records.values():
        for record in file_records:
            inputs = tensor(record.predict_log.request.inputs["features"])
            (output,) = record.predict_log.response.outputs.values()
            np.testing.assert_array_equal(tensor(output), exact_model(inputs).numpy())
            assert record.log_metadata.sampling_config.sampling_rate == 1.0


@pytest.mark.server
def test_a_stalled_sink_costs_the_files_nothing(served, exact_model):
    """Requests flow from four clients while the sink holds each worker's sender (5 s a send):
    every request is answered and every sampled record reaches the files, none dropped."""
    server, directory, sink = served
    before = record_counts(directory)
    batches = [integer_rows(3, seed=2000 + index) for index in range(200)]
    answers: dict[int, requests.Response] = {}

    def client(indices: range) -> None:
        with requests.Session() as session:
            for index in indices:
                answers[index] = session.post(f"{server.url}/v1/models/{NAME}:predict",
                                              json={"instances": batches[index].tolist()}, timeout=60)

    clients = [threading.Thread(target=client, args=(range(start, len(batches), 4),)) for start in range(4)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    assert sorted(answers) == list(range(len(batches)))
    for index, answer in answers.items():
        assert answer.status_code == 200, answer.text
        np.testing.assert_array_equal(np.asarray(answer.json()["predictions"], np.float32),
                                      exact_model(batches[index]).numpy())
    assert sink.accepted.wait(30)  # a sender is held by the sink

    records = wait_for(lambda: records_since(directory, before, len(batches)), what="every sampled record written")
    logged = sorted(tensor(record.predict_log.request.inputs["features"]).tolist()
                    for file_records in records.values() for record in file_records)
    assert logged == sorted(rows.tolist() for rows in batches)
    assert server.metric("model_server_payload_log_dropped_records_total") == 0
