"""Worker memory and other clients' latency while clients send the largest bodies allowed.

For each configuration a real `gunicorn -c gunicorn.conf.py wsgi:app` (one worker) is
started on loopback; then, for `--duration` seconds each:

1. quiet: `--clients` closed-loop clients send one-row predicts; their latency is the baseline;
2. attack: the same clients, while `--attackers` clients send, without pause, bodies of
   exactly MAX_REQUEST_BYTES and of MAX_REQUEST_BYTES + 1 in turn (valid JSON rows, as many
   as fit: the most a body that passes the size check can make the server parse).

The worker's RSS is sampled every 20 ms. Configurations:

- `unlimited`: MAX_REQUEST_BYTES=16 MiB (the former default), LARGE_BODY_SLOTS=1000 (no limit
  on large bodies in practice): the server before this change;
- `slots`: MAX_REQUEST_BYTES=16 MiB, LARGE_BODY_SLOTS at its default (2);
- `derived`: every limit at its default (MAX_REQUEST_BYTES derived from the model).

    python scripts/hostile_bodies.py [--model-path m.keras] [--duration 20] [--configs unlimited,slots,derived]

Prints a Markdown table. The attack stops early if the worker's RSS passes `--rss-cap-mb`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
CONFIGS = {
    "unlimited": {"MAX_REQUEST_BYTES": str(16 * MIB), "LARGE_BODY_SLOTS": "1000"},
    "slots": {"MAX_REQUEST_BYTES": str(16 * MIB)},
    "derived": {},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        inherited = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        self.env = {**inherited, "BIND": f"127.0.0.1:{self.port}", "TF_CPP_MIN_LOG_LEVEL": "2",
                    "READYZ_DETAIL": "true", "ACCESS_LOG": "false", **env}
        self.log_path = log_path

    def __enter__(self) -> Server:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app",
                                      "--workers=1"], cwd=REPO, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited; see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"gunicorn not ready; see {self.log_path}")
            try:
                answer = requests.get(self.url + "/readyz", timeout=10)
                if answer.status_code == 200:
                    self.worker = psutil.Process(answer.json()["pid"])
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)  # nothing to wait on but the port

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def max_request_bytes(self) -> int:
        # The 413's message names the limit: send one byte more than any limit could be.
        answer = requests.post(self.url + "/predict", data=b" " * (64 * MIB + 1), timeout=120,
                               headers={"Content-Type": "application/json"})
        return int(answer.json()["error"].split("larger than ")[1].split(" ")[0])


def body_of(size: int, features: int) -> bytes:
    """Valid JSON rows filling exactly `size` bytes (trailing spaces make up the rest)."""
    row = b"[" + b",".join([b"1.2345678"] * features) + b"]"
    head, tail = b'{"instances":[', b"]}"
    count = max(1, (size - len(head) - len(tail) + 1) // (len(row) + 1))
    body = head + b",".join([row] * count) + tail
    return body + b" " * (size - len(body))


def features_of(url: str) -> int:
    metadata = requests.get(url + "/v1/models/default/metadata", timeout=10).json()
    inputs = metadata["metadata"]["signature_def"]["signature_def"]["serving_default"]["inputs"]
    (spec,) = inputs.values()
    return int(spec["tensor_shape"]["dim"][-1]["size"])


def client(url: str, features: int, stop: threading.Event, latencies: list[float], errors: list[str]) -> None:
    body = {"instances": [[1.0] * features]}
    with requests.Session() as session:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                answer = session.post(url + "/predict", json=body, timeout=60)
                if answer.status_code != 200:
                    errors.append(str(answer.status_code))
            except requests.RequestException as exc:
                errors.append(type(exc).__name__)
            latencies.append(time.perf_counter() - started)


def attacker(url: str, bodies: list[bytes], stop: threading.Event, statuses: dict[str, int]) -> None:
    index = 0
    with requests.Session() as session:
        while not stop.is_set():
            try:
                answer = session.post(url + "/predict", data=bodies[index % len(bodies)], timeout=120,
                                      headers={"Content-Type": "application/json"})
                key = str(answer.status_code)
            except requests.RequestException as exc:
                key = type(exc).__name__
            statuses[key] = statuses.get(key, 0) + 1
            index += 1


def attack(url: str, bodies: list[bytes], attackers: int, stop: multiprocessing.synchronize.Event,
           results: multiprocessing.Queue) -> None:
    """The attackers, in a process of their own: their GIL is not the measuring clients'."""
    statuses: dict[str, int] = {}
    done = threading.Event()
    threads = [threading.Thread(target=attacker, args=(url, bodies, done, statuses)) for _ in range(attackers)]
    for thread in threads:
        thread.start()
    stop.wait()
    done.set()
    for thread in threads:
        thread.join()
    results.put(statuses)


