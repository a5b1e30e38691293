"""The KServe SDK's v2 REST client (InferenceRESTClient, protocol v2) against a live server.

The SDK pins protobuf and psutil older than TensorFlow and the dev tools take, so it lives in
a venv of its own: .venv-kserve, from requirements-kserve.lock, made here if it is missing
(.ci/run makes it beforehand). Its client runs there as a subprocess (tests/kserve_v2_client.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, integer_rows
from tests.test_tf_serving import save_tag_signal_sensor

KSERVE_VENV = REPO / ".venv-kserve"
KSERVE_PYTHON = KSERVE_VENV / "bin" / "python"


@pytest.fixture(scope="module")
def kserve_python() -> str:
    if not KSERVE_PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(KSERVE_VENV)], check=True)
        subprocess.run([sys.executable, "-m", "pip", "--python", str(KSERVE_PYTHON), "install", "-q",
                        "-r", str(REPO / "requirements-kserve.lock")], check=True, timeout=900)
    return str(KSERVE_PYTHON)


@pytest.fixture(scope="module")
def served(tmp_path_factory, exact_model_path):
    from tests.conftest import Server

    folder = tmp_path_factory.mktemp("kserve")
    save_tag_signal_sensor(folder / "tss")
    config = folder / "models.json"
    config.write_text(json.dumps({"default": "exact", "models": [
        {"name": "exact", "path": str(exact_model_path)}, {"name": "tss", "path": str(folder / "tss")}]}))
    server = Server(folder, {"MODEL_CONFIG": str(config), "MODEL_POLL_SECONDS": "0"})
    server.start()
    yield server
    server.stop()


def kserve_infer(python: str, url: str, model: str, inputs: dict, *, binary: bool) -> dict:
    done = subprocess.run([python, str(REPO / "tests" / "kserve_v2_client.py"), url, model],
                          input=json.dumps({"inputs": inputs, "binary": binary}), capture_output=True, text=True,
                          timeout=120, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_kserve_client_gets_the_models_own_output_row_for_row(kserve_python, served, exact_model, binary):
    rows = integer_rows(5, seed=21)

    answer = kserve_infer(kserve_python, served.url, "exact",
                          {"features": {"datatype": "FP32", "data": rows.tolist()}}, binary=binary)

    assert answer["ready"] and answer["model_ready"]
    scores = answer["outputs"]["scores"]
    assert (scores["datatype"], scores["shape"]) == ("FP32", [5, 3])
    np.testing.assert_array_equal(np.array(scores["data"], np.float32).reshape(5, 3), exact_model(rows).numpy())


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_kserve_client_with_several_inputs_and_strings(kserve_python, served, binary):
    inputs = {"tag": {"datatype": "BYTES", "data": ["foo", "héllo", ""]},
              "signal": {"datatype": "FP32", "data": np.arange(15).reshape(3, 5).tolist()},
              "sensor": {"datatype": "FP32", "data": np.arange(12).reshape(3, 2, 2).tolist()}}

    outputs = kserve_infer(kserve_python, served.url, "tss", inputs, binary=binary)["outputs"]

    assert outputs["tag_length"] == {"datatype": "INT32", "shape": [3], "data": [3, 6, 0]}
    assert outputs["sensor_max"]["data"] == [3.0, 7.0, 11.0]
    assert outputs["signal_sum"]["data"] == [10.0, 35.0, 60.0]
