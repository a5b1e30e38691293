"""Reproduce the experiment: the model alone, then real servers under real Locust load.

    python scripts/benchmark.py                        # full run (about 24 min): docs/benchmarks.md, .png
    python scripts/benchmark.py --quick --out /tmp/b   # a minute or two, for CI: never overwrites docs/
    python scripts/benchmark.py --configs naive,default --users 1,20 --duration 10

1. The model alone: time and CPU per call at batch sizes 1, 2, 4, ... with Keras'
   model.predict and with the server's predict path (a compiled tf.function).
2. Each server configuration as a real `gunicorn -c gunicorn.conf.py wsgi:app`, loaded by a
   real headless Locust (locustfile.py) at several user counts with 1-3 s think time, then
   in a closed loop (no think time) for throughput. Locust's own CPU use is measured too,
   so that a saturated load generator is not mistaken for a slow server.
3. Ratios, tables and a plot.
4. REST against gRPC: the `default` configuration loaded in a closed loop over HTTP/JSON and
   over TensorFlow Serving's gRPC API (LOCUST_PROTOCOL=grpc), with the server's CPU per request.
5. The closed loop against the model's own ceiling: the batch sizes each server actually
   ran (from its /metrics), what the model alone does with those same batches back to back,
   and the server's CPU per request split into the model's own and everything else.

The built-in default model is used unless --model wide (1,024 floats in, 4 x 4,096 hidden,
1,000 out, ~235 MB, built from seeds at the start of the run) or --model-path is given.
--baseline-ref REF adds the configuration `baseline@<sha>`: the server of commit REF (checked
out into a temporary git worktree), its defaults, 1 worker, the same model, side by side with
`default`. Nothing here asserts a timing: the numbers are whatever this machine gives.

Performance issue's setup (wide model, one row per request, 32 clients in the closed loop,
1 and 50 users with think time), before and after in one run:

    python scripts/benchmark.py --model wide --closed-loop-users 32 --users 1,50 --configs default \\
        --baseline-ref REF --no-protocols
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import os
import platform
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Any

import psutil
import requests
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.batching import bucket_sizes  # noqa: E402  (after the path is set; imports no TensorFlow)
from app.settings import Settings, documented  # noqa: E402

LOCUSTFILE = REPO / "locustfile.py"
SERVER_COMMAND = ("gunicorn", "-c", "gunicorn.conf.py", "wsgi:app")
# Server knobs that would leak from the caller's environment into every configuration.
SERVER_DEFAULTS = {name: default for name, default, _ in documented()}
SERVER_VARIABLES = set(SERVER_DEFAULTS) | {
    "WORKERS", "THREADS", "BIND", "TIMEOUT", "GRACEFUL_TIMEOUT", "KEEPALIVE", "GUNICORN_CMD_ARGS"}
LOCUST_VARIABLES = {"LOCUST_SHAPE", "LOCUST_ROWS", "LOCUST_PATH", "LOCUST_MODEL", "LOCUST_WAIT_MIN", "LOCUST_PROTOCOL",
                    "LOCUST_WAIT_MAX", "LOCUST_SUMMARY_FILE"}
THINK_TIME_S = (1.0, 3.0)
CLOSED_LOOP_LABEL = "closed loop"
# A load generator above this share of one core may itself have limited the load.
LOCUST_BUSY_SHARE = 0.8
# The performance issue's wide-input model: build_default_model's arguments.
WIDE_MODEL = {"features": 1024, "depth": 3, "outputs": 1000}
WIDE_MODEL_NAME = "1,024 floats in, 4 × 4,096 hidden, 1,000 out dense, ~235 MB of float32 weights"
# The batch bucket sizes every configuration pads to (the server's default MAX_BATCH_SIZE).
SERVER_BUCKETS = bucket_sizes(Settings().max_batch_size)
BATCH_ROWS_METRIC = "model_server_batch_size_rows"
PREDICT_SECONDS_METRIC = "model_server_predict_duration_seconds"


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    workers: int
    env: dict[str, str]
    what: str
    baseline: bool  # a configuration the default is compared against
    tree: Path = REPO  # the checkout whose gunicorn.conf.py and app/ it runs
    app: tuple[str, ...] = SERVER_COMMAND[-1:]  # what Gunicorn serves, with any flags it needs
    in_full_run: bool = True  # run when --configs is not given

    @property
    def predict_path(self) -> str:
        """The part-1 timing that matches this configuration's predict calls."""
        return "keras_predict" if self.env.get("PREDICT_METHOD") == "keras_predict" else "function"


FLOOR_APP = ("--pythonpath", "scripts", "floor_app:app")
CONFIGS = [
    Config("naive", 1, {"PREDICT_METHOD": "keras_predict", "BATCHING": "false"},
           "Keras model.predict per request, no batching: the article's starting point", True),
    Config("unbatched-1w", 1, {"BATCHING": "false"},
           "our compiled predict path, one request per call, 1 worker", True),
    Config("unbatched-2w", 2, {"BATCHING": "false"},
           "our compiled predict path, one request per call, 2 workers", True),
    Config("timeout-500ms", 1, {"BATCH_TIMEOUT_MS": "500"},
           "batching that waits up to 500 ms for a batch to fill, as the article did", True),
    Config("timeout-20ms", 1, {"BATCH_TIMEOUT_MS": "20"},
           "batching that waits up to 20 ms for a batch to fill", True),
    Config("default", 1, {}, "the shipped default: batch as soon as the model is free, 1 worker", False),
    Config("default-2w", 2, {}, "the shipped default with 2 workers", False),
    # Not servers: what Gunicorn and Flask cost around the same model (scripts/floor_app.py).
    Config("floor", 1, {"GRPC_BIND": ""}, "the floor: Gunicorn and Flask around the same model, nothing of app/ in a "
           "request (scripts/floor_app.py; fixed answers)", True, app=FLOOR_APP, in_full_run=False),
    Config("floor-batcher", 1, {"GRPC_BIND": "", "FLOOR_BATCHER": "true"}, "the floor with the server's batching "
           "engine as its model thread (scripts/floor_app.py, FLOOR_BATCHER=true; fixed answers)", True,
           app=FLOOR_APP, in_full_run=False),
]
CONFIGS_BY_NAME = {config.name: config for config in CONFIGS}
REFERENCE = "default"


# ---------------------------------------------------------------------------------------------
# 1. The model alone


def model_alone(model_path: str | None, batch_sizes: Sequence[int], *, budget_s: float,
                idle_calls: int, think_s: tuple[float, float]) -> dict[str, Any]:
    """Time per call, items/s and CPU of both predict paths, then batch-1 calls after idling; run in a child."""
    import numpy as np

    from app import runtime
    from app.models import example_batch, load_model

    # TensorFlow's thread pools as in one worker of a default server, so its calls are the ones timed here.
    runtime.configure(Settings(), workers=1)
    model = load_model(model_path, name="default")
    keras_model = model.keras_model
    rng = np.random.default_rng(0)
    rows = []
    for batch_size in batch_sizes:
        batch = {name: rng.standard_normal(array.shape).astype(array.dtype)
                 for name, array in example_batch(model, batch_size).items()}
        keras_input = batch[model.inputs[0].name] if len(model.inputs) == 1 else batch
        row: dict[str, Any] = {"batch": batch_size}
        paths = {"function": lambda: model.predict(batch)}
        if keras_model is not None:
            # batch_size = the batch: one step per call (Keras' default of 32 would split 64 rows in two).
            paths["keras_predict"] = lambda: keras_model.predict(keras_input, verbose=0, batch_size=batch_size)
        for label, call in paths.items():
            row[label] = _time_calls(call, budget_s=budget_s, batch_size=batch_size)
        rows.append(row)
    one_row = {name: rng.standard_normal(array.shape).astype(array.dtype)
               for name, array in example_batch(model, 1).items()}
    after_idle = _time_after_idle(lambda: model.predict(one_row), calls=idle_calls, think_s=think_s,
                                  rng=random.Random(0))
    return {"batches": rows, "after_idle": after_idle}


