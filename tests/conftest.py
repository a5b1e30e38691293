"""Shared fixtures: small real Keras models on disk, and real Gunicorn servers on loopback."""

from __future__ import annotations

import inspect
import shlex
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests

# Test files import REPO, SERVER_COMMAND, free_port and free_ports from here, beside the fixtures.
from scripts.live_server import REPO as REPO
from scripts.live_server import SERVER_COMMAND as SERVER_COMMAND
from scripts.live_server import LiveServer
from scripts.live_server import free_ports as free_ports

FEATURES = 4
# The address TensorFlow Serving's docs send their curl lines to.
TF_SERVING_DOCS_URL = "http://localhost:8501"


def free_port() -> int:
    return free_ports(1)[0]


def _starts_a_process(target, seen: set) -> bool:
    """Whether `target` (a function or class of tests/ or scripts/) can reach subprocess.Popen: a
    Gunicorn master, nginx, a tool's command. Read from the code, following the names it uses."""
    if id(target) in seen:
        return False
    seen.add(id(target))
    if isinstance(target, type):
        return any(_starts_a_process(member, seen) for cls in target.__mro__ if _ours(cls)
                   for member in vars(cls).values() if inspect.isfunction(member) or isinstance(member, property)
                   for member in ([member.fget] if isinstance(member, property) else [member]))
    function = inspect.unwrap(target)
    if not inspect.isfunction(function):
        return False
    codes, names = [function.__code__], set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    if "Popen" in names:
        return True
    # The globals it names, and what it names of those that are modules of ours (`benchmark.server.Server`).
    found = [function.__globals__.get(name, sys.modules.get(name)) for name in names]  # a local import too
    while found:
        value = found.pop()
        if isinstance(value, types.ModuleType) and _ours(value):
            # Each (module, name) once: a module reached again from another function is looked
            # up for that function's names too, so the answer does not depend on the order names
            # are visited in (a set's, which differs between processes: xdist's workers must agree).
            lookups = {(id(value), name) for name in names if hasattr(value, name)} - seen
            seen.update(lookups)
            found.extend(getattr(value, name) for _, name in sorted(lookups, key=lambda pair: pair[1]))
        elif (inspect.isfunction(value) or isinstance(value, type)) and _ours(value) and \
                _starts_a_process(value, seen):
            return True
    return False


def _ours(thing) -> bool:
    """Defined in tests/ or scripts/ (pytest imports a test module by its bare name)."""
    module = thing if isinstance(thing, types.ModuleType) else sys.modules.get(thing.__module__)
    where = getattr(module, "__file__", None) or ""
    return where.startswith((str(REPO / "tests"), str(REPO / "scripts")))


