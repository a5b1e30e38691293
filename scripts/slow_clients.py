"""Slow clients against nginx + Gunicorn, and against bare Gunicorn: what normal clients see.

    python scripts/slow_clients.py                       # 1,000 slow connections, about 2 minutes
    python scripts/slow_clients.py --connections 300 --duration 10

Three runs, each with a few normal clients sending one-row predictions in a closed loop
for --duration seconds, all on 127.0.0.1:
1. baseline: nginx (deploy/nginx/nginx.conf) in front of Gunicorn, no attack;
2. the same while --connections slow clients (half send their headers a byte a second,
   half their bodies) hold connections open, reopening any that nginx closes;
3. bare Gunicorn under the same attack, without nginx.
It prints a Markdown table of the normal clients' outcomes (answers, errors, p50/p99) for
docs/reliability.md. tests/test_nginx.py runs the same pieces, smaller. Nothing here
asserts a timing: the numbers are whatever this machine gives.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
NGINX_CONF = REPO / "deploy" / "nginx" / "nginx.conf"
# The slow clients' pace: one byte per connection per interval.
TRICKLE_INTERVAL_S = 1.0
# The workers' gRPC port behind nginx's gRPC front (GRPC_BIND in compose and Kubernetes).
GRPC_UPSTREAM_PORT = 8510


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def raise_fd_limit(needed: int) -> int:
    """Raise this process's soft descriptor limit toward `needed` (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ---------------------------------------------------------------------------- nginx


def render_nginx_conf(*, listen_port: int, upstream_port: int, temp_dir: Path, text: str | None = None,
                      overrides: dict[str, str] | None = None, grpc_listen_port: int | None = None,
                      grpc_upstream_port: int = GRPC_UPSTREAM_PORT) -> str:
    """The shipped config on loopback ports, its /tmp paths inside temp_dir.

    The gRPC front listens on `grpc_listen_port` (a free port if None) and passes to
    `grpc_upstream_port`. `overrides` replaces the value of a directive wherever it appears
    (e.g. {"proxy_read_timeout": "1s"}).
    """
    text = NGINX_CONF.read_text() if text is None else text
    replacements = {
        r"listen 8080;": f"listen 127.0.0.1:{listen_port};",
        r"server 127\.0\.0\.1:8000;": f"server 127.0.0.1:{upstream_port};",
        r"listen 8500 http2;": f"listen 127.0.0.1:{grpc_listen_port or free_port()} http2;",
        rf"server 127\.0\.0\.1:{GRPC_UPSTREAM_PORT};": f"server 127.0.0.1:{grpc_upstream_port};",
        r"/tmp/": f"{temp_dir}/",
        r"access_log /dev/stdout model_server;": f"access_log {temp_dir}/access.log model_server;",
    }
    for pattern, value in replacements.items():
        text, count = re.subn(pattern, value, text)
        assert count, f"{pattern!r} is not in {NGINX_CONF.name}"
    for directive, value in (overrides or {}).items():
        text, count = re.subn(rf"(?m)^(\s*{directive}) [^;]+;", rf"\1 {value};", text)
        assert count, f"{directive} is not in {NGINX_CONF.name}"
    return text


