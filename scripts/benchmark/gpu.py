"""The wide model on Keras's JAX backend on one GPU: the model alone, then served under load.
`python -m scripts.benchmark gpu --out results/`, on a host with JAX's CUDA build.

1. The model alone: app.core.models' jitted predict (host copies included) at B = 1 .. 256.
2. Served: MODEL_PROCESSES=1 (one model process holds the GPU), WORKERS workers, REST and v2
   only (gRPC needs TensorFlow's protos), GPU_MEMORY_LIMIT_MB as the cap. A local generator
   (processes x threads, one keep-alive connection each, one row per request) runs closed loops
   at each client count: req/s, p50, p99; rows per predict call from /metrics; the GPU memory
   nvidia-smi reports against the cap. Answers are checked against the model alone first.
Writes gpu_jax.json under --out and prints a summary. `--small` sizes it for a CPU check.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import http.client
import json
import multiprocessing
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import requests

from .common import WIDE_MODEL, Config, MetricSnapshot, Server, run_child
from .layouts import LAYOUTS_BY_NAME, check_answer, infer_body, predict_body

SMALL = WIDE_MODEL | {"width": 256}
SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def check_rows() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(3, 1024)).astype("float32")


def save_model_alone(path: str, out: str, budget_s: float, small: bool) -> None:
    """Build and save the model, then time it: run in a process of its own, so that its JAX client
    (and the GPU memory JAX takes by default) is gone before the server's starts."""
    from app.core.models import build_default_model, example_batch, load_model

    from .experiment import time_calls

    build_default_model(**(SMALL if small else WIDE_MODEL)).save(path)
    model = load_model(path, name="wide")
    rows = []
    for size in SIZES:
        batch = example_batch(model, size)
        batch["features"] = np.random.default_rng(size).normal(size=batch["features"].shape).astype("float32")
        timing = time_calls(functools.partial(model.predict, batch), budget_s=budget_s, batch_size=size,
                            max_calls=10**6)
        rows.append({"batch": size, "calls": timing.calls, "median_ms": round(timing.median_ms, 3),
                     "rows_per_s": round(timing.items_per_s)})
    expected = model.predict({"features": check_rows()})["scores"]
    Path(out).write_text(json.dumps({"timings": rows, "check": expected.tolist()}))


def _client(url: str, body: bytes, until: float, latencies: list[float], errors: list[str]) -> None:
    host, port = url.split("//")[1].split(":")
    connection = None
    while time.perf_counter() < until:
        started = time.perf_counter()
        try:
            connection = connection or http.client.HTTPConnection(host, int(port), timeout=60)
            connection.request("POST", "/v1/models/wide:predict", body, {"Content-Type": "application/json"})
            answer = connection.getresponse()
            answer.read()
        except (OSError, http.client.HTTPException) as exc:
            errors.append(type(exc).__name__)
            connection = None  # a fresh connection for the next request
            continue
        if answer.status == 200:
            latencies.append(time.perf_counter() - started)
        else:
            errors.append(str(answer.status))


def _generator_process(args: tuple) -> tuple[list[float], list[str]]:
    url, body, threads, until = args
    latencies: list[float] = []
    errors: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: _client(url, body, until, latencies, errors), range(threads)))
    return latencies, errors


def _imported(started: Any) -> None:
    """A generator process's first call: unpickling it imports this module, which must not eat into the load."""
    started.wait()


def load(url: str, body: bytes, clients: int, seconds: float, processes: int) -> dict:
    shares = [clients // processes + (index < clients % processes) for index in range(processes)]
    context = multiprocessing.get_context("spawn")
    started = context.Barrier(processes + 1)
    with context.Pool(processes, initializer=_imported, initargs=(started,)) as pool:
        started.wait()  # every process started and this module imported before the clock runs
        until = time.perf_counter() + seconds  # CLOCK_MONOTONIC: one clock for every process
        parts = pool.map(_generator_process, [(url, body, share, until) for share in shares if share])
    latencies = np.array([value for part, _ in parts for value in part])
    errors = [error for _, part in parts for error in part]
    return {"clients": clients, "seconds": seconds, "requests": len(latencies), "errors": len(errors),
            "req_per_s": round(len(latencies) / seconds, 1),
            "p50_ms": round(float(np.percentile(latencies, 50)) * 1e3, 2) if len(latencies) else None,
            "p99_ms": round(float(np.percentile(latencies, 99)) * 1e3, 2) if len(latencies) else None}


def gpu_memory() -> dict:
    query = ["nvidia-smi", "--query-gpu=name,memory.used,memory.total", "--format=csv,noheader,nounits"]
    apps = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        name, used, total = subprocess.run(query, capture_output=True, text=True, check=True).stdout.split(",")
        per_process = subprocess.run(apps, capture_output=True, text=True, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.CalledProcessError, ValueError):
        return {}
    return {"gpu": name.strip(), "used_mib": int(used), "total_mib": int(total), "processes_mib": per_process}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-jax-results")))
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--clients", default="32,128,256")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--cap-mb", default="8192")
    parser.add_argument("--max-batch", default="128")
    parser.add_argument("--small", action="store_true", help="a narrow model and short runs: a CPU check")


