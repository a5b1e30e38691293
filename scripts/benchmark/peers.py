"""Peers: this server beside PyTriton and the small Flask batcher, one model, one client, one load.

This server (the `default` configuration, one worker), PyTriton (Triton's server and dynamic
batcher around a Python callable, scripts/pytriton_server.py, from a virtualenv of its own:
--pytriton-python) and the small Flask batcher (scripts/floor_app.py: Flask and one model
thread under the same Gunicorn configuration, fixed answers) serve the same saved wide model.
Locust loads each over every protocol it speaks (v2 HTTP and gRPC; TF Serving's REST and gRPC)
in a closed loop; server CPU is that of the server's whole process tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import requests

from app.settings import Settings

from . import common
from .common import DOCS, FLOOR_APP, REPO, Config, Load, Server, fmt, log, markdown_table
from .experiment import SERVER_BUCKETS
from .load import LoadStats, measure_load

PAGE = DOCS / "peers-benchmark.md"
PYTRITON_PYTHON = REPO / ".venv-pytriton" / "bin" / "python"
PYTRITON_SCRIPT = REPO / "scripts" / "pytriton_server.py"
# LOCUST_PROTOCOL values, as the page names them.
PROTOCOLS = {"v2": "v2 HTTP", "v2-grpc": "v2 gRPC", "http": "TF Serving REST", "grpc": "TF Serving gRPC"}
OURS, PYTRITON, FLASK = "this server", "PyTriton", "Flask batcher"
MODEL = "default"
PROBE_ROWS = 4
# With the default (THREADS / 4 streams a connection), 8 closed-loop gRPC users get most calls
# refused (REFUSED_STREAM) by this server; raised so that the gRPC rows measure serving.
GRPC_STREAMS = {"GRPC_MAX_STREAMS_PER_CONNECTION": "1000"}
SIDES = {
    OURS: (Config("default", 1, GRPC_STREAMS, "this server, 1 worker"), ("v2", "v2-grpc", "http", "grpc")),
    PYTRITON: (Config("pytriton", 1, {}, "PyTriton"), ("v2", "v2-grpc")),
    FLASK: (Config("flask-batcher", 1, {"GRPC_BIND": ""}, "scripts/floor_app.py", app=FLOOR_APP), ("http",)),
}


class PyTritonServer(Server):
    """scripts/pytriton_server.py on free loopback ports; ready once its model answers ready over v2."""

    def __init__(self, *, python: Path, model_path: str, log_path: Path) -> None:
        super().__init__(SIDES[PYTRITON][0], model_path=model_path, log_path=log_path)
        self.python, self.model_path = python, model_path

    def command(self, *, workers: int = 1) -> list[str]:
        return [str(self.python), str(PYTRITON_SCRIPT), "--model-path", self.model_path, "--model-name", MODEL,
                "--http-port", str(self.port), "--grpc-port", self.grpc_target.rsplit(":", 1)[1],
                "--max-batch-size", str(Settings().max_batch_size)]

    def start(self, *, workers: int | None = None, ready_within_s: float = 300) -> PyTritonServer:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_within_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"PyTriton exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"PyTriton not ready within {ready_within_s} s:\n{self.log()[-3000:]}")
            try:
                if requests.get(f"{self.url}/v2/models/{MODEL}/ready", timeout=10).status_code == 200:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.5)  # nothing listens yet, or the model still loads: there is no event to wait on

    def metrics(self) -> None:
        return None  # Triton's batch figures are not this server's /metrics


@dataclasses.dataclass
class PeerLoad:
    server: str
    protocol: str  # a LOCUST_PROTOCOL value
    users: int
    stats: LoadStats


@dataclasses.dataclass
class PeerRun:
    loads: list[PeerLoad] = dataclasses.field(default_factory=list)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    max_abs_difference: float | None = None  # between this server's and PyTriton's answers to the same rows


def infer_once(url: str, rows: np.ndarray) -> np.ndarray:
    """One v2 JSON infer of `rows`: the model's first output."""
    body = {"inputs": [{"name": "features", "shape": list(rows.shape), "datatype": "FP32",
                        "data": rows.reshape(-1).tolist()}]}
    answer = requests.post(f"{url}/v2/models/{MODEL}/infer", json=body, timeout=60)
    answer.raise_for_status()
    output = answer.json()["outputs"][0]
    return np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])


def measure_side(name: str, server: Server, args: argparse.Namespace, work_dir: Path, run: PeerRun,
                 probe: np.ndarray) -> np.ndarray | None:
    """Start one server, load it over each protocol it speaks at every user count, stop it; its answer to `probe`."""
    answer = None
    try:
        server.start(ready_within_s=args.server_start_timeout)
        if "v2" in SIDES[name][1]:
            answer = infer_once(server.url, probe)
        for users in args.users:
            for protocol in SIDES[name][1]:
                slug = f"{server.config.name}-{protocol}-{users}"
                stats = measure_load(server, Load(f"{users} closed", users), duration_s=args.duration,
                                     prefix=work_dir / slug, what=slug, protocol=protocol, buckets=SERVER_BUCKETS)
                run.loads.append(PeerLoad(name, protocol, users, stats))
    except Exception as exc:  # one server failing should not lose the others' numbers
        run.errors[name] = common.failure(exc, server)
        log(f"{name}: {run.errors[name]}")
    finally:
        server.stop()
    return answer


