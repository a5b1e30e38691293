"""scripts/benchmark/common.py's shared options and server lifetime, which several scenarios lean on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from scripts.benchmark import common
from scripts.benchmark.__main__ import parse_args


def test_the_model_options_name_the_model_and_resolve_its_path(monkeypatch, tmp_path):
    """A relative --model-path becomes absolute (a baseline's server runs in another tree); the page names it."""
    monkeypatch.chdir(tmp_path)
    args = parse_args(["profile", "--model-path", "my.keras", "--baseline-ref", "HEAD~1"])
    assert (args.model_path, args.baseline_ref) == (str(tmp_path / "my.keras"), "HEAD~1")
    assert (common.model_name(args), common.model_path(args, tmp_path)) == ("my.keras", str(tmp_path / "my.keras"))
    experiment = parse_args(["experiment"])
    assert (experiment.model, experiment.model_path, experiment.baseline_ref) == ("default", None, None)
    assert common.model_name(experiment) == common.DEFAULT_MODEL_NAME
    assert common.model_path(experiment, tmp_path) is None  # the built-in model: nothing to build


def test_the_wide_model_is_built_once_for_the_run_and_named_by_its_shape(monkeypatch, tmp_path):
    built = []
    monkeypatch.setattr(common, "build_wide_model", lambda work_dir: built.append(work_dir) or "wide.keras")
    args = parse_args(["profile"])  # profile's default model is the wide one
    assert common.model_name(args) == f"the wide-input model ({common.WIDE_MODEL_NAME})"
    assert common.model_path(args, tmp_path) == "wide.keras" and built == [tmp_path]


def test_the_page_options_have_a_default_page_and_no_default_work_dir():
    args = parse_args(["variable-length"])
    assert (args.out, args.work_dir) == (common.DOCS / "variable-length-benchmark.md", None)
    assert parse_args(["profile", "--work-dir", "w"]).work_dir == Path("w")


class NeverReady(common.Server):
    """A process that never answers /readyz, in place of Gunicorn."""

    def command(self, *, workers: int) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(600)"]


def test_a_server_that_never_gets_ready_is_still_stopped(tmp_path):
    server = NeverReady(common.Config("never", 1, {}, ""), model_path=None, log_path=tmp_path / "never.log")
    with pytest.raises(TimeoutError), server.running(within_s=0.5):
        pytest.fail("running() yielded a server that was never ready")
    assert server.proc is not None and server.proc.poll() is not None
