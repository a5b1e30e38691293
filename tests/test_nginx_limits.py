"""deploy/nginx/nginx.conf's own limits, in a real nginx in front of a live Gunicorn (as tests/test_nginx.py runs it).

Per-address connection limit, the header timeout, and /metrics (with METRICS_PATH's copy) and
/readyz kept off the public location. The limited client connects from 127.0.0.2 (all of 127.0.0.0/8 is loopback on Linux):
the config leaves 127.0.0.1, the pod's own processes, unlimited.
"""

from __future__ import annotations

import re
import shutil
import socket

import pytest
import requests

from scripts.slow_clients import Nginx
from tests.conftest import REPO, Server, integer_rows

PER_CLIENT = 64
METRICS_PATH = "/monitoring/prometheus/metrics"  # TF Serving's, from its monitoring config
SOCKET_TIMEOUT_S = 30


@pytest.fixture(autouse=True, scope="module")
def nginx_installed() -> None:
    assert shutil.which("nginx"), "the nginx binary is needed (.ci/run installs Debian's package)"


@pytest.fixture(scope="module")
def gunicorn(tmp_path_factory, exact_model_path):
    server = Server(tmp_path_factory.mktemp("nginx-limits-upstream"), {"MODEL_PATH": str(exact_model_path),
                                                                       "METRICS_PATH": METRICS_PATH})
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def nginx(tmp_path_factory, gunicorn):
    front = Nginx(tmp_path_factory.mktemp("nginx-limits"), upstream_port=gunicorn.port).start()
    yield front
    front.stop()


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


def test_one_address_holds_at_most_its_connections_and_others_are_served(nginx, exact_model):
    held: list[socket.socket] = []
    try:
        # Each sends a whole header and promises a body it never sends: nginx counts it.
        for _ in range(PER_CLIENT):
            sock = connect_from("127.0.0.2", nginx.port)
            sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n")
            held.append(sock)
        # nginx has read every header once the next connection from 127.0.0.2 is answered.
        with connect_from("127.0.0.2", nginx.port) as extra:
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = read_to_end(extra)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429 "), answer
        assert re.search(rb"(?i)\r\nretry-after: 1(\r\n|$)", head)
        assert body == b'{"error": "too many connections from this address; retry later"}\n'
        # Another address is served meanwhile.
        rows = integer_rows(2, seed=41)
        answer = requests.post(nginx.url + "/predict", json={"instances": rows.tolist()}, timeout=30)
        assert answer.status_code == 200
        assert answer.json()["predictions"] == exact_model(rows).numpy().tolist()
    finally:
        for sock in held:
            sock.close()


def test_a_header_that_never_ends_is_closed_before_the_former_10_s(nginx):
    with connect_from("127.0.0.2", nginx.port) as sock:
        sock.settimeout(8)  # past client_header_timeout (5 s); the former 10 s would time this out
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        assert sock.recv(65536) == b""
