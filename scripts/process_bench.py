"""Model processes beside the default and PyTriton: one run, one load generator (wrk), two models.

    .venv/bin/python scripts/process_bench.py --duration 30 --rounds 2

Every layout serves the same saved Keras model, built here from fixed seeds: the default with
WORKERS=1, 2 and 4 (a model copy per worker), MODEL_PROCESSES=1 with WORKERS=1, 2 and 4 (one
copy), and PyTriton (scripts/pytriton_server.py, Triton's C++ front and dynamic batcher, from
a virtualenv of its own: --pytriton-python). wrk loads each in a closed loop of 32 connections,
one row per request, over the v2 REST infer route that all of them speak. Each server's answer
to that very request is first checked against the Keras model's own output; a load with any
non-2xx answer or socket error is refused, not reported. Server CPU is user + system time of
the server's whole process tree from /proc; resident memory is that of every process in it,
read as the load ends. Rounds run the layouts in alternating order, so that drift shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.benchmark.configs import WIDE_MODEL, WIDE_MODEL_NAME, Config  # noqa: E402
from scripts.benchmark.machine import machine_facts, versions  # noqa: E402
from scripts.benchmark.options import without_flags  # noqa: E402
from scripts.benchmark.peers import MODEL, PYTRITON_PYTHON, PyTritonServer  # noqa: E402
from scripts.benchmark.runlog import log  # noqa: E402
from scripts.benchmark.server import Server  # noqa: E402
from scripts.benchmark.text import fmt, markdown_table  # noqa: E402

COMMAND = ".venv/bin/python scripts/process_bench.py"
OUT = REPO / "docs" / "model-processes-benchmark.md"
FEATURES = WIDE_MODEL["features"]
MODELS = {
    "tiny": f"{FEATURES:,} floats in, one Dense(3) layer: almost no compute, what lies around the model is measured",
    "wide": WIDE_MODEL_NAME,
}
CONNECTIONS = 32
REFERENCE = "default-1w"
PYTRITON = "pytriton"
WRK_SUMMARY = "WRK_SUMMARY "
# wrk's Lua hooks: POST the body file's bytes on every request; at the end one JSON line with the
# counts and percentiles (microseconds) from wrk's own histogram.
WRK_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local file = assert(io.open("%(body)s", "rb"))
wrk.body = file:read("*a")
file:close()

function done(summary, latency, requests)
  io.write(string.format(
    '%(marker)s{"requests": %%d, "duration_us": %%d, "non_2xx_3xx": %%d, "connect": %%d, "read": %%d, ' ..
    '"write": %%d, "timeout": %%d, "p50_us": %%d, "p99_us": %%d, "mean_us": %%.1f}\\n',
    summary.requests, summary.duration, summary.errors.status, summary.errors.connect, summary.errors.read,
    summary.errors.write, summary.errors.timeout, latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    workers: int
    model_processes: int  # 0: the default, a model copy per worker
    what: str


LAYOUTS = [
    *(Layout(f"default-{n}w", n, 0, f"default, {n} worker{'s' if n > 1 else ''}") for n in (1, 2, 4)),
    *(Layout(f"procs-{n}w", n, 1, f"MODEL_PROCESSES=1, {n} worker{'s' if n > 1 else ''}") for n in (1, 2, 4)),
    Layout(PYTRITON, 1, 0, "PyTriton"),
]
LAYOUTS_BY_NAME = {layout.name: layout for layout in LAYOUTS}


@dataclasses.dataclass
class WrkResult:
    requests: int
    duration_s: float
    non_2xx_3xx: int
    socket_errors: dict[str, int]
    p50_ms: float
    p99_ms: float
    mean_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s

    @property
    def errors(self) -> str | None:
        """What makes the load unfit to report, or None."""
        found = [f"{self.non_2xx_3xx} non-2xx/3xx answers"] if self.non_2xx_3xx else []
        found += [f"{count} socket {kind} errors" for kind, count in self.socket_errors.items() if count]
        return ", ".join(found) or None


def parse_wrk(output: str) -> WrkResult:
    """wrk's output with WRK_SCRIPT's summary line; its text form is cross-checked for non-2xx answers."""
    lines = [line for line in output.splitlines() if line.startswith(WRK_SUMMARY)]
    if len(lines) != 1:
        raise ValueError(f"no single {WRK_SUMMARY.strip()} line in wrk's output:\n{output}")
    summary = json.loads(lines[0][len(WRK_SUMMARY):])
    result = WrkResult(
        requests=summary["requests"], duration_s=summary["duration_us"] / 1e6, non_2xx_3xx=summary["non_2xx_3xx"],
        socket_errors={kind: summary[kind] for kind in ("connect", "read", "write", "timeout")},
        p50_ms=summary["p50_us"] / 1000, p99_ms=summary["p99_us"] / 1000, mean_ms=summary["mean_us"] / 1000)
    if "Non-2xx or 3xx responses" in output and not result.non_2xx_3xx:
        raise ValueError(f"wrk reported non-2xx answers its summary did not count:\n{output}")
    return result


def run_wrk(url: str, body: Path, *, duration_s: float, threads: int, connections: int = CONNECTIONS,
            log_path: Path | None = None) -> tuple[WrkResult, float]:
    """One closed-loop wrk run POSTing `body` to `url`; its result and wrk's own CPU seconds."""
    script = body.with_suffix(".lua")
    script.write_text(WRK_SCRIPT % {"body": body.resolve(), "marker": WRK_SUMMARY})
    command = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{duration_s:g}s", "--latency",
               "--timeout", "30s", "-s", str(script), url]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, capture_output=True, text=True, timeout=duration_s + 120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if log_path is not None:
        log_path.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"wrk exited with {done.returncode}:\n{done.stdout}{done.stderr}")
    wrk_cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return parse_wrk(done.stdout), wrk_cpu_s


