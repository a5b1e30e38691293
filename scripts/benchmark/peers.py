"""The v2 front doors beside PyTriton: one model, one client, one load, in one run.

    python -m scripts.benchmark.peers --users 8 --duration 30 --out docs/wide-v2-pytriton

This repository's server (the reference configuration, one worker) and PyTriton (Triton's own
server and dynamic batcher around a Python callable, scripts/pytriton_server.py) serve the same
saved wide model. Locust's v2 users (locustfile.py, LOCUST_PROTOCOL=v2 and v2-grpc) load each
over HTTP and gRPC in a closed loop; the server's CPU comes from /proc for its whole process tree,
as for every other configuration (measure.measure_load). PyTriton runs from a virtualenv of its
own (requirements-pytriton.txt), given by --pytriton-python.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import requests

from app.settings import Settings

from .cli import working_folder
from .configs import CONFIGS_BY_NAME, REFERENCE, WIDE_MODEL_NAME, Config, Load
from .machine import machine_facts
from .measure import failure, measure_load
from .model_alone import build_wide_model
from .options import parse_args, without_flags
from .results import LoadStats
from .runlog import log
from .server import Server
from .text import fmt, markdown_table

REPO = Path(__file__).resolve().parent.parent.parent
COMMAND = "python -m scripts.benchmark.peers"
PYTRITON_PYTHON = REPO / ".venv-pytriton" / "bin" / "python"
PYTRITON_SCRIPT = REPO / "scripts" / "pytriton_server.py"
# LOCUST_PROTOCOL values, as the report names them.
PROTOCOLS = {"v2": "HTTP", "v2-grpc": "gRPC"}
OURS, PYTRITON = "this server", "PyTriton"
MODEL = "default"


# With the default (THREADS / 4 streams a connection), 8 closed-loop gRPC users get most calls
# refused (RST_STREAM, REFUSED_STREAM) by this server; one user does not. Raised here so that
# the gRPC rows measure serving, not that refusal; the report says so.
GRPC_STREAMS = {"GRPC_MAX_STREAMS_PER_CONNECTION": "1000"}


def reference_config() -> Config:
    reference = CONFIGS_BY_NAME[REFERENCE]
    return dataclasses.replace(reference, env={**reference.env, **GRPC_STREAMS})


class PyTritonServer(Server):
    """scripts/pytriton_server.py on free loopback ports; ready once its model answers ready over v2."""

    def __init__(self, *, python: Path, model_path: str, log_path: Path) -> None:
        super().__init__(Config("pytriton", 1, {}, "PyTriton around the same model", False),
                         model_path=model_path, log_path=log_path)
        self.python = python
        self.model_path = model_path

    def command(self, *, workers: int = 1) -> list[str]:
        return [str(self.python), str(PYTRITON_SCRIPT), "--model-path", self.model_path, "--model-name", MODEL,
                "--http-port", str(self.port), "--grpc-port", self.grpc_target.rsplit(":", 1)[1],
                "--max-batch-size", str(Settings().max_batch_size)]

    def start(self, *, workers: int | None = None, ready_within_s: float = 300) -> PyTritonServer:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), cwd=REPO, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
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
    start_s: dict[str, float] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    max_abs_difference: float | None = None  # between the two servers' answers to the same rows


def infer_once(url: str, rows: np.ndarray) -> np.ndarray:
    """One v2 JSON infer of `rows` (tritonclient's HTTP client): the model's first output."""
    import tritonclient.http as triton_http

    client = triton_http.InferenceServerClient(url.split("://", 1)[1])
    tensor = triton_http.InferInput("features", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows, binary_data=False)
    answer = client.infer(MODEL, [tensor])
    return answer.as_numpy(answer.get_response()["outputs"][0]["name"])


def measure_side(name: str, server: Server, users: Sequence[int], options, work_dir: Path, run: PeerRun,
                 probe: np.ndarray) -> np.ndarray | None:
    """Start one server, load it over both protocols at every user count, stop it; its answer to `probe`."""
    answer = None
    try:
        started = time.monotonic()
        server.start(ready_within_s=options.server_start_timeout)
        run.start_s[name] = time.monotonic() - started
        log(f"{name}: ready in {run.start_s[name]:.1f} s")
        answer = infer_once(server.url, probe)
        for count in users:
            load = Load(f"{count} closed", count, (0.0, 0.0))
            for protocol in PROTOCOLS:
                slug = f"{server.config.name}-{protocol}-{count}"
                stats = measure_load(server, load, options, prefix=work_dir / slug, what=f"{name} {slug}",
                                     protocol=protocol)
                run.loads.append(PeerLoad(name, protocol, count, stats))
    except Exception as exc:  # one server failing should not lose the other's numbers
        run.errors[name] = failure(exc, server)
        log(f"{name}: {run.errors[name]}")
    finally:
        server.stop()
    return answer


def peer_table(loads: Sequence[PeerLoad]) -> list[str]:
    """The report's table: one row per server, protocol and user count."""
    rows = [(load.server, PROTOCOLS[load.protocol], load.users, f"{load.stats.requests:,}", load.stats.failures,
             fmt(load.stats.rps), fmt(load.stats.p50_ms), fmt(load.stats.p99_ms),
             fmt(load.stats.server_cpu_ms_per_request), fmt(load.stats.server_cpu_share, 2))
            for load in loads]
    return markdown_table(("server", "protocol", "users", "requests", "failures", "req/s", "p50 ms", "p99 ms",
                           "server CPU ms/request", "server cores busy"), rows)


def ratio_table(loads: Sequence[PeerLoad]) -> list[str]:
    """PyTriton's figures over this server's, per protocol and user count, where both were measured."""
    ours = {(load.protocol, load.users): load.stats for load in loads if load.server == OURS}
    rows = []
    for load in loads:
        mine = ours.get((load.protocol, load.users))
        if load.server != PYTRITON or mine is None:
            continue
        theirs = load.stats
        rows.append((PROTOCOLS[load.protocol], load.users, _ratio(mine.rps, theirs.rps),
                     _ratio(mine.p50_ms, theirs.p50_ms),
                     _ratio(mine.server_cpu_ms_per_request, theirs.server_cpu_ms_per_request)))
    return markdown_table(("protocol", "users", "req/s: this server ÷ PyTriton", "p50: this server ÷ PyTriton",
                           "CPU per request: this server ÷ PyTriton"), rows)


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.2f}" if numerator is not None and denominator else "–"


