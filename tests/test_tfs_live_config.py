"""TF Serving's ModelServerConfig applied live, by ModelService.HandleReloadConfigRequest and
by polling the config file, on a real server with real stubs; and gRPC outputs as
`tensor_content` when GRPC_TENSOR_CONTENT asks (TF Serving's
--enable_serialization_as_tensor_content).

The reload server has two workers: a reload is the server's, applied by both before the call
answers, and by a worker Gunicorn starts later. Each worker is reached on connections of its
own (the kernel spreads them, SO_REUSEPORT) and told apart by the pid of its access lines.

The models are TF Serving's test models (scripts/tfs_models.py): half_plus_two (y = 0.5 x + 2)
in versions 123 and 124, and half_plus_three (y = 0.5 x + 3); every answer is exact.
"""

from __future__ import annotations

import json
import os
import signal
import uuid

import grpc
import numpy as np
import pytest
import requests
from google.protobuf import text_format
from tensorflow_serving.apis import (
    get_model_status_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from tests.conftest import Server, wait_for
from tests.tfs_models import VERSION, tfs_models  # noqa: F401  (a fixture)

TIMEOUT_S = 60


def config_text(models) -> str:
    """A ModelServerConfig in text format: (name, base path, versions or None, labels) each."""
    entries = []
    for name, path, versions, labels in models:
        policy = ("model_version_policy { specific { " + " ".join(f"versions: {v}" for v in versions) + " } }"
                  if versions else "")
        label_text = " ".join(f'version_labels {{ key: "{k}" value: {v} }}' for k, v in labels.items())
        entries.append(f'config {{ name: "{name}" base_path: "{path}" model_platform: "tensorflow" '
                       f"{policy} {label_text} }}")
    return "model_config_list { " + " ".join(entries) + " }"


@pytest.fixture(scope="module")
def paths(tfs_models):  # noqa: F811
    return {"two": str(tfs_models["half_plus_two_2_versions"]), "three": str(tfs_models["half_plus_three"])}


def start_config(tmp_path_factory, paths):
    path = tmp_path_factory.mktemp("live-config") / "models.config"
    path.write_text(config_text([("a", paths["two"], [VERSION], {"stable": VERSION})]))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, paths):
    running = Server(tmp_path_factory.mktemp("live-config-logs"), {
        "MODEL_CONFIG": str(start_config(tmp_path_factory, paths)), "MODEL_POLL_SECONDS": "0",
        "GRPC_TENSOR_CONTENT": "true", "LOG_FORMAT": "json"}).start(workers=2)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target) as opened:
        yield opened


@pytest.fixture(scope="module")
def config_file(tmp_path_factory, paths):
    return start_config(tmp_path_factory, paths)


@pytest.fixture(scope="module")
def polled_server(tmp_path_factory, config_file):
    running = Server(tmp_path_factory.mktemp("polled-config-logs"), {
        "MODEL_CONFIG": str(config_file), "MODEL_CONFIG_POLL_SECONDS": "0.2", "MODEL_POLL_SECONDS": "0",
        "GRPC_TENSOR_CONTENT": "true"}).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def polled_channel(polled_server):
    with grpc.insecure_channel(polled_server.grpc_target) as opened:
        yield opened


def reload(channel, text: str, timeout_s: float | None = TIMEOUT_S) -> model_management_pb2.ReloadConfigResponse:
    request = model_management_pb2.ReloadConfigRequest()
    text_format.Parse(text, request.config)
    return model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(request, timeout_s)


def predict(channel, model: str, x: float, *, label: str = "") -> predict_pb2.PredictResponse:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    if label:
        request.model_spec.version_label = label
    request.inputs["x"].dtype = 1  # DT_FLOAT
    request.inputs["x"].float_val.append(x)
    request.inputs["x"].tensor_shape.dim.add().size = 1
    request.output_filter.append("y")
    return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, TIMEOUT_S)


def y_and_version(response: predict_pb2.PredictResponse) -> tuple[list[float], int]:
    """y from tensor_content (GRPC_TENSOR_CONTENT=true: the typed field stays empty), and who answered."""
    y = response.outputs["y"]
    assert list(y.float_val) == []
    return np.frombuffer(y.tensor_content, dtype="<f4").tolist(), response.model_spec.version.value


