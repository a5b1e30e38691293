"""The cost of MODEL_PROCESSES' hand-off per request: a worker's link to a model process against
the same batcher called in-process.

Both sides run the real code (app/model_process: link, wire, arena, the model process's
connection handler) around a real Batcher whose predict function returns its input, so
that what differs between the two rows is the hand-off alone: packing into shared memory,
one frame each way over a Unix socket, the reader thread, and copying the outputs out. The
model process side runs in a forked child (no TensorFlow is involved, so forking is safe).

    .venv/bin/python scripts/handoff_cost.py [--requests 2000]

Requests are sequential (one in flight), so the latency is the hand-off's own; CPU is each
process's user + system time over the run, divided by the requests.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.batching import Batcher  # noqa: E402
from app.model_process.client import RemoteModels, RemoteRegistry  # noqa: E402
from app.model_process.link import ModelProcessLink  # noqa: E402
from app.model_process.server import WorkerConnection  # noqa: E402
from app.models import LoadedModel, TensorInfo  # noqa: E402
from app.registry import ModelRegistry, Servable  # noqa: E402

SHAPES = ((1, 4), (1, 1024), (32, 1024))


def echo_registry(width: int) -> ModelRegistry:
    row = TensorInfo("x", (width,), np.dtype(np.float32), "DT_FLOAT")
    out = TensorInfo("y", (width,), np.dtype(np.float32), "DT_FLOAT")
    model = LoadedModel("echo", 1, "echo", [row], [out], lambda tensors: {"y": tensors["x"]})
    registry = ModelRegistry("echo")
    registry.add(Servable(model, {"serving_default": Batcher(model.predict, name="echo", max_batch_size=32)}))
    return registry


def serve(listener: socket.socket, width: int) -> None:
    """The model process's side, in the forked child: one connection, served until it closes."""
    registry = echo_registry(width)
    sock, _ = listener.accept()
    WorkerConnection(sock, registry, 32 << 20).serve()
    os._exit(0)


def timed(call, count: int) -> tuple[list[float], float]:
    latencies = []
    cpu_start = time.process_time()
    for _ in range(count):
        start = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - start)
    return latencies, time.process_time() - cpu_start


def measure(shape: tuple[int, int], count: int) -> dict[str, float]:
    rows = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    local = echo_registry(shape[1])
    servable = local.get("echo")
    local_latencies, local_cpu = timed(lambda: local.predict(servable, {"x": rows}, timeout_s=10), count)
    local.close()

    path = os.path.join(tempfile.mkdtemp(), "echo.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)  # before the fork: the parent's connect waits in the backlog, not in a poll
    child = os.fork()
    if child == 0:
        serve(listener, shape[1])
    listener.close()
    registry = RemoteRegistry("")
    link = ModelProcessLink(path, arena_bytes=32 << 20, on_meta=lambda _meta: None)
    RemoteModels(registry, link).apply(link.connect())
    remote = registry.get("echo")
    answer = registry.predict(remote, {"x": rows}, timeout_s=10)[1]
    assert np.array_equal(answer.outputs["y"], rows)
    child_cpu = psutil.Process(child).cpu_times()
    remote_latencies, remote_cpu = timed(lambda: registry.predict(remote, {"x": rows}, timeout_s=10), count)
    child_after = psutil.Process(child).cpu_times()
    link.close()
    os.waitpid(child, 0)
    model_cpu = (child_after.user + child_after.system) - (child_cpu.user + child_cpu.system)
    return {
        "in_process_p50_us": statistics.median(local_latencies) * 1e6,
        "handoff_p50_us": statistics.median(remote_latencies) * 1e6,
        "handoff_p99_us": sorted(remote_latencies)[int(count * 0.99)] * 1e6,
        "in_process_cpu_us": local_cpu / count * 1e6,
        "worker_cpu_us": remote_cpu / count * 1e6,
        "model_process_cpu_us": model_cpu / count * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    print("| rows × floats | in-process p50 | hand-off p50 | hand-off p99 | CPU in-process | CPU worker + "
          "model process |")
    print("|---|---|---|---|---|---|")
    for shape in SHAPES:
        result = measure(shape, args.requests)
        print(f"| {shape[0]} × {shape[1]} | {result['in_process_p50_us']:.0f} µs | {result['handoff_p50_us']:.0f} µs "
              f"| {result['handoff_p99_us']:.0f} µs | {result['in_process_cpu_us']:.0f} µs "
              f"| {result['worker_cpu_us']:.0f} + {result['model_process_cpu_us']:.0f} µs |")


if __name__ == "__main__":
    main()
