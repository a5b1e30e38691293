"""Versions served at once, labels, version status, and pinning through a version change.

TF Serving's rules, each test citing the file it follows: version folders are numbers
(servables/tensorflow/.../storage_path.cc: '00000123' is 123, other names ignored);
model_version_policy latest/all/specific (sources/storage_path/file_system_storage_path_source.proto);
version_labels and the label routes, an unknown label answering 400
(model_servers/server_core.cc, http_rest_api_handler.cc); GetModelStatus listing every
version with its state (model_servers/get_model_status_impl.cc, g3doc/api_rest.md); a
request for a version not served answering 404 "Servable not found for request:
Specific(name, version)" (core/basic_manager.cc).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading

import numpy as np
import pytest
import requests

from app.core import models
from app.core.batching import Batcher, BatchObserver, wait
from app.core.call import Call, ModelSpec
from app.core.errors import NotFound
from app.core.models import LoadedModel, TensorInfo
from app.core.registry import LiveConfig, ModelRegistry, Servable, wanted_versions
from app.ops.settings import ModelConfig, Settings, SettingsError, model_configs
from tests.conftest import Server, wait_for

TIMEOUT_S = 60


# -- version folders and policies (no server) ----------------------------------------------------

def test_version_folders_are_numbers_with_leading_zeros_and_nothing_else(tmp_path):
    """storage_path.cc: a version folder's name is parsed as a number; others are skipped."""
    for name in ("00000123", "7", "abc", ".export-9", "12x", "v3"):
        (tmp_path / name).mkdir()
    (tmp_path / "5").write_text("a file, not a version")
    assert models.version_folders(str(tmp_path)) == {7: str(tmp_path / "7"), 123: str(tmp_path / "00000123")}
    assert models.resolve_version(str(tmp_path)) == (str(tmp_path / "00000123"), 123)
    assert models.resolve_version(str(tmp_path), 7) == (str(tmp_path / "7"), 7)


@pytest.mark.parametrize("policy,expected", [
    (("latest", 1), [9]),
    (("latest", 2), [4, 9]),
    (("latest", 5), [1, 2, 4, 9]),
    (("all", ()), [1, 2, 4, 9]),
    (("specific", (2, 3, 9)), [2, 9]),
])
def test_version_policy_picks_as_tf_serving_does(policy, expected):
    """file_system_storage_path_source.proto: latest N (default 1), all, specific versions."""
    config = ModelConfig("m", "/x", 8, 0.0, 64, version_policy=policy)
    assert wanted_versions(config, [4, 1, 9, 2]) == expected


def write_config(tmp_path, entry) -> Settings:
    (tmp_path / "models.json").write_text(json.dumps({"models": [{"name": "m", **entry}]}))
    return Settings(model_config=str(tmp_path / "models.json"))


def test_model_config_reads_version_policy_and_labels(tmp_path):
    """config/model_server_config.proto: model_version_policy and version_labels, as JSON."""
    config, = model_configs(write_config(tmp_path, {
        "path": "/m", "model_version_policy": {"specific": {"versions": [2, 1]}},
        "version_labels": {"stable": 1, "canary": 2}}))
    assert (config.version_policy, config.version_labels) == (("specific", (1, 2)), (("canary", 2), ("stable", 1)))
    default, = model_configs(write_config(tmp_path, {"path": "/m"}))
    assert default.version_policy == ("latest", 1)


@pytest.mark.parametrize("entry,words", [
    ({"model_version_policy": {"latest": {"num_versions": 0}}}, "model_version_policy must be one of"),
    ({"model_version_policy": {"newest": {}}}, "model_version_policy must be one of"),
    ({"model_version_policy": {"specific": {"versions": []}}}, "model_version_policy must be one of"),
    ({"version_labels": {"stable": "1"}}, "version_labels: 'stable'"),
    ({"version_labels": [1]}, "version_labels must be an object"),
])
def test_bad_version_policy_or_labels_stop_start_up_with_a_message(tmp_path, entry, words):
    """file_system_storage_path_source.proto: num_versions is at least 1, versions a list of numbers."""
    with pytest.raises(SettingsError, match=words):
        model_configs(write_config(tmp_path, {"path": "/m", **entry}))


