"""Servers side by side under one load generator (wrk): the model-processes, peers and floor scenarios.

PyTriton is Triton's server and dynamic batcher around a compiled tf.function (scripts/pytriton_server.py,
from a virtualenv of its own: --pytriton-python); the small Flask batcher is scripts/floor_app.py: Flask
and one model thread under the same Gunicorn configuration, fixed answers. Every layout serves the same
saved Keras model, built from fixed seeds; wrk loads each in a closed loop, one row per request, over
v2 REST infer unless its name says otherwise (the Flask batcher: TF Serving's REST /predict). Each answer
to that very request is first checked against the Keras model's own output (but the Flask batcher's); a
load with any non-2xx answer or socket error is refused, not reported. Server CPU and resident memory are
those of the server's whole process tree. Rounds run the layouts in alternating order, so that drift shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import requests

from app.ops.settings import Settings

from . import common
from .common import DOCS, FLOOR_APP, REPO, WIDE_MODEL, Config, Server, fmt, log, markdown_table, mean, ratio
from .load import WrkResult, run_h2load, run_wrk

PYTRITON_PYTHON = REPO / ".venv-pytriton" / "bin" / "python"
PYTRITON_SCRIPT = REPO / "scripts" / "pytriton_server.py"
MODEL = "default"
FEATURES = WIDE_MODEL["features"]
MODELS = {"tiny": f"{FEATURES:,} floats in, one Dense(3) layer: almost no compute, what lies around the model "
                  "is measured", "wide": common.WIDE_MODEL_NAME}
REFERENCE = "default-1w"
PYTRITON, FLASK, FLOOR_BATCHER = "pytriton", "flask-batcher", "floor-batcher"


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    workers: int
    model_processes: int  # 0: the default, a model copy per worker
    what: str
    protocol: str = "v2"  # v2 (JSON), v2-binary, predict (TF Serving REST) or grpc (TF Serving's Predict)


LAYOUTS = [
    *(Layout(f"default-{n}w", n, 0, f"default, {n} worker{'s' if n > 1 else ''}") for n in (1, 2, 4)),
    *(Layout(f"procs-{n}w", n, 1, f"MODEL_PROCESSES=1, {n} worker{'s' if n > 1 else ''}") for n in (1, 2, 4)),
    Layout(PYTRITON, 1, 0, "PyTriton"),
    Layout(FLASK, 1, 0, "the small Flask batcher: the floor", "predict"),
    Layout(FLOOR_BATCHER, 1, 0, "the floor with the server's Batcher as its model thread", "predict"),
    Layout("predict-1w", 1, 0, "default, 1 worker, TF Serving REST /predict", "predict"),
    Layout("binary-1w", 1, 0, "default, 1 worker, v2 binary tensors", "v2-binary"),
    Layout("grpc-1w", 1, 0, "default, 1 worker, TF Serving gRPC Predict (h2load)", "grpc"),
    Layout("pytriton-binary", 1, 0, "PyTriton, v2 binary tensors", "v2-binary"),
]
LAYOUTS_BY_NAME = {layout.name: layout for layout in LAYOUTS}
# scenario: (title, page, layouts, models, the layouts each other is divided by)
SCENARIOS = {
    "model-processes": ("Model processes beside the default and PyTriton", DOCS / "model-processes-benchmark.md",
                        [layout.name for layout in LAYOUTS[:7]], list(MODELS), [REFERENCE]),
    "peers": ("This server beside PyTriton and the small Flask batcher", DOCS / "peers-benchmark.md",
              [REFERENCE, PYTRITON, FLASK], ["wide"], [REFERENCE]),
    "floor": ("The request path beside its floors and PyTriton", DOCS / "floor-benchmark.md",
              ["predict-1w", REFERENCE, "binary-1w", "grpc-1w", FLASK, FLOOR_BATCHER, PYTRITON, "pytriton-binary"],
              list(MODELS), [FLASK, FLOOR_BATCHER, PYTRITON]),
}


class PeerServer(Server):
    """A peer's server (not Gunicorn) on a free loopback port; ready once GET `ready_path` answers 200."""

    ready_path = "/"

    def wait_ready(self, *, workers: int = 1, within_s: float = 300) -> set[int]:
        assert self.proc is not None
        name, deadline = self.config.what, time.monotonic() + within_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready within {within_s} s:\n{self.log()[-3000:]}")
            try:
                if requests.get(self.url + self.ready_path, timeout=10).status_code == 200:
                    return {self.proc.pid}
            except requests.ConnectionError:
                pass
            time.sleep(0.5)  # nothing listens yet, or the model still loads: there is no event to wait on

    def metrics(self) -> None:
        return None  # a peer's batch figures are not this server's /metrics


