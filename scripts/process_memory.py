"""Resident memory of a whole server (master, workers, supervisor, model processes), per layout.

    .venv/bin/python scripts/process_memory.py --model-path MODEL [--workers 1,2,4]

Each layout is started as a real server (scripts/live_server.py), sent one request so that
every lazy import has happened, and measured: the resident set of each process and their
sum. Forked workers share the master's pages until they write them, so the sum counts those
shared pages once per process: an upper bound, the same way for both modes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.live_server import LiveServer  # noqa: E402


def role(process: psutil.Process, master: int) -> str:
    command = " ".join(process.cmdline())
    if process.pid == master:
        return "master"
    for module, name in (("app.model_process.server", "model process"), ("app.model_process.supervisor",
                                                                          "supervisor")):
        if module in command:
            return name
    return "worker"


def measure(model_path: str, workers: int, model_processes: int, log_dir: Path) -> dict[str, float]:
    server = LiveServer(log_dir, {"MODEL_PATH": model_path, "MODEL_PROCESSES": str(model_processes),
                                  "GRPC_BIND": ""})
    server.start(workers=workers)
    try:
        features = requests.get(server.url + "/v1/models/default/metadata", timeout=30).json()
        inputs = features["metadata"]["signature_def"]["signature_def"]["serving_default"]["inputs"]
        width = int(next(iter(inputs.values()))["tensor_shape"]["dim"][1]["size"])
        answer = requests.post(server.url + "/predict", json={"instances": [[0.0] * width]}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert server.proc is not None
        sizes: dict[str, float] = {}
        for process in server.processes():
            name = role(process, server.proc.pid)
            sizes[name] = sizes.get(name, 0.0) + process.memory_info().rss / 2**20
        return sizes
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--workers", default="1,2,4")
    args = parser.parse_args()
    print("| layout | master | workers (all) | supervisor | model process | all processes |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for model_processes in (0, 1):
            for workers in (int(part) for part in args.workers.split(",")):
                sizes = measure(args.model_path, workers, model_processes, Path(folder))
                label = f"{workers} worker(s)" + (", 1 model process" if model_processes else ", default")
                cells = [f"{sizes.get(name, 0.0):.0f} MiB" if name in sizes else "–"
                         for name in ("master", "worker", "supervisor", "model process")]
                print(f"| {label} | {' | '.join(cells)} | {sum(sizes.values()):.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
