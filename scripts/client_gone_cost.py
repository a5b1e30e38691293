"""What the HTTP client_gone peek costs: a closed loop against the servers of two commits, in pairs.

    python scripts/client_gone_cost.py --base REF [--pairs 4] [--seconds 15] [--clients 8]

Both servers (this checkout's HEAD and REF, each exported to a temporary folder) run the
built-in default model with one worker and their defaults. They take turns: in each pair the
same closed loop of one-row requests runs against one, then the other, the order alternating
from pair to pair. Prints requests per second and median latency of every run. Nothing here
asserts a timing: the numbers are whatever this machine gives.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
BODY = {"instances": [[0.1, 0.2, 0.3, 0.4]]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def export(ref: str, folder: Path) -> Path:
    folder.mkdir()
    archive = subprocess.run(["git", "archive", ref], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def start(tree: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "BIND": f"127.0.0.1:{port}", "GRPC_BIND": f"127.0.0.1:{free_port()}",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app", "--workers=1"],
                            cwd=tree, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if requests.get(url + "/readyz", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server in {tree} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)  # nothing to wait on but the server's answer


def closed_loop(url: str, *, clients: int, seconds: float) -> tuple[float, float]:
    latencies: list[float] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client() -> None:
        mine = []
        with requests.Session() as session:
            while time.monotonic() < stop_at:
                began = time.perf_counter()
                session.post(url + "/predict", json=BODY, timeout=30).raise_for_status()
                mine.append(time.perf_counter() - began)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(latencies) / seconds, statistics.median(latencies) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare HEAD with")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        servers = {}
        try:
            for name, ref in (("base", args.base), ("head", "HEAD")):
                servers[name] = start(export(ref, Path(work) / name), Path(work) / f"{name}.log")
            for _, url in servers.values():
                closed_loop(url, clients=args.clients, seconds=3)  # warm the connections and the caches
            results: dict[str, list[tuple[float, float]]] = {"base": [], "head": []}
            for pair in range(args.pairs):
                for name in (("base", "head") if pair % 2 == 0 else ("head", "base")):
                    rate, median_ms = closed_loop(servers[name][1], clients=args.clients, seconds=args.seconds)
                    results[name].append((rate, median_ms))
                    print(f"pair {pair} {name}: {rate:.1f} req/s, median {median_ms:.2f} ms", flush=True)
            for name, runs in results.items():
                print(f"{name}: median of runs {statistics.median(r for r, _ in runs):.1f} req/s, "
                      f"{statistics.median(m for _, m in runs):.2f} ms")
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(60)


if __name__ == "__main__":
    main()