def infer_body(rows: np.ndarray) -> bytes:
    """The v2 JSON request for `rows`: one FP32 input, numbers as wrk sends them."""
    data = [float(value) for value in rows.reshape(-1)]
    return json.dumps({"inputs": [{"name": "features", "shape": list(rows.shape), "datatype": "FP32",
                                   "data": data}]}).encode()


def check_answer(url: str, body: bytes, expected: np.ndarray) -> float:
    """POST `body` once; the largest difference of the answer from the Keras model's output (0 when exact)."""
    answer = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60)
    if answer.status_code != 200:
        raise RuntimeError(f"check request: {answer.status_code} {answer.text[:500]}")
    output = answer.json()["outputs"][0]
    got = np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])
    if got.shape != expected.shape:
        raise RuntimeError(f"check request: shape {got.shape}, the model's {expected.shape}")
    difference = float(np.max(np.abs(got - expected)))
    if not np.allclose(got, expected, rtol=1e-5, atol=1e-6):
        raise RuntimeError(f"check request: answer differs from the model's by up to {difference:g}")
    return difference


@dataclasses.dataclass
class Measured:
    model: str
    layout: str
    round: int
    start_s: float | None = None
    check_difference: float | None = None
    requests: int | None = None
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    cpu_ms_per_request: float | None = None
    server_cores: float | None = None
    rss_mib: float | None = None
    processes: int | None = None
    batch_rows: float | None = None
    wrk_cores: float | None = None
    load_average: float | None = None  # the machine's 1-minute load average as the load began
    error: str | None = None


