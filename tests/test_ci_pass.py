"""The README's test command runs the model-process suites a second time, in the mode, within its one
pytest run (`--model-processes`, tests/conftest.py): checked on a stand-in file, in a pytest of its own."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

STAND_IN = '''
import os

import pytest


@pytest.fixture(scope="module")
def mode_at_start():
    # What a module fixture that starts a server sees: the copy's variable is set before it.
    return os.environ.get("MODEL_PROCESSES")


@pytest.mark.server
def test_served(request, mode_at_start):
    copy = request.node.nodeid.split("::")[0].endswith("[model-processes]")
    assert mode_at_start == os.environ.get("MODEL_PROCESSES") == ("1" if copy else None)


def test_in_process():
    pass
'''


def run_stand_in(tmp_path, *args: str) -> str:
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import (_model_processes_mode, pytest_addoption, pytest_collect_file,  # noqa: F401\n"
        "                            pytest_collection_modifyitems, pytest_configure)\n")
    (tmp_path / "test_server.py").write_text(STAND_IN)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    server: starts a live server\n")
    env = {**{key: value for key, value in os.environ.items() if key != "MODEL_PROCESSES"}, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def test_model_processes_copies_a_files_server_tests_and_runs_them_in_the_mode(tmp_path):
    output = run_stand_in(tmp_path, "--model-processes")
    assert "3 passed, 1 deselected in" in output, output
    assert "PASSED test_server.py[model-processes]::test_served" in output, output
    assert "PASSED test_server.py::test_served" in output and "PASSED test_server.py::test_in_process" in output


def test_without_the_option_each_file_runs_once_in_the_default_mode(tmp_path):
    output = run_stand_in(tmp_path)
    assert "2 passed" in output and "deselected" not in output and "[model-processes]" not in output, output