# -- the swap, deterministically (in-process: real Batchers, event-gated fake predict) --------------

class RecordingObserver(BatchObserver):
    def __init__(self) -> None:
        self.rejections: list[str] = []
        self.depths: list[int] = []
        self.changed = threading.Condition()

    def queue_depth(self, rows: int) -> None:
        with self.changed:
            self.depths.append(rows)
            self.changed.notify_all()

    def rejected(self, reason: str) -> None:
        self.rejections.append(reason)


def gated_servable(version: int, gate: threading.Event, running: threading.Event) -> tuple[Servable, RecordingObserver]:
    """Version v answers x * v, and only once `gate` is set."""
    def predict(batch):
        running.set()
        assert gate.wait(TIMEOUT_S)
        return {"y": batch["x"] * version}

    spec = TensorInfo("x", (), np.dtype("float32"), "DT_FLOAT")
    model = LoadedModel("m", version, "test", [spec], [TensorInfo("y", (), np.dtype("float32"), "DT_FLOAT")], predict)
    observer = RecordingObserver()
    batcher = Batcher(predict, name=f"m-v{version}", max_batch_size=1, max_queue_rows=16, observer=observer)
    return Servable(model, {models.DEFAULT_SIGNATURE: batcher}), observer


def test_requests_held_queued_on_the_old_version_through_a_swap():
    """Issue #10 item 3: while v1 holds one request in predict and two queued (one pinned to
    v1), v2 comes in and v1 is retired. Those three are answered by v1; a request that chose
    v1 just before and arrives after is sent to v2 if unpinned, refused with TF Serving's
    NotFound if pinned (core/basic_manager.cc); nothing is lost and no rejection is counted."""
    gate1, running1 = threading.Event(), threading.Event()
    v1, observer1 = gated_servable(1, gate1, running1)
    open_gate = threading.Event()
    open_gate.set()
    v2, observer2 = gated_servable(2, open_gate, threading.Event())
    registry = ModelRegistry("m")
    registry.add(v1)

    def call(servable, x, *, pinned=False):
        call = Call.within(TIMEOUT_S, model=ModelSpec("m", servable.model.version) if pinned else ModelSpec())
        inputs = {"x": np.array([x], np.float32)}
        servable, engine, future = registry.submit(call, servable, servable.signature(), inputs)
        return servable, wait(engine, call, future)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        try:
            running_now = pool.submit(call, registry.get("m"), 10.0)
            assert running1.wait(TIMEOUT_S)  # v1's batch thread is inside predict with x=10
            queued_unpinned = pool.submit(call, registry.get("m"), 20.0)
            queued_pinned = pool.submit(call, registry.get("m", 1), 30.0, pinned=True)
            with observer1.changed:  # both are queued behind it (max_batch_size 1)
                assert observer1.changed.wait_for(lambda: observer1.depths[-1:] == [2], TIMEOUT_S)
            late_unpinned, late_pinned = registry.get("m"), registry.get("m", 1)  # chose v1; not yet sent

            registry.add(v2)
            retiring = pool.submit(registry.retire, "m", 1)
            assert v1.retiring.wait(TIMEOUT_S)
            assert not retiring.done()  # it waits for the three requests inside v1
            assert registry.model_status("m") == [
                {"version": "2", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}},
                {"version": "1", "state": "UNLOADING", "status": {"error_code": "OK", "error_message": ""}}]

            served_by, result = call(late_unpinned, 40.0)
            assert (served_by is v2, result.outputs["y"].tolist()) == (True, [80.0])
            with pytest.raises(NotFound, match=r"^Servable not found for request: Specific\(m, 1\)"):
                call(late_pinned, 50.0, pinned=True)
            with pytest.raises(NotFound, match=r"^Servable not found for request: Specific\(m, 1\)"):
                registry.get("m", 1)
            assert registry.get("m") is v2
        finally:
            gate1.set()  # also when an assertion above failed: no thread is left waiting
        answers = [future.result(TIMEOUT_S) for future in (running_now, queued_unpinned, queued_pinned)]
        retiring.result(TIMEOUT_S)
    assert [(served is v1, result.outputs["y"].tolist()) for served, result in answers] == [
        (True, [10.0]), (True, [20.0]), (True, [30.0])]
    assert (observer1.rejections, observer2.rejections) == ([], [])
    assert not v1.batcher.alive  # closed once drained
    assert registry.model_status("m", 1) == [
        {"version": "1", "state": "END", "status": {"error_code": "OK", "error_message": ""}}]
    registry.close()


