"""What tracing costs a worker: CPU per request with TRACING off and on, closed loop (docs/tracing.md).

    python scripts/trace_cost.py                      # 3 pairs of runs, 8 users, 3000 requests each
    python scripts/trace_cost.py --profile            # also: py-spy on the worker while tracing is off

One Gunicorn worker serves a small dense model (tests/conftest.py's exact model: 4 features,
a predict costs little, so the request path's own cost shows); `--users` client threads send
one-row REST predictions back to back (no think time) over kept-alive connections. The
worker's CPU time (user + system, from /proc) over a run, divided by the requests it
answered, is its CPU per request. Runs go in pairs, off then on, so that both sides of a
pair see the same load from whatever else the machine runs. With tracing on, spans go over
OTLP/HTTP to a receiver in this script that answers and keeps nothing: its own CPU is not
the worker's.

--profile samples the worker with py-spy (PyPI) during an extra run with tracing off and
counts the samples with a frame of OpenTelemetry or app/tracing.py: there must be none.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.server
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import Server  # noqa: E402  (a real `gunicorn -c gunicorn.conf.py wsgi:app`)

BODY = {"instances": [[1.0, 2.0, 3.0, 4.0]]}


class _Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def worker_pid(server: Server) -> int:
    return requests.get(server.url + "/readyz", timeout=10).json()["pid"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def closed_loop(url: str, *, users: int, requests_total: int) -> float:
    """Send requests_total predictions from `users` threads, each back to back; returns seconds."""
    per_user = requests_total // users

    def user() -> None:
        with requests.Session() as session:
            for _ in range(per_user):
                answer = session.post(url + "/predict", json=BODY, timeout=60)
                answer.raise_for_status()

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(users) as pool:
        for done in [pool.submit(user) for _ in range(users)]:
            done.result()
    return time.perf_counter() - started


def measure(env: dict[str, str], work: Path, *, model: Path, users: int, requests_total: int, profile: bool = False) -> dict:
    server = Server(work, {"MODEL_PATH": str(model), "ACCESS_LOG": "false", **env})
    server.start()
    try:
        pid = worker_pid(server)
        closed_loop(server.url, users=users, requests_total=requests_total // 10)  # warm
        spy = None
        if profile:
            raw = work / f"profile-{pid}.txt"
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--format", "raw",
                                    "--rate", "200", "--nonblocking", "--output", str(raw)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1)  # py-spy attaches: nothing to poll for
        before = cpu_seconds(pid)
        seconds = closed_loop(server.url, users=users, requests_total=requests_total)
        used = cpu_seconds(pid) - before
        result = {"cpu_ms": used / requests_total * 1000, "req_s": requests_total / seconds}
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output as it stops on SIGINT
            spy.wait(30)
            stacks = [line for line in raw.read_text().splitlines() if line.strip()] if raw.exists() else []
            traced = [line for line in stacks if "opentelemetry" in line or "app/tracing.py" in line]
            result["profile"] = (sum(int(line.rsplit(" ", 1)[1]) for line in stacks),
                                 sum(int(line.rsplit(" ", 1)[1]) for line in traced))
        return result
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"
    with tempfile.TemporaryDirectory(prefix="trace-cost-") as folder:
        work = Path(folder)
        from tests.conftest import build_exact_model

        model = work / "exact.keras"
        build_exact_model().save(model)
        if args.profile:
            samples, traced = measure({}, work, model=model, users=args.users, requests_total=args.requests,
                                      profile=True)["profile"]
            print(f"tracing off, py-spy: {samples} samples, {traced} with a tracing frame")
        results: dict[str, list[dict]] = {"off": [], "on": []}
        for pair in range(args.pairs):
            for mode, env in (("off", {}), ("on", {"TRACING": "otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint})):
                result = measure(env, work, model=model, users=args.users, requests_total=args.requests)
                results[mode].append(result)
                print(f"pair {pair + 1} tracing {mode}: {result['cpu_ms']:.3f} CPU ms/request, "
                      f"{result['req_s']:.0f} req/s", flush=True)
    sink.shutdown()
    for mode, runs in results.items():
        print(f"tracing {mode}: median {statistics.median(r['cpu_ms'] for r in runs):.3f} CPU ms/request, "
              f"{statistics.median(r['req_s'] for r in runs):.0f} req/s")
    added = [on["cpu_ms"] - off["cpu_ms"] for off, on in zip(results["off"], results["on"])]
    print(f"added by tracing, per pair: {', '.join(f'{ms:+.3f}' for ms in added)} CPU ms/request "
          f"(median {statistics.median(added):+.3f})")


if __name__ == "__main__":
    main()
