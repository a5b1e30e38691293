"""How long HandleReloadConfigRequest takes with one worker and with two (docs/tf-serving.md).

    python scripts/reload_latency.py [--rounds 5]

Two servers of this checkout run side by side, one with one Gunicorn worker and one with two,
each serving TF Serving's half_plus_two test model (tests/tfs_models.py) as model `a`. A
round reloads each server twice: adding half_plus_three as `b` (a load and a warm-up in every
worker), then removing it (an unload, with drain). The servers take turns, the order
alternating from round to round, so both see the same load from whatever else the machine
runs. Prints each call's wall time and the medians. Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from google.protobuf import text_format
from tensorflow_serving.apis import model_management_pb2, model_service_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import Server  # noqa: E402  (a real `gunicorn -c gunicorn.conf.py wsgi:app`)
from tests.tfs_models import VERSION, save_half_plus_three_tf1, save_half_plus_two_tf1  # noqa: E402


def config_text(models: dict[str, Path]) -> str:
    entries = " ".join(f'config {{ name: "{name}" base_path: "{path}" model_platform: "tensorflow" }}'
                       for name, path in models.items())
    return f"model_config_list {{ {entries} }}"


def reload_seconds(server: Server, text: str) -> float:
    request = model_management_pb2.ReloadConfigRequest()
    text_format.Parse(text, request.config)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        started = time.perf_counter()
        response = stub.HandleReloadConfigRequest(request, timeout=300)
        took = time.perf_counter() - started
    if response.status.error_code != 0:
        raise RuntimeError(f"reload failed: {response.status.error_message}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="reload-latency-") as folder:
        root = Path(folder)
        models = {"a": root / "two", "b": root / "three"}
        save_half_plus_two_tf1(models["a"] / f"{VERSION:08d}")
        save_half_plus_three_tf1(models["b"] / f"{VERSION:08d}")
        start = root / "models.config"
        start.write_text(config_text({"a": models["a"]}))
        env = {"MODEL_CONFIG": str(start), "MODEL_POLL_SECONDS": "0"}
        servers = {workers: Server(root, env).start(workers=workers) for workers in (1, 2)}
        times: dict[tuple[int, str], list[float]] = {key: [] for key in
                                                     [(w, kind) for w in servers for kind in ("add", "remove")]}
        try:
            for round_number in range(args.rounds):
                order = list(servers) if round_number % 2 == 0 else list(reversed(servers))
                for workers in order:
                    added = reload_seconds(servers[workers], config_text(models))
                    removed = reload_seconds(servers[workers], config_text({"a": models["a"]}))
                    times[(workers, "add")].append(added)
                    times[(workers, "remove")].append(removed)
                    print(f"round {round_number + 1}, {workers} worker(s): add b {added:.3f} s, "
                          f"remove b {removed:.3f} s", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    print("\n| workers | add b, median (s) | remove b, median (s) |\n|---|---|---|")
    for workers in servers:
        print(f"| {workers} | {statistics.median(times[(workers, 'add')]):.3f} | "
              f"{statistics.median(times[(workers, 'remove')]):.3f} |")


if __name__ == "__main__":
    main()
