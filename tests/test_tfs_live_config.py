"""TF Serving's ModelServerConfig applied live, by ModelService.HandleReloadConfigRequest and
by polling the config file, on a real server with real stubs; and gRPC outputs as
`tensor_content` when GRPC_TENSOR_CONTENT asks (TF Serving's
--enable_serialization_as_tensor_content).

The models are TF Serving's test models (tests/tfs_models.py): half_plus_two (y = 0.5 x + 2)
in versions 123 and 124, and half_plus_three (y = 0.5 x + 3); every answer is exact.
"""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def config_file(tmp_path_factory, paths):
    path = tmp_path_factory.mktemp("live-config") / "models.config"
    path.write_text(config_text([("a", paths["two"], [VERSION], {"stable": VERSION})]))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, config_file):
    running = Server(tmp_path_factory.mktemp("live-config-logs"), {
        "MODEL_CONFIG": str(config_file), "MODEL_CONFIG_POLL_SECONDS": "0.2", "MODEL_POLL_SECONDS": "0",
        "GRPC_TENSOR_CONTENT": "true"}).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target) as opened:
        yield opened


def reload(channel, text: str) -> model_management_pb2.ReloadConfigResponse:
    request = model_management_pb2.ReloadConfigRequest()
    text_format.Parse(text, request.config)
    return model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(request, TIMEOUT_S)


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


def test_the_polled_config_file_is_applied_when_it_changes(server, channel, config_file, paths):
    config_file.write_text(config_text([("a", paths["two"], [VERSION + 1], {"stable": VERSION + 1}),
                                        ("c", paths["three"], None, {})]))
    # The file's models are applied in its order: c is served last.
    wait_for(lambda: requests.get(f"{server.url}/v1/models/c", timeout=TIMEOUT_S).ok, what="model c served")
    assert states(channel, "a") == {VERSION: "END", VERSION + 1: "AVAILABLE"}
    assert y_and_version(predict(channel, "c", 6.0)) == ([6.0], VERSION)
    assert y_and_version(predict(channel, "a", 6.0, label="stable")) == ([5.0], VERSION + 1)
