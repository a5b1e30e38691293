"""Triton's model repository extension, driven by tritonclient (HTTP and gRPC), and
RESTRICTED_MODEL_CONTROL on it and on TF Serving's HandleReloadConfigRequest.

One live server with two workers serves a repository of three model folders, `name/1/`:
alpha and beta (exact models: integer weights, so served outputs equal the models' own with
==) and broken (a saved_model.pb that is not one). It starts serving alpha only, with model
control explicit and restricted to callers sending `admin-key: s3cret`. Each test leaves it
serving alpha only. What needs no Gunicorn runs in-process.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tensorflow_serving.apis import model_management_pb2, model_service_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from app.core.registry import config_entry
from app.ops import settings as app_settings
from app.ops.queue_policy import Priorities, QueuePolicy
from app.ops.settings import ModelConfig, Settings, SettingsError
from tests.conftest import Server, build_exact_model, integer_rows
from tests.test_tfs_live_config import worker_channels

KEY, SECRET = "admin-key", "s3cret"
ALLOWED = {KEY: SECRET}
TIMEOUT_S = 120


def broken_reason(folder: str) -> str:
    """Why broken/1 cannot be served, as its version status and the index give it: its folder is
    named as `<model broken>`, or in full with READYZ_DETAIL (which live test servers set)."""
    return (f"ModelLoadError: cannot read the SavedModel in {folder}/1: DecodeError: Error parsing message with "
            "type 'tensorflow.SavedModel': Wire format was corrupt")


@pytest.fixture(scope="module")
def models():
    return {"alpha": build_exact_model(seed=11), "beta": build_exact_model(seed=12)}


@pytest.fixture(scope="module")
def repository(tmp_path_factory, models):
    folder = tmp_path_factory.mktemp("repository")
    for name, model in models.items():
        model.export(str(folder / name / "1"), format="tf_saved_model", verbose=False)
    (folder / "broken" / "1").mkdir(parents=True)
    (folder / "broken" / "1" / "saved_model.pb").write_bytes(b"not a SavedModel")
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, repository):
    running = Server(tmp_path_factory.mktemp("repository-logs"), {
        "MODEL_PATH": str(repository / "alpha"), "MODEL_NAME": "alpha", "MODEL_REPOSITORY": str(repository),
        "MODEL_CONTROL_MODE": "explicit", "RESTRICTED_MODEL_CONTROL": f"{KEY}={SECRET}",
        "MODEL_POLL_SECONDS": "0", "LOG_FORMAT": "json"}).start(workers=2)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(server):
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{server.port}", network_timeout=TIMEOUT_S)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc_client(server):
    client = grpcclient.InferenceServerClient(url=server.grpc_target)
    yield client
    client.close()


@pytest.fixture(scope="module")
def workers(server):
    """A gRPC channel to each of the two workers."""
    channels = worker_channels(server, server.wait_ready(workers=2))
    yield channels
    for channel in channels.values():
        channel.close()


def infer(channel, model: str, rows: np.ndarray) -> np.ndarray:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="features", datatype="FP32", shape=rows.shape)
    request.raw_input_contents.append(rows.tobytes())
    response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=TIMEOUT_S)
    [output] = response.outputs
    return np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(tuple(output.shape))


def own_output(models, name: str, rows: np.ndarray) -> np.ndarray:
    return np.asarray(models[name](rows))


def worker_index(channel, headers: dict[str, str] | None = None) -> list[tuple[str, str, str, str]]:
    """The repository index as the worker of `channel` lists it."""
    response = service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryIndex(
        service_pb2.RepositoryIndexRequest(), timeout=TIMEOUT_S, metadata=list((headers or {}).items()))
    return [(model.name, model.version, model.state, model.reason) for model in response.models]


def test_index_lists_the_repository_with_states(server, http, grpc_client):
    expected = [{"name": "alpha", "version": "1", "state": "READY", "reason": ""}, {"name": "beta"},
                {"name": "broken"}]
    assert http.get_model_repository_index(headers=ALLOWED) == expected
    index = grpc_client.get_model_repository_index(headers=ALLOWED, as_json=True)
    # Proto3's JSON leaves out empty strings.
    assert index == {"models": [{key: value for key, value in model.items() if value} for model in expected]}
    ready = requests.post(f"{server.url}/v2/repository/index", json={"ready": True}, headers=ALLOWED, timeout=30)
    assert (ready.status_code, ready.json()) == (200, expected[:1])


def test_load_serves_in_every_worker_and_unload_stops_everywhere(http, grpc_client, workers, models):
    rows = integer_rows(5)
    grpc_client.load_model("beta", headers=ALLOWED)
    for channel in workers.values():
        np.testing.assert_array_equal(infer(channel, "beta", rows), own_output(models, "beta", rows))
    assert grpc_client.get_model_repository_index(headers=ALLOWED, as_json=True)["models"][1] == {
        "name": "beta", "version": "1", "state": "READY"}
    http.unload_model("beta", headers=ALLOWED)
    for channel in workers.values():
        with pytest.raises(grpc.RpcError) as gone:
            infer(channel, "beta", rows)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        np.testing.assert_array_equal(infer(channel, "alpha", rows), own_output(models, "alpha", rows))
    assert http.get_model_repository_index(headers=ALLOWED)[1] == {
        "name": "beta", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}


def test_a_broken_model_fails_with_its_reason_and_the_others_serve(http, grpc_client, workers, models, repository):
    with pytest.raises(InferenceServerException) as over_http:
        http.load_model("broken", headers=ALLOWED)
    assert over_http.value.status() == "400"
    assert over_http.value.message().startswith("failed to load 'broken': model 'broken': ")
    with pytest.raises(InferenceServerException) as over_grpc:
        grpc_client.load_model("broken", headers=ALLOWED)
    assert over_grpc.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert over_grpc.value.message().startswith("failed to load 'broken': model 'broken': ")
    with pytest.raises(InferenceServerException) as missing:
        http.load_model("nothing", headers=ALLOWED)
    assert (missing.value.status(), missing.value.message()) == (
        "400", "failed to load 'nothing', failed to poll from model repository: no folder 'nothing' in "
               "MODEL_REPOSITORY")
    rows = integer_rows(3)
    for channel in workers.values():
        np.testing.assert_array_equal(infer(channel, "alpha", rows), own_output(models, "alpha", rows))
        # Every worker lists it as Triton does: unavailable, and why.
        assert ("broken", "1", "UNAVAILABLE", broken_reason(f"{repository}/broken")) in worker_index(channel, ALLOWED)
    # Unloading what is not served succeeds, as in Triton.
    http.unload_model("broken", headers=ALLOWED)


def reload_request(repository) -> model_management_pb2.ReloadConfigRequest:
    request = model_management_pb2.ReloadConfigRequest()
    text_format.Parse(f'model_config_list {{ config {{ name: "alpha" base_path: "{repository / "alpha"}" '
                      'model_platform: "tensorflow" } }', request.config)
    return request


def test_restricted_calls_without_the_key_are_refused_and_logged(server, http, grpc_client, repository):
    calls = (("get_model_repository_index", ()), ("load_model", ("beta",)), ("unload_model", ("alpha",)))
    for headers in ({}, {KEY: "wrong"}):
        for client, expected in ((http, ("403", f"This API is restricted, expecting header '{KEY}'")),
                                 (grpc_client, ("StatusCode.UNAVAILABLE", "This protocol is restricted, "
                                                f"expecting header 'triton-grpc-protocol-{KEY}'"))):
            for method, args in calls:
                with pytest.raises(InferenceServerException) as error:
                    getattr(client, method)(*args, headers=headers)
                assert (error.value.status(), error.value.message()) == expected, method
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        with pytest.raises(grpc.RpcError) as reload_refused:
            stub.HandleReloadConfigRequest(reload_request(repository), TIMEOUT_S)
        assert reload_refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # RESTRICTED_MODEL_CONTROL's bare key, as before Triton's spelling, and Triton's.
        for key in (KEY, f"triton-grpc-protocol-{KEY}"):
            allowed = stub.HandleReloadConfigRequest(reload_request(repository), TIMEOUT_S, metadata=[(key, SECRET)])
            assert allowed.status.error_code == 0
    log = server.log()
    warnings = [json.loads(line) for line in log.splitlines()
                if line.startswith("{") and "refused" in line and '"app.wire.restricted"' in line]
    assert {entry["message"] for entry in warnings} >= {
        f"refused /v2/repository/index: no valid '{KEY}' header",
        f"refused /inference.GRPCInferenceService/RepositoryModelLoad: no valid 'triton-grpc-protocol-{KEY}' header",
        "refused /tensorflow.serving.ModelService/HandleReloadConfigRequest: no valid "
        f"'triton-grpc-protocol-{KEY}' header"}
    assert all(entry["level"] == "WARNING" for entry in warnings)
    assert SECRET not in log and "wrong" not in log


def rest_index_status(server, values: list[str]) -> int:
    """POST /v2/repository/index with the restricted header once per value, in order (as sent on the wire)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT_S)
    try:
        connection.putrequest("POST", "/v2/repository/index")
        for value in values:
            connection.putheader(KEY, value)
        connection.putheader("Content-Length", "0")
        connection.endheaders()
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.mark.parametrize("values, allowed", [([SECRET, "bad"], False), (["bad", SECRET], False),
                                             ([SECRET, SECRET], True), ([SECRET], True)])
