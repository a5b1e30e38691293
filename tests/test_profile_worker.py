"""The profile scenario: how py-spy's samples become the stages of its page; and the floor app.

The profile itself needs py-spy attached to a live worker (ptrace), which a CI container may
not allow; what is tested here is the reading of py-spy's raw output and the attribution
of each stack to a stage and each thread to a role, on stacks as py-spy writes them.
"""

from __future__ import annotations

import collections
import importlib.util
import json

import pytest

from scripts.benchmark.common import Server
from tests.conftest import REPO, wait_for


@pytest.fixture(scope="module")
def profile_worker():
    from scripts.benchmark import profile

    return profile


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
    assert profile_worker.on_batch_thread(stack)


BATCH_THREAD = "_bootstrap (threading.py:995);_bootstrap_inner (threading.py:1038);run (threading.py:975)"


@pytest.mark.parametrize("stack, stage", [
    # The engine's own frames, and the futures it settles, are the batch thread's time there ...
    (BATCH_THREAD + ";Batcher._run (app/batching/batcher.py:150);Executor.run (app/batching/execution.py:60);"
     "pad_rows (app/batching/rows.py:60)", "batch thread: gather, pad, deliver"),
    (BATCH_THREAD + ";Batcher._run (app/batching/batcher.py:150);Pending.deliver (app/batching/work.py:70);"
     "Future.set_result (concurrent/futures/_base.py:540)", "batch thread: gather, pad, deliver"),
    # ... and a request thread's queueing and waiting on a request thread.
    (REQUEST + ";Batcher.submit (app/batching/batcher.py:90);RowQueue._put (app/batching/row_queue.py:60)",
     "request thread: queue and wait"),
])
def test_the_engines_frames_count_for_the_thread_they_run_on(profile_worker, stack, stage):
    assert profile_worker.stage_of(stack) == stage
    assert profile_worker.on_batch_thread(stack) == stack.startswith(BATCH_THREAD)


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
    result = {"label": "t", "gil": profile_worker.Profile(samples, 0, 200), "gil_requests_in_window": 1000,
              "seconds": 10}
    lines = profile_worker.gil_table([result])
    assert "| JSON decode and checks | 75.0% | 1.500 |" in lines
    assert "| Flask and Werkzeug | 25.0% | 0.500 |" in lines
    assert "| **all (GIL held)** | 100% | **2.000** |" in lines


def test_thread_names_are_read_from_py_spys_dump(profile_worker):
    dump = ('Process 30465: python -m gunicorn -c gunicorn.conf.py wsgi:app\nPython v3.11.7 (/usr/bin/python3.11)\n\n'
            'Thread 30465 (idle): "MainThread"\n    EpollSelector.select (selectors.py:468)\n\n'
            'Thread 30470 (active+gil): "ThreadPoolExecutor-0_3"\n    parse_json (app/codec.py:67)\n\n'
            'Thread 30471 (idle): "batcher-default"\n    Condition.wait (threading.py:327)\n')
    assert profile_worker.parse_thread_names(dump) == {
        30465: "MainThread", 30470: "ThreadPoolExecutor-0_3", 30471: "batcher-default"}