# Seconds each file took on the 2-core CI machine (`pytest -n 2 --dist loadfile`, junit times, servers
# included), the files of 4 s or more; the rest count 0. Only their order matters: re-measure when a
# file's weight changes by much. A file's model-process copy (below) has a key of its own, from a run of
# that pass alone, scaled to the same machine.
FILE_SECONDS = {
    "test_manual_runs": 120,
    "test_reliability": 60, "test_stops": 60, "test_jax": 59, "test_model_process_faults": 49, "test_benchmark": 48,
    "test_fuzz": 37, "test_grpc": 26, "test_handler_server": 25, "test_locust": 24, "test_tfs_live_config": 24,
    "test_server": 23,
    "test_tracing": 22, "test_tfs_model_server": 22, "test_hostile_grpc": 22, "test_logs": 21, "test_tf_serving": 20,
    "test_json_logs_tensorflow_cuda": 18, "test_worker_lifecycle": 17, "test_priority": 17, "test_nginx": 16,
    "test_metrics": 16, "test_model_processes": 15, "test_model_process_gpus": 14, "test_tfs_command_flags": 14,
    "test_triton_server": 35, "test_triton_clients": 16,
    "test_grpc_truth": 13, "test_v2_statistics": 13, "test_v2_repository": 18, "test_hostile_logs": 12,
    "test_profile_worker": 12, "test_v2_kserve": 11, "test_nginx_grpc": 10, "test_v2": 10, "test_nginx_limits": 9,
    "test_tls": 9, "test_varlen": 9, "test_hostile": 8, "test_process_bench": 8, "test_tfs_models": 8,
    "test_signatures": 7, "test_handlers": 6, "test_payload_log": 6, "test_versions": 6, "test_model_process_ops": 6,
    "test_tfs_inference": 6, "test_client_gone": 6, "test_deploy": 5, "test_live_server": 5, "test_http_errors": 5,
    "test_status_privacy": 5, "test_rest_fidelity": 5, "test_cores": 4, "test_app_factory": 4,
    "test_grpc[model-processes]": 34, "test_handler_server[model-processes]": 25, "test_jax[model-processes]": 20,
    "test_server[model-processes]": 18, "test_triton_server[model-processes]": 18,
    "test_v2[model-processes]": 13, "test_stops[model-processes]": 10, "test_http_errors[model-processes]": 10,
    "test_hostile[model-processes]": 8, "test_signatures[model-processes]": 7, "test_rest_fidelity[model-processes]": 7,
    "test_versions[model-processes]": 6, "test_client_gone[model-processes]": 5,
    "test_worker_lifecycle[model-processes]": 4,
}

# The suites that cover REST, gRPC, errors, limits, versions and shutdown, run again with the models in
# a model process (docs/scaling.md) under --model-processes (.ci/run): each file collected a second time
# as a file of its own, whose servers inherit MODEL_PROCESSES=1 (Server.start fails one that comes up
# without a model process). Only their `server` tests: an in-process test starts no server and so runs
# the same in either mode. None: every such test of the file; else the names of the tests to run.
MODEL_PROCESSES_FILES: dict[str, set[str] | None] = {
    "test_server.py": None, "test_http_errors.py": None, "test_rest_fidelity.py": None, "test_signatures.py": None,
    "test_versions.py": None, "test_grpc.py": None, "test_v2.py": None, "test_jax.py": None,
    "test_hostile.py": None, "test_client_gone.py": None, "test_handler_server.py": None,
    "test_stops.py": {"test_group_stop_under_load_loses_no_accepted_request"},
    "test_worker_lifecycle.py": {"test_quick_shutdown_answers_a_request_held_in_its_batch_window"},
    # Triton's extensions: raw binary, the model config, streaming and the restricted categories.
    "test_triton_server.py": {
        "test_raw_binary", "test_byte", "test_raw_requests_batch_with_json_requests_and_are_refused_past_the_row_limit",
        "test_model_config_answers_tritons_fields_on_both_doors",
        "test_stream_answers_in_request_order_each_with_its_id",
        "test_stream_requests_batch_with_each_other_and_with_unary_calls",
        "test_a_streamed_failure_is_answered_in_the_stream_which_goes_on",
        "test_a_cancelled_stream_cancels_its_requests_before_they_run", "test_stream_infer", "test_infer",
        "test_grpc_methods_answer_unavailable_without_their_categorys_metadata"},
}
MODEL_PROCESSES_SUFFIX = "[model-processes]"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--model-processes", action="store_true",
                     help="also run MODEL_PROCESSES_FILES' server tests (tests/conftest.py) with MODEL_PROCESSES=1")


def pytest_configure(config: pytest.Config) -> None:
    # xdist's --dist loadfile hands whole files to its two workers in the order of the collection, and
    # by default first re-sorts them by their number of tests. The run ends when the worker holding the
    # last file finishes while the other idles: a 3-test file of 37 s (schemathesis) came last. The
    # collection below puts the longest files first, so that the last ones handed out are short; xdist
    # must keep that order.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


