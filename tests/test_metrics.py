"""Observability: /metrics under several workers, access logs, request ids, a real Prometheus."""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import subprocess
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, Server, free_port, integer_rows, wait_for

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "model-server.json"


def samples(server) -> dict[tuple[str, tuple], float]:
    return parsed(requests.get(server.url + "/metrics", timeout=30).text)


def parsed(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(found: dict, name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def send_spread(server, bodies) -> list[requests.Response]:
    # A new connection per request, so that the kernel hands them to both workers.
    return [requests.post(server.url + "/predict", json={"instances": rows.tolist()},
                          headers={"Connection": "close"}, timeout=60) for rows in bodies]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory, exact_model_path):
    """The exact model on two workers, logging JSON, with a metrics folder the tests can look into.

    The same file is also served as "windowed": a 300 ms batch window and buckets up to 8 rows.
    One server for both: every test reads what it added (or the series of its own model).
    """
    folder = tmp_path_factory.mktemp("metrics-two-workers")
    config = folder / "models.json"
    config.write_text(json.dumps({"models": [
        {"name": "default", "path": str(exact_model_path)},
        {"name": "windowed", "path": str(exact_model_path), "max_batch_size": 8, "batch_timeout_ms": 300},
    ]}))
    running = Server(folder, {"MODEL_CONFIG": str(config), "PROMETHEUS_MULTIPROC_DIR": str(folder / "metrics"),
                              "LOG_FORMAT": "json"})
    yield running.start(workers=2)
    running.stop()


def counted(before: dict, after: dict, name: str, **labels: str) -> float:
    """What a test added to a counter of a server that others used before it."""
    return value(after, name, **labels) - value(before, name, **labels)


def test_metrics_count_exactly_the_requests_served_by_two_workers(two_workers):
    server = two_workers
    before = samples(server)
    bodies = [integer_rows(1 + i % 3, seed=i) for i in range(40)]
    answers = send_spread(server, bodies)
    assert [answer.status_code for answer in answers] == [200] * len(bodies)
    bad = requests.post(server.url + "/predict", json={"instances": [[1, 2]]}, timeout=60)
    assert bad.status_code == 400

    # Both workers served (each writes its own file) and /metrics adds them up exactly.
    assert len(list((server.log_path.parent / "metrics").glob("counter_*.db"))) == 2
    found = samples(server)
    assert counted(before, found, "model_server_requests_total", route="/predict", method="POST", status="200") == 40
    assert counted(before, found, "model_server_requests_total", route="/predict", method="POST", status="400") == 1
    assert counted(before, found, "model_server_request_duration_seconds_count", route="/predict") == 41
    assert counted(before, found, "model_server_batch_size_rows_sum", model="default") == sum(len(b) for b in bodies)
    assert counted(before, found, "model_server_batch_size_requests_sum", model="default") == 40
    assert value(found, "model_server_queue_rows", model="default") == 0
    assert value(found, "model_server_model_load_seconds", model="default") > 0


def test_full_queue_is_counted_as_a_rejection(in_process_app, exact_model_path):
    # In-process: the queue's limit, its 503 and the counters are the app's, not Gunicorn's.
    app = in_process_app(model_path=str(exact_model_path), max_queue_rows=2, batch_timeout_ms=2000, max_batch_size=64)

    def found() -> dict[tuple[str, tuple], float]:
        return parsed(app.test_client().get("/metrics").text)

    def predict(rows):
        return app.test_client().post("/predict", json={"instances": rows.tolist()})

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(predict, integer_rows(2))
        deadline = time.monotonic() + 60
        while value(found(), "model_server_queue_rows", model="default") != 2:
            assert time.monotonic() < deadline
        assert predict(integer_rows(1)).status_code == 503
        assert waiting.result(60).status_code == 200
    after = found()
    assert value(after, "model_server_rejections_total", model="default", reason="queue_full") == 1
    assert value(after, "model_server_requests_total", route="/predict", method="POST", status="503") == 1
    assert value(after, "model_server_padding_rows_total", model="default") == 0


def test_http_answers_are_counted_by_the_rule_they_matched(in_process_app, exact_model_path):
    # The rule, not the path (a path per model or per probe would grow a series each); none matched: other.
    client = in_process_app(model_path=str(exact_model_path)).test_client()
    rows = {"instances": integer_rows(1).tolist()}
    assert client.post("/v1/models/default:predict", json=rows).status_code == 200
    assert client.post("/v1/models/nothing:predict", json=rows).status_code == 404
    assert client.get("/no/such/path").status_code == 404
    assert client.get("/predict").status_code == 405
    found = parsed(client.get("/metrics").text)
    rule = "/v1/models/<model_name:name>:predict"
    assert value(found, "model_server_requests_total", route=rule, method="POST", status="200") == 1
    assert value(found, "model_server_requests_total", route=rule, method="POST", status="404") == 1
    assert value(found, "model_server_requests_total", route="other", method="GET", status="404") == 1
    assert value(found, "model_server_requests_total", route="other", method="GET", status="405") == 1
    assert value(found, "model_server_request_duration_seconds_count", route=rule) == 2
    assert value(found, "model_server_request_duration_seconds_count", route="other") == 2
    # The /metrics request itself is the one in flight.
    assert value(found, "model_server_requests_in_flight") == 1


def access_lines(server) -> dict[str, dict]:
    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    return {line["request_id"]: line for line in lines if line["logger"] == "app.access"}


def test_access_log_line_carries_request_id_rows_and_batch(two_workers):
    server = two_workers
    given = server.predict(integer_rows(3), headers={"X-Request-ID": "trace-42"})
    generated = server.predict(integer_rows(1), headers={"X-Request-ID": "bad id\twith spaces"})
    assert given.headers["X-Request-ID"] == "trace-42"
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["X-Request-ID"])
    # The worker writes the line once the answer has gone: poll its log for both.
    access = wait_for(lambda: (lines := access_lines(server)).keys() >= {"trace-42", generated.headers["X-Request-ID"]}
                      and lines, what="both access log lines")
    entry = access["trace-42"]
    assert (entry["method"], entry["path"], entry["status"], entry["rows"]) == ("POST", "/predict", 200, 3)
    assert entry["batch_rows"] == 3 and entry["batch_requests"] == 1 and entry["model"] == "default"
    assert entry["latency_ms"] > 0
    assert access[generated.headers["X-Request-ID"]]["rows"] == 1


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]


