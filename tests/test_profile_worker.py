"""scripts/profile_worker.py: how py-spy's samples become the stages of docs/profile.md.

The profile itself needs py-spy attached to a live worker (ptrace), which a CI container may
not allow; what is tested here is the reading of py-spy's raw output and the attribution
of each stack to a stage and each thread to a role, on stacks as py-spy writes them.
"""

from __future__ import annotations

import collections
import importlib.util
import sys

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def profile_worker():
    sys.path.insert(0, str(REPO / "scripts"))  # it imports scripts/benchmark.py as `benchmark`
    try:
        spec = importlib.util.spec_from_file_location("profile_worker", REPO / "scripts" / "profile_worker.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(REPO / "scripts"))


REQUEST = ("_bootstrap (threading.py:995);_worker (concurrent/futures/thread.py:83);"
           "ThreadWorker.handle (gunicorn/workers/gthread.py:553);Flask.wsgi_app (flask/app.py:1511)")


@pytest.mark.parametrize("leaf, stage", [
    # numpy called by the codec is the codec's time; the nearest known frame decides.
    (";_to_number_array (app/codec.py:251);_all (numpy/_core/_methods.py:70)", "JSON decode and checks"),
    (";_predict (app/api.py:40);encode_response (app/codec.py:380);_jsonable (app/codec.py:405)", "JSON encode"),
    # Gunicorn's own parse_request_line is HTTP, not the codec's parse_request.
    (";Request.parse_request_line (gunicorn/http/message.py:922)", "Gunicorn: HTTP, threads, polling"),
    (";_predict (app/api.py:38);ModelRegistry.predict (app/registry.py:233);Batcher.predict (app/batching.py:286)",
     "request thread: queue and wait"),
    (";_AccessLayer.__call__ (app/logs.py:290);log_access (app/logs.py:260)", "access log"),
    (";_MetricsLayer.__call__ (app/metrics.py:166);MmapedValue.inc (prometheus_client/values.py:115)", "metrics"),
    (";full_dispatch_request (flask/app.py:904);LocalProxy.__get__ (werkzeug/local.py:310)", "Flask and Werkzeug"),
])
def test_a_stack_counts_in_the_stage_of_its_nearest_known_frame(profile_worker, leaf, stage):
    assert profile_worker.stage_of(REQUEST + leaf) == stage


def test_the_batch_threads_predict_counts_as_the_model(profile_worker):
    stack = ("_bootstrap (threading.py:995);Batcher._run (app/batching.py:347);Batcher._execute (app/batching.py:470);"
             "_from_keras.<locals>.predict (app/models.py:245);quick_execute (tensorflow/python/eager/execute.py:53)")
    assert profile_worker.stage_of(stack) == "model: TensorFlow call"
    assert profile_worker.role_of(stack) == "batch thread"
    assert not profile_worker.is_waiting(stack)


def test_waiting_is_read_from_the_leaf(profile_worker):
    waiting = REQUEST + ";Future.result (concurrent/futures/_base.py:451);Condition.wait (threading.py:327)"
    assert profile_worker.role_of(waiting) == "request threads"
    assert profile_worker.is_waiting(waiting)
    assert not profile_worker.is_waiting(REQUEST + ";parse_json (app/codec.py:67)")


def test_raw_output_is_read_stack_by_stack(profile_worker, tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(f"{REQUEST};parse_json (app/codec.py:67) 7\n{REQUEST};parse_json (app/codec.py:67) 2\n"
                   "main (x.py:1);select (selectors.py:468) 5\n\n")
    assert profile_worker.read_raw(raw) == collections.Counter({
        f"{REQUEST};parse_json (app/codec.py:67)": 9, "main (x.py:1);select (selectors.py:468)": 5})


def test_gil_table_turns_shares_into_milliseconds_per_request(profile_worker):
    samples = collections.Counter({f"{REQUEST};parse_json (app/codec.py:67)": 30,
                                   f"{REQUEST};LocalProxy.__get__ (werkzeug/local.py:310)": 10})
    # 40 GIL samples of 200 ticks: the GIL was held 20 % of 10 s, 2 s, over 1,000 requests.
    result = {"label": "t", "gil": profile_worker.Profile("t", samples, 0, 200), "gil_requests_in_window": 1000,
              "seconds": 10}
    lines = profile_worker.gil_table([result])
    assert "| JSON decode and checks | 75.0% | 1.500 |" in lines
    assert "| Flask and Werkzeug | 25.0% | 0.500 |" in lines
    assert "| **all (GIL held)** | 100% | **2.000** |" in lines


def test_the_report_shows_its_command_without_local_folders(profile_worker):
    """The committed report names no folder of the machine it ran on: --out and --work-dir go
    with their values, in either spelling."""
    args = profile_worker.parse_args(["--model", "wide", "--out", "/somewhere/prof", "--baseline-ref", "166bcbf",
                                      "--work-dir=/elsewhere", "--users", "32"])
    assert args.argv_shown == ["--model", "wide", "--baseline-ref", "166bcbf", "--users", "32"]


def test_the_report_describes_the_method_not_the_usage(profile_worker):
    text = profile_worker.description()
    assert text.startswith("For each tree (this one, and with --baseline-ref a git worktree")
    assert text.endswith("its time on, waiting included.")
    assert "python scripts/profile_worker.py" not in text