class Nginx:
    """A real nginx in the foreground (daemon off), as an unprivileged user may run it."""

    def __init__(self, temp_dir: Path, *, upstream_port: int, overrides: dict[str, str] | None = None,
                 grpc_upstream_port: int = GRPC_UPSTREAM_PORT) -> None:
        self.temp_dir = temp_dir
        temp_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The gRPC front's port: "127.0.0.1:port", as grpc.insecure_channel takes it.
        self.grpc_port = free_port()
        self.grpc_target = f"127.0.0.1:{self.grpc_port}"
        self.conf = temp_dir / "nginx.conf"
        self.conf.write_text(render_nginx_conf(listen_port=self.port, upstream_port=upstream_port,
                                               temp_dir=temp_dir, overrides=overrides,
                                               grpc_listen_port=self.grpc_port,
                                               grpc_upstream_port=grpc_upstream_port))
        self.proc: subprocess.Popen | None = None

    def command(self, *extra: str) -> list[str]:
        return ["nginx", "-p", str(self.temp_dir), "-e", "stderr", "-c", str(self.conf), *extra]

    def start(self, within_s: float = 10) -> Nginx:
        self.log = open(self.temp_dir / "nginx.out", "wb")
        self.proc = subprocess.Popen(self.command("-g", "daemon off;"), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + within_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {(self.temp_dir / 'nginx.out').read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # nothing listens yet: there is no event to wait on

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: nginx's fast shutdown
            self.proc.wait(10)
        if self.proc is not None:
            self.log.close()


# ---------------------------------------------------------------------------- slow clients


@dataclasses.dataclass
class AttackStats:
    opened: int = 0
    open_now: int = 0
    closed_by_server: int = 0
    refused: int = 0


class SlowClients:
    """`connections` sockets that each send a byte per interval and never finish a request.

    Half send a request header that never ends; half send a whole header announcing a body
    that then comes a byte at a time. A connection the server closes is opened again, so
    the count holds for the whole attack. Runs its own event loop in a thread.
    """

    def __init__(self, port: int, connections: int, *, body_bytes: int = 4096) -> None:
        self.port = port
        self.connections = connections
        self.body_bytes = body_bytes
        self.stats = AttackStats()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._all_open = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)

    def start(self, within_s: float = 30) -> SlowClients:
        self._thread.start()
        if not self._all_open.wait(within_s):
            raise TimeoutError(f"only {self.stats.open_now} of {self.connections} slow connections opened")
        return self

    def stop(self) -> AttackStats:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        return self.stats

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        await asyncio.gather(*(self._hold(index % 2 == 0) for index in range(self.connections)))

    def _first_bytes(self, slow_body: bool) -> bytes:
        if slow_body:
            return (f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {self.body_bytes}\r\n\r\n[").encode()
        return b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"

    async def _hold(self, slow_body: bool) -> None:
        while not self._stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                self.stats.refused += 1
                if await self._paused():
                    return
                continue
            self.stats.opened += 1
            self.stats.open_now += 1
            if self.stats.open_now >= self.connections:
                self._all_open.set()
            try:
                writer.write(self._first_bytes(slow_body))
                while not self._stop.is_set():
                    await writer.drain()
                    if await self._paused() or reader.at_eof():
                        break
                    writer.write(b" " if slow_body else b"X")
            except OSError:
                pass
            finally:
                self.stats.open_now -= 1
                if not self._stop.is_set():
                    self.stats.closed_by_server += 1
                writer.close()

    async def _paused(self) -> bool:
        """Wait one trickle interval; True when the attack is over."""
        try:
            await asyncio.wait_for(self._stop.wait(), TRICKLE_INTERVAL_S)
        except asyncio.TimeoutError:
            return False
        return True


# ---------------------------------------------------------------------------- normal clients


@dataclasses.dataclass(frozen=True)
class Outcome:
    status: int  # 0: no answer (connection error or timeout)
    latency_s: float
    row: list[float]
    predictions: list | None


def normal_clients(url: str, rows: list[list[float]], *, clients: int, duration_s: float,
                   timeout_s: float = 10) -> list[Outcome]:
    """`clients` threads, each sending one row after another (keep-alive) for duration_s."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    end = time.monotonic() + duration_s

    def client(index: int) -> None:
        with requests.Session() as session:
            sent = index
            while time.monotonic() < end:
                row = rows[sent % len(rows)]
                sent += clients
                started = time.perf_counter()
                try:
                    answer = session.post(url + "/predict", json={"instances": [row]}, timeout=timeout_s)
                    status = answer.status_code
                    predictions = answer.json().get("predictions") if status == 200 else None
                except (requests.RequestException, ValueError):
                    status, predictions = 0, None
                with lock:
                    outcomes.append(Outcome(status, time.perf_counter() - started, row, predictions))

    threads = [threading.Thread(target=client, args=(index,)) for index in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(duration_s + timeout_s + 30)
    return outcomes


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


def summary(label: str, outcomes: list[Outcome], attack: SlowClients | None) -> str:
    """A table row; `attack` is read before it stops, while its connections are still held."""
    ok = [o.latency_s for o in outcomes if o.status == 200]
    errors = len(outcomes) - len(ok)
    held = f"{attack.stats.open_now} held at the end, {attack.stats.opened} opened" if attack else "none"
    return (f"| {label} | {held} | {len(ok)} | {errors} | {percentile(ok, 0.5) * 1000:.1f} | "
            f"{percentile(ok, 0.99) * 1000:.1f} | {max(ok, default=float('nan')) * 1000:.1f} |")


# ---------------------------------------------------------------------------- the experiment


@contextmanager
def gunicorn(temp_dir: Path, env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    inherited = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    with open(temp_dir / f"gunicorn-{port}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"], cwd=REPO,
                                env={**inherited, "BIND": f"127.0.0.1:{port}", **env}, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gunicorn did not start: see {log.name}")
                try:
                    if requests.get(url + "/readyz", timeout=10).status_code == 200:
                        break
                except requests.RequestException:
                    time.sleep(0.2)  # nothing listens yet: there is no event to wait on
            yield url
        finally:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=4, help="normal clients, each in a closed loop")
    parser.add_argument("--duration", type=float, default=20, help="seconds of normal traffic per run")
    parser.add_argument("--model-path", help="served model (default: the server's built-in one)")
    args = parser.parse_args()
    raise_fd_limit(4 * args.connections + 512)
    rows = [[float(i % 7), 1.0, -2.0, float(i % 3)] for i in range(64)]
    env = {"MODEL_PATH": args.model_path} if args.model_path else {}
    lines = ["| run | slow connections | answered 200 | errors | p50 ms | p99 ms | max ms |",
             "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="slow-clients-") as temp, gunicorn(Path(temp), env) as url:
        upstream_port = int(url.rpartition(":")[2])
        front = Nginx(Path(temp) / "nginx", upstream_port=upstream_port).start()
        try:
            lines.append(summary("nginx, no attack", normal_clients(front.url, rows, clients=args.clients,
                                                                    duration_s=args.duration), None))
            attack = SlowClients(front.port, args.connections).start()
            outcomes = normal_clients(front.url, rows, clients=args.clients, duration_s=args.duration)
            lines.append(summary("nginx, slow clients", outcomes, attack))
            attack.stop()
        finally:
            front.stop()
        lines.append(summary("bare Gunicorn, no attack",
                             normal_clients(url, rows, clients=args.clients, duration_s=args.duration), None))
        try:
            attack = SlowClients(upstream_port, args.connections).start()
        except TimeoutError as exc:
            print(f"bare Gunicorn: {exc}", file=sys.stderr)
            attack = None
        outcomes = normal_clients(url, rows, clients=args.clients, duration_s=args.duration)
        lines.append(summary("bare Gunicorn, slow clients", outcomes, attack))
        if attack:
            attack.stop()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