class ModelProcessesModule(pytest.Module):
    """A test file collected a second time, run with MODEL_PROCESSES=1. Its node id differs before the
    first `::`, so xdist's --dist loadfile hands it out as a file of its own, balanced with the rest in
    one run rather than in a second pytest run after it; its module fixtures are its own, so its
    servers are started afresh, in the mode."""


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if file_path.name not in MODEL_PROCESSES_FILES or not parent.config.getoption("model_processes"):
        return None
    nodeid = file_path.relative_to(parent.config.rootpath).as_posix() + MODEL_PROCESSES_SUFFIX
    return ModelProcessesModule.from_parent(parent, path=file_path, name=file_path.name + MODEL_PROCESSES_SUFFIX,
                                            nodeid=nodeid)


@pytest.fixture(scope="module", autouse=True)
def _model_processes_mode(request) -> Iterator[None]:
    """MODEL_PROCESSES=1 while a file's model-process copy runs: autouse, so set before its own module
    fixtures start their servers, and unset after they stopped them."""
    if not isinstance(request.node, ModelProcessesModule):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MODEL_PROCESSES", "1")
        yield


def _file_seconds(item: pytest.Item) -> int:
    copy = item.getparent(ModelProcessesModule) is not None
    return FILE_SECONDS.get(item.path.stem + (MODEL_PROCESSES_SUFFIX if copy else ""), 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `server` every test that starts a server or another long-lived process (Popen), itself
    or through a fixture: `pytest -m "not server"` is the fast tier, run in-process. Keep of the
    model-process copies only the tests they are for. Then order the files longest first (a stable
    sort: each file's tests keep their order)."""
    for item in items:
        if item.get_closest_marker("server") is not None or not isinstance(item, pytest.Function):
            continue
        fixtures = [definitions[-1].func for name, definitions in item._fixtureinfo.name2fixturedefs.items()
                    if name != "_server_marker_kept"]
        targets = [item.function, *(func for func in fixtures if _ours(func))]
        if any(_starts_a_process(target, set()) for target in targets):
            item.add_marker(pytest.mark.server)
    dropped = [item for item in items if not _in_its_model_processes_copy(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if _in_its_model_processes_copy(item)]
    items.sort(key=lambda item: -_file_seconds(item))


def _in_its_model_processes_copy(item: pytest.Item) -> bool:
    """True for every test but those of a model-process copy that the copy is not for."""
    if item.getparent(ModelProcessesModule) is None:
        return True
    names = MODEL_PROCESSES_FILES[item.path.name]
    return item.get_closest_marker("server") is not None and (
        names is None or getattr(item, "originalname", item.name) in names)


@pytest.fixture(autouse=True)
def _server_marker_kept(request, monkeypatch):
    """In the fast tier, a test that starts a live server without the `server` mark fails: the
    tier must start none, so the mark must follow the code (where the code cannot show it, a
    test names the mark itself)."""
    if "not server" in request.config.getoption("markexpr") and request.node.get_closest_marker("server") is None:
        def refuse(*args, **kwargs):
            raise AssertionError(f"{request.node.nodeid} starts a server: mark it `server`")

        monkeypatch.setattr(LiveServer, "start", refuse)


def wait_for(predicate, *, within_s: float = 30, what: str = "a condition"):
    """Poll a condition where there is no event to wait on (a live server, another thread's state)."""
    deadline = time.monotonic() + within_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {within_s} s")
        time.sleep(0.05)


def build_exact_model(features: int = FEATURES, hidden: int = 16, outputs: int = 3, seed: int = 7):
    """A small dense model with small-integer weights.

    With integer inputs every product and sum is an integer far below 2**24, so float32
    results are exact whatever the batch size or summation order: served predictions
    can be compared to the model's own output with ==.
    """
    import keras

    rng = np.random.default_rng(seed)
    inputs = keras.Input((features,), name="features")
    hidden_layer = keras.layers.Dense(hidden, activation="relu", name="hidden")
    output_layer = keras.layers.Dense(outputs, name="scores")
    model = keras.Model(inputs, output_layer(hidden_layer(inputs)))
    hidden_layer.set_weights([rng.integers(-3, 4, (features, hidden)).astype("float32"),
                              rng.integers(-3, 4, hidden).astype("float32")])
    output_layer.set_weights([rng.integers(-3, 4, (hidden, outputs)).astype("float32"),
                              rng.integers(-3, 4, outputs).astype("float32")])
    return model


def integer_rows(count: int, features: int = FEATURES, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-9, 10, (count, features)).astype("float32")


@pytest.fixture(scope="session")
def exact_model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "exact.keras"
    build_exact_model().save(path)
    return path


@pytest.fixture(scope="session")
def exact_model(exact_model_path):
    import keras

    return keras.models.load_model(exact_model_path, compile=False)


class Server(LiveServer):
    """A real `gunicorn -c gunicorn.conf.py wsgi:app` on a free loopback port, with a test's helpers."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                 python: str = sys.executable) -> None:
        super().__init__(log_dir, env, args=args, python=python)

    @property
    def model_processes(self) -> int:
        """MODEL_PROCESSES as this server got it: from a test's env, or over the whole run (.ci/run)."""
        return int(self.env.get("MODEL_PROCESSES") or 0)

    def start(self, *, workers: int = 1, ready_within_s: float = 180) -> Server:
        super().start(workers=workers, ready_within_s=ready_within_s)
        if self.model_processes:
            # A suite run in the mode must not pass by serving in the default mode.
            assert self.model_process_pids(), f"MODEL_PROCESSES={self.model_processes} but no model process"
        return self

    def model_process_pids(self) -> list[int]:
        """The live model processes (children of the supervisor, which the master starts)."""
        pids = []
        for process in self.processes():
            try:
                if "app.model_process.server" in process.cmdline():
                    pids.append(process.pid)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                pass
        return pids

    def predict(self, rows, *, path: str = "/predict", **kwargs) -> requests.Response:
        body = {"instances": np.asarray(rows).tolist()}
        return requests.post(self.url + path, json=body, timeout=kwargs.pop("timeout", 60), **kwargs)

    def curl(self, documented: str, *, timeout_s: float = 60) -> str:
        """Run a curl line as TensorFlow Serving's docs write it (to localhost:8501), pointed at this server."""
        args = shlex.split(documented.replace(TF_SERVING_DOCS_URL, self.url))
        assert args[0] == "curl"
        done = subprocess.run([*args, "--silent", "--show-error"], capture_output=True, text=True,
                              timeout=timeout_s, check=True)
        return done.stdout

    def metric(self, name: str, **labels: str) -> float:
        """The sum over workers of the /metrics samples named `name` whose labels include `labels`."""
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(self.url + "/metrics", timeout=30).text
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture
def in_process_app() -> Iterator:
    """in_process_app(**settings) -> the app a Gunicorn worker builds (create_app: the real
    registry, batchers and metrics), in this process, for Flask's test client; its batchers are
    closed afterwards. For what does not depend on Gunicorn, sockets or processes."""
    import logging

    from app import create_app
    from app.ops import logs
    from app.ops.settings import Settings

    # create_app sets the process's loggers as a worker's (the access log on or off, the app's
    # level): the tests after this one find them as they were.
    access_off, app_level = logs.access_log.disabled, logging.getLogger("app").level
    apps = []

    def make(**settings):
        app = create_app(Settings(**{"access_log": False, "model_poll_seconds": 0, **settings}))
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.services.registry.close(drain=False)
    logs.access_log.disabled = access_off
    logging.getLogger("app").setLevel(app_level)


@pytest.fixture
def start_server(tmp_path) -> Iterator:
    """start_server(env=..., workers=..., args=...) -> a running Server, stopped afterwards."""
    servers: list[Server] = []

    def start(env: dict[str, str] | None = None, *, workers: int = 1, args: tuple[str, ...] = ()) -> Server:
        server = Server(tmp_path, env, args)
        servers.append(server)
        return server.start(workers=workers)

    yield start
    for server in servers:
        server.stop()
