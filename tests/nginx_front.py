"""A real nginx running deploy/nginx/nginx.conf in front of a test's Gunicorn, and the slow clients
tests/test_nginx.py sends it: connections that send a byte a second, and closed-loop normal clients."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import resource
import socket
import subprocess
import threading
import time
from pathlib import Path

import requests

from scripts.live_server import REPO, free_ports

NGINX_CONF = REPO / "deploy" / "nginx" / "nginx.conf"
# The workers' gRPC port behind nginx's gRPC front (GRPC_BIND in compose and Kubernetes).
GRPC_UPSTREAM_PORT = 8510
# The slow clients' pace: one byte per connection per interval.
TRICKLE_INTERVAL_S = 1.0


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
        r"listen 8500 http2;": f"listen 127.0.0.1:{grpc_listen_port or free_ports(1)[0]} http2;",
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
        # The gRPC front's port too: "127.0.0.1:port", as grpc.insecure_channel takes it.
        self.port, self.grpc_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
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


def raise_fd_limit(needed: int) -> int:
    """Raise this process's soft descriptor limit toward `needed` (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


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
        except TimeoutError:
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
