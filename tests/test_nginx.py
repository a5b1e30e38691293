"""deploy/nginx/nginx.conf in front of a live Gunicorn: slow clients cost Gunicorn nothing.

The shipped config runs as it is, with only its ports and /tmp paths swapped for free ones
(tests/nginx_front.py renders it), in a real nginx started in the foreground as an
unprivileged process; all traffic stays on 127.0.0.1. 1,000 connections that send their
headers or bodies a byte a second are held open (nginx closes slow headers after
client_header_timeout; they are opened again) while normal clients keep predicting: every
normal request must be answered 200 with the model's exact output. Without nginx's request
buffering the slow bodies would each hold one of Gunicorn's threads, and normal clients
would wait behind them (docs/reliability.md, and what bare Gunicorn does).
nginx's own refusals (413, 502, 504) answer in the server's JSON error shape.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess

import numpy as np
import pytest
import requests

from tests.conftest import REPO, Server, free_port, integer_rows
from tests.nginx_front import Nginx, SlowClients, normal_clients, raise_fd_limit, render_nginx_conf

SLOW_CONNECTIONS = 1000
NORMAL_CLIENTS = 4
# Past client_header_timeout (5 s), with room to spare: nginx cuts every slow header once and
# it is opened again while the normal clients run. A longer attack only repeats that cycle.
ATTACK_SECONDS = 8


@pytest.fixture(autouse=True, scope="module")
def nginx_installed() -> None:
    assert shutil.which("nginx"), "the nginx binary is needed (.ci/run installs Debian's package)"


@pytest.fixture(scope="module")
def gunicorn(tmp_path_factory, exact_model_path):
    # Small batches and queue, hence few threads (MAX_QUEUE_ROWS + 2 x MAX_BATCH_SIZE = 24):
    # 500 slow bodies reaching Gunicorn would take every one of them.
    server = Server(tmp_path_factory.mktemp("nginx-upstream"), {
        "MODEL_PATH": str(exact_model_path), "MAX_BATCH_SIZE": "4", "MAX_QUEUE_ROWS": "16"})
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def nginx(tmp_path_factory, gunicorn):
    # Before nginx starts, so that it inherits the raised descriptor limit too.
    if raise_fd_limit(2 * SLOW_CONNECTIONS + 512) < SLOW_CONNECTIONS + 256:
        pytest.fail(f"the descriptor limit (ulimit -n) is too low for {SLOW_CONNECTIONS} connections")
    front = Nginx(tmp_path_factory.mktemp("nginx"), upstream_port=gunicorn.port).start()
    yield front
    front.stop()


def test_shipped_config_passes_nginx_t(tmp_path):
    conf = tmp_path / "nginx.conf"
    conf.write_text(render_nginx_conf(listen_port=8080, upstream_port=8000, temp_dir=tmp_path))
    result = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-e", "stderr", "-c", str(conf)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_body_limit_matches_max_request_bytes():
    from app.ops.settings import Settings

    text = (REPO / "deploy" / "nginx" / "nginx.conf").read_text()
    # An explicit MAX_REQUEST_BYTES, or (0) the limit derived for inputs of any size: 16 MiB.
    server_limit = Settings().max_request_bytes or 16 * 1024 * 1024
    assert "client_max_body_size 16m;" in text and server_limit == 16 * 1024 * 1024
    assert f"larger than {server_limit} bytes" in text


def test_predictions_pass_through_with_the_request_id(nginx, exact_model):
    rows = integer_rows(3)
    answer = requests.post(nginx.url + "/predict", json={"instances": rows.tolist()},
                           headers={"X-Request-ID": "trace-42"}, timeout=30)
    assert answer.status_code == 200
    assert answer.json()["predictions"] == exact_model(rows).numpy().tolist()
    assert answer.headers["X-Request-ID"] == "trace-42"
    # Without one, nginx's own id reaches the app, which echoes it.
    generated = requests.get(nginx.url + "/healthz", timeout=30).headers["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)


def test_the_servers_own_errors_pass_through_unchanged(nginx):
    answer = requests.post(nginx.url + "/predict", json={"instances": [[1, 2]]}, timeout=30)
    assert answer.status_code == 400
    assert "error" in answer.json() and "nginx" not in answer.text


def test_over_limit_body_is_refused_by_nginx_as_json(nginx):
    # Only the header is sent: nginx answers from Content-Length, before any body arrives.
    with socket.create_connection(("127.0.0.1", nginx.port), timeout=30) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"X-Request-ID: big-1\r\nContent-Length: 16777217\r\n\r\n")
        head, body = read_response(sock)
    assert head.startswith(b"HTTP/1.1 413 ")
    assert b"X-Request-ID: big-1" in head
    assert body == (b'{"error": "the request body is larger than 16777216 bytes '
                    b'(client_max_body_size of the proxy in front)"}\n')


def test_upstream_down_is_a_json_502(tmp_path):
    # A free port nobody listens on.
    front = Nginx(tmp_path, upstream_port=free_port()).start()
    try:
        answer = requests.post(front.url + "/predict", json={"instances": [[1, 2, 3, 4]]}, timeout=30)
    finally:
        front.stop()
    assert answer.status_code == 502
    assert answer.json() == {"error": "the model server is not answering; retry later"}
    assert answer.headers["Retry-After"] == "1"


def test_upstream_silent_past_the_read_timeout_is_a_json_504(tmp_path):
    with socket.socket() as silent:
        # Accepts connections (the kernel does, from the backlog) and never answers.
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        front = Nginx(tmp_path, upstream_port=silent.getsockname()[1],
                      overrides={"proxy_read_timeout": "1s"}).start()
        try:
            answer = requests.get(front.url + "/healthz", timeout=30)
        finally:
            front.stop()
    assert answer.status_code == 504
    assert answer.json() == {"error": "the model server did not answer in time"}


def test_slow_clients_leave_normal_clients_served(nginx, exact_model):
    rows = integer_rows(64).tolist()
    attack = SlowClients(nginx.port, SLOW_CONNECTIONS).start()
    try:
        outcomes = normal_clients(nginx.url, rows, clients=NORMAL_CLIENTS, duration_s=ATTACK_SECONDS)
        held_at_end = attack.stats.open_now
    finally:
        stats = attack.stop()
    assert stats.opened >= SLOW_CONNECTIONS and held_at_end >= SLOW_CONNECTIONS * 0.95, stats
    # Every slow header was cut by nginx (and opened again) while the attack held.
    assert stats.closed_by_server >= SLOW_CONNECTIONS // 2, stats
    statuses = [outcome.status for outcome in outcomes]
    assert len(outcomes) >= NORMAL_CLIENTS and set(statuses) == {200}, sorted(set(statuses))
    scores = exact_model(np.asarray(rows, dtype="float32")).numpy().tolist()
    expected = dict(zip(map(tuple, rows), scores, strict=True))
    for outcome in outcomes:
        assert outcome.predictions == [expected[tuple(outcome.row)]]


# ---------------------------------------------------------------------------- helpers


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head, body) of one HTTP/1.1 response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    [length] = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return head, body