def answering_pid(server: Server, channel) -> int:
    """The pid of the worker this channel's connection reached: its access line names it."""
    request_id = f"which-worker-{uuid.uuid4().hex}"
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "no-such-model"
    with pytest.raises(grpc.RpcError) as refused:
        model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
            request, TIMEOUT_S, metadata=[("x-request-id", request_id)])
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND

    def access_line():
        for line in server.log().splitlines():
            if line.startswith("{") and request_id in line:
                entry = json.loads(line)
                if entry["logger"] == "app.access" and entry["request_id"] == request_id:
                    return entry
        return None

    return wait_for(access_line, what=f"the access line of {request_id}")["pid"]


def worker_channels(server: Server, pids: set[int]) -> dict[int, grpc.Channel]:
    """A channel to each worker of `pids`: fresh connections until each has answered one."""
    channels: dict[int, grpc.Channel] = {}
    for _ in range(200):
        # A channel of its own connection: grpc would otherwise share one among equal channels.
        opened = grpc.insecure_channel(server.grpc_target, options=[("grpc.use_local_subchannel_pool", 1)])
        pid = answering_pid(server, opened)
        if pid in pids and pid not in channels:
            channels[pid] = opened
            if len(channels) == len(pids):
                return channels
        else:
            opened.close()
    for opened in channels.values():
        opened.close()
    raise AssertionError(f"200 connections reached workers {sorted(channels)} only, not all of {sorted(pids)}")


def served(channel, model: str) -> bool:
    try:
        predict(channel, model, 0.0)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.NOT_FOUND, error
        return False
    return True


def states(channel, model: str) -> dict[int, str]:
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = model
    response = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(request, TIMEOUT_S)
    names = get_model_status_pb2.ModelVersionStatus.State.Name
    return {status.version: names(status.state) for status in response.model_version_status}


def test_outputs_travel_in_tensor_content_when_asked(channel):
    assert y_and_version(predict(channel, "a", 2.0)) == ([3.0], VERSION)


def test_reload_adds_a_model_a_version_and_a_label(channel, paths):
    response = reload(channel, config_text([
        ("a", paths["two"], [VERSION, VERSION + 1], {"stable": VERSION, "canary": VERSION + 1}),
        ("b", paths["three"], None, {})]))
    assert (response.status.error_code, response.status.error_message) == (0, "")
    assert y_and_version(predict(channel, "b", 2.0)) == ([4.0], VERSION)
    assert y_and_version(predict(channel, "a", 2.0, label="canary")) == ([3.0], VERSION + 1)
    assert y_and_version(predict(channel, "a", 2.0, label="stable")) == ([3.0], VERSION)
    assert states(channel, "a") == {VERSION: "AVAILABLE", VERSION + 1: "AVAILABLE"}


def test_reload_removes_a_model_and_changes_a_label(channel, paths):
    reload(channel, config_text([("a", paths["two"], [VERSION, VERSION + 1], {"stable": VERSION}),
                                 ("b", paths["three"], None, {})]))
    response = reload(channel, config_text([("a", paths["two"], [VERSION, VERSION + 1], {"stable": VERSION + 1})]))
    assert response.status.error_code == 0
    assert y_and_version(predict(channel, "a", 4.0, label="stable")) == ([4.0], VERSION + 1)
    with pytest.raises(grpc.RpcError) as removed:
        predict(channel, "b", 2.0)
    assert removed.value.code() == grpc.StatusCode.NOT_FOUND
    assert states(channel, "b") == {VERSION: "END"}


def test_a_bad_reload_is_refused_with_invalid_argument_and_the_rest_applies(channel, paths, tmp_path):
    reload(channel, config_text([("a", paths["two"], [VERSION, VERSION + 1], {})]))
    with pytest.raises(grpc.RpcError) as custom:
        reload(channel, 'custom_model_config { type_url: "x" }')
    assert custom.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Only ModelConfigList is currently supported" in custom.value.details()
    with pytest.raises(grpc.RpcError) as missing:
        reload(channel, config_text([("a", paths["two"], [VERSION], {}),
                                     ("gone", str(tmp_path / "nothing"), None, {})]))
    assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model 'gone'" in missing.value.details()
    with pytest.raises(grpc.RpcError) as bad_label:
        reload(channel, config_text([("a", paths["two"], [VERSION], {}), ("d", paths["three"], None, {"x": 999})]))
    assert bad_label.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'x' names version 999, which is not served" in bad_label.value.details()
    with pytest.raises(grpc.RpcError) as unserved:
        predict(channel, "d", 2.0)  # loaded, then unloaded: served in full or not at all
    assert unserved.value.code() == grpc.StatusCode.NOT_FOUND
    assert y_and_version(predict(channel, "a", 0.0)) == ([2.0], VERSION)
    assert states(channel, "a")[VERSION + 1] == "END"


