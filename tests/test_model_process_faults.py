"""MODEL_PROCESSES: reloads, stops and faults on real servers (real Gunicorn, real TensorFlow in
the model processes, real sockets), and one race at the connection handler with real registries.

- HandleReloadConfigRequest is applied by every model process, and by every worker, before
  it answers; a bad config gets the default mode's error; a polled file still wins at its
  next poll.
- A stopping worker's rows wait out no batch window: SIGTERM to the master answers a request
  held in a long window at once, and the server exits long before the window would close.
- A version retired between the worker resolving it and the model process entering it:
  a pinned request is refused with TF Serving's words, an unpinned one goes to the newest.
- A batch thread that dies in a model process: every request is answered 200 or 503, and
  the model process that replaces it gives exact answers.
- Gunicorn's master killed: the supervisor and the model processes stop, nothing is left.

Answers are compared exactly with the model's own output.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import psutil
import pytest
import requests

from app.core import errors
from app.core.batching import Batcher, wait
from app.core.call import Call, ModelSpec
from app.core.models import LoadedModel, TensorInfo
from app.core.registry import ModelRegistry, Servable
from app.model_process.client import RemoteModels, RemoteRegistry
from app.model_process.link import ModelProcessLink
from app.model_process.server import WorkerConnection
from tests.conftest import REPO, Server, integer_rows, wait_for
from tests.test_tfs_live_config import (
    config_text,
    predict,
    reload,
    served,
    states,
    worker_channels,
    y_and_version,
)
from tests.tfs_models import VERSION, tfs_models  # noqa: F401  (a fixture)

CLIENT_TIMEOUT_S = 120
HOOKS = REPO / "tests" / "model_process_hooks"


def model_processes(server: Server) -> list[psutil.Process]:
    found = []
    for process in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "app.model_process.server" in process.cmdline():
                found.append(process)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return found


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def log_entries(server: Server) -> list[dict]:
    return [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]


# -- HandleReloadConfigRequest ---------------------------------------------------------------


@pytest.fixture(scope="module")
def paths(tfs_models):  # noqa: F811
    return {"two": str(tfs_models["half_plus_two_2_versions"]), "three": str(tfs_models["half_plus_three"])}


def started_config(paths) -> str:
    return config_text([("a", paths["two"], [VERSION], {"stable": VERSION})])


@pytest.fixture(scope="module")
def model_process_server(tmp_path_factory, paths):
    """Two model processes, three workers; no polling, so only the reload itself can change what
    is served. Shared by the reload tests, then ended by the killed master's."""
    config = tmp_path_factory.mktemp("mp-reload") / "models.config"
    config.write_text(started_config(paths))
    running = Server(tmp_path_factory.mktemp("mp-reload-logs"), {
        "MODEL_CONFIG": str(config), "MODEL_PROCESSES": "2", "MODEL_POLL_SECONDS": "0",
        "GRPC_TENSOR_CONTENT": "true", "LOG_FORMAT": "json"}).start(workers=3)
    yield running
    running.stop()


@pytest.fixture
def reload_server(model_process_server, paths):
    """The shared server; a reload test leaves it serving the config it started with."""
    yield model_process_server
    with grpc.insecure_channel(model_process_server.grpc_target) as channel:

        def restored() -> bool:
            try:
                response = reload(channel, started_config(paths), timeout_s=None)
            except grpc.RpcError as error:
                # A test that killed model processes may leave one still coming back: the server says retry.
                assert error.code() == grpc.StatusCode.UNAVAILABLE and "restarting" in error.details(), error
                return False
            assert response.status.error_code == 0, response
            return True

        wait_for(restored, within_s=CLIENT_TIMEOUT_S, what="the started config reloaded")


def test_a_reload_is_applied_by_every_model_process_and_worker_before_it_answers(reload_server, paths):
    pids = reload_server.wait_ready(workers=3)
    channels = worker_channels(reload_server, pids)
    try:
        first = next(iter(channels.values()))
        response = reload(first, config_text([
            ("a", paths["two"], [VERSION, VERSION + 1], {"stable": VERSION, "canary": VERSION + 1}),
            ("b", paths["three"], None, {})]))
        assert (response.status.error_code, response.status.error_message) == (0, "")
        # At once, in every worker, whichever model process it hands its rows to: no waiting.
        for opened in channels.values():
            assert y_and_version(predict(opened, "b", 2.0)) == ([4.0], VERSION)
            assert y_and_version(predict(opened, "a", 2.0, label="canary")) == ([3.0], VERSION + 1)
            assert states(opened, "a") == {VERSION: "AVAILABLE", VERSION + 1: "AVAILABLE"}
        # The model process that took the call published it; its sibling answered it applied.
        (published,) = [entry for entry in log_entries(reload_server)
                        if "model config generation 1 published" in entry["message"]]
        siblings = {process.pid for process in model_processes(reload_server)} - {published["pid"]}
        assert len(siblings) == 1
        assert f"workers [{siblings.pop()}] answered" in published["message"]

        response = reload(first, config_text([("b", paths["three"], None, {})]), timeout_s=None)
        assert response.status.error_code == 0
        for opened in channels.values():
            assert not served(opened, "a")
            assert states(opened, "a") == {VERSION: "END", VERSION + 1: "END"}
            assert y_and_version(predict(opened, "b", 6.0)) == ([6.0], VERSION)
    finally:
        for opened in channels.values():
            opened.close()