def test_retirement_waits_for_a_request_between_its_check_and_its_batcher():
    """A request that passed the retirement check but has not reached the batcher yet is
    still answered by the old version: retirement closes the batcher only after it, as TF
    Serving unloads a servable only once its last handle is released (core/servable_handle.h)."""
    gate, running = threading.Event(), threading.Event()
    gate.set()
    v1, observer = gated_servable(1, gate, running)
    registry = ModelRegistry("m")
    registry.add(v1)
    assert v1.enter()  # as registry.submit does, just before it submits
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        retiring = pool.submit(registry.retire, "m", 1)
        assert v1.retiring.wait(TIMEOUT_S)
        assert not v1.enter()  # no one else gets in
        try:
            result = v1.batcher.predict(Call.within(TIMEOUT_S), {"x": np.array([5.0], np.float32)})
        finally:
            v1.leave()
        retiring.result(TIMEOUT_S)
    assert result.outputs["y"].tolist() == [5.0]
    assert observer.rejections == []
    assert not v1.batcher.alive


def test_poller_loads_a_new_version_before_serving_it_and_keeps_serving_through_a_failed_load(
        tmp_path, monkeypatch):
    """The version states of GetModelStatus (core/servable_state.h ManagerState): a wanted
    version is LOADING while it loads, beside the one served; then AVAILABLE, and the one
    dropped ends (END). A version that fails to load ends with its error while the served one
    stays (TF Serving's availability-preserving policy), and is not retried."""
    import prometheus_client

    from app.core import registry as registry_module
    from app.ops.metrics import Metrics

    gate, running = threading.Event(), threading.Event()
    gate.set()
    seen_while_loading = {}

    def fake_load(config, settings, metrics, version=None, *, on_broken=None, loading=None):
        seen_while_loading[version] = registry.model_status("m")
        if version == 3:
            raise models.ModelLoadError("broken")
        return gated_servable(version, gate, running)[0]

    monkeypatch.setattr(registry_module, "load_servable", fake_load)
    for version in (1, 2):
        (tmp_path / str(version)).mkdir()
    config = ModelConfig("m", str(tmp_path), 1, 0.0, 16)
    registry = ModelRegistry("m")
    live = LiveConfig(registry, Settings(), Metrics(prometheus_client.CollectorRegistry()))
    registry.add(gated_servable(1, gate, running)[0])
    live.configs["m"] = config
    try:
        live.sync_versions(config)
        assert seen_while_loading[2] == [status(2, "LOADING"), status(1)]
        assert registry.model_status("m") == [status(2), status(1, "END")]
        assert registry.get("m").model.version == 2

        (tmp_path / "3").mkdir()
        live.sync_versions(config)
        live.sync_versions(config)  # a failed version is not loaded again
        assert list(seen_while_loading) == [2, 3]
        failed = {"version": "3", "state": "END",
                  "status": {"error_code": "UNKNOWN", "error_message": "ModelLoadError: broken"}}
        assert registry.model_status("m") == [failed, status(2), status(1, "END")]
        assert registry.get("m").model.version == 2
    finally:
        registry.close()


# -- live: two versions with labels, and a rolling base folder -----------------------------------

