"""The model-processes scenario's pieces: wrk driven for real against a small local HTTP server, the
check of a server's answer, and the page's tables. The scenario itself (TensorFlow servers, PyTriton)
is not run here.
"""

from __future__ import annotations

import itertools
import json
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from scripts.benchmark import layouts, load


@contextmanager
def local_server(answer: Callable[[BaseHTTPRequestHandler, bytes], None]) -> Iterator[tuple[str, list[bytes]]]:
    """A threaded HTTP/1.1 server on a free loopback port; `answer` replies to each POST. Yields its URL and the
    bodies it received, in order."""
    received: list[bytes] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as wrk expects

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                received.append(body)
            answer(self, body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v2/models/default/infer", received
    finally:
        server.shutdown()
        server.server_close()


def reply(status: int, payload: bytes = b"{}") -> Callable[[BaseHTTPRequestHandler, bytes], None]:
    def answer(handler: BaseHTTPRequestHandler, body: bytes) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)
    return answer


def hang_up(handler: BaseHTTPRequestHandler, body: bytes) -> None:
    handler.close_connection = True  # no answer at all: wrk sees the connection closed under a request


@pytest.fixture
def body(tmp_path: Path) -> Path:
    path = tmp_path / "body.json"
    path.write_bytes(layouts.infer_body(np.array([[0.5, -1.25, 3.0]], dtype=np.float32)))
    return path


@pytest.fixture(autouse=True)
def wrk_installed() -> None:
    assert shutil.which("wrk"), "the wrk binary is needed (.ci/run installs Debian's package)"


def test_wrk_posts_the_body_and_counts_every_answered_request(body: Path):
    with local_server(reply(200)) as (url, received):
        result, wrk_cpu_s = load.run_wrk(url, body, duration_s=1, threads=1, connections=4)
        served = len(received)
    assert result.errors is None
    assert result.requests > 0
    # wrk counts the answers it read; at most one request per connection was served but not read as it stopped.
    assert result.requests <= served <= result.requests + 4
    assert set(received) == {body.read_bytes()}
    assert result.rps == result.requests / result.duration_s
    assert 0 < result.p50_ms <= result.p99_ms
    assert wrk_cpu_s > 0


def test_wrk_posts_the_lines_of_the_body_file_in_turn(tmp_path: Path):
    """The variable-length scenario sends bodies of many lengths: one per line, each connection in turn."""
    bodies = [b'{"instances": [[1]]}', b'{"instances": [[1, 2, 3]]}', b'{"instances": [[4, 5]]}']
    path = tmp_path / "bodies.json"
    path.write_bytes(b"\n".join(bodies) + b"\n")
    with local_server(reply(200)) as (url, received):
        result, _ = load.run_wrk(url, path, duration_s=1, threads=1, connections=1)
        sent = list(received)
    assert result.errors is None and len(sent) >= 3 and set(sent) == set(bodies)
    # One connection: each body follows the one before it in the file (wrk may build a request it never sends).
    assert all(bodies.index(after) == (bodies.index(before) + 1) % 3 for before, after in itertools.pairwise(sent))


def test_wrk_posts_each_listed_body_with_its_own_headers_in_turn(tmp_path: Path):
    """The handler scenario's v2 binary bodies: each JSON header has its own length, sent in its own header."""
    bodies = [(b'{"a": 1}\n\x00\xff tail', {"Inference-Header-Content-Length": "8"}),
              (b'{"bb": 22}\r\n\x01', {"Inference-Header-Content-Length": "10", "Content-Type": "application/x"})]
    listed = load.write_listing(tmp_path / "bodies", "v2", bodies)
    seen: list[tuple[bytes, str | None, str | None]] = []

    def answer(handler: BaseHTTPRequestHandler, body: bytes) -> None:
        seen.append((body, handler.headers["Inference-Header-Content-Length"], handler.headers["Content-Type"]))
        reply(200)(handler, body)
    with local_server(answer) as (url, _):
        result, _ = load.run_wrk(url, listed, duration_s=1, threads=1, connections=1, listing=True)
        sent = list(seen)
    assert result.errors is None and len(sent) >= 2
    # Newlines and NULs inside a body stay in it; the default Content-Type unless the listing names one. One
    # connection: the bodies alternate (wrk may build a request it never sends, so either may come first).
    assert set(sent) == {(bodies[0][0], "8", "application/json"), (bodies[1][0], "10", "application/x")}
    assert all(before != after for before, after in itertools.pairwise(sent))


def test_non_2xx_answers_are_counted_and_make_the_load_unfit(body: Path):
    with local_server(reply(503)) as (url, received):
        result, _ = load.run_wrk(url, body, duration_s=1, threads=1, connections=2)
    assert result.requests > 0
    assert result.non_2xx_3xx == result.requests
    assert result.errors == f"{result.requests} non-2xx/3xx answers"


