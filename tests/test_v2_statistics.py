"""Triton's statistics extension: GET /v2/models[/{m}[/versions/{v}]]/stats and gRPC ModelStatistics.

In-process (Flask's test client over create_app, real models and engine) for the shape, the
exact counts and the refusals. One live Gunicorn server with two workers, driven by
tritonclient.http and tritonclient.grpc, for what needs processes: every worker's counts in
whichever worker answers, and the same sums as /metrics.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from app import create_app, shutdown_app
from app.ops import logs
from app.ops.settings import Settings
from tests.conftest import Server, build_exact_model, integer_rows
from tests.test_reliability import FEATURES, POISON, save_guarded_model

STAGES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


def model_config(folder, exact_model_path) -> str:
    save_guarded_model(folder / "guarded")
    for version, seed in ((1, 7), (2, 8)):
        build_exact_model(seed=seed).export(str(folder / "versioned" / str(version)), format="tf_saved_model",
                                            verbose=False)
    config = folder / "models.json"
    config.write_text(json.dumps({"default": "guarded", "models": [
        {"name": "guarded", "path": str(folder / "guarded")},
        {"name": "failing", "path": str(folder / "guarded")},
        {"name": "versioned", "path": str(folder / "versioned"), "model_version_policy": {"all": {}},
         "version_labels": {"stable": 1, "canary": 2}},
    ]}))
    return str(config)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory, exact_model_path) -> str:
    return model_config(tmp_path_factory.mktemp("stats"), exact_model_path)


@pytest.fixture(scope="module")
def app(config_path):
    # create_app sets the process's loggers as a worker's: the tests after this module find them as they were.
    access_off, app_level = logs.access_log.disabled, logging.getLogger("app").level
    served = create_app(Settings(model_config=config_path, access_log=False, model_poll_seconds=0))
    yield served
    shutdown_app(served, timeout_s=30)
    logs.access_log.disabled = access_off
    logging.getLogger("app").setLevel(app_level)


@pytest.fixture(scope="module")
def client(app):
    return app.test_client()


def infer_body(rows: np.ndarray) -> dict:
    return {"inputs": [{"name": "features", "datatype": "FP32", "shape": list(rows.shape),
                        "data": rows.ravel().tolist()}]}


def stats_of(client, path: str) -> list[dict]:
    answer = client.get(path)
    assert answer.status_code == 200, answer.json
    return answer.json["model_stats"]


def metric_sum(text: str, name: str, **labels: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


# -- in-process -----------------------------------------------------------------------------------


def test_counts_are_exact_after_known_requests(client):
    sizes = (1, 3, 2, 3)
    before_ms = time.time() * 1000
    for size in sizes:  # one at a time: each is a predict call of its own rows
        answer = client.post("/v2/models/guarded/infer", json=infer_body(integer_rows(size, FEATURES)))
        assert answer.status_code == 200, answer.json
    after_ms = time.time() * 1000
    [stats] = stats_of(client, "/v2/models/guarded/stats")
    assert (stats["name"], stats["version"]) == ("guarded", "1")
    assert stats["inference_count"] == sum(sizes) == 9
    assert stats["execution_count"] == len(sizes)
    inference = stats["inference_stats"]
    for stage in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[stage]["count"] == len(sizes), stage
    assert inference["fail"] == {"count": 0, "ns": 0}
    assert inference["cache_hit"] == {"count": 0, "ns": 0}
    # Each stage took time, and each is a part of the whole.
    assert all(inference[stage]["ns"] > 0 for stage in ("success", "queue", "compute_input", "compute_infer",
                                                         "compute_output"))
    parts = sum(inference[stage]["ns"] for stage in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert parts <= inference["success"]["ns"]
    assert before_ms - 1 <= stats["last_inference"] <= after_ms + 1
    batches = {batch["batch_size"]: batch for batch in stats["batch_stats"]}
    assert [batch["batch_size"] for batch in stats["batch_stats"]] == [1, 2, 3]
    assert [batches[size]["compute_infer"]["count"] for size in (1, 2, 3)] == [1, 1, 2]
    assert sum(batch["compute_infer"]["ns"] for batch in stats["batch_stats"]) == inference["compute_infer"]["ns"]
    for batch in stats["batch_stats"]:
        assert batch["compute_input"]["count"] == batch["compute_output"]["count"] == batch["compute_infer"]["count"]


def test_counts_agree_with_metrics(client):
    client.post("/v2/models/guarded/infer", json=infer_body(integer_rows(2, FEATURES)))
    [stats] = stats_of(client, "/v2/models/guarded/stats")
    text = client.get("/metrics").get_data(as_text=True)
    assert stats["execution_count"] == metric_sum(text, "model_server_batch_size_rows_count", model="guarded")
    assert stats["inference_count"] == metric_sum(text, "model_server_batch_size_rows_sum", model="guarded")
    queue = stats["inference_stats"]["queue"]
    assert queue["count"] == metric_sum(text, "model_server_queue_wait_seconds_count", model="guarded")
    assert queue["ns"] == round(metric_sum(text, "model_server_queue_wait_seconds_sum", model="guarded") * 1e9)
    infer_s = metric_sum(text, "model_server_predict_duration_seconds_sum", model="guarded")
    assert stats["inference_stats"]["compute_infer"]["ns"] == round(infer_s * 1e9)


def test_a_request_the_model_fails_counts_as_fail_not_success(client):
    rows = integer_rows(2, FEATURES).astype(np.float32)
    rows[1, 0] = POISON
    answer = client.post("/v2/models/failing/infer", json=infer_body(rows))
    assert answer.status_code == 500
    [stats] = stats_of(client, "/v2/models/failing/stats")
    inference = stats["inference_stats"]
    assert inference["fail"]["count"] == 1 and inference["fail"]["ns"] > 0
    assert inference["success"] == {"count": 0, "ns": 0}
    assert (stats["inference_count"], stats["execution_count"], stats["batch_stats"]) == (0, 0, [])
    assert stats["last_inference"] == 0


def test_versions_labels_and_all_models(client):
    answer = client.post("/v2/models/versioned/versions/2/infer", json=infer_body(integer_rows(4, FEATURES)))
    assert answer.status_code == 200
    both = stats_of(client, "/v2/models/versioned/stats")
    assert [(stats["version"], stats["inference_count"]) for stats in both] == [("1", 0), ("2", 4)]
    assert both[0]["batch_stats"] == [] and both[0]["inference_stats"]["success"] == {"count": 0, "ns": 0}
    assert stats_of(client, "/v2/models/versioned/versions/2/stats") == [both[1]]
    assert stats_of(client, "/v2/models/versioned/versions/stable/stats") == [both[0]]
    every = stats_of(client, "/v2/models/stats")
    assert [(stats["name"], stats["version"]) for stats in every] == [
        ("failing", "1"), ("guarded", "1"), ("versioned", "1"), ("versioned", "2")]


@pytest.mark.parametrize(("path", "status", "message"), [
    ("/v2/models/nope/stats", 400, "requested model 'nope' is not available"),
    ("/v2/models/versioned/versions/3/stats", 400, "requested model version is not available for model 'versioned'"),
    ("/v2/models/versioned/versions/beta/stats", 400, "Unrecognized servable version label: beta"),
    ("/v2/models/nope/versions/1/stats", 400, "requested model 'nope' is not available"),
])
def test_unknown_models_and_versions_are_refused_as_triton_refuses_them(client, path, status, message):
    answer = client.get(path)
    assert (answer.status_code, answer.json) == (status, {"error": message})


def test_stats_take_get_only(client):
    answer = client.post("/v2/models/guarded/stats")
    assert answer.status_code == 405
    assert "GET" in answer.headers["Allow"]


def test_server_metadata_lists_the_extension(client):
    assert "statistics" in client.get("/v2").json["extensions"]


# -- live: two workers, tritonclient ---------------------------------------------------------------


# Both modes: with a model process, its batch threads count, and the workers read its files.
@pytest.fixture(scope="module", params=["0", "1"], ids=["workers", "model_process"])
def served(request, tmp_path_factory, config_path):
    server = Server(tmp_path_factory.mktemp("stats_live"), {"MODEL_CONFIG": config_path, "MODEL_POLL_SECONDS": "0",
                                                            "MODEL_PROCESSES": request.param})
    server.start(workers=2)
    yield server
    server.stop()


def infer_once(served, size: int) -> None:
    # A client (a connection) each, so that the kernel may hand each to either worker.
    with httpclient.InferenceServerClient(url=f"127.0.0.1:{served.port}", network_timeout=60) as client:
        tensor = httpclient.InferInput("features", [size, FEATURES], "FP32")
        tensor.set_data_from_numpy(integer_rows(size, FEATURES).astype(np.float32))
        client.infer("guarded", [tensor])


def batches_by_worker(served) -> dict[int, int]:
    """Each worker's batches of `guarded`, by pid, as its /readyz tells them (fresh connections)."""
    seen: dict[int, int] = {}
    for _ in range(200):
        body = requests.get(served.url + "/readyz", headers={"Connection": "close"}, timeout=60).json()
        seen[body["pid"]] = body["models"]["guarded"]["batches_run"]
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only worker(s) {sorted(seen)} answered /readyz")