def test_a_bad_reload_gets_the_default_modes_error_and_the_rest_applies(reload_server, paths, tmp_path):
    with grpc.insecure_channel(reload_server.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as missing:
            reload(channel, config_text([("a", paths["two"], [VERSION], {}),
                                         ("gone", str(tmp_path / "nothing"), None, {})]))
        assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model 'gone'" in missing.value.details()
        with pytest.raises(grpc.RpcError) as custom:
            reload(channel, 'custom_model_config { type_url: "x" }')
        assert custom.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert y_and_version(predict(channel, "a", 0.0)) == ([2.0], VERSION)
        assert not served(channel, "gone")


def test_a_model_process_started_after_a_reload_serves_the_reloaded_config(reload_server, paths):
    with grpc.insecure_channel(reload_server.grpc_target) as channel:
        reload(channel, config_text([("c", paths["three"], None, {})]))
        killed = model_processes(reload_server)
        for process in killed:
            process.send_signal(signal.SIGKILL)
        wait_for(lambda: len([p for p in model_processes(reload_server) if p.pid not in {k.pid for k in killed}]) == 2,
                 within_s=CLIENT_TIMEOUT_S, what="two new model processes")

        def serves_c() -> bool:
            try:
                return y_and_version(predict(channel, "c", 2.0)) == ([4.0], VERSION)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error  # reconnecting
                return False

        wait_for(serves_c, within_s=CLIENT_TIMEOUT_S, what="model c served by the new model processes")
        assert not served(channel, "a")


def test_the_polled_file_wins_over_a_reload_at_the_next_poll(start_server, paths, tmp_path):
    config = tmp_path / "models.config"
    file_models = [("a", paths["two"], [VERSION], {})]
    config.write_text(config_text(file_models))
    server = start_server({"MODEL_CONFIG": str(config), "MODEL_PROCESSES": "1", "MODEL_CONFIG_POLL_SECONDS": "0.2",
                           "MODEL_POLL_SECONDS": "0", "GRPC_TENSOR_CONTENT": "true"})
    with grpc.insecure_channel(server.grpc_target) as channel:
        response = reload(channel, config_text([*file_models, ("d", paths["three"], None, {})]))
        assert response.status.error_code == 0
        # The model process applies the file, then pushes what it serves to the workers.
        wait_for(lambda: states(channel, "d") == {VERSION: "END"}, what="the file's config back")
        assert not served(channel, "d")
        assert y_and_version(predict(channel, "a", 6.0)) == ([5.0], VERSION)


# -- a stop cuts the batch windows ---------------------------------------------------------------

WINDOW_MS = 40_000


def test_sigterm_answers_a_request_held_in_its_batch_window_and_exits_before_it_closes(
        start_server, exact_model_path, exact_model):
    server = start_server({"MODEL_PATH": str(exact_model_path), "MODEL_PROCESSES": "1",
                           "BATCH_TIMEOUT_MS": str(WINDOW_MS), "MAX_BATCH_SIZE": "64", "GRACEFUL_TIMEOUT": "90",
                           "REQUEST_TIMEOUT_MS": "90000"})
    rows = integer_rows(1, seed=5)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(server.predict, rows, timeout=CLIENT_TIMEOUT_S)
        wait_for(lambda: server.metric("model_server_queue_rows", model="default") == 1,
                 what="the row queued in the model process")
        assert not waiting.done()
        server.send(signal.SIGTERM)
        # The server exits only once the worker has written its answer: bounded by half the window
        # (generous on a shared machine); without the cut it would wait the whole window first.
        assert server.proc.wait(WINDOW_MS / 2000) == 0
        answer = waiting.result(CLIENT_TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"predictions": exact_model(rows).numpy().tolist()}
    # It ran alone: its window was cut, not filled.
    assert answer.headers["X-Batch-Requests"] == "1"


def test_flush_runs_the_batch_forming_now_and_later_requests_wait_for_company_again():
    """The engine's part: flush() cuts the window of what is queued, not the batcher's window."""
    calls: list[int] = []

    def predict(tensors):
        calls.append(len(tensors["x"]))
        return {"y": tensors["x"] * 2}

    batcher = Batcher(predict, name="flushed", max_batch_size=4, batch_timeout_ms=WINDOW_MS)
    try:
        first = batcher.submit(Call(), {"x": np.ones((1, 2), np.float32)})
        batcher.flush()
        assert np.array_equal(first.result(30).outputs["y"], np.full((1, 2), 2, np.float32))
        assert first.result().batch_requests == 1
        later = [batcher.submit(Call(), {"x": np.zeros((1, 2), np.float32)})]
        # The flush is spent: the next request waits for three more (or its window).
        wait_for(lambda: batcher.queue.wake_requests == 3, what="the next request waiting for company")
        later += [batcher.submit(Call(), {"x": np.full((1, 2), value, np.float32)}) for value in range(1, 4)]
        assert [future.result(30).batch_requests for future in later] == [4] * 4
        assert calls == [1, 4]
    finally:
        batcher.close()


# -- a version retired between the worker and the model process ----------------------------------


GATE = 77.0


def _version(version: int, gate: threading.Event | None = None, *, width: int = 4) -> Servable:
    """Version n of "m": y = x + 10 n, rows of `width`; a request holding GATE waits for `gate` inside the model."""
    row = TensorInfo("x", (width,), np.dtype(np.float32), "DT_FLOAT")
    out = TensorInfo("y", (width,), np.dtype(np.float32), "DT_FLOAT")

    def predict(tensors):
        if gate is not None and (tensors["x"] == GATE).any():
            gate.wait(30)
        return {"y": tensors["x"] + np.float32(10 * version)}

    model = LoadedModel("m", version, f"m/{version}", [row], [out], predict)
    return Servable(model, {"serving_default": Batcher(model.predict, name=f"m-{version}", max_batch_size=8)})


def _predict(registry, call, servable, signature, inputs):
    """The rows through the registry's batcher (app/core/registry.py's submit), waited for here."""
    servable, engine, future = registry.submit(call, servable, signature, inputs)
    return servable, wait(engine, call, future)


@pytest.fixture
def handed_over(tmp_path):
    """A model process's registry (version 1 of "m", gated) and its connection handler, and a
    worker's registry linked to it; the worker hears of no change (no version push here)."""
    gate = threading.Event()
    models = ModelRegistry("m")
    models.add(_version(1, gate))
    path = str(tmp_path / "model.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        sock, _ = listener.accept()
        WorkerConnection(sock, models, 1 << 20).serve()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    worker = RemoteRegistry("")
    link = ModelProcessLink(path, arena_bytes=1 << 20, on_meta=lambda _description: None)
    RemoteModels(worker, link).apply(link.connect())
    yield models, worker, gate
    gate.set()
    link.close()
    thread.join(10)
    listener.close()
    models.close()


def test_a_version_retired_before_the_model_process_enters_it_refuses_pinned_and_sends_on_unpinned(handed_over):
    """Two moments of the swap, each after the worker resolved version 1: while version 1 is
    retiring (a request still inside it), and once it is gone."""
    models, worker, gate = handed_over
    rows = integer_rows(2, seed=9)
    held_rows = np.full((1, 4), GATE, np.float32)
    pinned, unpinned = worker.get("m", 1), worker.get("m")  # resolved in the worker: version 1 both
    assert pinned.model.version == unpinned.model.version == 1
    with ThreadPoolExecutor(2) as pool:
        held_in = worker.get("m", 1)
        held = pool.submit(_predict, worker, Call.within(30, model=ModelSpec("m", 1)), held_in, held_in.signature(),
                           {"x": held_rows})
        version_1 = models.get("m", 1)
        wait_for(lambda: version_1._inside == 1, what="a request inside version 1")
        models.add(_version(2))
        retiring = pool.submit(models.retire, "m", 1)
        wait_for(version_1.retiring.is_set, what="version 1 retiring")
        with pytest.raises(errors.NotFound) as refused:
            _predict(worker, Call.within(10, model=ModelSpec("m", 1)), pinned, pinned.signature(), {"x": rows})
        # TF Serving's words: whether the model process finds version 1 gone or still leaving.
        assert refused.value.message.startswith("Servable not found for request: Specific(m, 1)")
        _, answer = _predict(worker, Call.within(10), unpinned, unpinned.signature(), {"x": rows})
        assert np.array_equal(answer.outputs["y"], rows + 20)  # version 2's own answer
        gate.set()
        # The request inside version 1 when it began to retire is answered by it.
        assert np.array_equal(held.result(30)[1].outputs["y"], held_rows + 10)
        retiring.result(30)
    assert models.versions("m") == [2]
    with pytest.raises(errors.NotFound) as refused:
        _predict(worker, Call.within(10, model=ModelSpec("m", 1)), pinned, pinned.signature(), {"x": rows})
    assert refused.value.message.startswith("Servable not found for request: Specific(m, 1)")
    _, answer = _predict(worker, Call.within(10), unpinned, unpinned.signature(), {"x": rows})
    assert np.array_equal(answer.outputs["y"], rows + 20)


def test_a_model_process_refuses_an_unpinned_request_whose_newer_version_takes_other_inputs(handed_over):
    """The worker resolved version 1, which takes rows of 4; the model process has since retired it
    for a version 2 that takes rows of 3. Sending the request on would run rows decoded for version
    1's signature through version 2's: the model process refuses it as the default mode's registry
    does (the same fallback, ModelRegistry.enter), and the client may retry."""
    models, worker, _gate = handed_over
    unpinned = worker.get("m")  # resolved in the worker: version 1
    models.add(_version(2, width=3))
    models.retire("m", 1)
    assert models.versions("m") == [2]
    with pytest.raises(errors.Unavailable) as refused:
        _predict(worker, Call.within(10), unpinned, unpinned.signature(), {"x": integer_rows(2, seed=9)})
    assert refused.value.message == ("model 'm' changed to v2, whose signature 'serving_default' takes other "
                                     "inputs, while this request waited; retry")


# -- a batch thread dies in the model process -----------------------------------------------------


def test_a_batch_thread_that_dies_stops_its_model_process_and_a_new_one_serves(start_server, exact_model_path,
                                                                                  exact_model):
    server = start_server({"MODEL_PATH": str(exact_model_path), "MODEL_PROCESSES": "1", "LOG_FORMAT": "json",
                           "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")]),
                           "KILL_BATCH_THREADS_ON_SIGUSR2": "1"}, workers=2)
    rows = integer_rows(3, seed=21)
    expected = {"predictions": exact_model(rows).numpy().tolist()}
    statuses: list[int] = []
    wrong: list[str] = []
    stop = threading.Event()

    def load() -> None:
        with requests.Session() as session:
            while not stop.is_set():
                answer = session.post(server.url + "/predict", json={"instances": rows.tolist()},
                                      timeout=CLIENT_TIMEOUT_S)
                statuses.append(answer.status_code)
                if answer.status_code == 200 and answer.json() != expected:
                    wrong.append(answer.text)
                if answer.status_code == 503:
                    assert answer.headers["Retry-After"]

    (first,) = model_processes(server)
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(load) for _ in range(4)]
        try:
            wait_for(lambda: len(statuses) >= 20, what="20 answers under load")
            first.send_signal(signal.SIGUSR2)
            wait_for(lambda: gone(first), within_s=CLIENT_TIMEOUT_S, what="the broken model process gone")
        finally:
            stop.set()  # a failed wait ends the loads too, or the pool's exit would wait on them for ever
        for future in running:
            future.result()
    assert wrong == []
    assert set(statuses) <= {200, 503} and 503 in statuses
    assert any("batch thread of model 'default' died" in entry["message"] and entry["pid"] == first.pid
               for entry in log_entries(server))

    def ten_answers() -> list[dict] | None:
        answers = [server.predict(rows, headers={"Connection": "close"}).json() for _ in range(10)]
        return answers if all("error" not in answer for answer in answers) else None

    assert wait_for(ten_answers, within_s=CLIENT_TIMEOUT_S, what="ten answers in a row") == [expected] * 10
    (replacement,) = model_processes(server)
    assert replacement.pid != first.pid


# -- Gunicorn's master dies ------------------------------------------------------------------------


def test_a_killed_master_leaves_no_supervisor_or_model_process_running(model_process_server):
    """On the reload tests' server (two model processes, three workers), which it ends: so it
    comes last in this file, and a start of its own is saved."""
    server = model_process_server
    wait_for(lambda: len(model_processes(server)) == 2, within_s=CLIENT_TIMEOUT_S, what="two model processes")
    everything = psutil.Process(server.proc.pid).children(recursive=True)
    supervisors = [p for p in everything if "app.model_process.supervisor" in p.cmdline()]
    assert len(supervisors) == 1 and len(model_processes(server)) == 2
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(CLIENT_TIMEOUT_S)
    # The workers see their parent gone, the supervisor its pipe closed; it stops the model processes.
    wait_for(lambda: all(gone(process) for process in everything), within_s=CLIENT_TIMEOUT_S,
             what="every process of the server gone")