def build_models(folder: Path, names: Sequence[str]) -> None:
    """The child's side: each model saved, with the row wrk sends and the model's own answer to it."""
    import keras
    import tensorflow as tf

    from app.models import build_default_model

    rng = np.random.default_rng(0)
    # Three decimals: what a client sends, and the same float32 whichever server parses it.
    row = np.array([float(f"{value:.3f}") for value in rng.standard_normal(FEATURES)], dtype=np.float32)[None, :]
    np.save(folder / "row.npy", row)
    for name in names:
        if name == "wide":
            model = build_default_model(**WIDE_MODEL)
        else:
            inputs = keras.Input((FEATURES,), name="features")
            scores = keras.layers.Dense(3, name="scores", kernel_initializer=keras.initializers.GlorotUniform(seed=0),
                                        bias_initializer=keras.initializers.RandomNormal(seed=1))(inputs)
            model = keras.Model(inputs, scores, name="default")
        model.save(folder / f"{name}.keras")
        np.save(folder / f"{name}-expected.npy", model(tf.constant(row), training=False).numpy())


def our_server(layout: Layout, model_path: str, work_dir: Path, tag: str) -> Server:
    env = {"MODEL_PROCESSES": str(layout.model_processes)} if layout.model_processes else {}
    return Server(Config(layout.name, layout.workers, env, layout.what, False), model_path=model_path,
                  log_path=work_dir / f"{tag}.log")


def measure(server: Server, layout: Layout, model: str, round_number: int, *, body: Path, expected: np.ndarray,
            options: argparse.Namespace, work_dir: Path, tag: str) -> Measured:
    """Start, check, warm, load and stop one server."""
    result = Measured(model, layout.name, round_number)
    url = f"{server.url}/v2/models/{MODEL}/infer"
    try:
        started = time.monotonic()
        server.start(ready_within_s=options.server_start_timeout)
        result.start_s = time.monotonic() - started
        result.check_difference = check_answer(url, body.read_bytes(), expected)
        if options.warmup > 0:
            run_wrk(url, body, duration_s=options.warmup, threads=options.wrk_threads)
        server.wait_quiet(within_s=60)
        # /metrics is read outside the CPU window: the scrape is not part of the load.
        metrics_before = server.metrics()
        result.load_average = os.getloadavg()[0]
        cpu_before = server.cpu_seconds()
        wrk, wrk_cpu_s = run_wrk(url, body, duration_s=options.duration, threads=options.wrk_threads,
                                 log_path=work_dir / f"{tag}-wrk.txt")
        cpu_s = server.cpu_seconds() - cpu_before
        alive = server.processes()
        result.rss_mib = sum(_rss(process) for process in alive) / 2**20
        result.processes = len(alive)
        metrics_after = server.metrics()
        if wrk.errors:
            raise RuntimeError(f"refused: {wrk.errors} in {wrk.requests} requests")
        result.requests, result.rps, result.p50_ms, result.p99_ms = wrk.requests, wrk.rps, wrk.p50_ms, wrk.p99_ms
        result.cpu_ms_per_request = cpu_s / wrk.requests * 1000 if wrk.requests else None
        result.server_cores = cpu_s / wrk.duration_s
        result.wrk_cores = wrk_cpu_s / wrk.duration_s
        if metrics_before and metrics_after and metrics_after.calls > metrics_before.calls:
            calls = metrics_after.calls - metrics_before.calls
            result.batch_rows = (metrics_after.rows - metrics_before.rows) / calls
        log(f"{tag}: {wrk.requests} requests, {wrk.rps:.0f} req/s, p50 {wrk.p50_ms:.1f} ms, p99 {wrk.p99_ms:.1f} ms, "
            f"{fmt(result.cpu_ms_per_request, 2)} ms CPU/request, {result.rss_mib:.0f} MiB")
    except Exception as exc:  # one layout failing should not lose the others' numbers
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        result.error = f"{type(exc).__name__}: {first_line} (see {server.log_path.name})"
        log(f"{tag}: {result.error}")
    finally:
        server.stop()
    return result


def _rss(process) -> int:
    try:
        return process.memory_info().rss
    except Exception:  # exited since it was listed
        return 0


