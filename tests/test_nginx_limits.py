"""deploy/nginx/nginx.conf's own limits, in a real nginx in front of a live Gunicorn (as tests/test_nginx.py runs it).

Per-address connection limit, the header timeout, and /metrics (with METRICS_PATH's copy) and
/readyz kept off the public location. The limited client connects from 127.0.0.2 (all of
127.0.0.0/8 is loopback on Linux): the config leaves 127.0.0.1, the pod's own processes, unlimited.

The attacks run inside tests/http_ledger.py's `siege`, its session on nginx from 127.0.0.1:
Gunicorn's worker keeps its pid, `/healthz` and a predict answer during the attack, its memory
stays within a bound, and it logged and counted exactly the requests the clients got answers to.
Slow readers are also sent to bare Gunicorn, fewer than its THREADS (docs/reliability.md says
what more do).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import select
import shutil
import socket
import threading

import pytest
import requests

from tests.conftest import REPO, Server, integer_rows, wait_for
from tests.http_ledger import siege
from tests.nginx_front import Nginx
from tests.test_hostile_logs import FORGED, forged_path

PER_CLIENT = 64
METRICS_PATH = "/monitoring/prometheus/metrics"  # TF Serving's, from its monitoring config
SOCKET_TIMEOUT_S = 30
# Gunicorn's threads here: few, so that a bounded attack can hold all but two of them.
THREADS = 8
# Answers of 40 KB each: 200 fill the 4 MiB a loopback socket's send buffer grows to, and
# what the reader's 4 KiB receive buffer takes, so the thread writing them blocks.
PIPELINED = 200
OPENAPI = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(autouse=True, scope="module")
def nginx_installed() -> None:
    assert shutil.which("nginx"), "the nginx binary is needed (.ci/run installs Debian's package)"


@pytest.fixture(scope="module")
def gunicorn(tmp_path_factory, exact_model_path):
    server = Server(tmp_path_factory.mktemp("nginx-limits-upstream"), {
        "MODEL_PATH": str(exact_model_path), "METRICS_PATH": METRICS_PATH, "THREADS": str(THREADS)})
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def fronted(tmp_path_factory, gunicorn):
    """nginx, and a header that never ends sent to it as it starts (see HeaderThatNeverEnds)."""
    front = Nginx(tmp_path_factory.mktemp("nginx-limits"), upstream_port=gunicorn.port).start()
    never_ends = HeaderThatNeverEnds(front.port)
    yield front, never_ends
    never_ends.close()
    front.stop()


@pytest.fixture(scope="module")
def nginx(fronted) -> Nginx:
    return fronted[0]


@pytest.fixture(scope="module")
def header_that_never_ends(fronted) -> HeaderThatNeverEnds:
    return fronted[1]


class HeaderThatNeverEnds:
    """A connection that sends a request header without its end, then waits: a thread reads
    what nginx does with it from the moment nginx starts, so that client_header_timeout (5 s)
    passes while the other tests run rather than in a test of its own."""

    # Past client_header_timeout (5 s); the former 10 s would time the read out.
    WITHIN_S = 8

    def __init__(self, port: int) -> None:
        # From an address no other test uses: nginx counts no connection before its header ends,
        # but the per-address test below must not meet this one even so.
        self.sock = connect_from("127.0.0.3", port)
        self.sock.settimeout(self.WITHIN_S)
        self.sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        self.answer: bytes | OSError | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            self.answer = self.sock.recv(65536)
        except OSError as exc:  # TimeoutError: still open after WITHIN_S
            self.answer = exc

    def outcome(self) -> bytes | OSError | None:
        self._thread.join(self.WITHIN_S + 30)
        return self.answer

    def close(self) -> None:
        self.sock.close()


def connect_from(address: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.settimeout(SOCKET_TIMEOUT_S)
    sock.bind((address, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    data = b""
    while part := sock.recv(65536):
        data += part
    return data


def test_the_shipped_limits_are_what_the_docs_say():
    text = (REPO / "deploy" / "nginx" / "nginx.conf").read_text()
    assert f"limit_conn per_client {PER_CLIENT};" in text
    assert "client_header_timeout 5s;" in text and "client_body_timeout 5s;" in text


@pytest.mark.parametrize("path", ["/metrics", METRICS_PATH, "/readyz"])
def test_metrics_and_readiness_are_not_public(nginx, gunicorn, path):
    answer = requests.get(nginx.url + path, timeout=10)
    assert answer.status_code == 404
    assert answer.json() == {"error": "not found"}
    # Gunicorn's own port still answers them, for probes and Prometheus.
    assert requests.get(gunicorn.url + path, timeout=10).status_code == 200
    assert requests.get(nginx.url + "/healthz", timeout=10).status_code == 200


def test_one_address_holds_at_most_its_connections_and_others_are_served(nginx, gunicorn, exact_model):
    def hold() -> socket.socket:
        # A whole header that promises a body it never sends: nginx counts the connection.
        sock = connect_from("127.0.0.2", nginx.port)
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n")
        return sock

    with siege(gunicorn, exact_model, url=nginx.url) as watch:
        held = [hold() for _ in range(PER_CLIENT)]

        # nginx counts a connection once it has read its header, in whatever order its events
        # come: probe (a /healthz, which the ledger leaves out) until the next one is refused.
        # client_body_timeout (5 s) answers a held one 408 and frees its slot: on a slow machine
        # that can come first, so each probe first replaces the held ones nginx has answered.
        def probe() -> bytes | None:
            for index, sock in enumerate(held):
                if select.select([sock], [], [], 0)[0]:
                    sock.close()
                    held[index] = hold()
            with connect_from("127.0.0.2", nginx.port) as extra:
                extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answer = read_to_end(extra)
            return answer if answer.startswith(b"HTTP/1.1 429 ") else None

        answer = wait_for(probe, within_s=30, what="nginx refusing a connection past the address's limit")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429 "), answer
        assert re.search(rb"(?i)\r\nretry-after: 1(\r\n|$)", head)
        assert body == b'{"error": "too many connections from this address; retry later"}\n'
        # Another address is served meanwhile, on a new connection and on one made before.
        rows = integer_rows(2, seed=41)
        answer = requests.post(nginx.url + "/predict", json={"instances": rows.tolist()}, timeout=30)
        assert answer.status_code == 200
        assert answer.json()["predictions"] == exact_model(rows).numpy().tolist()
        watch.got("POST", 200)
        watch.serving()
        # The held requests and the 429 never reached Gunicorn: its ledger holds the predicts alone.
        for sock in held:
            sock.close()


def test_a_forged_path_through_nginx_is_one_escaped_log_line(nginx, gunicorn, exact_model):
    path = forged_path("%0d%0a")
    with siege(gunicorn, exact_model, url=nginx.url) as watch:
        with connect_from("127.0.0.2", nginx.port) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Request-ID: forged-through-nginx\r\n"
                         "Connection: close\r\n\r\n".encode())
            assert read_to_end(sock).startswith(b"HTTP/1.1 404 ")
        watch.got("GET", 404)
        watch.serving()
    [line] = [line for line in gunicorn.log().splitlines() if "forged-through-nginx" in line]
    assert re.match(r'\S+ INFO \[\d+\] app\.access: access method=GET path="/x\\x0d\\x0a2026-11-25', line), line
    assert "\r" not in gunicorn.log() and "\x1b" not in gunicorn.log()
    assert not any(other.startswith(FORGED[:23]) for other in gunicorn.log().splitlines())


def slow_reader(port: int) -> socket.socket:
    """A connection that pipelines PIPELINED requests for the OpenAPI document and reads none of the answers."""
    sock = socket.socket()
    sock.settimeout(SOCKET_TIMEOUT_S)
    # Before connecting, so the window the client advertises stays this small.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind(("127.0.0.2", 0))
    sock.connect(("127.0.0.1", port))
    sock.sendall(OPENAPI * PIPELINED)
    return sock


def statuses(sock: socket.socket, count: int) -> list[int]:
    """The statuses of the next `count` answers on `sock`, each read to its end (Content-Length)."""
    # A larger buffer now: the reader's 4 KiB window would make reading the rest take minutes.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    found: list[int] = []
    data = b""
    while len(found) < count:
        head_end = data.find(b"\r\n\r\n")
        length = int(re.findall(r"(?im)^content-length: *(\d+)\r?$", data[:head_end].decode("latin-1"))[0]) \
            if head_end >= 0 else 0
        if head_end < 0 or len(data) < head_end + 4 + length:
            part = sock.recv(1 << 20)
            assert part, f"closed after {len(found)} answers"
            data += part
            continue
        found.append(int(data[9:12]))
        data = data[head_end + 4 + length:]
    return found


def threads_writing(pid: int) -> int:
    """How many of the worker's threads wait for room in a socket's send buffer (sk_stream_wait_memory)."""
    waiting = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/wchan") as wchan:
            waiting += wchan.read() == "wait_woken"
    return waiting


@pytest.mark.parametrize("front, readers", [("bare", THREADS - 2), ("nginx", THREADS + 4)])
def test_slow_readers_pipelining_leave_the_server_answering(nginx, gunicorn, exact_model, front, readers):
    port = nginx.port if front == "nginx" else gunicorn.port
    held: list[socket.socket] = []
    with siege(gunicorn, exact_model, url=nginx.url if front == "nginx" else gunicorn.url) as watch:
        try:
            held = [slow_reader(port) for _ in range(readers)]
            if front == "bare":
                # Each reader holds a thread of Gunicorn's, blocked writing to it.
                wait_for(lambda: threads_writing(watch.pid) >= readers, within_s=30, what="threads blocked writing")
            else:
                # nginx spools the answers and holds the readers itself: Gunicorn's threads stay free.
                wait_for(lambda: watch.ledger.logged()["GET", "200"] >= readers, within_s=30,  # type: ignore[union-attr]
                         what="every reader's first request at Gunicorn")
                assert threads_writing(watch.pid) == 0
            watch.serving()
            # All at once: nginx closes a connection it could not write to for send_timeout (10 s).
            with concurrent.futures.ThreadPoolExecutor(readers) as pool:
                got = list(pool.map(lambda sock: statuses(sock, PIPELINED), held))
            assert got == [[200] * PIPELINED] * readers
            watch.got("GET", 200, readers * PIPELINED)
        finally:
            for sock in held:
                sock.close()


# Last: its connection has waited out client_header_timeout beside every test above.
def test_a_header_that_never_ends_is_closed_before_the_former_10_s(header_that_never_ends):
    assert header_that_never_ends.outcome() == b""
