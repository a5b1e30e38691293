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

from app.core.repository import config_entry
from app.ops import settings as app_settings
from app.ops.settings import ModelConfig, Settings, SettingsError
from tests.conftest import Server, build_exact_model, integer_rows
from tests.test_tfs_live_config import worker_channels

KEY, SECRET = "admin-key", "s3cret"
ALLOWED = {KEY: SECRET}
TIMEOUT_S = 120


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


def test_a_broken_model_fails_with_its_reason_and_the_others_serve(http, grpc_client, workers, models):
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
                                 (grpc_client, ("StatusCode.PERMISSION_DENIED",
                                                f"This API is restricted, expecting metadata key '{KEY}'"))):
            for method, args in calls:
                with pytest.raises(InferenceServerException) as error:
                    getattr(client, method)(*args, headers=headers)
                assert (error.value.status(), error.value.message()) == expected, method
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        with pytest.raises(grpc.RpcError) as reload_refused:
            stub.HandleReloadConfigRequest(reload_request(repository), TIMEOUT_S)
        assert reload_refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        allowed = stub.HandleReloadConfigRequest(reload_request(repository), TIMEOUT_S, metadata=[(KEY, SECRET)])
        assert allowed.status.error_code == 0
    log = server.log()
    warnings = [json.loads(line) for line in log.splitlines()
                if line.startswith("{") and "refused" in line and '"app.core.repository"' in line]
    assert {entry["message"] for entry in warnings} >= {
        f"refused /v2/repository/index: no valid '{KEY}' header",
        f"refused /inference.GRPCInferenceService/RepositoryModelLoad: no valid '{KEY}' metadata key",
        f"refused /tensorflow.serving.ModelService/HandleReloadConfigRequest: no valid '{KEY}' metadata key"}
    assert all(entry["level"] == "WARNING" for entry in warnings)
    assert SECRET not in log and "wrong" not in log


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
            ("/v2/repository/index", {"ready": "yes"}, "'ready' must be true or false"),
            ("/v2/repository/index", [1], "the request must be a JSON object")):
        answer = client.post(path, json=sent)
        assert (answer.status_code, answer.json) == (400, {"error": message}), path
    for body in (b"{", b"\t"):  # whitespace alone is no body's absence: it is not JSON
        answer = client.post("/v2/repository/index", data=body)
        assert answer.status_code == 400 and answer.json["error"].startswith("malformed JSON"), body
    assert client.post("/v2/repository/index").status_code == 200


def test_a_served_config_reads_back_unchanged():
    config = ModelConfig("m", "/models/m", max_batch_size=8, batch_timeout_ms=2.5, max_queue_rows=64,
                         max_request_rows=16, version_policy=("specific", (1, 3)), version_labels=(("stable", 1),),
                         pad_variable_length=True, pad_value=-1.5, length_buckets=(8, 16))
    for policy in (("specific", (1, 3)), ("latest", 2), ("all", ())):
        changed = ModelConfig(**{**config.__dict__, "version_policy": policy})
        assert app_settings.configs_from_document({"models": [config_entry(changed)]}, Settings(), "x") == [changed]
    default = ModelConfig("d", None, max_batch_size=32, batch_timeout_ms=0.0, max_queue_rows=128)
    assert app_settings.configs_from_document({"models": [config_entry(default)]}, Settings(), "x") == [default]


@pytest.mark.parametrize(("values", "message"), [
    ({"MODEL_CONTROL_MODE": "explicit"}, "MODEL_CONTROL_MODE='explicit' loads models from MODEL_REPOSITORY: set it"),
    ({"MODEL_CONTROL_MODE": "explicit", "MODEL_REPOSITORY": "/r", "MODEL_PROCESSES": "1"},
     "MODEL_CONTROL_MODE='explicit' with MODEL_PROCESSES=1 is not supported"),
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