def _mean(values: Sequence[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return sum(known) / len(known) if known else None


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.2f}" if numerator is not None and denominator else "–"


def model_tables(results: Sequence[Measured], model: str, layouts: Sequence[Layout], rounds: int) -> list[str]:
    """Per model: the mean over rounds per layout, then every round's own row."""
    mine = [result for result in results if result.model == model]

    def of(layout: str, number: int | None = None) -> list[Measured]:
        return [r for r in mine if r.layout == layout and (number is None or r.round == number)]

    def mean(layout: str, field: str) -> float | None:
        found = [r for r in of(layout) if r.error is None]
        return _mean([getattr(r, field) for r in found]) if found else None

    reference_rps, reference_cpu = mean(REFERENCE, "rps"), mean(REFERENCE, "cpu_ms_per_request")
    summary = []
    for layout in layouts:
        failed = sum(1 for r in of(layout.name) if r.error)
        summary.append((layout.what, fmt(mean(layout.name, "rps")), _ratio(mean(layout.name, "rps"), reference_rps),
                        fmt(mean(layout.name, "p50_ms")), fmt(mean(layout.name, "p99_ms")),
                        fmt(mean(layout.name, "cpu_ms_per_request"), 2),
                        _ratio(mean(layout.name, "cpu_ms_per_request"), reference_cpu),
                        fmt(mean(layout.name, "rss_mib"), 0), fmt(mean(layout.name, "batch_rows")),
                        f"{rounds - failed} of {rounds}"))
    lines = [f"Mean of the rounds; ratios to `{REFERENCE}` (the default, 1 worker) in this run.", "",
             *markdown_table(("layout", "req/s", "÷ default 1w", "p50 ms", "p99 ms", "server CPU ms/request",
                              "÷ default 1w", "RSS all processes MiB", "mean batch rows", "rounds"), summary), "",
             "Every round (ratios to the same round's `default-1w`):", ""]
    rows = []
    for number in range(1, rounds + 1):
        reference = next((r for r in of(REFERENCE, number) if r.error is None), None)
        for layout in layouts:
            for r in of(layout.name, number):
                if r.error:
                    rows.append((layout.what, number, r.error, *("–",) * 10))
                    continue
                rows.append((layout.what, number, f"{r.requests:,}", fmt(r.rps),
                             _ratio(r.rps, reference.rps if reference else None), fmt(r.p50_ms), fmt(r.p99_ms),
                             fmt(r.cpu_ms_per_request, 2),
                             _ratio(r.cpu_ms_per_request, reference.cpu_ms_per_request if reference else None),
                             fmt(r.server_cores, 2), f"{r.rss_mib:,.0f} ({r.processes})", fmt(r.batch_rows),
                             fmt(r.load_average, 2)))
    lines += markdown_table(("layout", "round", "requests", "req/s", "÷ default 1w", "p50 ms", "p99 ms",
                             "server CPU ms/request", "÷ default 1w", "server cores busy",
                             "RSS MiB (processes)", "mean batch rows", "load average"), rows)
    wrk_cores = [r.wrk_cores for r in mine if r.wrk_cores is not None]
    if wrk_cores:
        lines += ["", f"wrk itself used {min(wrk_cores):.2f} to {max(wrk_cores):.2f} of a core over these loads."]
    differences = [r.check_difference for r in mine if r.check_difference is not None]
    if differences:
        lines += [f"Before each load, the server's answer to the very request wrk sends was checked against the Keras "
                  f"model's own output: largest difference {max(differences):g} over {len(differences)} servers."]
    return lines


def targets(results: Sequence[Measured], models: Sequence[str]) -> list[str]:
    def mean_rps(model: str, layout: str) -> float | None:
        return _mean([r.rps for r in results if r.model == model and r.layout == layout and r.error is None])

    def best_procs(model: str) -> tuple[str, float | None]:
        found = [(mean_rps(model, name), name) for name in LAYOUTS_BY_NAME if name.startswith("procs-")]
        known = [(rps, name) for rps, name in found if rps is not None]
        if not known:
            return "–", None
        rps, name = max(known)
        return name, rps

    lines = []
    if "tiny" in models:
        name, rps = best_procs("tiny")
        theirs = mean_rps("tiny", PYTRITON)
        lines.append(f"- Tiny model, MODEL_PROCESSES=1 at least PyTriton's req/s: best `{name}` {fmt(rps)} against "
                     f"PyTriton's {fmt(theirs)} ({_ratio(rps, theirs)}×): "
                     f"{'met' if rps and theirs and rps >= theirs else 'not met'}.")
    if "wide" in models:
        name, rps = best_procs("wide")
        default = mean_rps("wide", REFERENCE)
        lines.append(f"- Wide model, MODEL_PROCESSES=1 at least the default's req/s with one model copy: best "
                     f"`{name}` {fmt(rps)} against `{REFERENCE}`'s {fmt(default)} ({_ratio(rps, default)}×): "
                     f"{'met' if rps and default and rps >= default else 'not met'}.")
    return lines


def write_page(out: Path, results: Sequence[Measured], *, argv: Sequence[str], options: argparse.Namespace,
               layouts: Sequence[Layout], started_at: str, elapsed_s: float, machine: dict[str, str],
               found_versions: dict[str, str]) -> None:
    command = " ".join([COMMAND, *without_flags(argv, ("--out", "--work-dir", "--pytriton-python"))])
    lines = [
        "# Model processes beside the default and PyTriton", "",
        f"Made by `{command}` on {started_at}, in {elapsed_s / 60:.0f} minutes"
        + (" (PyTriton from `.venv-pytriton`: [v2 beside PyTriton](benchmarks.md#v2-beside-pytriton))."
           if any(layout.name == PYTRITON for layout in layouts) else "."), "",
        f"Each layout serves the same model, built from fixed seeds, and is loaded by wrk: a closed loop of "
        f"{CONNECTIONS} connections ({options.wrk_threads} wrk thread{'s' if options.wrk_threads > 1 else ''}) for "
        f"{options.duration:g} s after {options.warmup:g} s of warm-up, each request one row of {FEATURES:,} float32 "
        f"numbers as v2 JSON (`POST /v2/models/{MODEL}/infer`; PyTriton speaks only v2). Our server runs with its "
        "defaults (THREADS, batching, gRPC port open) but for WORKERS and MODEL_PROCESSES; PyTriton as "
        "scripts/pytriton_server.py starts it (dynamic batcher, no queue delay, the same largest batch). Server CPU is "
        "user + system time over the load of every process of the server (Gunicorn's master and workers, the "
        "supervisor and model process; PyTriton's Python process, tritonserver and its Python stub), per request. "
        "RSS is the resident memory of all those processes added up as the load ended (shared pages counted once per "
        "process: an upper bound, the same way for every layout). Mean batch rows: the server's own /metrics over the "
        "load. Rounds run the layouts in alternating order (forward, then backward), so that drift shows. A load "
        "with any non-2xx answer or socket error is refused, and its row says so.", "",
        "## Machine", "", *markdown_table(("", ""), machine.items()), "",
        "## Versions", "", *markdown_table(("", ""), found_versions.items()), "",
        "## Targets (issue #31)", "", *targets(results, options.models), ""]
    for model in options.models:
        lines += [f"## The {model} model", "", f"{MODELS[model]}.", "",
                  *model_tables(results, model, layouts, options.rounds), ""]
    out.write_text("\n".join(lines))


def pytriton_version(python: Path) -> str:
    try:
        return subprocess.run([str(python), "-c", "from importlib.metadata import version; "
                               "print(version('nvidia-pytriton'))"], capture_output=True, text=True,
                              timeout=60, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not found"


def wrk_version() -> str:
    done = subprocess.run(["wrk", "--version"], capture_output=True, text=True)
    return (done.stdout + done.stderr).split(" Copyright")[0].replace("wrk ", "", 1).strip()


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=30, help="seconds of load per layout (default 30)")
    parser.add_argument("--warmup", type=float, default=3, help="seconds of unmeasured load first (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every layout, order alternating (default 2)")
    parser.add_argument("--models", type=lambda text: text.split(","), default=list(MODELS),
                        help="comma-separated, of tiny and wide (default both)")
    parser.add_argument("--layouts", type=lambda text: text.split(","), default=[layout.name for layout in LAYOUTS],
                        help=f"comma-separated, of {', '.join(LAYOUTS_BY_NAME)} (default all)")
    parser.add_argument("--wrk-threads", type=int, default=1, help="wrk's threads (default 1)")
    parser.add_argument("--pytriton-python", type=Path, default=PYTRITON_PYTHON,
                        help="the Python of PyTriton's own virtualenv (default .venv-pytriton/bin/python)")
    parser.add_argument("--out", type=Path, default=OUT, help="the page to write (default %(default)s)")
    parser.add_argument("--work-dir", type=Path, help="logs, wrk outputs and results.json (default: a temporary one)")
    parser.add_argument("--server-start-timeout", type=float, default=300)
    parser.add_argument("--build-models", type=Path, help=argparse.SUPPRESS)  # the child's side
    args = parser.parse_args(argv)
    unknown = [name for name in args.models if name not in MODELS]
    unknown += [name for name in args.layouts if name not in LAYOUTS_BY_NAME]
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)}")
    if PYTRITON in args.layouts and not args.pytriton_python.exists() and not args.build_models:
        parser.error(f"{args.pytriton_python} is missing: make it (docs/benchmarks.md, v2 beside PyTriton), "
                     f"or leave {PYTRITON} out of --layouts")
    return args