def write_report(out: Path, run: PeerRun, *, argv: Sequence[str], duration_s: int, started_at: str,
                 machine: dict[str, str]) -> Path:
    lines = ["# v2 beside PyTriton", "",
             f"Made by `{' '.join([COMMAND, *argv])}` on {started_at}. The same model ({WIDE_MODEL_NAME}), one row "
             f"per request, served by this server (`{REFERENCE}` configuration, 1 worker) and by PyTriton "
             f"(scripts/pytriton_server.py); Locust's v2 users over HTTP (binary tensors) and gRPC, a closed loop "
             f"of N users for {duration_s} s each. Server CPU is user + system time of the server's whole process "
             "tree (Gunicorn's master and worker; PyTriton's Python process, tritonserver and its Python stub). "
             f"This server ran with {' '.join(f'{k}={v}' for k, v in GRPC_STREAMS.items())}: with the default, "
             "concurrent gRPC users on one machine get most calls refused (REFUSED_STREAM).",
             "", "## Machine", "", *markdown_table(("", ""), machine.items()), ""]
    if run.max_abs_difference is not None:
        lines += [f"Both servers answered the same {PROBE_ROWS} rows; the largest difference between their scores "
                  f"was {run.max_abs_difference:g}.", ""]
    lines += ["## Throughput, latency and CPU", "", *peer_table(run.loads), "", "## Ratios", "",
              *ratio_table(run.loads), ""]
    if run.errors:
        lines += ["## Errors", "", *(f"- {name}: {error}" for name, error in run.errors.items()), ""]
    path = out / "benchmarks.md"
    path.write_text("\n".join(lines))
    return path


PROBE_ROWS = 4


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=lambda text: [int(part) for part in text.split(",")], default=[8],
                        help="closed-loop user counts, comma-separated (default 8)")
    parser.add_argument("--duration", type=int, default=30, help="seconds per load point (default 30)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "wide-v2-pytriton")
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--pytriton-python", type=Path, default=PYTRITON_PYTHON,
                        help="the Python of PyTriton's own virtualenv (default .venv-pytriton/bin/python)")
    parser.add_argument("--server-start-timeout", type=float, default=300)
    args = parser.parse_args(argv)
    # SIGTERM as SystemExit, so that the finally blocks stop the servers (and Locust) too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    options = parse_args(["--duration", str(args.duration), "--server-start-timeout", str(args.server_start_timeout)])
    if not args.pytriton_python.exists():
        parser.error(f"{args.pytriton_python} is missing: make it (docs/benchmarks.md, v2 beside PyTriton)")
    args.out.mkdir(parents=True, exist_ok=True)
    started_at = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = machine_facts()
    run = PeerRun()
    probe = np.random.default_rng(0).standard_normal((PROBE_ROWS, 1024)).astype(np.float32)
    with working_folder(args.work_dir) as work_dir:
        model_path = build_wide_model(work_dir)
        ours = Server(reference_config(), model_path=model_path, log_path=work_dir / "gunicorn-v2.log")
        theirs = PyTritonServer(python=args.pytriton_python, model_path=model_path,
                                log_path=work_dir / "pytriton.log")
        answers = [measure_side(name, server, args.users, options, work_dir, run, probe)
                   for name, server in ((OURS, ours), (PYTRITON, theirs))]
        if all(answer is not None for answer in answers):
            run.max_abs_difference = float(np.max(np.abs(answers[0] - answers[1])))
        (work_dir / "results.json").write_text(json.dumps(dataclasses.asdict(run), indent=1))
        report = write_report(args.out, run, argv=without_flags(argv, ("--out", "--work-dir", "--pytriton-python")),
                              duration_s=args.duration, started_at=started_at, machine=machine)
        (args.out / "results.json").write_text(json.dumps(dataclasses.asdict(run), indent=1))
    print(report.read_text())
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