def test_a_restricted_key_sent_twice_is_let_in_only_if_every_value_matches(server, values, allowed):
    assert rest_index_status(server, values) == (200 if allowed else 403)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        call = lambda: stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), timeout=TIMEOUT_S,  # noqa: E731
                                            metadata=[(KEY, value) for value in values])
        if allowed:
            assert [model.name for model in call().models] == ["alpha", "beta", "broken"]
        else:
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


# -- with MODEL_PROCESSES ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def processes_server(tmp_path_factory, repository):
    """The repository served by one model process and two workers: the model process loads and
    unloads, then tells each worker what it serves."""
    running = Server(tmp_path_factory.mktemp("repository-processes-logs"), {
        "MODEL_PATH": str(repository / "alpha"), "MODEL_NAME": "alpha", "MODEL_REPOSITORY": str(repository),
        "MODEL_CONTROL_MODE": "explicit", "MODEL_PROCESSES": "1", "MODEL_POLL_SECONDS": "0",
        "LOG_FORMAT": "json"}).start(workers=2)
    yield running
    running.stop()


# Loads and unloads under the closed loop (under 1 s a pair on a 2-core machine).
TURNS = 6


class ClosedLoop:
    """Clients that each send `rows` to alpha again as soon as answered, one over REST and one over
    gRPC to each worker, and keep every answer that is not alpha's own output for them."""

    def __init__(self, server: Server, channels, rows: np.ndarray, expected: np.ndarray) -> None:
        self.answered = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": list(rows.shape),
                            "data": rows.ravel().tolist()}]}
        self._threads = [threading.Thread(target=self._run, args=(self._rest, server.url, body, expected)),
                         *(threading.Thread(target=self._run, args=(self._grpc, channel, rows, expected))
                           for channel in channels)]

    def __enter__(self) -> ClosedLoop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(TIMEOUT_S)

    def _run(self, send, target, sent, expected: np.ndarray) -> None:
        with requests.Session() as session:
            while not self._stop.is_set():
                try:
                    got = send(session, target, sent)
                    error = "" if np.array_equal(got, expected) else f"answered {got.tolist()}"
                except Exception as exc:  # noqa: BLE001 - each one is the test's to report
                    error = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.answered += 1
                    if error:
                        self.errors.append(error[:300])

    @staticmethod
    def _rest(session: requests.Session, url: str, body: dict) -> np.ndarray:
        answer = session.post(f"{url}/v2/models/alpha/infer", json=body, timeout=TIMEOUT_S)
        answer.raise_for_status()
        [output] = answer.json()["outputs"]
        return np.reshape(output["data"], output["shape"])

    @staticmethod
    def _grpc(_session: requests.Session, channel, rows: np.ndarray) -> np.ndarray:
        return infer(channel, "alpha", rows)