def test_thread_cpu_is_read_from_proc_whatever_the_threads_command(profile_worker, tmp_path):
    """utime and stime are fields 14 and 15 of /proc/PID/task/TID/stat, counted after the
    command's closing parenthesis: a command may itself hold spaces and parentheses."""
    ticks = profile_worker.os.sysconf("SC_CLK_TCK")
    for tid, command, utime, stime in ((11, "python", 3 * ticks, ticks), (12, "tf (pool) 1", ticks // 2, ticks // 4)):
        task = tmp_path / "7" / "task" / str(tid)
        task.mkdir(parents=True)
        fields = ["S", "1", "7", "7", "0", "-1", "4194624", "10", "0", "0", "0", str(utime), str(stime), "0", "0"]
        (task / "stat").write_text(f"{tid} ({command}) {' '.join(fields)} 20 0 1 0\n")
    assert profile_worker.thread_cpu(7, proc=tmp_path) == {11: 4.0, 12: (ticks // 2 + ticks // 4) / ticks}


def test_cpu_is_summed_by_kind_of_thread_and_a_thread_without_python_is_native(profile_worker):
    names = {1: "MainThread", 2: "ThreadPoolExecutor-0_0", 3: "ThreadPoolExecutor-0_1", 4: "batcher-default",
             5: "floor-model", 6: "access-log", 7: "grpc-server"}
    before = {1: 1.0, 2: 2.0, 3: 0.5, 4: 1.0, 5: 0.0, 6: 0.0, 7: 0.0, 8: 10.0}
    # Thread 9 started after the first reading: all of its CPU is in the window.
    after = {1: 1.5, 2: 4.0, 3: 1.5, 4: 1.25, 5: 0.5, 6: 0.125, 7: 0.25, 8: 13.0, 9: 2.0}
    assert profile_worker.cpu_by_kind(before, after, names) == collections.Counter({
        "main thread (Gunicorn's poller)": 0.5, "request threads": 3.0, "batch thread": 0.75,
        "access-log thread": 0.125, "other Python threads": 0.25, profile_worker.NATIVE_THREADS: 5.0})


def test_cpu_table_gives_milliseconds_per_request_with_and_without_native_threads(profile_worker):
    cpu = collections.Counter({"request threads": 1.5, "batch thread": 0.25, profile_worker.NATIVE_THREADS: 4.0})
    lines = profile_worker.cpu_table([{"label": "t", "cpu": cpu, "cpu_requests": 1000, "cpu_rps": 50.0}])
    assert "| request threads | 1.500 |" in lines
    assert "| batch thread | 0.250 |" in lines
    assert f"| {profile_worker.NATIVE_THREADS} | 4.000 |" in lines
    assert "| **all Python threads** | **1.750** |" in lines
    assert "| all | 5.750 |" in lines
    assert not any(line.startswith("| access-log thread") for line in lines)  # no CPU in any column


def test_the_floor_profiles_as_the_floor_app_and_its_model_thread(profile_worker):
    view = REQUEST + ";predict (floor_app.py:76);ModelThread.wait (floor_app.py:58);Condition.wait (threading.py:327)"
    assert profile_worker.stage_of(view) == "floor app: parse, hand to the model thread, wait"
    model = ("_bootstrap (threading.py:995);ModelThread._run (floor_app.py:67);"
             "_from_keras.<locals>.predict (app/models.py:245);quick_execute (tensorflow/python/eager/execute.py:53)")
    assert profile_worker.stage_of(model) == "model: TensorFlow call"
    assert profile_worker.on_batch_thread(model)


def load_floor_app(name: str):
    """scripts/floor_app.py as a fresh module: it loads the built-in model, as Gunicorn would."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "floor_app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_floors_model_thread_runs_a_row_for_each_waiting_request_padded_to_the_servers_buckets():
    """The floor stands beside the server only if its calls are sized like the server's: a lone
    request runs a batch of one (a full batch would make the floor slower than the server at one
    user), waiting requests share a call padded to a bucket, and no call exceeds the largest."""
    import threading

    floor_app = load_floor_app("floor_app")
    assert floor_app.BUCKETS[-1] == floor_app.settings.max_batch_size

    calls: list[int] = []
    first_call_held = threading.Event()

    def predict(rows: int) -> None:
        calls.append(rows)
        first_call_held.wait(timeout=60)

    model_thread = floor_app.ModelThread(predict, (1, 2, 4, 8))
    requests = [threading.Thread(target=model_thread.wait)]
    requests[0].start()
    wait_for(lambda: calls == [1], what="the first call")
    requests += [threading.Thread(target=model_thread.wait) for _ in range(11)]
    for thread in requests[1:]:
        thread.start()
    wait_for(lambda: len(model_thread._waiting) == 11, what="11 requests waiting")
    first_call_held.set()
    for thread in requests:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in requests)
    assert calls == [1, 8, 4]  # 11 waiting: the largest bucket, then 3 padded to 4


def test_a_failed_call_of_the_floors_model_thread_fails_its_requests_and_the_thread_goes_on():
    """A benchmark against the floor must not hang: the error reaches the waiting request, and
    the next request gets a call of its own."""
    floor_app = load_floor_app("floor_app_failing")
    calls: list[int] = []

    def predict(rows: int) -> None:
        calls.append(rows)
        if len(calls) == 1:
            raise RuntimeError("the first call fails")

    model_thread = floor_app.ModelThread(predict, (1, 2, 4, 8))
    with pytest.raises(RuntimeError, match="the first call fails"):
        model_thread.wait(timeout_s=30)
    model_thread.wait(timeout_s=30)
    assert calls == [1, 1]


def test_floor_batcher_sends_each_request_through_the_servers_batching_engine(monkeypatch):
    """FLOOR_BATCHER=true: the floor's requests go through app/batching/'s Batcher (a batch
    per call, its own thread), and still get the floor's fixed answer of one row."""
    monkeypatch.setenv("FLOOR_BATCHER", "true")
    floor_app = load_floor_app("floor_app_batcher")
    try:
        answer = floor_app.app.test_client().post("/predict", json={"instances": [[1.0, 2.0, 3.0, 4.0]]})
        assert answer.status_code == 200 and answer.data == floor_app.ANSWER
        assert floor_app.batcher.batches_run == 1
        assert floor_app.batcher.max_batch_size == floor_app.settings.max_batch_size
        assert floor_app.batcher.fill_under_load and floor_app.batcher.buckets == floor_app.BUCKETS
    finally:
        floor_app.batcher.close()


def test_the_floor_describes_the_model_as_the_server_does_and_answers_one_row_of_it(profile_worker, tmp_path):
    """Locust builds its bodies from the metadata and checks the answer's row count, so the floor,
    a real Gunicorn serving scripts/floor_app.py, must describe the model exactly as the server
    does and answer one row of the model's own output, a real answer's size: here the model's
    answer to row 0 of the floor's seeded batch (standard normal, seed 0)."""
    import numpy as np
    import requests

    from app.core.models import example_batch, load_model
    from app.wire.metadata import describe

    server = Server(profile_worker.FLOOR, model_path=None, log_path=tmp_path / "floor.log")
    try:
        server.start(ready_within_s=180)
        metadata = requests.get(server.url + "/v1/models/default/metadata", timeout=30)
        answer = requests.post(server.url + "/predict", json={"instances": [[1.0, 2.0, 3.0, 4.0]]}, timeout=30)
    finally:
        server.stop()
    model = load_model(None, name="default")
    assert metadata.status_code == 200 and metadata.json() == json.loads(json.dumps(describe(model)))
    zeros = example_batch(model, 32)
    batch = {name: np.random.default_rng(0).standard_normal(array.shape).astype(array.dtype)
             for name, array in zeros.items()}
    expected = next(iter(model.predict(batch).values()))[0]
    assert answer.status_code == 200
    assert np.array_equal(np.asarray(answer.json()["predictions"], dtype=np.float32), expected[None, :])