class PyTritonServer(PeerServer):
    """scripts/pytriton_server.py on free loopback ports; ready once its model answers ready over v2."""

    ready_path = f"/v2/models/{MODEL}/ready"

    def __init__(self, *, python: Path, model_path: str, log_path: Path, name: str = PYTRITON) -> None:
        super().__init__(Config(name, 1, {}, "PyTriton"), model_path=model_path, log_path=log_path)
        self.python, self.model_path = python, model_path

    def command(self, *, workers: int = 1) -> list[str]:
        return [str(self.python), str(PYTRITON_SCRIPT), "--model-path", self.model_path, "--model-name", MODEL,
                "--http-port", str(self.port), "--grpc-port", self.grpc_target.rsplit(":", 1)[1],
                "--max-batch-size", str(Settings().max_batch_size)]


def layout_server(layout: Layout, args: argparse.Namespace, model_path: str, log_path: Path) -> Server:
    if layout.name.startswith(PYTRITON):
        return PyTritonServer(python=args.pytriton_python, model_path=model_path, log_path=log_path)
    if layout.name in (FLASK, FLOOR_BATCHER):
        env = {"GRPC_BIND": ""} | ({"FLOOR_BATCHER": "true"} if layout.name == FLOOR_BATCHER else {})
        return Server(Config(layout.name, 1, env, layout.what, app=FLOOR_APP), model_path=model_path,
                      log_path=log_path)
    env = {"MODEL_PROCESSES": str(layout.model_processes)} if layout.model_processes else {}
    return Server(Config(layout.name, layout.workers, env, layout.what), model_path=model_path, log_path=log_path)


@dataclasses.dataclass
class Measured:
    model: str
    layout: str
    round: int
    check_difference: float | None = None
    requests: int | None = None
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    cpu_ms_per_request: float | None = None
    rss_mib: float | None = None
    batch_rows: float | None = None
    wrk_cores: float | None = None
    other_cores: float | None = None  # CPU of processes other than the server's and wrk's
    error: str | None = None


def infer_body(rows: np.ndarray) -> bytes:
    """The v2 JSON request for `rows`: one FP32 input, numbers as wrk sends them."""
    return json.dumps({"inputs": [{"name": "features", "shape": list(rows.shape), "datatype": "FP32",
                                   "data": [float(value) for value in rows.reshape(-1)]}]}).encode()


def predict_body(rows: np.ndarray) -> bytes:
    """The same rows as TF Serving's REST /predict takes them."""
    return json.dumps({"instances": [[float(value) for value in row] for row in rows]}).encode()