def test_with_model_processes_load_and_unload_under_load_lose_no_request_and_workers_agree(processes_server,
                                                                                             models, repository):
    server = processes_server
    channels = worker_channels(server, server.wait_ready(workers=2))
    http = httpclient.InferenceServerClient(url=f"127.0.0.1:{server.port}", network_timeout=TIMEOUT_S)
    over_grpc = grpcclient.InferenceServerClient(url=server.grpc_target)
    rows = integer_rows(3, seed=5)
    beta = own_output(models, "beta", rows)
    alpha_ready, broken_unknown = ("alpha", "1", "READY", ""), ("broken", "", "", "")

    def every_worker_lists(*index) -> None:
        assert [worker_index(channel) for channel in channels.values()] == [list(index)] * len(channels)

    try:
        with ClosedLoop(server, channels.values(), rows, own_output(models, "alpha", rows)) as loop:
            for turn in range(TURNS):
                # Each door loads, and unloads, after each: every pair in four turns.
                loads, unloads = (http, over_grpc)[turn % 2], (http, over_grpc)[turn // 2 % 2]
                answered = loop.answered
                loads.load_model("beta")
                # Answered once every worker serves it: each one's answer is beta's own output.
                for channel in channels.values():
                    np.testing.assert_array_equal(infer(channel, "beta", rows), beta)
                every_worker_lists(alpha_ready, ("beta", "1", "READY", ""), broken_unknown)
                unloads.unload_model("beta")
                for channel in channels.values():
                    with pytest.raises(grpc.RpcError) as gone:
                        infer(channel, "beta", rows)
                    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
                every_worker_lists(alpha_ready, ("beta", "1", "UNAVAILABLE", "unloaded"), broken_unknown)
                assert loop.answered > answered, f"no request answered during turn {turn}"
            with pytest.raises(InferenceServerException) as failed:
                http.load_model("broken")
            assert failed.value.status() == "400"
            assert failed.value.message().startswith("failed to load 'broken': model 'broken': ")
            every_worker_lists(alpha_ready, ("beta", "1", "UNAVAILABLE", "unloaded"),
                               ("broken", "1", "UNAVAILABLE", broken_reason(f"{repository}/broken")))
        assert loop.errors == []
    finally:
        http.close()
        over_grpc.close()
        for channel in channels.values():
            channel.close()


# -- in-process ---------------------------------------------------------------------------


def test_load_and_unload_are_refused_unless_model_control_is_explicit(in_process_app):
    client = in_process_app().test_client()
    for action in ("load", "unload"):
        answer = client.post(f"/v2/repository/models/default/{action}")
        assert (answer.status_code, answer.json) == (
            503, {"error": "explicit model load / unload is not allowed if polling is enabled"})
    answer = client.post("/v2/repository/index", json={"ready": True})
    assert (answer.status_code, answer.json) == (200, [{"name": "default", "version": "1", "state": "READY",
                                                        "reason": ""}])


def test_in_process_load_unload_and_bad_calls(in_process_app, repository, models):
    app = in_process_app(model_repository=str(repository), model_control_mode="explicit",
                         model_path=str(repository / "alpha"), model_name="alpha")
    client = app.test_client()
    assert client.post("/v2/repository/models/beta/load").status_code == 200
    rows = integer_rows(4)
    body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": list(rows.shape),
                        "data": rows.ravel().tolist()}]}
    answer = client.post("/v2/models/beta/infer", json=body)
    assert answer.status_code == 200
    [output] = answer.json["outputs"]
    np.testing.assert_array_equal(np.reshape(output["data"], output["shape"]), own_output(models, "beta", rows))
    assert client.post("/v2/repository/models/alpha/unload", json={"parameters": {"unload_dependents": False}}
                       ).status_code == 200
    assert client.post("/v2/models/alpha/infer", json=body).status_code == 404
    for path, sent, message in (
            ("/v2/repository/models/beta/unload", None,
             "failed to unload 'beta': it is the only model served, and the server serves at least one"),
            ("/v2/repository/models/beta/load", {"parameters": {"config": "{}"}},
             "parameter(s) ['config'] not supported: a model is loaded from its folder in MODEL_REPOSITORY as it is"),
            ("/v2/repository/index", {"ready": "yes"}, "Invalid value for 'ready': expected a boolean"),
            ("/v2/repository/index", [1], "the request must be a JSON object")):
        answer = client.post(path, json=sent)
        assert (answer.status_code, answer.json) == (400, {"error": message}), path
    for body in (b"{", b"\t"):  # whitespace alone is no body's absence: it is not JSON
        answer = client.post("/v2/repository/index", data=body)
        assert answer.status_code == 400 and answer.json["error"].startswith("malformed JSON"), body
    assert client.post("/v2/repository/index").status_code == 200


