"""Payload logging: sampled predictions as TF Serving PredictionLog records, and as CloudEvents.

In-process (the real app and engine, Flask's test client) for sampling, the records' content,
rotation, drops and CloudEvents; one live Gunicorn server with two workers for the files of
each process and TF Serving's logging_config read from a ModelServerConfig.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
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
    log = payload_log.PayloadLog(rates={"a": 0.5, "off": 0.0}, default_rate=0.0, directory=str(tmp_path), url="",
                                 max_file_bytes=1 << 20, buffer_records=10, count_drop=drops.append,
                                 to_record=prediction_log.record, sample=lambda: next(draws))
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
        assert metrics.registry.get_sample_value("model_server_payload_log_dropped_records_total",
                                                 {"reason": "buffer_full"}) == 2
    finally:
        receiver.gate.set()
    app.services.payload_log.close()
    assert len(receiver.events) == 4  # entries 1 and 2, request and response each


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


# -- one live server: two workers, the rate from a ModelServerConfig ----------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory, exact_model_path):
    folder = tmp_path_factory.mktemp("payload")
    config = folder / "models.config"
    config.write_text(f'model_config_list {{ config {{ name: "{NAME}" base_path: "{exact_model_path}" '
                      'model_platform: "tensorflow" logging_config { sampling_config { sampling_rate: 1.0 } } } }')
    server = Server(tmp_path_factory.mktemp("payload-server"),
                    {"MODEL_CONFIG": str(config), "PAYLOAD_LOG_DIR": str(folder / "payload")})
    server.start(workers=2)
    yield server, folder / "payload"
    server.stop()


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
    server, directory = served
    sent: list[np.ndarray] = []

    def pids_seen() -> set[int]:
        return {int(path.name.split(".")[2]) for path in directory.glob("*.tfrecord")}

    def send_until_two_workers_wrote() -> bool:
        rows = integer_rows(1, seed=len(sent))
        # A fresh connection each time: the kernel hands it to either worker.
        assert requests.post(f"{server.url}/v1/models/{NAME}:predict", json={"instances": rows.tolist()},
                             timeout=60).status_code == 200
        sent.append(rows)
        return len(pids_seen()) == 2

    wait_for(send_until_two_workers_wrote, within_s=120, what="records from both workers")
    sent.append(grpc_predict(server, integer_rows(2, seed=1000)))  # TF Serving's own client, gRPC
    workers = {process.pid for process in server.processes()} - set(server.model_process_pids())
    assert pids_seen() <= workers

    def all_written() -> dict[str, list] | None:
        try:
            records = read_records(directory)
        except Exception:  # a record being written: read again
            return None
        return records if sum(map(len, records.values())) == len(sent) else None

    records = wait_for(all_written, what="every sampled record written")
    assert len(records) == 2  # one file per worker
    logged = sorted(tensor(record.predict_log.request.inputs["features"]).tolist()
                    for file_records in records.values() for record in file_records)
    assert logged == sorted(rows.tolist() for rows in sent)  # HTTP's and gRPC's, each once
    for file_records in records.values():
        for record in file_records:
            inputs = tensor(record.predict_log.request.inputs["features"])
            (output,) = record.predict_log.response.outputs.values()
            np.testing.assert_array_equal(tensor(output), exact_model(inputs).numpy())
            assert record.log_metadata.sampling_config.sampling_rate == 1.0