def run(args: argparse.Namespace) -> int:
    os.environ["KERAS_BACKEND"] = "jax"  # the model-alone child's too
    args.out.mkdir(parents=True, exist_ok=True)
    path, alone_path = str(Path(tempfile.mkdtemp(prefix="gpu-jax-")) / "wide.keras"), args.out / "model_alone.json"
    results: dict = {"model": "small" if args.small else "wide", "idle": gpu_memory()}
    run_child("scripts.benchmark.gpu:save_model_alone", args.out / "model_alone.log", path=path, out=str(alone_path),
              budget_s=0.3 if args.small else 1.0, small=args.small)
    alone = json.loads(alone_path.read_text())
    results["alone"], expected = alone["timings"], np.array(alone["check"], dtype=np.float32)
    env = {"MODEL_PATH": path, "MODEL_NAME": "wide", "MODEL_PROCESSES": "1", "GRPC_BIND": "",
           "GPU_MEMORY_LIMIT_MB": args.cap_mb, "MAX_BATCH_SIZE": args.max_batch, "MAX_QUEUE_ROWS": "1024",
           "ACCESS_LOG": "false", "KERAS_BACKEND": "jax"}
    server = Server(Config("gpu", args.workers, env, "JAX"), model_path=None, log_path=args.out / "server.log")
    started = time.perf_counter()
    with server.running(workers=args.workers):
        results["server"] = {**env, "workers": args.workers, "ready_s": round(time.perf_counter() - started, 1)}
        rows, json_type = check_rows(), {"Content-Type": "application/json"}
        results["readyz"] = requests.get(server.url + "/readyz", timeout=30).json().get("tensorflow")
        # Each answer against the model alone's: the largest difference; one past float32 rounding raises.
        results["check"] = {name: check_answer(LAYOUTS_BY_NAME[layout], server.url + path, body, json_type, expected)
                            for name, layout, path, body in (
                                ("v1 max diff", "predict-1w", "/v1/models/wide:predict", predict_body(rows)),
                                ("v2 max diff", "default-1w", "/v2/models/wide/infer", infer_body(rows)))}
        body = json.dumps({"instances": rows[:1].tolist()}).encode()
        results["load"] = []
        for clients in [int(count) for count in args.clients.split(",")]:
            before = (server.metrics() or MetricSnapshot()).calls
            level = load(server.url, body, clients, args.seconds, min(8, clients))
            calls = (server.metrics() or MetricSnapshot()).calls - before
            level["rows_per_call"] = round(level["requests"] / calls, 2) if calls else None
            level["gpu"] = gpu_memory()
            results["load"].append(level)
            print(f"{clients:>4} clients: {level['req_per_s']} req/s, p50 {level['p50_ms']} ms, p99 {level['p99_ms']} "
                  f"ms, {level['rows_per_call']} rows/call, errors {level['errors']}, gpu "
                  f"{level['gpu'].get('used_mib')}/{level['gpu'].get('total_mib')} MiB (cap {args.cap_mb})", flush=True)
    (args.out / "gpu_jax.json").write_text(json.dumps(results, indent=1))
    print("model alone (B, ms, rows/s):", [(row["batch"], row["median_ms"], row["rows_per_s"])
                                           for row in results["alone"]])
    print("check:", results["check"], "readyz:", results["readyz"])
    print(*[line for line in server.log().splitlines() if "configured in pid" in line or "JAX backend" in line],
          sep="\n")
    return 0