@pytest.fixture
def explicit_app(in_process_app, repository):
    """An in-process app serving alpha, with model control explicit over the repository."""
    return in_process_app(model_repository=str(repository), model_control_mode="explicit",
                          model_path=str(repository / "alpha"), model_name="alpha")


# A sibling worker's name in the run folder (app/core/shared_config.py): no process has this pid.
SILENT_PID = 4_000_000_001


@pytest.fixture
def explicit_app_in_run_folder(in_process_app, repository, monkeypatch):
    """explicit_app as one of a server's workers: it shares reloads through a run folder, beside a
    sibling whose socket takes connections and never answers (a worker stalled)."""
    from app.core import shared_config

    environ: dict[str, str] = {}
    folder = shared_config.prepare_run_dir(environ)
    monkeypatch.setenv(shared_config.RUN_DIR_ENV, folder)
    silent_worker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent_worker.bind(os.path.join(folder, f"{SILENT_PID}.sock"))
    silent_worker.listen(8)
    app = in_process_app(model_repository=str(repository), model_control_mode="explicit",
                         model_path=str(repository / "alpha"), model_name="alpha", request_timeout_ms=500)
    yield app, silent_worker
    silent_worker.close()
    shared_config.remove_run_dir(environ, folder)


@pytest.mark.parametrize(("path", "parameters", "message"), [
    ("alpha/unload", {"unload_dependents": "yes"},
     "Unable to parse 'unload_dependents': attempt to access JSON non-boolean as boolean"),
    ("alpha/unload", {"unload_dependents": 1},
     "Unable to parse 'unload_dependents': attempt to access JSON non-boolean as boolean"),
    ("beta/load", {"config": {"max_batch_size": 8}}, "attempt to access JSON non-string as string"),
    ("beta/load", {"file:1/model.savedmodel/saved_model.pb": 7}, "attempt to access JSON non-string as string"),
])
def test_rest_parameters_of_the_wrong_type_are_refused_in_tritons_words(explicit_app, path, parameters, message):
    client = explicit_app.test_client()
    answer = client.post(f"/v2/repository/models/{path}", json={"parameters": parameters})
    assert (answer.status_code, answer.json) == (400, {"error": message})
    # Nothing changed: alpha serves, beta does not.
    assert client.post("/v2/repository/index", json={"ready": True}).json == [
        {"name": "alpha", "version": "1", "state": "READY", "reason": ""}]