def _time_calls(call: Any, *, budget_s: float, batch_size: int, max_calls: int = 200) -> dict[str, float]:
    for _ in range(2):  # the first calls of a shape trace and allocate
        call()
    wall: list[float] = []
    cpu_started = time.process_time()
    stop_at = time.perf_counter() + budget_s
    while len(wall) < max_calls and (len(wall) < 3 or time.perf_counter() < stop_at):
        started = time.perf_counter()
        call()
        wall.append(time.perf_counter() - started)
    cpu_s = time.process_time() - cpu_started
    wall.sort()
    median_s = wall[len(wall) // 2]
    return {"calls": len(wall), "median_ms": median_s * 1000, "mean_ms": sum(wall) / len(wall) * 1000,
            "items_per_s": batch_size / median_s, "cpu_ms_per_call": cpu_s / len(wall) * 1000,
            "cpu_ms_per_row": cpu_s / len(wall) / batch_size * 1000}


def _time_after_idle(call: Any, *, calls: int, think_s: tuple[float, float], rng: random.Random) -> dict[str, Any]:
    """Batch-1 calls, each after an idle pause drawn like a Locust user's think time.

    After an idle second the weights may have left the caches and TensorFlow's threads gone to
    sleep: this, not a back-to-back call, is what one user with think time can hope for.
    """
    call()
    wall = []
    for _ in range(calls):
        time.sleep(rng.uniform(*think_s))  # the idle time itself is what is measured against
        started = time.perf_counter()
        call()
        wall.append(time.perf_counter() - started)
    ordered = sorted(wall)
    return {"calls": calls, "think_s": list(think_s), "mean_ms": sum(wall) / calls * 1000,
            "median_ms": ordered[calls // 2] * 1000, "wall_ms": [value * 1000 for value in wall]}


def run_model_alone(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    out = work_dir / "model_alone.json"
    command = [sys.executable, __file__, "--model-alone-json", str(out), "--batch-sizes",
               ",".join(map(str, args.batch_sizes)), "--call-budget", str(args.call_budget),
               "--idle-calls", str(args.idle_calls)]
    if args.served_model_path:
        command += ["--model-path", args.served_model_path]
    log(f"model alone: batch sizes {args.batch_sizes}, then {args.idle_calls} calls after idling")
    _run_child(command, work_dir / "model_alone.log", timeout_s=args.model_alone_timeout)
    return json.loads(out.read_text())


def build_wide_model(work_dir: Path) -> str:
    """The issue's wide-input model, built from seeds and saved once for every configuration."""
    path = work_dir / "wide.keras"
    log(f"building the wide model ({WIDE_MODEL_NAME})")
    _run_child([sys.executable, __file__, "--build-wide-model", str(path)], work_dir / "build_model.log",
               timeout_s=600)
    return str(path)


def save_wide_model(path: Path) -> None:
    from app.models import build_default_model

    build_default_model(**WIDE_MODEL).save(path)


def _run_child(command: list[str], log_path: Path, *, timeout_s: float) -> None:
    """This script again, in a child process: TensorFlow is never loaded in this one."""
    env = {key: value for key, value in os.environ.items() if key not in SERVER_VARIABLES}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    with open(log_path, "wb") as output:
        subprocess.run(command, cwd=REPO, env=env, check=True, timeout=timeout_s,
                       stdout=output, stderr=subprocess.STDOUT)


# ---------------------------------------------------------------------------------------------
# 2. Servers under load


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A real gunicorn on a free loopback port.

    It stays in this script's process group, so that whoever stops the script as a group
    (a test's timeout) stops the servers too.
    """

    def __init__(self, config: Config, *, model_path: str | None, log_path: Path) -> None:
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # A gRPC port of its own: with SO_REUSEPORT, two servers on one port would share it.
        self.grpc_target = f"127.0.0.1:{free_port()}"
        self.log_path = log_path
        self.env = {key: value for key, value in os.environ.items()
                    if key not in SERVER_VARIABLES and key not in LOCUST_VARIABLES}
        # READYZ_DETAIL: the workers are told apart by the pid /readyz then shows. LOG_LEVEL and
        # ACCESS_LOG stay the server's defaults: writing the access log is part of a request's cost.
        self.env.update({"BIND": f"127.0.0.1:{self.port}", "GRPC_BIND": self.grpc_target,
                         "TF_CPP_MIN_LOG_LEVEL": "2", "READYZ_DETAIL": "true", **config.env})
        if model_path:
            self.env["MODEL_PATH"] = model_path
        self.proc: subprocess.Popen | None = None

    def start(self, *, ready_within_s: float) -> float:
        started = time.monotonic()
        command = [sys.executable, "-m", *SERVER_COMMAND[:-1], *self.config.app, f"--workers={self.config.workers}"]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(command, cwd=self.config.tree, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self._wait_ready(within_s=ready_within_s)
        return time.monotonic() - started

    def _wait_ready(self, *, within_s: float) -> None:
        """Poll /readyz until every worker has answered ready (fresh connections reach any worker)."""
        seen: set[int] = set()
        deadline = time.monotonic() + within_s
        while len(seen) < self.config.workers:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"gunicorn not ready within {within_s} s; see {self.log_path}")
            try:
                answer = requests.get(self.url + "/readyz", timeout=5, headers={"Connection": "close"})
                if answer.status_code == 200:
                    # An older tree (a --baseline-ref) may not show the pid: one worker needs none.
                    seen.add(answer.json().get("pid", 0))
                    continue
            except (requests.ConnectionError, requests.Timeout):
                pass  # a worker that still loads its model answers nothing yet
            time.sleep(0.2)  # nothing listens, or a worker still loads: there is no event to wait on

    def metrics(self) -> dict[str, Any] | None:
        """The batching figures of /metrics (all workers added up), or None where it cannot be read."""
        try:
            answer = requests.get(self.url + "/metrics", timeout=10)
        except (requests.ConnectionError, requests.Timeout):
            return None
        return metric_snapshot(answer.text) if answer.status_code == 200 else None

    def processes(self) -> list[psutil.Process]:
        try:
            master = psutil.Process(self.proc.pid)
            return [master, *master.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu_seconds(self) -> float:
        """User + system CPU of the master and every worker, alive now."""
        total = 0.0
        for process in self.processes():
            try:
                times = process.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        return total

    def wait_quiet(self, *, within_s: float, idle_share: float = 0.05, window_s: float = 0.5) -> float:
        """Wait until the server uses under `idle_share` of a core: the last load's backlog is done."""
        started = time.monotonic()
        before = self.cpu_seconds()
        while time.monotonic() - started < within_s:
            time.sleep(window_s)  # a CPU rate needs a window; there is no event for "idle"
            now = self.cpu_seconds()
            if now - before < idle_share * window_s:
                break
            before = now
        return time.monotonic() - started

    def stop(self, *, within_s: float = 60) -> None:
        """SIGTERM (gunicorn drains and stops its workers); SIGKILL to all of it past `within_s`."""
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                processes = self.processes()
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(within_s)
                except subprocess.TimeoutExpired:
                    for process in processes:
                        try:
                            process.kill()
                        except psutil.NoSuchProcess:
                            pass
                    self.proc.wait(10)
        finally:
            self._log.close()


@dataclasses.dataclass(frozen=True)
class Load:
    label: str
    users: int
    think_s: tuple[float, float]

    @property
    def closed_loop(self) -> bool:
        return self.think_s == (0.0, 0.0)


def locust_command(url: str, load: Load, *, duration_s: int, prefix: Path,
                   spawn_rate: float | None = None) -> list[str]:
    """Headless Locust; with no spawn rate every user starts at once (Locust spawns
    floor(rate) users per step, one step a second)."""
    rate = load.users if spawn_rate is None else spawn_rate
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "-u", str(load.users), "-r", f"{rate:g}", "-t", f"{duration_s}s", "--host", url,
            "--csv", str(prefix), "--json-file", str(prefix), "--only-summary", "--loglevel", "WARNING"]


def spawning(spawn_rate: float | None) -> str:
    if spawn_rate is None:
        return "all users started at once (their first requests arrive together)"
    return f"users started {spawn_rate:g} a second"


def run_locust(url: str, load: Load, *, duration_s: int, prefix: Path, protocol: str = "http",
               spawn_rate: float | None = None) -> dict[str, Any]:
    """One headless Locust run; its stats, and its own CPU use (measured, not guessed)."""
    summary_path = prefix.with_name(prefix.name + "_batches.json")
    env = {key: value for key, value in os.environ.items() if key not in LOCUST_VARIABLES}
    env.update({"LOCUST_WAIT_MIN": str(load.think_s[0]), "LOCUST_WAIT_MAX": str(load.think_s[1]),
                "LOCUST_SUMMARY_FILE": str(summary_path), "LOCUST_PROTOCOL": protocol})
    command = locust_command(url, load, duration_s=duration_s, prefix=prefix, spawn_rate=spawn_rate)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    with open(prefix.with_name(prefix.name + ".log"), "wb") as output:
        proc = psutil.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
        peak_share = 0.0
        try:
            proc.cpu_percent()
            while proc.poll() is None and time.monotonic() - started < duration_s + 60:
                time.sleep(1.0)  # sampling Locust's CPU once a second
                try:
                    peak_share = max(peak_share, proc.cpu_percent() / 100)
                except psutil.NoSuchProcess:
                    break
            if proc.poll() is None:
                proc.terminate()  # past its run time and a minute's grace: let it write its stats
            returncode = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wall_s = time.monotonic() - started
    if returncode not in (0, 1):  # 1: some requests failed, counted below; anything else: Locust itself
        log(f"locust exited with {returncode}; see {prefix.name}.log in the working folder")
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # RUSAGE_CHILDREN grows only when a child is reaped: between the two reads, only Locust was.
    locust_cpu_s = (children_after.ru_utime - children_before.ru_utime) + (
        children_after.ru_stime - children_before.ru_stime)
    stats = parse_locust_stats(prefix)
    # Over the run time, not Locust's "first to last request", which says little for a few requests.
    stats["rps"] = stats.get("requests", 0) / duration_s
    stats.update(locust_exit_code=returncode, locust_wall_s=wall_s, locust_cpu_s=locust_cpu_s,
                 locust_cpu_share=locust_cpu_s / wall_s if wall_s else 0.0, locust_peak_share=peak_share)
    if summary_path.exists():
        stats.update(json.loads(summary_path.read_text()))
    return stats


def parse_locust_stats(prefix: Path) -> dict[str, Any]:
    """Percentiles from the Aggregated row of <prefix>_stats.csv; counts and mean from the JSON.

    Locust rewrites the CSV once a second, so it may miss the last second's requests; the
    JSON file is written once, at exit, with every request counted.
    """
    stats: dict[str, Any] = {}
    csv_path = Path(f"{prefix}_stats.csv")
    if csv_path.exists():
        with open(csv_path, newline="") as file:
            for row in csv.DictReader(file):
                if row["Name"] == "Aggregated":
                    stats.update(
                        requests=int(row["Request Count"]), failures=int(row["Failure Count"]),
                        mean_ms=float(row["Average Response Time"]), p50_ms=_number(row["50%"]),
                        p95_ms=_number(row["95%"]), p99_ms=_number(row["99%"]), max_ms=_number(row["100%"]))
    json_path = Path(f"{prefix}.json")
    if json_path.exists():
        entries = json.loads(json_path.read_text())
        stats["requests"] = sum(entry["num_requests"] for entry in entries)
        stats["failures"] = sum(entry["num_failures"] for entry in entries)
        if stats["requests"]:
            stats["mean_ms"] = sum(entry["total_response_time"] for entry in entries) / stats["requests"]
    return stats


def _number(text: str) -> float | None:
    return None if text in ("", "N/A") else float(text)


def metric_snapshot(text: str) -> dict[str, Any]:
    """The batch-size histogram and predict time from a /metrics page, added up over models and labels."""
    snapshot: dict[str, Any] = {"buckets": {}, "rows": 0.0, "calls": 0.0, "predict_s": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name not in (BATCH_ROWS_METRIC, PREDICT_SECONDS_METRIC):
            continue
        for sample in family.samples:
            if family.name == PREDICT_SECONDS_METRIC:
                if sample.name == PREDICT_SECONDS_METRIC + "_sum":
                    snapshot["predict_s"] += sample.value
            elif sample.name == BATCH_ROWS_METRIC + "_bucket":
                upper = float(sample.labels["le"])
                snapshot["buckets"][upper] = snapshot["buckets"].get(upper, 0.0) + sample.value
            elif sample.name == BATCH_ROWS_METRIC + "_sum":
                snapshot["rows"] += sample.value
            elif sample.name == BATCH_ROWS_METRIC + "_count":
                snapshot["calls"] += sample.value
    return snapshot


def batch_delta(before: dict[str, Any], after: dict[str, Any], buckets: Sequence[int] = SERVER_BUCKETS
                ) -> dict[str, Any]:
    """Predict calls per padded batch size, real rows and predict seconds between two snapshots.

    The histogram counts real rows per call, cumulatively (le=1, 2, 4, ...): the calls in
    (lower, upper] are the ones the server padded up to the smallest bucket size >= upper
    (or its largest, which no call exceeds).
    """
    calls: dict[int, int] = {}
    previous = 0.0
    for upper in sorted(after["buckets"]):
        cumulative = after["buckets"][upper] - before["buckets"].get(upper, 0.0)
        count = round(cumulative - previous)
        previous = cumulative
        if count:
            padded = next((size for size in buckets if size >= upper), buckets[-1])
            calls[padded] = calls.get(padded, 0) + count
    return {"calls_per_bucket": calls, "rows": round(after["rows"] - before["rows"]),
            "calls": round(after["calls"] - before["calls"]), "predict_s": after["predict_s"] - before["predict_s"]}


def ceiling_figures(batches: dict[str, Any], timings: dict[int, dict[str, float]], *, requests: int, rps: float,
                    server_cpu_s: float) -> dict[str, float | None]:
    """The model alone's throughput at the batches the server ran, and the server's CPU split.

    `timings` is part 1's figures per batch size for the server's predict path. Ceiling: the real
    rows served ÷ the time the model alone takes to run the same calls back to back. Predict
    CPU: the model's own CPU for those calls; everything else is the server's CPU less that.
    """
    calls = {int(size): count for size, count in batches["calls_per_bucket"].items()}
    figures: dict[str, float | None] = {
        "mean_batch_rows": batches["rows"] / batches["calls"] if batches["calls"] else None,
        "predict_wall_ms_per_request": batches["predict_s"] / requests * 1000 if requests else None,
        "cpu_ms_per_request": server_cpu_s / requests * 1000 if requests else None,
        "ceiling_rows_per_s": None, "ratio": None, "predict_cpu_ms_per_request": None,
        "other_cpu_ms_per_request": None}
    if not calls or not requests or any(size not in timings for size in calls):
        return figures
    alone_s = sum(count * timings[size]["median_ms"] for size, count in calls.items()) / 1000
    predict_cpu_s = sum(count * timings[size]["cpu_ms_per_call"] for size, count in calls.items()) / 1000
    ceiling = batches["rows"] / alone_s
    figures.update(ceiling_rows_per_s=ceiling, ratio=rps / ceiling,
                   predict_cpu_ms_per_request=predict_cpu_s / requests * 1000,
                   other_cpu_ms_per_request=(server_cpu_s - predict_cpu_s) / requests * 1000)
    return figures


def measure_load(server: Server, load: Load, args: argparse.Namespace, *, prefix: Path, what: str,
                 protocol: str = "http") -> dict[str, Any]:
    """One load point against a running server, with the server's CPU over it."""
    server.wait_quiet(within_s=60)
    # /metrics is read outside the CPU window: the scrape is not part of the load.
    metrics_before = server.metrics()
    cpu_before = server.cpu_seconds()
    url = server.url if protocol == "http" else f"grpc://{server.grpc_target}"
    stats = run_locust(url, load, duration_s=args.duration, prefix=prefix, protocol=protocol,
                       spawn_rate=args.spawn_rate)
    server_cpu_s = server.cpu_seconds() - cpu_before
    metrics_after = server.metrics()
    if metrics_before and metrics_after:
        stats["server_batches"] = batch_delta(metrics_before, metrics_after)
    stats["server_cpu_s"] = server_cpu_s
    stats["server_cpu_ms_per_request"] = server_cpu_s / stats["requests"] * 1000 if stats.get("requests") else None
    stats["server_cpu_share"] = server_cpu_s / stats["locust_wall_s"]
    log(f"{what}: {stats.get('requests', 0)} requests, {stats.get('failures', 0)} failed, mean "
        f"{_fmt(stats.get('mean_ms'))} ms, {_fmt(stats.get('rps'))} req/s, locust {stats['locust_cpu_share']:.0%} of a core")
    return stats


PROTOCOLS = ("http", "grpc")
PROTOCOL_NAMES = {"http": "REST (HTTP/JSON)", "grpc": "gRPC (TensorProto)"}


def run_protocols(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    """The reference configuration once, loaded over REST and over gRPC at each closed-loop user count."""
    config = CONFIGS_BY_NAME[REFERENCE]
    server = Server(config, model_path=args.served_model_path, log_path=work_dir / "gunicorn-protocols.log")
    result: dict[str, Any] = {"config": config.name, "loads": []}
    try:
        result["start_s"] = server.start(ready_within_s=args.server_start_timeout)
        for users in args.protocol_users:
            load = Load(f"{users} closed", users, (0.0, 0.0))
            for protocol in PROTOCOLS:
                stats = measure_load(server, load, args, prefix=work_dir / f"protocols-{protocol}-{users}",
                                     what=f"{protocol} {users} users closed loop", protocol=protocol)
                result["loads"].append({"protocol": protocol, "users": users, **stats})
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"protocols: {result['error']}")
    finally:
        server.stop()
    return result


def run_config(config: Config, loads: Sequence[Load], args: argparse.Namespace, work_dir: Path, *,
               tag: str = "") -> dict[str, Any]:
    """Start the configuration's server, run every load point against it, stop it. `tag` names a round's files."""
    server = Server(config, model_path=args.served_model_path, log_path=work_dir / f"gunicorn-{config.name}{tag}.log")
    result: dict[str, Any] = {"config": config.name, "loads": {}}
    try:
        result["start_s"] = server.start(ready_within_s=args.server_start_timeout)
        result["cwd"] = psutil.Process(server.proc.pid).cwd()  # the tree it really runs, as the OS sees it
        log(f"{config.name}: ready in {result['start_s']:.1f} s")
        for load in loads:
            result["loads"][load.label] = measure_load(server, load, args, prefix=work_dir / (
                f"{config.name}{tag}-{load.label.replace(' ', '_')}"), what=f"{config.name}{tag} {load.label}")
    except Exception as exc:  # one configuration failing should not lose the others' numbers
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{config.name}: {result['error']}")
    finally:
        server.stop()
    return result


def run_rounds(configs: Sequence[Config], loads: Sequence[Load], args: argparse.Namespace,
               work_dir: Path) -> list[list[dict[str, Any]]]:
    """Every configuration, `args.rounds` times; each round's results in the order of `configs`.

    The order alternates from one round to the next (A B, B A, A B, ...), so that a machine
    growing faster or slower over the run favours neither side of a ratio.
    """
    rounds = []
    for number in range(args.rounds):
        order = list(configs) if number % 2 == 0 else list(configs)[::-1]
        tag = f"-round{number + 1}" if args.rounds > 1 else ""
        by_name = {config.name: run_config(config, loads, args, work_dir, tag=tag) for config in order}
        rounds.append([by_name[config.name] for config in configs])
    return rounds


@contextmanager
def baseline_tree(ref: str) -> Iterator[tuple[Path, str]]:
    """Commit `ref` checked out in a temporary detached git worktree, and its short sha; removed after."""
    short = subprocess.run(["git", "rev-parse", "--short", f"{ref}^{{commit}}"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="benchmark-baseline-") as folder:
        tree = Path(folder) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), ref], cwd=REPO, check=True,
                       capture_output=True, text=True)
        try:
            yield tree, short
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)


def baseline_config(tree: Path, short_sha: str) -> Config:
    return Config(f"baseline@{short_sha}", 1, {}, f"the server of commit {short_sha}: its defaults, 1 worker",
                  True, tree)


# ---------------------------------------------------------------------------------------------
# 3. Report


def machine_facts() -> dict[str, str]:
    cpu_model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = psutil.virtual_memory().total / 2**30
    return {
        "CPU": cpu_model,
        "cores": f"{psutil.cpu_count(logical=True)} logical, {psutil.cpu_count(logical=False)} physical",
        "memory": f"{memory_gib:.1f} GiB",
        "OS": platform.platform(),
        "GPU": "none used (TensorFlow CPU build)",
        "load average at start (1, 5, 15 min)": ", ".join(f"{value:.2f}" for value in os.getloadavg()),
    }


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    distributions = {"tensorflow": ("tensorflow-cpu", "tensorflow"), "keras": ("keras",), "gunicorn": ("gunicorn",),
                     "locust": ("locust",), "flask": ("flask",), "numpy": ("numpy",)}
    for label, names in distributions.items():
        found[label] = "not installed"
        for name in names:
            try:
                version = package_metadata.version(name)
            except package_metadata.PackageNotFoundError:
                continue
            found[label] = version if name == label else f"{version} ({name})"
            break
    return found


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "–"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def _load_name(label: str) -> str:
    if label == CLOSED_LOOP_LABEL:
        return "the closed loop"
    return f"{label} user" if label == "1" else f"{label} users"


def _ratio(numerator: float | None, denominator: float | None) -> str:
    if not numerator or not denominator:
        return "–"
    return f"{numerator / denominator:.1f}×" if numerator / denominator < 100 else f"{numerator / denominator:,.0f}×"


def best_function_throughput(alone: list[dict[str, Any]]) -> tuple[float, int] | None:
    if not alone:
        return None
    best = max(alone, key=lambda row: row["function"]["items_per_s"])
    return best["function"]["items_per_s"], best["batch"]


def nearest_row(alone: list[dict[str, Any]], batch_rows: float | None) -> dict[str, Any] | None:
    if not alone or not batch_rows:
        return None
    return min(alone, key=lambda row: abs(row["batch"] - batch_rows))


def protocol_lines(protocols: dict[str, Any]) -> list[str]:
    lines = [f"The `{protocols['config']}` configuration (one server) loaded in a closed loop (no think time), "
             "one random row per call: over REST, Locust's FastHttpUser POSTs JSON to /predict; over gRPC, "
             "a Locust user calls TensorFlow Serving's PredictionService/Predict with the "
             "`tensorflow-serving-api` stubs, the row as `tensor_content`. Both reach the same batcher. "
             "Server CPU per request: the workers' and master's user + system CPU over the load point, "
             "÷ the requests answered. Locust's gRPC user imports TensorFlow (for the stubs' protos) "
             "before its run starts; its start-up CPU counts in its Locust CPU.", ""]
    if "error" in protocols and not protocols["loads"]:
        return lines + [f"Not measured: {protocols['error']}"]
    rows = [(PROTOCOL_NAMES[entry["protocol"]], entry["users"], entry.get("requests", "–"), entry.get("failures", "–"),
             _fmt(entry.get("mean_ms")), _fmt(entry.get("p50_ms")), _fmt(entry.get("p99_ms")), _fmt(entry.get("rps")),
             _fmt(entry.get("server_cpu_ms_per_request"), 2), f"{entry['locust_cpu_share']:.0%}")
            for entry in protocols["loads"]]
    lines += _table(["protocol", "users", "requests", "failures", "mean ms", "p50 ms", "p99 ms", "req/s",
                     "server CPU ms/request", "Locust CPU"], rows) + [""]
    by_key = {(entry["protocol"], entry["users"]): entry for entry in protocols["loads"]}
    for users in sorted({entry["users"] for entry in protocols["loads"]}):
        rest, grpc_ = by_key.get(("http", users), {}), by_key.get(("grpc", users), {})
        rest_cpu, grpc_cpu = rest.get("server_cpu_ms_per_request"), grpc_.get("server_cpu_ms_per_request")
        if rest_cpu and grpc_cpu:
            lines.append(f"- {users} {'user' if users == 1 else 'users'}: server CPU per request "
                         f"{_fmt(rest_cpu, 2)} ms over REST, {_fmt(grpc_cpu, 2)} ms over gRPC "
                         f"(REST ÷ gRPC {_ratio(rest_cpu, grpc_cpu)}); throughput {_fmt(rest.get('rps'))} and "
                         f"{_fmt(grpc_.get('rps'))} req/s; mean latency {_fmt(rest.get('mean_ms'))} and "
                         f"{_fmt(grpc_.get('mean_ms'))} ms.")
    return lines


def write_report(out: Path, *, args: argparse.Namespace, alone: dict[str, Any], results: list[dict[str, Any]],
                 loads: Sequence[Load], machine: dict[str, str], started: datetime.datetime,
                 elapsed_s: float, protocols: dict[str, Any] | None = None,
                 configs: dict[str, Config] | None = None, rounds: list[list[dict[str, Any]]] | None = None) -> Path:
    configs = configs or CONFIGS_BY_NAME
    after_idle = alone["after_idle"]
    alone_batches = alone["batches"]
    open_loads = [load for load in loads if not load.closed_loop]
    closed = next((load for load in loads if load.closed_loop), None)
    by_config = {result["config"]: result for result in results}
    lines = ["# Benchmarks", ""]
    lines += [f"Generated by `{_command_line(args)}` on {started:%Y-%m-%d %H:%M} UTC; the run took "
              f"{elapsed_s / 60:.1f} min. Nothing is asserted about these numbers: they are what this "
              "machine gave, once. Re-run the command to reproduce them on yours.", ""]
    if args.quick:
        lines += ["**A quick run**: seconds per load point, a few configurations. Its numbers are a smoke "
                  "test of the benchmark, not measurements.", ""]

    lines += ["## Machine", ""] + _table(["", ""], machine.items()) + [""]
    lines += ["## Versions", ""] + _table(["package", "version"], versions().items()) + [""]
    default_model = ("the built-in default model (4 → 4096 ×5 → 3 dense, ~268 MB of float32 weights)"
                     if args.model == "default" else f"the wide-input model ({WIDE_MODEL_NAME}), built from seeds")
    max_batch_size = SERVER_DEFAULTS["MAX_BATCH_SIZE"]
    lines += ["## Settings", "",
              f"- Model: {Path(args.model_path).name if args.model_path else default_model}.",
              f"- Each load point runs {args.duration} s of headless Locust (`locustfile.py`, one process, "
              f"FastHttpUser), {spawning(args.spawn_rate)}, one random row per request.",
              f"- Think time {THINK_TIME_S[0]:g}–{THINK_TIME_S[1]:g} s per user for "
              + ", ".join(str(load.users) for load in open_loads) + " users"
              + (f"; then a closed loop: {closed.users} users, no think time." if closed else "."),
              "- Between load points the server is left to finish any backlog (its CPU falls idle).",
              "- Server CPU is the user + system time of the gunicorn master and workers, from psutil, "
              "across each load point. Locust's CPU is its own user + system time (getrusage of the "
              "finished process), with psutil sampling its busiest second.",
              f"- Other settings are the server's defaults (MAX_BATCH_SIZE {max_batch_size}, "
              f"MAX_QUEUE_ROWS {Settings().max_queue_rows}, THREADS = MAX_QUEUE_ROWS + 2 × MAX_BATCH_SIZE, "
              "TF threads = cores ÷ workers).", ""]
    config_rows = [(f"`{name}`", configs[name].workers,
                    " ".join(f"{k}={v}" for k, v in configs[name].env.items()) or "(defaults)",
                    configs[name].what) for name in by_config]
    lines += _table(["configuration", "workers", "environment", "what it is"], config_rows) + [""]

    lines += ["## 1. The model alone", "",
              "One process, no server: median wall time per call, rows per second, and the process's "
              "CPU time per row (`time.process_time` around the calls, all threads). `model.predict` is "
              "Keras' own (called with batch_size = the batch); the predict path is the server's compiled "
              "`tf.function`, the one the batcher calls. TensorFlow's thread pools are sized as in one worker "
              "of a default server.", ""]
    alone_rows = []
    for row in alone_batches:
        keras_row = row.get("keras_predict")
        function_row = row["function"]
        alone_rows.append((row["batch"], _fmt(keras_row["median_ms"]) if keras_row else "–",
                           _fmt(keras_row["items_per_s"]) if keras_row else "–",
                           _fmt(function_row["median_ms"]), _fmt(function_row["items_per_s"]),
                           _fmt(function_row["cpu_ms_per_row"], 2),
                           _ratio(keras_row["median_ms"], function_row["median_ms"]) if keras_row else "–",
                           _fmt(function_row["cpu_ms_per_call"], 2)))
    lines += _table(["batch", "model.predict ms/call", "model.predict rows/s", "predict path ms/call",
                     "predict path rows/s", "predict path CPU ms/row", "model.predict ÷ predict path",
                     "predict path CPU ms/call"], alone_rows) + [""]
    ceiling = best_function_throughput(alone_batches)
    if ceiling:
        lines += [f"Ceiling: **{ceiling[0]:,.0f} rows/s** at batch {ceiling[1]} (best of the predict path).", ""]
    back_to_back = alone_batches[0]["function"]["median_ms"] if alone_batches and alone_batches[0]["batch"] == 1 else None
    lines += [f"A bare call after idling: {after_idle['calls']} calls of the predict path at batch 1, each after "
              f"a pause drawn from {THINK_TIME_S[0]:g}–{THINK_TIME_S[1]:g} s (a user's think time): mean "
              f"**{_fmt(after_idle['mean_ms'], 2)} ms**, median {_fmt(after_idle['median_ms'], 2)} ms "
              f"(back to back: median {_fmt(back_to_back, 2)} ms).", ""]

    lines += ["## 2. Servers under load", "",
              "Latencies in ms as Locust measured them (client side, including HTTP and JSON); "
              "percentiles are Locust's (rounded to 2 significant digits above 100 ms); req/s is requests "
              "÷ run time. "
              "`batch rows` is the mean X-Batch-Size the answers reported: the rows in the predict call "
              "that served them. `server CPU` is in cores (1.0 = one core busy all the time).", ""]
    load_header = ["configuration", "users", "requests", "failures", "mean", "p50", "p95", "p99", "req/s",
                   "batch rows", "server CPU", "Locust CPU"]
    load_rows = []
    for name, result in by_config.items():
        if "error" in result and not result["loads"]:
            load_rows.append((f"`{name}`", "failed: " + result["error"], *["–"] * (len(load_header) - 2)))
            continue
        for label, stats in result["loads"].items():
            load_rows.append((f"`{name}`", label, stats.get("requests", "–"), stats.get("failures", "–"),
                              _fmt(stats.get("mean_ms")), _fmt(stats.get("p50_ms")), _fmt(stats.get("p95_ms")),
                              _fmt(stats.get("p99_ms")), _fmt(stats.get("rps")),
                              _fmt(stats.get("mean_batch_rows")), _fmt(stats.get("server_cpu_share"), 2),
                              f"{stats['locust_cpu_share']:.0%}"))
    lines += _table(load_header, load_rows) + [""]

    if closed:
        lines += [f"## 3. Throughput and CPU in the closed loop ({closed.users} users, no think time)", "",
                  "CPU per request: all the server's CPU (HTTP, JSON, batching and the model) over the "
                  "requests served. Beside it, the model's own CPU per row from part 1 at batch 1 and at "
                  "the batch size nearest the mean batch the server ran.", ""]
        cpu_rows = []
        batch_one = alone_batches[0] if alone_batches else None
        for name, result in by_config.items():
            stats = result["loads"].get(closed.label)
            if not stats:
                continue
            near = nearest_row(alone_batches, stats.get("mean_batch_rows"))
            cpu_rows.append((f"`{name}`", _fmt(stats.get("rps")), _fmt(stats.get("mean_ms")),
                             _fmt(stats.get("p99_ms")), _fmt(stats.get("mean_batch_rows")),
                             _fmt(stats.get("server_cpu_ms_per_request"), 2),
                             _fmt(batch_one["function"]["cpu_ms_per_row"], 2) if batch_one else "–",
                             (f"{_fmt(near['function']['cpu_ms_per_row'], 2)} (batch {near['batch']})"
                              if near else "–"),
                             f"{stats['locust_cpu_share']:.0%}"))
        lines += _table(["configuration", "req/s", "mean ms", "p99 ms", "batch rows", "server CPU ms/request",
                         "model CPU ms/row, batch 1", "model CPU ms/row, near that batch", "Locust CPU"],
                        cpu_rows) + [""]

    lines += ["## 4. Ratios", ""] + ratio_lines(by_config, open_loads, closed, ceiling, configs) + [""]
    lines += ["## 5. The load generator", ""] + load_generator_lines(by_config) + [""]
    if protocols is not None:
        lines += ["## 6. REST and gRPC", ""] + protocol_lines(protocols) + [""]
    lines += ["## 7. Closed loop against the model's own ceiling", ""]
    lines += ceiling_lines(by_config, configs, alone, closed, open_loads) + [""]
    if rounds and len(rounds) > 1:
        lines += ["## 8. Rounds", ""] + round_lines(rounds, configs, alone, loads) + [""]
    lines += ["## Plot", "", "![Mean latency against users, and closed-loop throughput](benchmarks.png)", ""]
    lines += ["## Reproduce", "", "```",
              "python scripts/benchmark.py            # the full report, about 24 min",
              "python scripts/benchmark.py --quick --out /tmp/bench",
              "# the performance issue's setup, before (commit REF) and after in one run:",
              "python scripts/benchmark.py --model wide --closed-loop-users 32 --users 1,50 --configs default "
              "--baseline-ref REF --no-protocols", "```", "",
              "Add `--work-dir DIR` to keep the raw Locust CSV and JSON, the server logs and `results.json`.",
              ""]
    path = out / "benchmarks.md"
    path.write_text("\n".join(lines))
    return path


def ratio_lines(by_config: dict[str, dict[str, Any]], open_loads: Sequence[Load], closed: Load | None,
                ceiling: tuple[float, int] | None, configs: dict[str, Config]) -> list[str]:
    reference = by_config.get(REFERENCE)
    if not reference or not reference["loads"]:
        return [f"No ratios: the `{REFERENCE}` configuration was not run."]
    labels = [load.label for load in open_loads] + ([closed.label] if closed else [])
    lines = [f"Mean latency of each configuration ÷ mean latency of `{REFERENCE}` "
             "(above 1×: the default answered faster).", ""]
    rows = []
    for name, result in by_config.items():
        if name == REFERENCE:
            continue
        rows.append((f"`{name}`", *(_ratio(result["loads"].get(label, {}).get("mean_ms"),
                                           reference["loads"].get(label, {}).get("mean_ms")) for label in labels)))
    lines += _table(["configuration", *(_load_name(label) for label in labels)], rows) + [""]
    for load in open_loads:
        ref_mean = reference["loads"].get(load.label, {}).get("mean_ms")
        parts = []
        for name, result in by_config.items():
            mean = result["loads"].get(load.label, {}).get("mean_ms")
            if name != REFERENCE and configs[name].baseline and mean and ref_mean:
                parts.append(f"`{name}` {_fmt(mean)} ms ({_ratio(mean, ref_mean)})")
        if parts and ref_mean:
            lines.append(f"- {_load_name(load.label)}: `{REFERENCE}` {_fmt(ref_mean)} ms mean; " + ", ".join(parts) + ".")
    if closed:
        ref_rps = reference["loads"].get(closed.label, {}).get("rps")
        parts = []
        for name, result in by_config.items():
            rps = result["loads"].get(closed.label, {}).get("rps")
            if name != REFERENCE and rps and ref_rps:
                parts.append(f"`{name}` {_fmt(rps)} req/s (the default serves {_ratio(ref_rps, rps)} as many)")
        if ref_rps:
            lines += ["", f"- Closed-loop throughput: `{REFERENCE}` {_fmt(ref_rps)} req/s; " + ", ".join(parts) + "."]
            if ceiling:
                lines.append(f"- The model alone peaks at {ceiling[0]:,.0f} rows/s (batch {ceiling[1]}): "
                             f"`{REFERENCE}` serves {ref_rps / ceiling[0]:.0%} of that ceiling over HTTP, "
                             "with the load generator on the same cores.")
    return lines


def load_ceiling(config: Config, stats: dict[str, Any], alone: dict[str, Any]) -> dict[str, float | None]:
    """ceiling_figures for one load point, from its /metrics batches and part 1's timings."""
    timings = {row["batch"]: row[config.predict_path] for row in alone["batches"] if config.predict_path in row}
    if "server_batches" not in stats:
        return {}
    return ceiling_figures(stats["server_batches"], timings, requests=stats.get("requests", 0),
                           rps=stats.get("rps", 0.0), server_cpu_s=stats["server_cpu_s"])


def ceiling_lines(by_config: dict[str, dict[str, Any]], configs: dict[str, Config], alone: dict[str, Any],
                  closed: Load | None, open_loads: Sequence[Load]) -> list[str]:
    lines = []
    figures = {}
    if closed:
        lines += [f"The closed loop ({closed.users} users, one row per request). `rows per call`: the real rows "
                  "per predict call, from the server's `model_server_batch_size_rows` histogram over the load point; "
                  "each call was padded to the next bucket size. `ceiling`: the rows/s of the model alone (part 1, "
                  "the configuration's predict path) running those same padded calls back to back: real rows ÷ "
                  "Σ calls × median ms per call. `ratio`: req/s ÷ ceiling. `predict wall`: the server's own "
                  "`model_server_predict_duration_seconds` ÷ requests. Server CPU per request (master and workers, "
                  "psutil) is split into `predict` (Σ calls × the model alone's CPU per call at that size) and "
                  "`everything else` (the rest: HTTP, JSON, Flask, logging, batching, metrics).", ""]
        rows = []
        for name, result in by_config.items():
            stats = result["loads"].get(closed.label)
            if not stats:
                continue
            figures[name] = numbers = load_ceiling(configs[name], stats, alone)
            rows.append((f"`{name}`", _fmt(stats.get("rps")), _fmt(numbers.get("mean_batch_rows")),
                         _fmt(numbers.get("ceiling_rows_per_s")),
                         f"{numbers['ratio']:.0%}" if numbers.get("ratio") else "–",
                         _fmt(numbers.get("predict_wall_ms_per_request"), 2),
                         _fmt(numbers.get("cpu_ms_per_request"), 2), _fmt(numbers.get("predict_cpu_ms_per_request"), 2),
                         _fmt(numbers.get("other_cpu_ms_per_request"), 2)))
        lines += _table(["configuration", "req/s", "rows per call", "ceiling rows/s", "ratio", "predict wall ms/request",
                         "server CPU ms/request", "of which predict", "of which everything else"], rows) + [""]
        reference = figures.get(REFERENCE)
        for name, numbers in figures.items():
            if name.startswith("baseline@") and reference:
                ref_rps = by_config[REFERENCE]["loads"][closed.label].get("rps")
                rps = by_config[name]["loads"][closed.label].get("rps")
                lines.append(f"- `{REFERENCE}` ÷ `{name}`: req/s {_ratio(ref_rps, rps)}; server CPU outside predict "
                             f"per request {_ratio(reference.get('other_cpu_ms_per_request'), numbers.get('other_cpu_ms_per_request'))} "
                             f"({_fmt(reference.get('other_cpu_ms_per_request'), 2)} against "
                             f"{_fmt(numbers.get('other_cpu_ms_per_request'), 2)} ms).")
        lines.append("")
    one_user = next((load for load in open_loads if load.users == 1), None)
    after_idle = alone["after_idle"]
    if one_user:
        lines += [f"One user with {THINK_TIME_S[0]:g}–{THINK_TIME_S[1]:g} s think time against a bare call of the "
                  f"model after the same idle time (part 1: mean {_fmt(after_idle['mean_ms'], 2)} ms over "
                  f"{after_idle['calls']} calls): the difference is what the server adds to one request.", ""]
        rows = []
        for name, result in by_config.items():
            stats = result["loads"].get(one_user.label)
            if not stats or stats.get("mean_ms") is None:
                continue
            rows.append((f"`{name}`", _fmt(stats.get("mean_ms"), 2), _fmt(stats.get("p50_ms"), 2),
                         _fmt(after_idle["mean_ms"], 2), _fmt(stats["mean_ms"] - after_idle["mean_ms"], 2)))
        lines += _table(["configuration", "1 user mean ms", "1 user p50 ms", "bare call after idle, mean ms",
                         "difference ms"], rows)
    return lines


def round_lines(rounds: list[list[dict[str, Any]]], configs: dict[str, Config], alone: dict[str, Any],
                loads: Sequence[Load]) -> list[str]:
    """Each round's figures per load point, and the median of each round's ratios to the reference."""
    names = [result["config"] for result in rounds[0]]
    others = [name for name in names if name != REFERENCE]
    lines = [f"{len(rounds)} rounds. In each, every configuration's server is started afresh and runs every load "
             "point; the order alternates from round to round. Sections 1–7 are round 1. A ratio is taken within "
             "a round, between runs minutes apart, and then the median over the rounds: a machine's speed can "
             "drift more between rounds than between neighbouring runs.", ""]
    for load in loads:
        columns = ["req/s", "mean ms", "p99 ms"] + (["CPU outside predict ms/request"] if load.closed_loop else [])
        header = ["round", *[f"`{name}` {column}" for name in names for column in columns]]
        if REFERENCE in names:
            header += [(f"`{REFERENCE}` ÷ `{name}` req/s" if load.closed_loop else f"`{name}` ÷ `{REFERENCE}` mean")
                       for name in others]
        table: list[list[float | None]] = []
        for results in rounds:
            by_name = {result["config"]: result["loads"].get(load.label, {}) for result in results}
            row: list[float | None] = []
            for name in names:
                stats = by_name[name]
                row += [stats.get("rps"), stats.get("mean_ms"), stats.get("p99_ms")]
                if load.closed_loop:
                    row.append(load_ceiling(configs[name], stats, alone).get("other_cpu_ms_per_request")
                               if stats else None)
            if REFERENCE in names:
                reference = by_name[REFERENCE]
                for name in others:
                    top, bottom = ((reference.get("rps"), by_name[name].get("rps")) if load.closed_loop
                                   else (by_name[name].get("mean_ms"), reference.get("mean_ms")))
                    row.append(top / bottom if top and bottom else None)
            table.append(row)
        ratios_from = len(names) * len(columns)

        def cell(value: float | None, column: int) -> str:
            return f"{value:.2f}×" if column >= ratios_from and value is not None else _fmt(value, 2)

        rows = [[str(number), *(cell(value, column) for column, value in enumerate(row))]
                for number, row in enumerate(table, 1)]
        medians = [statistics.median(values) if (values := [row[column] for row in table if row[column] is not None])
                   else None for column in range(len(header) - 1)]
        rows.append(["**median**", *(f"**{cell(value, column)}**" for column, value in enumerate(medians))])
        lines += [f"### {_load_name(load.label).capitalize()}", ""] + _table(header, rows) + [""]
    return lines


def load_generator_lines(by_config: dict[str, dict[str, Any]]) -> list[str]:
    busiest = None
    for name, result in by_config.items():
        for label, stats in result["loads"].items():
            if busiest is None or stats["locust_cpu_share"] > busiest[2]["locust_cpu_share"]:
                busiest = (name, label, stats)
    if busiest is None:
        return ["No load was run."]
    name, label, stats = busiest
    lines = [f"Locust ran as one process (one core at most). Its busiest run was `{name}`, {_load_name(label)}: "
             f"{stats['locust_cpu_share']:.0%} of a core on average, {stats['locust_peak_share']:.0%} in its "
             "busiest second."]
    limited = [(n, l) for n, r in by_config.items() for l, s in r["loads"].items()
               if s["locust_cpu_share"] >= LOCUST_BUSY_SHARE]
    if limited:
        lines.append("**The load generator was near saturation** (≥ "
                     f"{LOCUST_BUSY_SHARE:.0%} of a core) in: " + ", ".join(f"`{n}` {_load_name(l)}" for n, l in limited)
                     + ". There, throughput is a floor for the server's, not its limit; run Locust with "
                     "`--processes` or from another machine to push further.")
    else:
        lines.append(f"It stayed under {LOCUST_BUSY_SHARE:.0%} of a core everywhere, so it was not the bottleneck; "
                     "but on a small machine it shares the cores with the server, and its CPU is CPU the "
                     "server did not get.")
    return lines


def write_plot(out: Path, results: list[dict[str, Any]], loads: Sequence[Load]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter

    open_loads = [load for load in loads if not load.closed_loop]
    closed = next((load for load in loads if load.closed_loop), None)
    figure, (latency_axes, throughput_axes) = plt.subplots(1, 2, figsize=(12, 4.8),
                                                           gridspec_kw={"width_ratios": [3, 2]})
    colours = {result["config"]: f"C{index}" for index, result in enumerate(results)}
    for result in results:
        points = [(load.users, result["loads"][load.label]["mean_ms"]) for load in open_loads
                  if result["loads"].get(load.label, {}).get("mean_ms")]
        if points:
            latency_axes.plot(*zip(*points), marker="o", label=result["config"], color=colours[result["config"]])
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    latency_axes.set_xlabel(f"users ({THINK_TIME_S[0]:g}–{THINK_TIME_S[1]:g} s think time; log scale)")
    latency_axes.set_ylabel("mean latency, ms (log scale)")
    latency_axes.set_xscale("log")
    latency_axes.set_yscale("log")
    latency_axes.set_xticks([load.users for load in open_loads])
    latency_axes.xaxis.set_major_formatter(plain)
    latency_axes.xaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))
    latency_axes.yaxis.set_major_formatter(plain)
    # Minor ticks of a log axis: label 2s and 5s only (20, 50, 200 ...), or they crowd.
    latency_axes.yaxis.set_minor_formatter(FuncFormatter(
        lambda value, _: f"{value:g}" if f"{value:g}"[0] in "25" else ""))
    latency_axes.grid(True, which="both", alpha=0.3)
    latency_axes.legend(fontsize="small")
    latency_axes.set_title("Mean latency against users")
    if closed:
        names = [result["config"] for result in results if result["loads"].get(closed.label, {}).get("rps")]
        values = [next(r for r in results if r["config"] == name)["loads"][closed.label]["rps"] for name in names]
        bars = throughput_axes.barh(names, values, color=[colours[name] for name in names])
        throughput_axes.bar_label(bars, labels=[f"{value:,.0f}" for value in values], padding=3, fontsize="small")
        throughput_axes.margins(x=0.15)
        throughput_axes.invert_yaxis()
        throughput_axes.set_xlabel("requests/s")
        throughput_axes.set_title(f"Closed loop, {closed.users} users")
        throughput_axes.grid(True, axis="x", alpha=0.3)
    else:
        throughput_axes.set_axis_off()
    figure.tight_layout()
    path = out / "benchmarks.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


# ---------------------------------------------------------------------------------------------
# Command line


def without_flags(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """argv less these flags and their values (`--out DIR` and `--out=DIR`): a report shows
    its command without the folders of the machine it ran on."""
    shown, skip = [], False
    for part in argv:
        if skip:
            skip = False
        elif part in flags:
            skip = True
        elif not part.startswith(tuple(f"{flag}=" for flag in flags)):
            shown.append(part)
    return shown


def _command_line(args: argparse.Namespace) -> str:
    """The command as run, less the flags that only name local folders."""
    shown = without_flags(args.argv_shown, ("--out", "--work-dir", "--model-path"))
    if args.model_path:
        shown.append(f"--model-path {Path(args.model_path).name}")
    return " ".join(["python scripts/benchmark.py", *shown])


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected whole numbers of 1 or more, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    values = _int_list(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one whole number of 1 or more, got {text!r}")
    return values[0]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return value


def _config_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in CONFIGS_BY_NAME]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS_BY_NAME)}")
    return names


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="seconds, not minutes: 2 configurations, users 1 and 5, 3 s each, batch sizes 1..8")
    parser.add_argument("--out", type=Path, default=REPO / "docs",
                        help="folder for benchmarks.md and benchmarks.png (default docs/)")
    parser.add_argument("--duration", type=int, help="seconds per load point (default 30; quick 3)")
    parser.add_argument("--configs", type=_config_list,
                        help=f"comma-separated subset of: {', '.join(CONFIGS_BY_NAME)} (default all but floor; "
                             "quick naive,default)")
    parser.add_argument("--users", type=_int_list, help="user counts with think time (default 1,5,20,50; quick 1,5)")
    parser.add_argument("--closed-loop-users", type=int,
                        help="users of the closed loop, 0 to skip it (default 64; quick 16)")
    parser.add_argument("--protocol-users", type=_int_list,
                        help="closed-loop user counts of the REST and gRPC comparison (default 1,50; quick 1,5)")
    parser.add_argument("--no-protocols", action="store_true", help="skip the REST and gRPC comparison")
    parser.add_argument("--max-batch", type=int, help="largest batch size of part 1 (default 64; quick 8)")
    parser.add_argument("--model", choices=("default", "wide"), default="default",
                        help=f"the built-in default model, or the wide-input model ({WIDE_MODEL_NAME}), "
                             "built from seeds at the start of the run")
    parser.add_argument("--model-path", help="serve and time this model (any MODEL_PATH); wins over --model")
    parser.add_argument("--baseline-ref", metavar="REF",
                        help="also run the server of this git commit (a temporary worktree), defaults and 1 worker, "
                             "as configuration baseline@<sha>, side by side with default")
    parser.add_argument("--rounds", type=_positive_int, default=1,
                        help="run every configuration this many times, in alternating order, and report each "
                             "round and the median of each round's ratios (default 1)")
    parser.add_argument("--spawn-rate", type=_positive_float,
                        help="users Locust starts a second (default: all at once, their first requests together)")
    parser.add_argument("--idle-calls", type=int,
                        help="batch-1 calls of the model alone, each after 1-3 s idle (default 8; quick 2)")
    parser.add_argument("--work-dir", type=Path, help="keep raw Locust output and server logs here (default: a temp folder)")
    parser.add_argument("--server-start-timeout", type=float, default=300)
    # Internal: part 1 runs in a child process, so that TensorFlow is not loaded in this one.
    parser.add_argument("--model-alone-json", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--batch-sizes", type=_int_list, help=argparse.SUPPRESS)
    parser.add_argument("--call-budget", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--build-wide-model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv_shown = list(argv)
    quick = args.quick
    args.duration = args.duration or (3 if quick else 30)
    args.configs = args.configs or (["naive", "default"] if quick else
                                    [config.name for config in CONFIGS if config.in_full_run])
    args.users = args.users or ([1, 5] if quick else [1, 5, 20, 50])
    args.protocol_users = [] if args.no_protocols else (args.protocol_users or ([1, 5] if quick else [1, 50]))
    if args.closed_loop_users is None:
        args.closed_loop_users = 16 if quick else 64
    args.max_batch = args.max_batch or (8 if quick else 64)
    if args.batch_sizes is None:
        # Every size the servers pad to, so that their batches can be timed alone.
        args.batch_sizes = sorted({size for size in (2**power for power in range(16)) if size <= args.max_batch}
                                  | set(SERVER_BUCKETS))
    if args.idle_calls is None:
        args.idle_calls = 2 if quick else 8
    args.call_budget = args.call_budget or (0.5 if quick else 3.0)
    args.model_alone_timeout = 300 if quick else 900
    if args.model_path:
        args.model_path = str(Path(args.model_path).resolve())
    args.served_model_path = args.model_path  # set to the wide model's file once it is built
    return args


def expected_minutes(args: argparse.Namespace, loads: Sequence[Load]) -> float:
    """A rough forecast from runs on a 2-core machine: Locust's own start and the idle wait add ~2 s a load."""
    model_alone_s = len(args.batch_sizes) * (2 * args.call_budget + 1) + 10 + args.idle_calls * 2.5
    build_s = 15 if args.model == "wide" and not args.model_path else 0
    per_config_s = 10 + len(loads) * (args.duration + 2)
    configs = (len(args.configs) + (1 if args.baseline_ref else 0)) * args.rounds
    protocols_s = (10 + 2 * len(args.protocol_users) * (args.duration + 8)) if args.protocol_users else 0
    return (build_s + model_alone_s + configs * per_config_s + protocols_s) / 60


def log(message: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


@contextmanager
def working_folder(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="benchmark-") as folder:
        yield Path(folder)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # SIGTERM as SystemExit, so that the finally blocks stop the servers and Locust.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.build_wide_model:
        save_wide_model(args.build_wide_model)
        return 0
    if args.model_alone_json:
        alone = model_alone(args.model_path, args.batch_sizes, budget_s=args.call_budget,
                            idle_calls=args.idle_calls, think_s=THINK_TIME_S)
        args.model_alone_json.write_text(json.dumps(alone))
        return 0

    started_at = datetime.datetime.now(datetime.timezone.utc)
    started = time.monotonic()
    machine = machine_facts()
    loads = [Load(str(users), users, THINK_TIME_S) for users in args.users]
    if args.closed_loop_users:
        loads.append(Load(CLOSED_LOOP_LABEL, args.closed_loop_users, (0.0, 0.0)))
    args.out.mkdir(parents=True, exist_ok=True)
    with working_folder(args.work_dir) as work_dir, ExitStack() as stack:
        configs = [CONFIGS_BY_NAME[name] for name in args.configs]
        if args.baseline_ref:
            tree, short_sha = stack.enter_context(baseline_tree(args.baseline_ref))
            configs.insert(0, baseline_config(tree, short_sha))
        log(f"working folder {work_dir}; configurations {[config.name for config in configs]}; loads "
            f"{[l.label for l in loads]}; {args.duration} s each; expect about {expected_minutes(args, loads):.0f} min")
        if args.model == "wide" and not args.model_path:
            args.served_model_path = build_wide_model(work_dir)
        alone = run_model_alone(args, work_dir)
        rounds = run_rounds(configs, loads, args, work_dir)
        results = rounds[0]
        protocols = run_protocols(args, work_dir) if args.protocol_users else None
        (work_dir / "results.json").write_text(json.dumps(
            {"model_alone": alone, "servers": results, "rounds": rounds, "protocols": protocols}, indent=1))
        report = write_report(args.out, args=args, alone=alone, results=results, loads=loads, machine=machine,
                              started=started_at, elapsed_s=time.monotonic() - started, protocols=protocols,
                              configs={config.name: config for config in configs}, rounds=rounds)
        plot = write_plot(args.out, results, loads)
    log(f"wrote {report} and {plot} in {(time.monotonic() - started) / 60:.1f} min")
    print(report.read_text())
    failed = any("error" in result for round_results in rounds for result in round_results)
    return 1 if failed or (protocols and "error" in protocols) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