def dashboard_metric_names() -> set[str]:
    return {re.sub(r"_(bucket|sum|count|total)$", "", name)
            for expr in dashboard_exprs() for name in re.findall(r"model_server_\w+", expr)}


def test_every_metric_the_dashboard_queries_is_exported():
    from prometheus_client import CollectorRegistry, generate_latest

    from app.ops.metrics import Metrics

    metrics = Metrics(CollectorRegistry())
    exported = {family.name for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    assert dashboard_metric_names() <= exported
    assert len(dashboard_metric_names()) >= 9


def query(prometheus_url: str, expr: str) -> list[dict]:
    answer = requests.get(prometheus_url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def wait_for_value(prometheus_url: str, expr: str, expected: float, within_s: float = 60) -> float:
    """Poll Prometheus until the query answers `expected` (it scrapes every second)."""
    deadline = time.monotonic() + within_s
    last = None
    while time.monotonic() < deadline:
        result = query(prometheus_url, expr)
        last = float(result[0]["value"][1]) if result else None
        if last == expected:
            return last
        time.sleep(0.25)  # Prometheus gives no event to wait on: its next scrape is the signal
    raise AssertionError(f"{expr} = {last}, expected {expected}")


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    assert binary, "the prometheus binary is needed (.ci/run installs Debian's package)"

    def start(target: str) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: model-server\n    metrics_path: /metrics\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        port = free_port()
        log = open(tmp_path / "prometheus.log", "wb")
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
        started.append((proc, log))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(url + "/-/ready", timeout=5).status_code == 200:
                    return url
            except requests.ConnectionError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.1)

    started: list = []
    yield start
    for proc, log in started:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_real_prometheus_scrapes_request_and_batch_series_from_two_workers(two_workers, prometheus):
    server = two_workers
    before = samples(server)
    prometheus_url = prometheus(server.url.removeprefix("http://"))
    bodies = [integer_rows(1 + i % 4, seed=i) for i in range(30)]
    assert [answer.status_code for answer in send_spread(server, bodies)] == [200] * 30

    wait_for_value(prometheus_url, 'sum(model_server_requests_total{route="/predict",status="200"})',
                   value(before, "model_server_requests_total", route="/predict", method="POST", status="200") + 30)
    wait_for_value(prometheus_url, 'sum(model_server_batch_size_rows_sum{model="default"})',
                   value(before, "model_server_batch_size_rows_sum", model="default") + sum(len(b) for b in bodies))
    wait_for_value(prometheus_url, 'sum(model_server_batch_size_requests_sum{model="default"})',
                   value(before, "model_server_batch_size_requests_sum", model="default") + 30)
    assert query(prometheus_url, 'up{job="model-server"}')[0]["value"][1] == "1"
    # Every query of the Grafana dashboard is valid PromQL for this Prometheus.
    for expr in dashboard_exprs():
        query(prometheus_url, expr.replace("$__rate_interval", "1m"))


def test_padding_and_queue_wait_read_from_a_live_server_are_exact(two_workers):
    # One request of 3 rows, alone in its 300 ms batch window: it waits out the window (the
    # batch thread times its wait, so at least 0.3 s) and runs padded to the 4-row bucket.
    server = two_workers
    before = samples(server)
    assert server.predict(integer_rows(3), path="/v1/models/windowed:predict").status_code == 200
    found = samples(server)
    assert counted(before, found, "model_server_padding_rows_total", model="windowed") == 1
    assert counted(before, found, "model_server_batch_size_rows_sum", model="windowed") == 3
    assert counted(before, found, "model_server_queue_wait_seconds_count", model="windowed") == 1
    assert counted(before, found, "model_server_queue_wait_seconds_sum", model="windowed") >= 0.3
    assert counted(before, found, "model_server_queue_wait_seconds_bucket", model="windowed", le="0.25") == 0
    assert counted(before, found, "model_server_queue_wait_seconds_bucket", model="windowed", le="+Inf") == 1
    assert value(found, "model_server_queue_rows", model="windowed") == 0


def test_queue_rows_of_a_model_add_up_over_its_batchers():
    """A model's versions and signatures each have a batcher, all reporting under one label."""
    from prometheus_client import CollectorRegistry

    from app.ops.metrics import Metrics

    registry = CollectorRegistry()
    metrics = Metrics(registry)
    v1, v2 = metrics.observer("m"), metrics.observer("m")
    v1.queue_depth(5)
    v2.queue_depth(3)
    v1.queue_depth(2)
    assert registry.get_sample_value("model_server_queue_rows", {"model": "m"}) == 5
    v1.queue_depth(0)
    v2.queue_depth(0)
    assert registry.get_sample_value("model_server_queue_rows", {"model": "m"}) == 0