def test_grpc_parameters_of_the_wrong_type_are_refused_in_tritons_words(explicit_app):
    from app.grpc import server as grpc_server
    from tests.conftest import free_port

    Parameter = service_pb2.ModelRepositoryParameter
    target = f"127.0.0.1:{free_port()}"
    with grpc_server.serving(explicit_app.services, bind=target), grpc.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def refused(call, request) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.RpcError) as error:
                call(request, timeout=TIMEOUT_S)
            return error.value.code(), error.value.details()

        unload, load = stub.RepositoryModelUnload, stub.RepositoryModelLoad
        for wrong in (Parameter(string_param="yes"), Parameter(int64_param=1), Parameter()):
            assert refused(unload, service_pb2.RepositoryModelUnloadRequest(
                model_name="alpha", parameters={"unload_dependents": wrong})) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "invalid value type for 'unload_dependents' parameter, expected bool_param.")
        for name, wrong, expected in (("config", Parameter(bytes_param=b"{}"), "string_param"),
                                      ("file:1/model.savedmodel", Parameter(string_param="AAAA"), "bytes_param")):
            request = service_pb2.RepositoryModelLoadRequest(model_name="beta", parameters={name: wrong})
            assert refused(load, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                              f"invalid value type for load parameter '{name}', expected {expected}.")
        # Of the right type, a load parameter is still refused, as before: the folder is loaded as it is.
        assert refused(load, service_pb2.RepositoryModelLoadRequest(
            model_name="beta", parameters={"config": Parameter(string_param="{}")})) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "parameter(s) ['config'] not supported: a model is loaded from its folder in MODEL_REPOSITORY as it is")
        index = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True), timeout=TIMEOUT_S)
        assert [(model.name, model.state) for model in index.models] == [("alpha", "READY")]


def test_a_failed_load_is_listed_unavailable_with_its_reason(explicit_app):
    reason = broken_reason("<model broken>")  # without READYZ_DETAIL: no path
    client = explicit_app.test_client()
    answer = client.post("/v2/repository/models/broken/load")
    assert answer.status_code == 400
    assert answer.json["error"].startswith("failed to load 'broken': model 'broken': ")
    [broken] = [model for model in client.post("/v2/repository/index").json if model["name"] == "broken"]
    assert broken == {"name": "broken", "version": "1", "state": "UNAVAILABLE", "reason": reason}
    # TF Serving's GetModelStatus says the same: the version ended, with the reason.
    status = client.get("/v1/models/broken").json["model_version_status"]
    assert status == [{"version": "1", "state": "END",
                       "status": {"error_code": "UNKNOWN", "error_message": reason}}]