def peer_table(loads: Sequence[PeerLoad]) -> list[str]:
    rows = [(load.server, PROTOCOLS[load.protocol], load.users, f"{load.stats.requests:,}", load.stats.failures,
             fmt(load.stats.rps), fmt(load.stats.p50_ms), fmt(load.stats.p99_ms),
             fmt(load.stats.server_cpu_ms_per_request), fmt(load.stats.server_cpu_share, 2)) for load in loads]
    return markdown_table(("server", "protocol", "users", "requests", "failures", "req/s", "p50 ms", "p99 ms",
                           "server CPU ms/request", "server cores busy"), rows)


def ratio_table(loads: Sequence[PeerLoad]) -> list[str]:
    """This server's figures over each peer's, per protocol and user count, where both were measured."""
    ours = {(load.protocol, load.users): load.stats for load in loads if load.server == OURS}
    rows = [(load.server, PROTOCOLS[load.protocol], load.users, _ratio(mine.rps, theirs.rps),
             _ratio(mine.p50_ms, theirs.p50_ms),
             _ratio(mine.server_cpu_ms_per_request, theirs.server_cpu_ms_per_request))
            for load in loads if load.server != OURS and (mine := ours.get((load.protocol, load.users)))
            and (theirs := load.stats)]
    return markdown_table(("peer", "protocol", "users", "req/s: ours ÷ peer", "p50: ours ÷ peer",
                           "CPU per request: ours ÷ peer"), rows)


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.2f}" if numerator is not None and denominator else "–"


def report_lines(run: PeerRun, *, duration_s: float) -> list[str]:
    lines = [f"The same model ({common.WIDE_MODEL_NAME}), one row per request, a closed loop of N Locust users for "
             f"{duration_s:g} s each. Server CPU: user + system time of each server's whole process tree. "
             f"This server ran with {' '.join(f'{k}={v}' for k, v in GRPC_STREAMS.items())}. The Flask batcher "
             "answers a fixed row: it bounds what Flask, Gunicorn and one model thread allow, it is not a server.", ""]
    if run.max_abs_difference is not None:
        lines += [f"This server and PyTriton answered the same {PROBE_ROWS} rows; the largest difference between "
                  f"their scores was {run.max_abs_difference:g}.", ""]
    lines += ["## Throughput, latency and CPU", "", *peer_table(run.loads), "", "## Ratios", "",
              *ratio_table(run.loads), ""]
    return lines + (["## Errors", "", *(f"- {name}: {error}" for name, error in run.errors.items())]
                    if run.errors else [])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--users", type=lambda text: [int(part) for part in text.split(",")], default=[8],
                        help="closed-loop user counts, comma-separated (default 8)")
    parser.add_argument("--duration", type=float, default=30, help="seconds per load point (default 30)")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write (default %(default)s)")
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--pytriton-python", type=Path, default=PYTRITON_PYTHON,
                        help="the Python of PyTriton's own virtualenv; PyTriton is left out where it is missing")
    parser.add_argument("--server-start-timeout", type=float, default=300)


def run(args: argparse.Namespace) -> int:
    started, clock = datetime.datetime.now(datetime.UTC), time.monotonic()
    machine, result = common.machine_facts(), PeerRun()
    probe = np.random.default_rng(0).standard_normal((PROBE_ROWS, 1024)).astype(np.float32)
    with common.working_folder(args.work_dir) as work_dir:
        model_path = common.build_wide_model(work_dir)
        servers: dict[str, Server] = {name: Server(config, model_path=model_path, log_path=work_dir / f"{name}.log")
                                      for name, (config, _) in SIDES.items() if name != PYTRITON}
        if args.pytriton_python.exists():
            servers[PYTRITON] = PyTritonServer(python=args.pytriton_python, model_path=model_path,
                                               log_path=work_dir / "pytriton.log")
        else:
            result.errors[PYTRITON] = f"not run: {args.pytriton_python.name} of PyTriton's virtualenv is missing"
        answers = {name: measure_side(name, server, args, work_dir, result, probe) for name, server in servers.items()}
        if answers.get(OURS) is not None and answers.get(PYTRITON) is not None:
            result.max_abs_difference = float(np.max(np.abs(answers[OURS] - answers[PYTRITON])))
        (work_dir / "results.json").write_text(json.dumps(dataclasses.asdict(result), indent=1))
    page = common.write_page(args.out, "This server beside its peers", scenario="peers", argv=args.argv,
                             started=started,
                      elapsed_s=time.monotonic() - clock, machine=machine,
                      body=report_lines(result, duration_s=args.duration))
    log(f"wrote {page}")
    return 1 if set(result.errors) - {PYTRITON} else 0