def phase(server: Server, *, clients: int, attackers: int, bodies: list[bytes], features: int,
          duration_s: float, rss_cap: int) -> dict[str, object]:
    stop = threading.Event()
    latencies: list[float] = []
    errors: list[str] = []
    threads = [threading.Thread(target=client, args=(server.url, features, stop, latencies, errors))
               for _ in range(clients)]
    attack_stop = multiprocessing.Event()
    results: multiprocessing.Queue = multiprocessing.Queue()
    attackers_process = multiprocessing.Process(target=attack,
                                                args=(server.url, bodies, attackers, attack_stop, results))
    peak = server.worker.memory_info().rss
    if attackers:
        attackers_process.start()
    for thread in threads:
        thread.start()
    end = time.monotonic() + duration_s
    capped = False
    while time.monotonic() < end:
        try:
            peak = max(peak, server.worker.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        if peak > rss_cap:
            capped = True
            break
        stop.wait(0.02)
    stop.set()
    attack_stop.set()
    statuses = results.get() if attackers else {}
    for thread in threads:
        thread.join()
    if attackers:
        attackers_process.join()
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [float("nan")] * 99
    return {"requests": len(latencies), "p50_ms": quantiles[49] * 1000, "p99_ms": quantiles[98] * 1000,
            "errors": len(errors), "peak_rss_mb": peak / MIB, "attack_statuses": statuses, "capped": capped}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", help="MODEL_PATH for the servers; default: the built-in model")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--attackers", type=int, default=8)
    parser.add_argument("--rss-cap-mb", type=int, default=8000)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hostile-bodies-") as work:
        for name in args.configs.split(","):
            env = dict(CONFIGS[name])
            if args.model_path:
                env["MODEL_PATH"] = args.model_path
            with Server(env, Path(work) / f"gunicorn-{name}.log") as server:
                limit = server.max_request_bytes()
                features = features_of(server.url)
                bodies = [body_of(limit, features), body_of(limit + 1, features)]
                common = dict(clients=args.clients, bodies=bodies, features=features, duration_s=args.duration,
                              rss_cap=args.rss_cap_mb * MIB)
                quiet = phase(server, attackers=0, **common)
                attack = phase(server, attackers=args.attackers, **common)
                rows.append((name, limit, quiet, attack))
                print(f"{name}: limit {limit}, quiet {quiet}, attack {attack}", file=sys.stderr, flush=True)
    print("| config | MAX_REQUEST_BYTES | worker RSS quiet (MB) | peak RSS under attack (MB) | "
          "clients p50 / p99 quiet (ms) | p50 / p99 under attack (ms) | client errors | attack answers |")
    print("|---|---|---|---|---|---|---|---|")
    for name, limit, quiet, attack in rows:
        answers = ", ".join(f"{key}: {count}" for key, count in sorted(attack["attack_statuses"].items()))
        capped = " (stopped at the RSS cap)" if attack["capped"] else ""
        print(f"| {name} | {limit:,} | {quiet['peak_rss_mb']:.0f} | {attack['peak_rss_mb']:.0f}{capped} | "
              f"{quiet['p50_ms']:.0f} / {quiet['p99_ms']:.0f} | {attack['p50_ms']:.0f} / {attack['p99_ms']:.0f} | "
              f"{quiet['errors'] + attack['errors']} | {answers} |")


if __name__ == "__main__":
    main(sys.argv[1:])