def binary_body(rows: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """The same rows as a v2 binary request (the answer stays JSON), and its headers."""
    header = json.dumps({"inputs": [{"name": "features", "shape": list(rows.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": rows.nbytes}}]}).encode()
    return header + rows.astype("<f4").tobytes(), {"Content-Type": "application/octet-stream",
                                                    "Inference-Header-Content-Length": str(len(header))}


def grpc_body(rows: np.ndarray) -> bytes:
    """The same rows as a gRPC message (length-prefixed) of TF Serving's PredictRequest."""
    from tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name = MODEL
    tensor = request.inputs["features"]
    tensor.dtype, tensor.tensor_content = 1, rows.astype("<f4").tobytes()  # 1: DT_FLOAT
    tensor.tensor_shape.dim.add().size, tensor.tensor_shape.dim.add().size = rows.shape
    message = request.SerializeToString()
    return b"\0" + len(message).to_bytes(4, "big") + message


def answer_rows(layout: Layout, url: str, body: bytes, headers: dict[str, str]) -> np.ndarray:
    """The server's answer to `body`, sent once as the load will send it."""
    if layout.protocol == "grpc":
        import grpc
        from tensorflow_serving.apis import predict_pb2

        with grpc.insecure_channel(url.split("/")[2]) as channel:
            call = channel.unary_unary("/" + url.split("/", 3)[3],
                                       response_deserializer=predict_pb2.PredictResponse.FromString)
            tensor = next(iter(call(body[5:], timeout=60).outputs.values()))
        shape = [dim.size for dim in tensor.tensor_shape.dim]
        return (np.frombuffer(tensor.tensor_content, "<f4") if tensor.tensor_content else np.asarray(tensor.float_val,
                np.float32)).reshape(shape)
    answer = requests.post(url, data=body, headers=headers, timeout=60)
    if answer.status_code != 200:
        raise RuntimeError(f"check request: {answer.status_code} {answer.text[:500]}")
    if layout.protocol == "predict":
        return np.asarray(answer.json()["predictions"], dtype=np.float32)
    output = answer.json()["outputs"][0]
    return np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])


def check_answer(layout: Layout, url: str, body: bytes, headers: dict[str, str], expected: np.ndarray) -> float:
    """Send `body` once; the largest difference of the answer from the Keras model's output (0 when exact)."""
    got = answer_rows(layout, url, body, headers)
    if got.shape != expected.shape:
        raise RuntimeError(f"check request: shape {got.shape}, the model's {expected.shape}")
    difference = float(np.max(np.abs(got - expected)))
    if not np.allclose(got, expected, rtol=1e-5, atol=1e-6):
        raise RuntimeError(f"check request: answer differs from the model's by up to {difference:g}")
    return difference


def build_models(folder: str, names: list[str]) -> None:
    """The child's side: each model saved, with the row wrk sends and the model's own answer to it."""
    import keras
    import tensorflow as tf

    from app.core.models import build_default_model

    rng = np.random.default_rng(0)
    # Three decimals: what a client sends, and the same float32 whichever server parses it.
    row = np.array([float(f"{value:.3f}") for value in rng.standard_normal(FEATURES)], dtype=np.float32)[None, :]
    np.save(Path(folder) / "row.npy", row)
    for name in names:
        if name == "wide":
            model = build_default_model(**WIDE_MODEL)
        else:
            inputs = keras.Input((FEATURES,), name="features")
            scores = keras.layers.Dense(3, name="scores", kernel_initializer=keras.initializers.GlorotUniform(seed=0),
                                        bias_initializer=keras.initializers.RandomNormal(seed=1))(inputs)
            model = keras.Model(inputs, scores, name="default")
        model.save(Path(folder) / f"{name}.keras")
        np.save(Path(folder) / f"{name}-expected.npy", model(tf.constant(row), training=False).numpy())


LoadIt = Callable[[float, Path | None], tuple[WrkResult, float]]  # (seconds, log file) -> result, its CPU s
Snapshot = common.MetricSnapshot | None


def closed_loop(server: Server, result: Measured, load_it: LoadIt, *, warmup_s: float, duration_s: float, tag: str,
                work_dir: Path, quiet: bool = True) -> tuple[WrkResult, Snapshot, Snapshot]:
    """Warm a started server, wait until it is idle (unless `quiet` is false: a server that never idles), then one
    measured load; `result` gets its figures, and the caller refuses a load with errors. Returns the load and the
    /metrics snapshots around it."""
    if warmup_s > 0:
        load_it(warmup_s, None)
    if quiet:
        server.wait_quiet(within_s=60)
    metrics_before = server.metrics()  # outside the CPU window: the scrape is not part of the load
    cpu_before, busy_before = server.cpu_seconds(), common.busy_cpu_seconds()
    load, wrk_cpu_s = load_it(duration_s, work_dir / f"{tag}-load.txt")
    cpu_s = server.cpu_seconds() - cpu_before
    # What the rest of the machine took meanwhile: another tenant's tests make the figures lower.
    result.other_cores = max(0.0, common.busy_cpu_seconds() - busy_before - cpu_s - wrk_cpu_s) / load.duration_s
    result.rss_mib = server.rss_bytes() / 2**20
    metrics_after = server.metrics()
    result.requests, result.rps, result.p50_ms, result.p99_ms = load.requests, load.rps, load.p50_ms, load.p99_ms
    result.cpu_ms_per_request = cpu_s / load.requests * 1000 if load.requests else None
    result.wrk_cores = wrk_cpu_s / load.duration_s
    if metrics_before and metrics_after and metrics_after.calls > metrics_before.calls:
        result.batch_rows = (metrics_after.rows - metrics_before.rows) / (metrics_after.calls - metrics_before.calls)
    log(f"{tag}: {load.requests} requests, {load.rps:.0f} req/s, p50 {fmt(load.p50_ms)} ms, "
        f"{fmt(result.cpu_ms_per_request, 2)} ms CPU/request, {result.rss_mib:.0f} MiB, "
        f"other processes {result.other_cores:.2f} of a core")
    return load, metrics_before, metrics_after


def measure(server: Server, result: Measured, *, work_dir: Path, expected: np.ndarray, args: argparse.Namespace,
            tag: str) -> Measured:
    """Start, check, warm, load and stop one server."""
    layout = LAYOUTS_BY_NAME[result.layout]
    body, headers = work_dir / f"{layout.protocol}.body", {"Content-Type": "application/json"}
    if layout.protocol == "v2-binary":
        headers = json.loads((work_dir / "v2-binary.headers").read_text())
    url = server.url + ("/predict" if layout.protocol == "predict" else f"/v2/models/{MODEL}/infer")
    if layout.protocol == "grpc":
        url = f"http://{server.grpc_target}/tensorflow.serving.PredictionService/Predict"

    def load_it(duration_s: float, log_path: Path | None = None) -> tuple[Any, float]:
        if layout.protocol == "grpc":
            return run_h2load(url, body, duration_s=duration_s, connections=args.connections, log_path=log_path)
        return run_wrk(url, body, duration_s=duration_s, threads=args.wrk_threads, connections=args.connections,
                       log_path=log_path, headers=headers if layout.protocol == "v2-binary" else None)
    try:
        server.start(workers=server.config.workers, ready_within_s=args.server_start_timeout)
        if result.layout not in (FLASK, FLOOR_BATCHER):  # the floors answer a fixed row
            result.check_difference = check_answer(layout, url, body.read_bytes(), headers, expected)
        load, metrics_before, metrics_after = closed_loop(server, result, load_it, warmup_s=args.warmup,
                                                          duration_s=args.duration, tag=tag, work_dir=work_dir)
        served = metrics_after.rows - metrics_before.rows if metrics_before and metrics_after else 0.0
        if layout.protocol == "grpc" and served < load.requests:
            raise RuntimeError(f"refused: {served:.0f} rows served for {load.requests} gRPC calls h2load saw end (a "
                               "status trailer it cannot read)")
        if load.errors:
            raise RuntimeError(f"refused: {load.errors} in {load.requests} requests")
    except Exception as exc:  # one layout failing should not lose the others' numbers
        result.error = common.failure(exc, server)
        log(f"{tag}: {result.error}")
    finally:
        server.stop()
    return result


def model_tables(results: Sequence[Measured], model: str, layouts: Sequence[Layout], rounds: int,
                 references: Sequence[str] = (REFERENCE,)) -> list[str]:
    """Per model: the mean over rounds per layout, with its ratios to `references`, then every round's req/s."""
    mine = [result for result in results if result.model == model]

    def average(layout: str, field: str) -> float | None:
        return mean(getattr(r, field) for r in mine if r.layout == layout and r.error is None)

    refs = [(name, average(name, "rps"), average(name, "cpu_ms_per_request")) for name in references]
    summary = [(f"`{layout.name}`: {layout.what}", fmt(rps := average(layout.name, "rps")),
                *(ratio(rps, ref_rps, 2) for _, ref_rps, _ in refs), fmt(average(layout.name, "p50_ms")),
                fmt(average(layout.name, "p99_ms")), fmt(cpu := average(layout.name, "cpu_ms_per_request"), 2),
                *(ratio(cpu, ref_cpu, 2) for _, _, ref_cpu in refs), fmt(average(layout.name, "rss_mib"), 0),
                fmt(average(layout.name, "batch_rows")),
                f"{sum(1 for r in mine if r.layout == layout.name and r.error is None)} of {rounds}")
               for layout in layouts]
    over = [f"÷ {name}" for name, _, _ in refs]
    lines = ["Mean of the rounds; req/s and server CPU per request divided by those of "
             + ", ".join(f"`{name}`" for name in references) + ".", "",
             *markdown_table(("layout", "req/s", *over, "p50 ms", "p99 ms", "server CPU ms/request", *over,
                              "RSS all processes MiB", "mean batch rows", "rounds"), summary), "",
             "Every round's req/s: " + "; ".join(
                 f"`{layout.name}` " + ", ".join(fmt(r.rps) if r.error is None else "failed"
                                                 for r in mine if r.layout == layout.name) for layout in layouts) + "."]
    lines += [f"- `{r.layout}`, round {r.round}: {r.error}" for r in mine if r.error]
    if wrk_cores := [r.wrk_cores for r in mine if r.wrk_cores is not None]:
        lines += ["", f"wrk itself used {min(wrk_cores):.2f} to {max(wrk_cores):.2f} of a core over these loads."]
    if others := [r.other_cores for r in mine if r.other_cores is not None]:
        lines += [f"Other processes on the machine used {min(others):.2f} to {max(others):.2f} of a core meanwhile."]
    if differences := [r.check_difference for r in mine if r.check_difference is not None]:
        lines += [f"Before each load, the server's answer to the very request wrk sends was checked against the Keras "
                  f"model's own output: largest difference {max(differences):g} over {len(differences)} servers."]
    return lines


def add_arguments(parser: argparse.ArgumentParser, *, scenario: str) -> None:
    _, page, layouts, models, _ = SCENARIOS[scenario]
    add = parser.add_argument
    add("--duration", type=float, default=30, help="seconds of load per layout (default 30)")
    add("--warmup", type=float, default=3, help="seconds of unmeasured load first (default 3)")
    add("--rounds", type=int, default=2, help="runs of every layout, order alternating (default 2)")
    add("--models", type=common.names(list(MODELS)), default=models, help=f"comma-separated, of tiny and wide "
        f"(default {','.join(models)})")
    add("--layouts", type=common.names(list(LAYOUTS_BY_NAME)), default=layouts,
        help=f"comma-separated, of {', '.join(LAYOUTS_BY_NAME)} (default {','.join(layouts)})")
    add("--connections", type=int, default=32, help="wrk's connections (default 32)")
    add("--wrk-threads", type=int, default=1, help="wrk's threads (default 1)")
    add("--pytriton-python", type=Path, default=PYTRITON_PYTHON, help="the Python of PyTriton's own virtualenv")
    add("--out", type=Path, default=page, help="the page to write (default %(default)s)")
    add("--work-dir", type=Path, help="logs, wrk outputs and results.json (default: a temporary folder)")
    add("--server-start-timeout", type=float, default=300)


def run(args: argparse.Namespace) -> int:
    if any(name.startswith(PYTRITON) for name in args.layouts) and not args.pytriton_python.exists():
        raise SystemExit(f"{args.pytriton_python} is missing: make it, or leave {PYTRITON} out of --layouts")
    return common.run_scenario(args, SCENARIOS[args.scenario][0], lambda work_dir, machine: measure_all(
        args, work_dir, machine))


def measure_all(args: argparse.Namespace, work_dir: Path, machine: dict[str, str]) -> tuple[list[str], bool]:
    if any(name.startswith(PYTRITON) for name in args.layouts):
        done = subprocess.run([str(args.pytriton_python), "-c", "import importlib.metadata as m; "
                               "print(m.version('nvidia-pytriton'))"], capture_output=True, text=True, timeout=60)
        machine["nvidia-pytriton"] = done.stdout.strip() or "not found"
    machine["wrk"] = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split(" Copyright")[0]
    layouts = [layout for layout in LAYOUTS if layout.name in args.layouts]
    results: list[Measured] = []
    log(f"building {', '.join(args.models)} in a child process")
    common.run_child("scripts.benchmark.layouts:build_models", work_dir / "build.log", folder=str(work_dir),
                     names=args.models)
    row = np.load(work_dir / "row.npy")
    binary, headers = binary_body(row)
    for protocol, body in (("v2", infer_body(row)), ("predict", predict_body(row)), ("v2-binary", binary),
                           ("grpc", grpc_body(row) if any(LAYOUTS_BY_NAME[name].protocol == "grpc"
                                                            for name in args.layouts) else b"")):
        (work_dir / f"{protocol}.body").write_bytes(body)
    (work_dir / "v2-binary.headers").write_text(json.dumps(headers))
    for model in args.models:
        model_path, expected = str(work_dir / f"{model}.keras"), np.load(work_dir / f"{model}-expected.npy")
        for number in range(1, args.rounds + 1):
            for layout in layouts if number % 2 else layouts[::-1]:
                tag = f"{model}-{layout.name}-round{number}"
                server = layout_server(layout, args, model_path, work_dir / f"{tag}.log")
                results.append(measure(server, Measured(model, layout.name, number), work_dir=work_dir,
                                       expected=expected, args=args, tag=tag))
                (work_dir / "results.json").write_text(json.dumps([dataclasses.asdict(r) for r in results]))
    lines = [__doc__.split("\n\n", 1)[1].replace("\n", " ").strip(), "",
             f"wrk: {args.connections} connections, {args.wrk_threads} thread(s), {args.duration:g} s after "
             f"{args.warmup:g} s of warm-up; each request one row of {FEATURES:,} float32.", ""]
    for model in args.models:
        tables = model_tables(results, model, layouts, args.rounds, SCENARIOS[args.scenario][4])
        lines += [f"## The {model} model", "", f"{MODELS[model]}.", "", *tables, ""]
    return lines, any(r.error for r in results)