def test_a_rest_load_and_unload_answer_at_the_requests_deadline(explicit_app_in_run_folder):
    """REST has no client deadline: REQUEST_TIMEOUT_MS is the call's. A sibling worker that took the
    reload's connection and never answers is reported at it, not waited for."""
    app, silent_worker = explicit_app_in_run_folder
    client = app.test_client()
    answers = []
    with ThreadPoolExecutor(1) as pool:
        try:
            for action in ("load", "unload"):
                answers.append(pool.submit(client.post, f"/v2/repository/models/beta/{action}").result(timeout=30))
        finally:
            silent_worker.close()  # without a deadline a call waits for it: closing ends the wait
    assert [(answer.status_code, answer.json) for answer in answers] == [(504, {"error": (
        f"the model config was applied by this worker, but worker(s) [{SILENT_PID}] had not reported it applied "
        "within the call's deadline; they go on")})] * 2
    # Applied here, as the answer says: beta loaded, then unloaded.
    assert client.post("/v2/repository/index").json[1] == {"name": "beta", "version": "1", "state": "UNAVAILABLE",
                                                           "reason": "unloaded"}


def test_a_served_config_reads_back_unchanged():
    config = ModelConfig("m", "/models/m", max_batch_size=8, batch_timeout_ms=2.5, max_queue_rows=64,
                         max_request_rows=16, version_policy=("specific", (1, 3)), version_labels=(("stable", 1),),
                         pad_variable_length=True, pad_value=-1.5, length_buckets=(8, 16))
    for policy in (("specific", (1, 3)), ("latest", 2), ("all", ())):
        changed = ModelConfig(**{**config.__dict__, "version_policy": policy})
        assert app_settings.configs_from_document({"models": [config_entry(changed)]}, Settings(), "x") == [changed]
    default = ModelConfig("d", None, max_batch_size=32, batch_timeout_ms=0.0, max_queue_rows=128)
    assert app_settings.configs_from_document({"models": [config_entry(default)]}, Settings(), "x") == [default]
    # A load or unload rewrites every other model's entry: its sampling rate and priorities included.
    for priorities in (Priorities(1, 1, (QueuePolicy(),)),
                       Priorities(3, 2, (QueuePolicy(8, 0.0015), QueuePolicy(), QueuePolicy(0, 2.5)))):
        prioritized = ModelConfig(**{**config.__dict__, "payload_log_sampling_rate": 0.25, "priorities": priorities})
        assert app_settings.configs_from_document({"models": [config_entry(prioritized)]}, Settings(), "x") == [
            prioritized]


@pytest.mark.parametrize(("values", "message"), [
    ({"MODEL_CONTROL_MODE": "explicit"}, "MODEL_CONTROL_MODE='explicit' loads models from MODEL_REPOSITORY: set it"),
    ({"MODEL_CONTROL_MODE": "explicit", "MODEL_REPOSITORY": "/r", "MODEL_CONFIG_POLL_SECONDS": "5"},
     "MODEL_CONTROL_MODE='explicit' and MODEL_CONFIG_POLL_SECONDS=5 both change"),
    ({"MODEL_CONTROL_MODE": "poll"}, "MODEL_CONTROL_MODE='poll' is not valid"),
    ({"RESTRICTED_MODEL_CONTROL": "admin-key"}, "RESTRICTED_MODEL_CONTROL=<hidden> is not valid"),
    ({"RESTRICTED_MODEL_CONTROL": "grpc-x=1"}, "RESTRICTED_MODEL_CONTROL='grpc-x=<hidden>' is not valid"),
    ({"RESTRICTED_MODEL_CONTROL": "key-bin=1"}, "RESTRICTED_MODEL_CONTROL='key-bin=<hidden>' is not valid"),
    ({"RESTRICTED_MODEL_CONTROL": "key="}, "RESTRICTED_MODEL_CONTROL='key=<hidden>' is not valid"),
])
def test_bad_model_control_settings_stop_start_up(values, message):
    with pytest.raises(SettingsError, match="^" + message.replace("(", r"\(").replace("[", r"\[")):
        Settings.from_env(values)
