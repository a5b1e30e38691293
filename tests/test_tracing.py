"""Tracing (app/ops/tracing.py, docs/tracing.md): spans as a live server sends them, and nothing when off.

The server exports over real OTLP/HTTP to a receiver the test runs, which decodes each
export with opentelemetry-proto's own messages. The engine's part (which requests each
predict call reports) is checked with a fake predictor, as in test_batching.py.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import http.server
import random
import threading
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from tensorflow import make_ndarray
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from app.core.batching import Batcher, BatchObserver
from app.core.call import Call
from app.ops.settings import Settings
from app.wire.tensor_proto import from_ndarray
from tests.conftest import integer_rows
from tests.test_grpc_truth import unread_predict

TEST_HOOKS = ("-c", "tests/gunicorn_test_hooks.py")
REST_REQUESTS, GRPC_REQUESTS = 8, 4
PREDICT = "/v1/models/default:predict"


class OtlpReceiver:
    """An OTLP/HTTP trace endpoint on loopback: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.resources: list[dict] = []
        lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                export = ExportTraceServiceRequest.FromString(body)
                with lock:
                    for resource_spans in export.resource_spans:
                        receiver.resources.append(attributes(resource_spans.resource))
                        for scope_spans in resource_spans.scope_spans:
                            receiver.spans.extend(scope_spans.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def attributes(message) -> dict:
    return {entry.key: getattr(entry.value, entry.value.WhichOneof("value")) for entry in message.attributes}


@pytest.fixture
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


def traceparent() -> tuple[str, str, str]:
    """A new W3C traceparent, with its trace id and parent span id in hex."""
    trace_id, span_id = f"{random.getrandbits(128):032x}", f"{random.getrandbits(64):016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def grpc_predict(target: str, rows: np.ndarray, header: str):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "default"
    from_ndarray(rows, "DT_FLOAT", request.inputs["features"])
    with grpc.insecure_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        response, call = stub.Predict.with_call(request, timeout=60,
                                                metadata=(("traceparent", header), ("x-request-id", header[3:35])))
    # Traced, the request id still rides with the answer (app/ops/patches.py, initial_metadata_with_the_answer).
    assert dict(call.initial_metadata())["x-request-id"] == header[3:35]
    return response


# With model processes the predict calls run and are exported there: the same spans and links.
@pytest.mark.parametrize("model_processes", ["0", "1"], ids=["default", "model-processes"])
def test_concurrent_requests_are_traced_and_each_predict_call_links_the_requests_it_served(
        start_server, receiver, exact_model_path, exact_model, model_processes):
    # A long batch window (a batch goes as soon as it is full), so that concurrent requests share calls.
    server = start_server({"TRACING": "otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
                           "OTEL_SERVICE_NAME": "traced-test", "MODEL_PATH": str(exact_model_path),
                           "MODEL_NAME": "default", "MAX_BATCH_SIZE": "4", "BATCH_TIMEOUT_MS": "1000",
                           "MODEL_PROCESSES": model_processes})
    sent = [(f"rest{index}", integer_rows(1, seed=index), *traceparent()) for index in range(REST_REQUESTS)]
    sent += [(f"grpc{index}", integer_rows(1, seed=100 + index), *traceparent()) for index in range(GRPC_REQUESTS)]

    def send(name, rows, header, trace_id, parent_id):
        if name.startswith("rest"):
            answer = requests.post(server.url + PREDICT, json={"instances": rows.tolist()},
                                   headers={"traceparent": header}, timeout=60)
            assert answer.status_code == 200, answer.text
            np.testing.assert_array_equal(np.asarray(answer.json()["predictions"], np.float32),
                                          exact_model(rows).numpy())
            return int(answer.headers["X-Batch-Requests"]), int(answer.headers["X-Batch-Size"])
        response = grpc_predict(server.grpc_target, rows, header)
        np.testing.assert_array_equal(make_ndarray(response.outputs["scores"]), exact_model(rows).numpy())
        return None, None

    with concurrent.futures.ThreadPoolExecutor(len(sent)) as pool:
        batches = list(pool.map(lambda item: send(*item), sent))
    # Refusals are traced too, with their status, and the client still gets its own error.
    rest_refused, grpc_refused = traceparent(), traceparent()
    assert requests.post(server.url + "/v1/models/nope:predict", json={"instances": [[1, 2, 3, 4]]},
                         headers={"traceparent": rest_refused[0]}, timeout=60).status_code == 404
    with pytest.raises(grpc.RpcError) as raised:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "nope"
        with grpc.insecure_channel(server.grpc_target) as channel:
            prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
                request, timeout=60, metadata=(("traceparent", grpc_refused[0]),))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    # An answer the client never reads before its deadline: the span ends with the client's status.
    unread = traceparent()
    trailers = unread_predict(server.grpc_target, integer_rows(1, seed=99), timeout="2S",
                              headers=(("traceparent", unread[0]),))
    assert trailers["grpc-status"] == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
    assert server.stop() == 0  # the worker flushes its spans as it exits

    [unread_span] = [span for span in receiver.spans
                     if span.trace_id.hex() == unread[1] and span.kind == Span.SPAN_KIND_SERVER]
    assert attributes(unread_span)["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert unread_span.status.code == unread_span.status.STATUS_CODE_ERROR

    [rest_span] = [span for span in receiver.spans if span.trace_id.hex() == rest_refused[1]]
    assert attributes(rest_span)["http.response.status_code"] == 404
    [grpc_span] = [span for span in receiver.spans if span.trace_id.hex() == grpc_refused[1]]
    assert attributes(grpc_span)["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert grpc_span.status.code == grpc_span.status.STATUS_CODE_ERROR

    spans = [span for span in receiver.spans if span not in (rest_span, grpc_span)
             and span.trace_id.hex() != unread[1]]
    assert {resource["service.name"] for resource in receiver.resources} == {"traced-test"}
    by_id = {span.span_id: span for span in spans}
    predicts = [span for span in spans if span.name == "predict"
                and all(link.trace_id.hex() != unread[1] for link in span.links)]
    served = Counter(link.span_id for span in predicts for link in span.links)
    for (name, _rows, _header, trace_id, parent_id), (batch_requests, batch_rows) in zip(sent, batches, strict=True):
        in_trace = [span for span in spans if span.trace_id.hex() == trace_id]
        [request] = [span for span in in_trace if span.kind == Span.SPAN_KIND_SERVER]
        # Every span of the request is in the client's trace, the request span under the client's span.
        assert request.parent_span_id.hex() == parent_id
        assert request.name == ("POST /v1/models/<model_name:name>:predict" if name.startswith("rest")
                                else "tensorflow.serving.PredictionService/Predict")
        children = {span.name: span for span in in_trace if span.parent_span_id == request.span_id}
        assert sorted(children) == ["decode", "encode", "queue wait"] and len(in_trace) == 4
        # Exactly one predict call ran this one-row request.
        assert served[request.span_id] == 1
        [predict] = [span for span in predicts if request.span_id in {link.span_id for link in span.links}]
        assert all(link.trace_id == by_id[link.span_id].trace_id for link in predict.links)
        batch = attributes(predict)
        assert batch["model_server.batch.requests"] == len(predict.links)
        assert batch["model_server.batch.rows"] + batch["model_server.batch.padded_rows"] in (1, 2, 4)
        assert (batch["model_server.model.name"], batch["model_server.model.version"],
                batch["model_server.model.signature"]) == ("default", 1, "serving_default")
        if batch_requests is not None:
            assert (batch["model_server.batch.requests"], batch["model_server.batch.rows"]) == (batch_requests,
                                                                                                 batch_rows)
        # decode, queue wait, predict and encode follow each other inside the request span.
        decode, wait, encode = children["decode"], children["queue wait"], children["encode"]
        assert (request.start_time_unix_nano <= decode.start_time_unix_nano <= decode.end_time_unix_nano
                <= wait.start_time_unix_nano <= wait.end_time_unix_nano == predict.start_time_unix_nano
                <= predict.end_time_unix_nano <= encode.start_time_unix_nano <= encode.end_time_unix_nano
                <= request.end_time_unix_nano)
    # Every link is to one of the requests sent, every predict call served some, and some served several.
    assert sum(served.values()) == len(sent) and all(predict.links for predict in predicts)
    assert max(len(predict.links) for predict in predicts) > 1


def test_with_tracing_off_the_worker_sends_no_span_and_imports_nothing_of_tracing(
        start_server, receiver, tmp_path, exact_model_path):
    report = tmp_path / "modules"
    report.mkdir()
    # Everything the SDK would need to export, but TRACING left at its default.
    server = start_server({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint, "MODULES_REPORT": str(report),
                           "MODEL_PATH": str(exact_model_path), "MODEL_NAME": "default"}, args=TEST_HOOKS)
    header, _trace_id, _parent_id = traceparent()
    rows = integer_rows(2)
    assert requests.post(server.url + PREDICT, json={"instances": rows.tolist()}, headers={"traceparent": header},
                         timeout=60).status_code == 200
    grpc_predict(server.grpc_target, rows, header)
    assert server.stop() == 0

    [modules] = [path.read_text().split() for path in Path(report).iterdir()]
    assert "app.core.serving" in modules  # the report is the serving worker's
    assert not [name for name in modules if name == "app.ops.tracing" or name.startswith("opentelemetry")]
    assert receiver.spans == []


def test_the_sdks_own_switch_keeps_tracing_off():
    assert Settings.from_env({"TRACING": "otlp"}).tracing_on
    assert not Settings.from_env({"TRACING": "otlp", "OTEL_SDK_DISABLED": "true"}).tracing_on
    assert not Settings.from_env({}).tracing_on


# -- the engine: which requests a predict call reports ------------------------------------------


class _Reports(BatchObserver):
    def __init__(self, *, traces: bool) -> None:
        self.traces = traces
        self.calls: list[tuple[list, int, int, bool]] = []

    def predict_call(self, traces, *, rows, padded_rows, predict_s, error) -> None:
        self.calls.append((traces, rows, padded_rows, error is not None))


def _gated_batcher(observer: BatchObserver, fail: bool = False):
    entered, gate = threading.Event(), threading.Event()

    def predict(inputs):
        entered.set()
        gate.wait(10)
        if fail:
            raise RuntimeError("poisoned")
        return {"y": inputs["x"] * 2}

    return Batcher(predict, name="traced", max_batch_size=4, bisect_failures=False, observer=observer), entered, gate


@pytest.mark.parametrize("fail", [False, True])
def test_each_predict_call_reports_the_traces_of_exactly_its_requests(fail):
    reports = _Reports(traces=True)
    batcher, entered, gate = _gated_batcher(reports, fail)
    try:
        first = batcher.submit(Call(trace="first"), {"x": np.ones((1, 2), np.float32)})
        assert entered.wait(10)
        # Queued while the first call holds the model: the next call takes all three.
        rest = [batcher.submit(Call(trace=name), {"x": np.ones((1, 2), np.float32)}) for name in ("a", "b", None)]
        gate.set()
        concurrent.futures.wait([first, *rest], timeout=10)
    finally:
        batcher.close()
    assert reports.calls == [(["first"], 1, 0, fail), (["a", "b", None], 3, 1, fail)]


def test_without_a_tracer_the_engine_reports_no_predict_call():
    reports = _Reports(traces=False)
    batcher, _entered, gate = _gated_batcher(reports)
    gate.set()
    try:
        assert batcher.predict(Call.within(10, trace="ignored"), {"x": np.ones((1, 2), np.float32)}).batch_rows == 1
    finally:
        batcher.close()
    assert reports.calls == []


def test_a_predict_call_hook_that_raises_is_logged_once_and_answers_stand(caplog):
    class Failing(_Reports):
        def predict_call(self, traces, **kwargs) -> None:
            raise RuntimeError("tracer down")

    batcher, _entered, gate = _gated_batcher(Failing(traces=True))
    gate.set()
    try:
        for _ in range(2):
            result = batcher.predict(Call.within(10, trace="request"), {"x": np.full((1, 2), 3, np.float32)})
            np.testing.assert_array_equal(result.outputs["y"], np.full((1, 2), 6, np.float32))
    finally:
        batcher.close()
    assert [record.getMessage() for record in caplog.records if "predict_call" in record.getMessage()] == [
        "observer hook predict_call of model 'traced' failed (logged once)"]
