"""What a client may learn of the host: no model paths in model status, no list of models in a 404.

A live `gunicorn -c gunicorn.conf.py wsgi:app` serves one versioned model; a broken version 2
appears on disk while it runs. Asked over REST and gRPC, as TF Serving's clients ask.
"""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from tensorflow_serving.apis import (
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from tests.conftest import Server, wait_for
from tests.http_ledger import siege
from tests.test_versions import save_half_plus

TIMEOUT_S = 60
NAME = "private_model"
NOT_FOUND = "Servable not found for request: Latest(nope): no model named 'nope'"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("host-layout") / NAME
    save_half_plus(base / "1", 1.0)
    server = Server(tmp_path_factory.mktemp("status-logs"), {
        "MODEL_PATH": str(base), "MODEL_NAME": NAME, "MODEL_POLL_SECONDS": "0.2", "READYZ_DETAIL": "false"}).start()
    # A version whose SavedModel cannot be parsed: its load fails with the file's path in the error.
    staging = base.parent / ".staging"
    staging.mkdir()
    (staging / "saved_model.pb").write_bytes(b"not a SavedModel")
    os.rename(staging, base / "2")
    yield server, base
    server.stop()


def failed_version_2(server) -> dict | None:
    statuses = requests.get(f"{server.url}/v1/models/{NAME}", timeout=TIMEOUT_S).json()["model_version_status"]
    return next((status for status in statuses if status["version"] == "2" and status["state"] == "END"), None)


def test_a_failed_load_shows_its_cause_but_not_its_path_over_rest_and_grpc(served):
    server, base = served
    rest = wait_for(lambda: failed_version_2(server), within_s=120, what="version 2 to fail its load")
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = NAME
    request.model_spec.version.value = 2
    with grpc.insecure_channel(server.grpc_target) as channel:
        (status,) = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
            request, timeout=TIMEOUT_S).model_version_status

    message = rest["status"]["error_message"]
    assert rest["status"]["error_code"] == "UNKNOWN"
    assert status.status.error_message == message
    assert status.state == get_model_status_pb2.ModelVersionStatus.END
    assert f"<model {NAME}>" in message
    assert str(base) not in message and str(base.parent) not in message and "/tmp" not in message
    assert str(base / "2") in server.log()  # the operator's log keeps the whole cause
    # Version 1 serves on: y = 0.5 x + 1.
    answer = server.predict([2.0, 4.0], path=f"/v1/models/{NAME}:predict")
    assert answer.json() == {"predictions": [2.0, 3.0]}


def half_plus_one(x: np.ndarray) -> np.ndarray:
    return 0.5 * x + 1.0


def small_numbers(seed: int) -> np.ndarray:
    return np.arange(seed, seed + 3, dtype=np.float32)


def test_an_unknown_model_is_not_found_without_naming_the_models_served(served):
    server, _ = served
    with siege(server, half_plus_one, path=f"/v1/models/{NAME}:predict", rows=small_numbers) as watch:
        answer = requests.post(f"{server.url}/v1/models/nope:predict", json={"instances": [[1.0]]},
                               timeout=TIMEOUT_S)
        watch.got("POST", answer.status_code)
        watch.serving()
    assert answer.status_code == 404 and answer.json() == {"error": NOT_FOUND}

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "nope"
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones(1, np.float32)))
    with grpc.insecure_channel(server.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND and refused.value.details() == NOT_FOUND
    assert NAME not in answer.text


@pytest.mark.parametrize("detail,shown", [
    (False, "ModelLoadError: cannot read the SavedModel in <model m>/3: broken"),
    (True, "ModelLoadError: cannot read the SavedModel in {base}/3: broken"),
])
def test_readyz_detail_lets_the_path_through(tmp_path, monkeypatch, detail, shown):
    import prometheus_client

    from app.core import models
    from app.core import registry as registry_module
    from app.core.registry import LiveConfig, ModelRegistry
    from app.ops.metrics import Metrics
    from app.ops.settings import ModelConfig, Settings

    def failing_load(config, settings, metrics, version=None, *, on_broken=None, loading=None):
        raise models.ModelLoadError(f"cannot read the SavedModel in {config.path}/{version}: broken")

    monkeypatch.setattr(registry_module, "load_servable", failing_load)
    (tmp_path / "3").mkdir()
    config = ModelConfig("m", str(tmp_path), 1, 0.0, 16)
    registry = ModelRegistry("m")
    live = LiveConfig(registry, Settings(readyz_detail=detail), Metrics(prometheus_client.CollectorRegistry()))
    live.configs["m"] = config
    registry.set_state("m", 1, "AVAILABLE")
    live.sync_versions(config)
    (status,) = registry.model_status("m", 3)
    assert status["status"]["error_message"] == shown.format(base=tmp_path)