def main(argv: Sequence[str]) -> int:
    options = parse_args(argv)
    if options.build_models:
        build_models(options.build_models, options.models)
        return 0
    # SIGTERM as SystemExit, so that the finally blocks stop the servers too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.monotonic()
    started_at = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = machine_facts()  # the load average at the start, before anything of this run
    found_versions = {**versions(), "wrk": wrk_version()}
    found_versions.pop("locust", None)
    if PYTRITON in options.layouts:
        found_versions["nvidia-pytriton"] = pytriton_version(options.pytriton_python)
    layouts = [layout for layout in LAYOUTS if layout.name in options.layouts]
    results: list[Measured] = []
    with tempfile.TemporaryDirectory(prefix="process-bench-") as temporary:
        work_dir = options.work_dir or Path(temporary)
        work_dir.mkdir(parents=True, exist_ok=True)
        log(f"building {', '.join(options.models)} in a child process")
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        with open(work_dir / "build.log", "wb") as output:
            subprocess.run([sys.executable, __file__, "--build-models", str(work_dir), "--models",
                            ",".join(options.models)], cwd=REPO, env=env, check=True,
                           stdout=output, stderr=subprocess.STDOUT, timeout=900)
        body = work_dir / "body.json"
        body.write_bytes(infer_body(np.load(work_dir / "row.npy")))
        for model in options.models:
            model_path = str(work_dir / f"{model}.keras")
            expected = np.load(work_dir / f"{model}-expected.npy")
            for number in range(1, options.rounds + 1):
                order = layouts if number % 2 else layouts[::-1]
                for layout in order:
                    tag = f"{model}-{layout.name}-round{number}"
                    if layout.name == PYTRITON:
                        server: Server = PyTritonServer(python=options.pytriton_python, model_path=model_path,
                                                        log_path=work_dir / f"{tag}.log")
                    else:
                        server = our_server(layout, model_path, work_dir, tag)
                    results.append(measure(server, layout, model, number, body=body, expected=expected,
                                           options=options, work_dir=work_dir, tag=tag))
                    (work_dir / "results.json").write_text(
                        json.dumps([dataclasses.asdict(r) for r in results], indent=1))
        options.out.parent.mkdir(parents=True, exist_ok=True)
        write_page(options.out, results, argv=argv, options=options, layouts=layouts, started_at=started_at,
                   elapsed_s=time.monotonic() - started, machine=machine, found_versions=found_versions)
    print(options.out.read_text())
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