def save_half_plus(path, c: float) -> None:
    """y = 0.5 x + c: each version's answer says which version gave it."""
    import tensorflow as tf

    class HalfPlus(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def serve(self, x):
            return {"y": 0.5 * x + c}

    module = HalfPlus()
    staging = path.parent / f".staging-{path.name}"
    tf.saved_model.save(module, str(staging), signatures={"serving_default": module.serve})
    os.rename(staging, path)  # whole, at once: the poller never sees half a version


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    for version in (1, 2):
        save_half_plus(root / "two" / str(version), float(version))
        save_half_plus(root / "rolling" / str(version), float(version))
    config = {"models": [
        {"name": "two", "path": str(root / "two"), "model_version_policy": {"all": {}},
         "version_labels": {"stable": 1, "canary": 2}, "max_batch_size": 4, "batch_timeout_ms": 200},
        {"name": "rolling", "path": str(root / "rolling"), "model_version_policy": {"latest": {"num_versions": 2}}},
    ]}
    (root / "models.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_root):
    running = Server(tmp_path_factory.mktemp("versions-logs"), {
        "MODEL_CONFIG": str(model_root / "models.json"), "MODEL_POLL_SECONDS": "0.2"}).start()
    yield running
    running.stop()


def post(server, path: str, body) -> requests.Response:
    return requests.post(server.url + path, data=json.dumps(body), timeout=TIMEOUT_S)


def get(server, path: str) -> requests.Response:
    return requests.get(server.url + path, timeout=TIMEOUT_S)


def status(version: int, state: str = "AVAILABLE") -> dict:
    return {"version": str(version), "state": state, "status": {"error_code": "OK", "error_message": ""}}


def test_status_lists_every_version_newest_first(server):
    """get_model_status_impl.cc; g3doc/api_rest.md: without /versions/N, every version."""
    assert get(server, "/v1/models/two").json() == {"model_version_status": [status(2), status(1)]}
    assert get(server, "/v1/models/two/versions/1").json() == {"model_version_status": [status(1)]}
    assert get(server, "/v1/models/two/labels/canary").json() == {"model_version_status": [status(2)]}
    missing = get(server, "/v1/models/two/versions/3")
    assert (missing.status_code, missing.json()) == (404, {"error": "Could not find version 3 of model two"})


def test_each_version_and_label_answers_with_its_own_version(server):
    """A pinned request is served by its version: the answer is 0.5 x + version."""
    expected = {
        "/v1/models/two:predict": ("2", [2.5, 4.0]),
        "/v1/models/two/versions/1:predict": ("1", [1.5, 3.0]),
        "/v1/models/two/versions/2:predict": ("2", [2.5, 4.0]),
        "/v1/models/two/labels/stable:predict": ("1", [1.5, 3.0]),
        "/v1/models/two/labels/canary:predict": ("2", [2.5, 4.0]),
    }
    for path, (version, predictions) in expected.items():
        answer = post(server, path, {"instances": [1.0, 4.0]})
        assert (answer.status_code, answer.headers["X-Model-Version"], answer.json()) == (
            200, version, {"predictions": predictions}), path
    metadata = get(server, "/v1/models/two/labels/stable/metadata").json()
    assert metadata["model_spec"] == {"name": "two", "signature_name": "", "version": "1"}


def test_versions_batch_apart(server):
    """Each version has its own batcher (TF Serving: one servable, one session, per version;
    core/aspired_versions_manager.h): four requests inside one 200 ms window, two per
    version, each answered by its own version, batches never holding the other's."""
    start = threading.Barrier(4)

    def send(path):
        start.wait(TIMEOUT_S)
        return post(server, path, {"instances": [6.0]})

    paths = ["/v1/models/two/versions/1:predict", "/v1/models/two/labels/canary:predict"] * 2
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, paths))
    assert [(a.headers["X-Model-Version"], a.json()) for a in answers] == [
        ("1", {"predictions": [4.0]}), ("2", {"predictions": [5.0]})] * 2
    assert all(int(a.headers["X-Batch-Requests"]) <= 2 for a in answers)