def test_a_reload_is_applied_by_every_worker_before_it_answers(server, channel, paths):
    reload(channel, config_text([("a", paths["two"], [VERSION], {"stable": VERSION})]))
    # A call without a deadline waits for every worker, however long their loads take.
    response = reload(channel, config_text([("b", paths["three"], None, {})]), timeout_s=None)
    assert (response.status.error_code, response.status.error_message) == (0, "")
    for opened in worker_channels(server, server.wait_ready(workers=2)).values():
        with opened:
            assert y_and_version(predict(opened, "b", 2.0)) == ([4.0], VERSION)
            assert not served(opened, "a")
            assert states(opened, "a")[VERSION] == "END"


def test_a_worker_started_after_a_reload_serves_the_reloaded_config(server, channel, paths):
    reload(channel, config_text([("b", paths["three"], None, {}),
                                 ("c", paths["two"], [VERSION + 1], {"canary": VERSION + 1})]))
    before = server.wait_ready(workers=2)
    # Not the worker the module's channel is connected to: the other tests go on using it.
    killed = next(pid for pid in before if pid != answering_pid(server, channel))
    os.kill(killed, signal.SIGKILL)
    # Gunicorn starts a worker in its place: two workers answer ready once its models are loaded.
    now = server.wait_ready(workers=2)
    (replacement,) = now - before
    with worker_channels(server, {replacement})[replacement] as opened:
        assert y_and_version(predict(opened, "b", 2.0)) == ([4.0], VERSION)
        assert y_and_version(predict(opened, "c", 2.0, label="canary")) == ([3.0], VERSION + 1)
        assert not served(opened, "a")
    # The killed worker's socket is left behind: the next reload finds it dead and goes on.
    response = reload(channel, config_text([("a", paths["two"], [VERSION], {})]))
    assert response.status.error_code == 0
    for opened in worker_channels(server, now).values():
        with opened:
            assert y_and_version(predict(opened, "a", 4.0)) == ([4.0], VERSION)
            assert not served(opened, "b")


def test_the_polled_config_file_is_applied_when_it_changes(polled_server, polled_channel, config_file, paths):
    config_file.write_text(config_text([("a", paths["two"], [VERSION + 1], {"stable": VERSION + 1}),
                                        ("c", paths["three"], None, {})]))
    # The file's models are applied in its order: c is served last.
    wait_for(lambda: requests.get(f"{polled_server.url}/v1/models/c", timeout=TIMEOUT_S).ok, what="model c served")
    assert states(polled_channel, "a") == {VERSION: "END", VERSION + 1: "AVAILABLE"}
    assert y_and_version(predict(polled_channel, "c", 6.0)) == ([6.0], VERSION)
    assert y_and_version(predict(polled_channel, "a", 6.0, label="stable")) == ([5.0], VERSION + 1)


def test_the_polled_file_wins_over_a_reload_at_the_next_poll(polled_server, polled_channel, config_file, paths):
    # As TF Serving, which applies the polled file at every poll (model_servers/server.cc).
    file_models = [("a", paths["two"], [VERSION + 1], {"stable": VERSION + 1}), ("c", paths["three"], None, {})]
    config_file.write_text(config_text(file_models))
    wait_for(lambda: served(polled_channel, "c"), what="the file's config applied")
    response = reload(polled_channel, config_text([*file_models, ("d", paths["three"], None, {})]))
    assert response.status.error_code == 0
    wait_for(lambda: not served(polled_channel, "d"), what="the file's config back")
    assert states(polled_channel, "d") == {VERSION: "END"}
    assert y_and_version(predict(polled_channel, "c", 6.0)) == ([6.0], VERSION)