def test_tritonclient_reads_every_workers_counts_and_they_equal_metrics(served):
    sizes = [1, 2, 3, 1, 2, 3, 1, 2]
    for size in sizes:
        infer_once(served, size)
    if not served.model_processes:
        # Both workers must have served some, or one worker's counts would pass for all.
        for _ in range(20):
            if min(batches_by_worker(served).values()) > 0:
                break
            sizes.append(1)
            infer_once(served, 1)
        assert sum(batches_by_worker(served).values()) == len(sizes)
    with httpclient.InferenceServerClient(url=f"127.0.0.1:{served.port}", network_timeout=60) as client:
        answers = [client.get_inference_statistics("guarded") for _ in range(4)]
    assert all(answer == answers[0] for answer in answers)
    [stats] = answers[0]["model_stats"]
    assert stats["execution_count"] == len(sizes)
    assert (stats["inference_count"], stats["inference_stats"]["success"]["count"]) == (sum(sizes), len(sizes))
    assert stats["execution_count"] == served.metric("model_server_batch_size_rows_count", model="guarded")
    assert stats["inference_count"] == served.metric("model_server_batch_size_rows_sum", model="guarded")
    assert stats["inference_stats"]["queue"]["count"] == served.metric("model_server_queue_wait_seconds_count",
                                                                       model="guarded")
    with grpcclient.InferenceServerClient(url=served.grpc_target) as client:
        over_grpc = client.get_inference_statistics("guarded", as_json=True)
    [grpc_stats] = over_grpc["model_stats"]
    # JSON from protobuf spells uint64 as strings and leaves out zeros.
    assert grpc_stats["inference_count"] == str(stats["inference_count"])
    assert grpc_stats["inference_stats"]["success"]["ns"] == str(stats["inference_stats"]["success"]["ns"])
    assert [int(batch["batch_size"]) for batch in grpc_stats["batch_stats"]] == [1, 2, 3]


def test_grpc_refuses_an_unknown_model_with_invalid_argument(served):
    from tritonclient.utils import InferenceServerException

    with grpcclient.InferenceServerClient(url=served.grpc_target) as client:
        with pytest.raises(InferenceServerException) as refused:
            client.get_inference_statistics("nope")
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert refused.value.message() == "requested model 'nope' is not available"