@pytest.mark.parametrize("method,path", [
    ("POST", "/v1/models/two/labels/nope:predict"),
    ("POST", "/v1/models/two/labels/nope:regress"),
    ("GET", "/v1/models/two/labels/nope/metadata"),
    ("GET", "/v1/models/two/labels/nope"),
])
def test_unknown_label_answers_400_as_tf_serving_does(server, method, path):
    """server_core.cc: InvalidArgument 'Unrecognized servable version label: nope' (400)."""
    answer = requests.request(method, server.url + path, data=b'{"instances": [1.0], "examples": [{}]}',
                              timeout=TIMEOUT_S)
    assert (answer.status_code, answer.json()) == (400, {"error": "Unrecognized servable version label: nope"})


def test_a_version_not_served_is_refused_never_answered_by_another(server):
    """basic_manager.cc: NotFound 'Servable not found for request: Specific(two, 3)'."""
    answer = post(server, "/v1/models/two/versions/3:predict", {"instances": [1.0]})
    assert answer.status_code == 404
    assert answer.json()["error"].startswith("Servable not found for request: Specific(two, 3)")
    unknown = post(server, "/v1/models/nope:predict", {"instances": [1.0]})
    assert unknown.json()["error"].startswith("Servable not found for request: Latest(nope)")


def test_classify_on_a_predict_only_model_answers_tf_servings_error(server):
    """servables/tensorflow/classifier.cc: without the method-name check (TF Serving's default),
    a signature whose input is not 'inputs' is refused."""
    answer = post(server, "/v1/models/two/labels/stable:classify", {"examples": [{"x": 1.0}]})
    assert (answer.status_code, answer.json()["error"]) == (
        400, "No classification inputs found in SignatureDef 'serving_default': its input is 'x', not 'inputs'")


def test_new_version_is_loaded_and_the_dropped_one_drained_under_load(server, model_root):
    """latest 2 of {1, 2, 3} is {2, 3}: v3 is loaded and warmed, then served; v1 goes to END
    (its pinned requests are refused from then on); no unpinned request fails meanwhile."""
    assert get(server, "/v1/models/rolling").json() == {"model_version_status": [status(2), status(1)]}
    stop = threading.Event()
    answers: list[tuple[float, requests.Response]] = []

    def load() -> None:
        with requests.Session() as session:
            for i in range(20_000):  # bounded; stopped much sooner
                if stop.is_set():
                    return
                x = float(i % 7)
                answers.append((x, session.post(server.url + "/v1/models/rolling:predict",
                                                data=json.dumps({"instances": [x]}), timeout=TIMEOUT_S)))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        clients = [pool.submit(load) for _ in range(2)]
        try:
            save_half_plus(model_root / "rolling" / "3", 3.0)
            # Until v1 has ended and v3 has answered under load: with MODEL_PROCESSES a worker
            # learns both from one description, so the status may end as v3 starts to serve.
            wait_for(lambda: get(server, "/v1/models/rolling").json()["model_version_status"] == [
                status(3), status(2), status(1, "END")] and any(
                answer.headers.get("X-Model-Version") == "3" for _, answer in list(answers)),
                within_s=120, what="v3 serving and v1 ended")
        finally:
            stop.set()
        for client in clients:
            client.result(TIMEOUT_S)
    assert answers and [answer.status_code for _, answer in answers] == [200] * len(answers)
    for x, answer in answers:
        version = int(answer.headers["X-Model-Version"])
        assert version in (2, 3)
        assert answer.json() == {"predictions": [0.5 * x + version]}
    assert "3" in {answer.headers["X-Model-Version"] for _, answer in answers}
    refused = post(server, "/v1/models/rolling/versions/1:predict", {"instances": [1.0]})
    assert refused.status_code == 404
    assert post(server, "/v1/models/rolling/versions/3:predict", {"instances": [1.0]}).json() == {"predictions": [3.5]}