def test_connections_closed_without_an_answer_make_the_load_unfit(body: Path):
    with local_server(hang_up) as (url, received):
        result, _ = load.run_wrk(url, body, duration_s=1, threads=1, connections=2)
    assert received  # the requests reached the server
    assert result.socket_errors["read"] > 0
    assert result.errors is not None and "socket read errors" in result.errors


def test_wrk_output_without_the_summary_line_is_refused():
    with pytest.raises(ValueError, match="WRK_SUMMARY"):
        load.parse_wrk("Running 1s test @ http://127.0.0.1:1/\n  10 requests in 1.00s\n")


def test_infer_body_is_v2_json_of_the_exact_float32_rows():
    rows = np.array([[0.1, -2.5, 1e-3]], dtype=np.float32)
    request = json.loads(layouts.infer_body(rows))
    (tensor,) = request["inputs"]
    assert (tensor["name"], tensor["shape"], tensor["datatype"]) == ("features", [1, 3], "FP32")
    assert np.array_equal(np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"]), rows)


def v2_answer(data: list[float]) -> bytes:
    return json.dumps({"outputs": [{"name": "scores", "datatype": "FP32", "shape": [1, len(data)],
                                    "data": data}]}).encode()


V2, JSON = layouts.LAYOUTS_BY_NAME["default-1w"], {"Content-Type": "application/json"}


def test_check_answer_accepts_the_model_output_and_refuses_another(body: Path):
    expected = np.array([[1.5, -0.25]], dtype=np.float32)
    with local_server(reply(200, v2_answer([1.5, -0.25]))) as (url, received):
        assert layouts.check_answer(V2, url, body.read_bytes(), JSON, expected) == 0.0
        assert received == [body.read_bytes()]
    with local_server(reply(200, v2_answer([1.5, -0.5]))) as (url, _):
        with pytest.raises(RuntimeError, match="differs from the model's by up to 0.25"):
            layouts.check_answer(V2, url, body.read_bytes(), JSON, expected)
    with local_server(reply(200, v2_answer([1.5]))) as (url, _):
        with pytest.raises(RuntimeError, match="shape"):
            layouts.check_answer(V2, url, body.read_bytes(), JSON, expected)
    with local_server(reply(503)) as (url, _):
        with pytest.raises(RuntimeError, match="503"):
            layouts.check_answer(V2, url, body.read_bytes(), JSON, expected)


def measured(model: str, layout: str, round_number: int, rps: float | None, error: str | None = None):
    return layouts.Measured(model, layout, round_number, requests=int(rps or 0), rps=rps, p50_ms=rps and 5.0,
                            p99_ms=rps and 9.0, cpu_ms_per_request=rps and 1000 / rps, rss_mib=rps and 10.0,
                            error=error)


def test_model_tables_average_the_rounds_and_divide_by_the_default_with_one_worker():
    results = [measured("tiny", "default-1w", 1, 1000.0), measured("tiny", "default-1w", 2, 1200.0),
               measured("tiny", "procs-2w", 1, 1150.0), measured("tiny", "procs-2w", 2, None, error="refused: 3 ..."),
               measured("wide", "default-1w", 1, 5.0)]
    chosen = [layouts.LAYOUTS_BY_NAME[name] for name in ("default-1w", "procs-2w")]
    lines = layouts.model_tables(results, "tiny", chosen, 2)
    # default-1w: mean 1,100 req/s and 1000/1000, 1000/1200 ms CPU a request; procs-2w: its one good round.
    assert lines[4:6] == [
        "| `default-1w`: default, 1 worker | 1,100 | 1.00× | 5.0 | 9.0 | 0.92 | 1.00× | 10 | – | 2 of 2 |",
        "| `procs-2w`: MODEL_PROCESSES=1, 2 workers | 1,150 | 1.05× | 5.0 | 9.0 | 0.87 | 0.95× | 10 | – | 1 of 2 |"]
    assert lines[7] == "Every round's req/s: `default-1w` 1,000, 1,200; `procs-2w` 1,150, failed."
    assert lines[8] == "- `procs-2w`, round 2: refused: 3 ..."


def test_non_2xx_answers_in_wrk_text_that_its_summary_missed_are_refused():
    summary = {"requests": 10, "duration_us": 1_000_000, "non_2xx_3xx": 0, "connect": 0, "read": 0, "write": 0,
               "timeout": 0, "p50_us": 900, "p99_us": 2000, "mean_us": 1000.0}
    line = load.WRK_SUMMARY + json.dumps(summary)
    assert load.parse_wrk(line).p99_ms == 2.0
    with pytest.raises(ValueError, match="did not count"):
        load.parse_wrk(f"  Non-2xx or 3xx responses: 10\n{line}\n")
