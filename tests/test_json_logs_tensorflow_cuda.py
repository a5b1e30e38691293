"""LOG_FORMAT=json with the `tensorflow` package (TensorFlow's CUDA build) on a host without a GPU.

That build prints "cuda_platform.cc:52] failed call to cuInit" straight to descriptor 2 when
TensorFlow first looks for devices, after the import. The package would shadow tensorflow-cpu
in the project's venv, so it lives in a second one: `.venv-tensorflow` (or the folder
TENSORFLOW_CUDA_VENV names), holding only requirements-tensorflow-cuda.txt installed with
--no-deps and a .pth file that puts the project venv's site-packages after its own. CI makes
it (.ci/run); without it this test is skipped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, Server, integer_rows

VENV = Path(os.environ.get("TENSORFLOW_CUDA_VENV", REPO / ".venv-tensorflow"))
PYTHON = VENV / "bin" / "python"

pytestmark = pytest.mark.skipif(not PYTHON.exists(), reason=f"no venv with the tensorflow package at {VENV}")


def test_every_worker_line_is_json_with_tensorflows_cuda_build(tmp_path):
    probe = subprocess.run([str(PYTHON), "-c", "import importlib.metadata as m, tensorflow, sys;"
                            "sys.stdout.write(m.version('tensorflow') + ' ' + tensorflow.__file__)"],
                           capture_output=True, text=True, check=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    version, imported_from = probe.stdout.split()
    assert version == "2.21.0" and imported_from.startswith(str(VENV)), probe.stdout

    server = Server(tmp_path, {"LOG_FORMAT": "json"}, python=str(PYTHON))
    # TensorFlow's own default, not the tests' quiet one: every native line it prints must be caught.
    server.env.pop("TF_CPP_MIN_LOG_LEVEL")
    try:
        server.start()
        assert server.predict(integer_rows(3)).status_code == 200
    finally:
        assert server.stop(signum=signal.SIGTERM) == 0

    lines = server.log().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not JSON: {line!r}\n{server.log()}")
    # The line this test exists for was there, and came out as a record.
    assert any("failed call to cuInit" in record["message"] for record in records), server.log()
    assert any(record["logger"] == "app.access" for record in records)
