"""scripts/benchmark: the command line, the arithmetic, the page from given results, and one quick run.

The page's tables are checked exactly from results given here; the one real run (a baseline
tree and this one, real Gunicorn and Locust, seconds a load) checks only that every figure is
there: timings are whatever the machine gives.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import types

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from app.core.batching import bucket_sizes
from app.ops.metrics import Metrics
from app.ops.settings import Settings
from scripts.benchmark import common, experiment, layouts, load
from scripts.benchmark.__main__ import parse_args
from tests.conftest import REPO

BENCHMARK_TIMEOUT_S = 240
SETTINGS = Settings()


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def experiment_args(*argv: str) -> argparse.Namespace:
    return experiment.resolve(parse_args(["experiment", *argv]))


def table_rows(markdown: str, header_start: str) -> list[list[str]]:
    """The body rows of the first table whose header line starts with `header_start`."""
    lines = markdown.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def is_number(cell: str) -> bool:
    return re.fullmatch(r"-?[\d,]+(\.\d+)?", cell) is not None


# ---------------------------------------------------------------- the page, from given results


def timing(median_ms: float, cpu_ms_per_call: float, batch: int = 1) -> experiment.CallTiming:
    return experiment.CallTiming(calls=3, median_ms=median_ms, items_per_s=batch / median_ms * 1000,
                                 cpu_ms_per_call=cpu_ms_per_call, cpu_ms_per_row=cpu_ms_per_call / batch)


ALONE = experiment.ModelAlone(
    batches=[experiment.BatchTiming(1, timing(10.0, 8.0), timing(40.0, 30.0)),
             experiment.BatchTiming(4, timing(20.0, 16.0, 4), timing(50.0, 40.0, 4))],
    after_idle_ms=[11.0, 13.0])


def stats(rps: float, mean_ms: float, *, requests: int = 100, batches: load.BatchDelta | None = None,
          cpu_s: float | None = None) -> load.LoadStats:
    return load.LoadStats(requests=requests, rps=rps, mean_ms=mean_ms, p50_ms=mean_ms, p95_ms=mean_ms,
                          p99_ms=2 * mean_ms, mean_batch_rows=1.0, server_batches=batches, server_cpu_s=cpu_s,
                          server_cpu_share=0.5, locust_cpu_share=0.25)


@pytest.fixture
def run() -> experiment.Run:
    args = experiment_args("--quick")
    closed = experiment.CLOSED_LOOP_LABEL
    # default: 2 calls at batch 1 and 3 padded to 4, 14 real rows; the model alone needs 2 x 10 + 3 x 20 = 80 ms.
    default_batches = load.BatchDelta(calls_per_bucket={1: 2, 4: 3}, rows=14, calls=5, predict_s=0.7)
    naive_batches = load.BatchDelta(calls_per_bucket={1: 14}, rows=14, calls=14, predict_s=0.7)
    results = [experiment.ConfigResult("naive", {"1": stats(0.5, 50.0), closed: stats(
                   10.0, 400.0, requests=14, batches=naive_batches, cpu_s=1.0)}),
               experiment.ConfigResult("default", {"1": stats(0.5, 25.0), closed: stats(
                   40.0, 100.0, requests=14, batches=default_batches, cpu_s=0.5)})]
    loads = [common.Load("1", 1, experiment.THINK_TIME_S), common.Load(closed, 4)]
    return experiment.Run(args, ALONE, [results], loads, dict(experiment.CONFIGS_BY_NAME))


def test_the_page_has_every_section_and_says_a_quick_run_is_no_measurement(run):
    lines = experiment.report_lines(run)
    assert [line for line in lines if line.startswith("## ")] == [
        "## Settings", "## The model alone", "## Servers under load", "## Ratios", "## Against the model's own ceiling"]
    assert lines[0].startswith("**A quick run**")


def test_model_alone_table_has_both_predict_paths_for_every_batch_size(run):
    markdown = "\n".join(experiment.report_lines(run))
    assert table_rows(markdown, "| batch | model.predict ms/call") == [
        ["1", "40.0", "25.0", "10.0", "100", "8.00", "4.0×", "8.00"],
        ["4", "50.0", "80.0", "20.0", "200", "4.00", "2.5×", "16.00"]]
    assert "Ceiling: **200 rows/s** at batch 4." in markdown
    assert "a batch-1 call took **12.00 ms** on average (2 calls)" in markdown


def test_load_table_has_every_configuration_and_load(run):
    rows = table_rows("\n".join(experiment.report_lines(run)), "| configuration | users | requests | failures")
    assert rows == [["`naive`", "1", "100", "0", "50.0", "50.0", "50.0", "100", "0.5", "1.0", "0.50", "25%"],
                    ["`naive`", "closed loop", "14", "0", "400", "400", "400", "800", "10.0", "1.0", "0.50", "25%"],
                    ["`default`", "1", "100", "0", "25.0", "25.0", "25.0", "50.0", "0.5", "1.0", "0.50", "25%"],
                    ["`default`", "closed loop", "14", "0", "100", "100", "100", "200", "40.0", "1.0", "0.50", "25%"]]


def test_ratios_compare_each_configuration_with_the_default(run):
    markdown = "\n".join(experiment.report_lines(run))
    assert table_rows(markdown, "| configuration | 1 user") == [["`naive`", "2.0×", "4.0×"]]
    assert "Closed-loop req/s: `default` 40.0; `naive` 10.0 (4.0×)." in markdown


def test_ceiling_table_and_one_user_against_a_bare_call(run):
    markdown = "\n".join(experiment.report_lines(run))
    # naive runs Keras' model.predict: its ceiling is 14 calls at batch 1 of 40 ms, 25 rows/s.
    assert table_rows(markdown, "| configuration | req/s | rows per call | ceiling rows/s") == [
        ["`naive`", "10.0", "1.0", "25.0", "40%", "50.00", "71.43", "30.00", "41.43"],
        ["`default`", "40.0", "2.8", "175", "23%", "50.00", "35.71", "4.57", "31.14"]]
    assert table_rows(markdown, "| configuration | 1 user mean ms") == [
        ["`naive`", "50.00", "12.00", "38.00"], ["`default`", "25.00", "12.00", "13.00"]]


def test_a_configuration_that_failed_to_start_says_so_in_the_load_table(run):
    run.rounds[0].insert(0, experiment.ConfigResult("timeout-20ms", error="RuntimeError: exited (see x.log)"))
    rows = table_rows("\n".join(experiment.report_lines(run)), "| configuration | users | requests | failures")
    assert rows[0] == ["`timeout-20ms`", "failed: RuntimeError: exited (see x.log)", *["–"] * 10]


def test_the_page_names_its_command_without_local_folders_and_the_machine(tmp_path):
    argv = ["--model", "wide", "--out", "/somewhere/page.md", "--work-dir=/elsewhere", "--users", "1,20"]
    page = common.write_page(tmp_path / "page.md", "Title", scenario="experiment", argv=argv,
                             started=datetime.datetime(2026, 1, 2, 3, 4), elapsed_s=90,
                             machine={"cores": "2"}, body=["body"])
    assert page.read_text() == (
        "# Title\n\nGenerated by `python -m scripts.benchmark experiment --model wide --users 1,20` on 2026-01-02 "
        "03:04 UTC in 1.5 min: the latest run, not asserted by any test; re-run the command to measure your "
        "machine.\n\n## Machine\n\n|  |  |\n|---|---|\n| cores | 2 |\n\nbody\n")


# ---------------------------------------------------------------- the arithmetic


def observed_metrics(calls: list[tuple[str, int, float]], metrics: Metrics) -> str:
    """A real /metrics page after predict calls of (model, real rows, predict seconds)."""
    for model, rows, seconds in calls:
        metrics.observer(model).batch_done(rows=rows, requests=rows, padded_rows=0, predict_s=seconds)
    return generate_latest(metrics.registry).decode()


def test_calls_per_padded_batch_size_from_the_metrics_page(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = Metrics(CollectorRegistry())
    before = common.metric_snapshot(observed_metrics([("a", 1, 0.25), ("a", 3, 0.5)], metrics))
    # Two models: the page has one series each, added up. Real rows r are padded to the next power of 2.
    after = common.metric_snapshot(observed_metrics(
        [("a", 1, 0.125), ("b", 2, 0.25), ("a", 3, 0.5), ("b", 5, 1.0), ("a", 32, 2.0), ("b", 17, 0.125)], metrics))
    assert load.batch_delta(before, after, bucket_sizes(32)) == load.BatchDelta(
        calls_per_bucket={1: 1, 2: 1, 4: 1, 8: 1, 32: 2}, rows=60, calls=6, predict_s=4.0)


def test_a_max_batch_size_off_the_powers_of_two_pads_to_itself(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = Metrics(CollectorRegistry())
    empty = common.metric_snapshot(observed_metrics([], metrics))
    # The histogram's bucket le=64 holds 33..64 rows; with MAX_BATCH_SIZE 48 the server padded them to 48.
    after = common.metric_snapshot(observed_metrics([("m", 40, 0.5), ("m", 20, 0.5)], metrics))
    assert load.batch_delta(empty, after, bucket_sizes(48)).calls_per_bucket == {48: 1, 32: 1}


def test_locust_figures_come_from_its_json_written_at_exit_alone(tmp_path):
    """Its CSV is rewritten once a second and misses a short run's last second: none is read. Percentiles
    as Locust reckons them, over its rounded response times of every endpoint."""
    (tmp_path / "run.json").write_text(json.dumps([
        {"num_requests": 6, "num_failures": 1, "total_response_time": 330.0,
         "response_times": {"10": 2, "20": 1, "100": 3}},
        {"num_requests": 4, "num_failures": 0, "total_response_time": 70.0, "response_times": {"10": 3, "40": 1}}]))
    (tmp_path / "run_stats.csv").write_text("Type,Name,Request Count\n,Aggregated,0\n")
    stats = load.parse_locust_stats(tmp_path / "run")
    assert (stats.requests, stats.failures, stats.mean_ms) == (10, 1, 40.0)
    # 10 rounded times: 10 ms x5, 20, 40, 100 ms x3. Locust's pN is the largest time with no more than
    # int(N% of 10) requests below it: p50 20 ms (5 below), p95 and p99 100 ms (7 below).
    assert (stats.p50_ms, stats.p95_ms, stats.p99_ms) == (20.0, 100.0, 100.0)
    assert load.parse_locust_stats(tmp_path / "none") == load.LoadStats()


TIMINGS = {1: timing(10.0, 8.0), 4: timing(20.0, 16.0), 8: timing(40.0, 30.0)}


def test_ceiling_ratio_and_cpu_split_at_the_batches_the_server_ran():
    # 2 calls at batch 1 and 3 padded to 4: 14 real rows; the model alone needs 2 x 10 + 3 x 20 = 80 ms.
    batches = load.BatchDelta(calls_per_bucket={1: 2, 4: 3}, rows=14, calls=5, predict_s=0.7)
    figures = experiment.ceiling_figures(batches, TIMINGS, requests=14, rps=7.0, server_cpu_s=0.5)
    assert dataclasses.asdict(figures) == pytest.approx({
        "mean_batch_rows": 14 / 5,
        "ceiling_rows_per_s": 14 / 0.080,  # 175 rows/s
        "ratio": 7.0 / 175,
        "predict_wall_ms_per_request": 700 / 14,
        "cpu_ms_per_request": 500 / 14,
        "predict_cpu_ms_per_request": (2 * 8 + 3 * 16) / 14,  # 64 ms of the model's own CPU
        "other_cpu_ms_per_request": (500 - 64) / 14,
    }, rel=1e-12)


def test_no_ceiling_for_a_batch_size_the_model_alone_was_not_timed_at():
    batches = load.BatchDelta(calls_per_bucket={1: 1, 16: 1}, rows=10, calls=2, predict_s=0.1)
    figures = experiment.ceiling_figures(batches, TIMINGS, requests=10, rps=5.0, server_cpu_s=0.2)
    assert figures.ceiling_rows_per_s is None and figures.ratio is None
    assert figures.other_cpu_ms_per_request is None
    assert figures.cpu_ms_per_request == pytest.approx(20.0) and figures.mean_batch_rows == 5.0


def test_rounds_report_the_median_of_each_rounds_ratio_not_the_ratio_of_medians():
    """Three rounds, the default's req/s 1.2, 1.5 and 1.4 times the baseline's; the median ratio is
    1.40 where the ratio of the median req/s would be 300 / 240 = 1.25."""
    closed = common.Load(experiment.CLOSED_LOOP_LABEL, 32)
    one = common.Load("1", 1, experiment.THINK_TIME_S)
    rounds = [[experiment.ConfigResult("baseline@abc", {"1": stats(1, 10.0), closed.label: stats(base, 100.0)}),
               experiment.ConfigResult("default", {"1": stats(1, 8.0), closed.label: stats(ours, 80.0)})]
              for base, ours in [(250, 300), (200, 300), (240, 336)]]
    configs = {"baseline@abc": common.Config("baseline@abc", 1, {}, ""),
               "default": experiment.CONFIGS_BY_NAME["default"]}
    lines = experiment.round_lines(experiment.Run(experiment_args(), ALONE, rounds, [one, closed], configs))
    assert lines[2].startswith("| round | `baseline@abc` req/s | `baseline@abc` CPU outside predict ms | `default`")
    assert lines[4:] == ["| 1 | 250 | – | 300 | – | 1.20× |", "| 2 | 200 | – | 300 | – | 1.50× |",
                         "| 3 | 240 | – | 336 | – | 1.40× |", "| median | 240 | – | 300 | – | 1.40× |"]


# ---------------------------------------------------------------- the command line and the servers


def test_baseline_tree_is_the_commit_and_is_removed_even_on_error():
    with pytest.raises(RuntimeError, match="inside"):
        with common.baseline_tree("HEAD") as (tree, short_sha):
            assert short_sha == git("rev-parse", "--short", "HEAD")
            assert (tree / "gunicorn.conf.py").read_text() == git("show", "HEAD:gunicorn.conf.py") + "\n"
            assert str(tree) in git("worktree", "list")
            config = common.baseline_config(tree, short_sha)
            assert (config.name, config.workers, config.env, config.tree) == (f"baseline@{short_sha}", 1, {}, tree)
            raise RuntimeError("inside")
    assert not tree.exists()
    assert str(tree) not in git("worktree", "list")


def test_locust_starts_every_user_at_once_unless_given_a_spawn_rate(tmp_path):
    """Locust starts floor(rate) users a step, one step a second: -r = users starts them together."""
    users = common.Load("50", 50, (1.0, 3.0))

    def rate(command):
        return command[command.index("-r") + 1], command[command.index("-u") + 1]

    assert rate(load.locust_command("http://x", users, duration_s=60, prefix=tmp_path / "p")) == ("50", "50")
    assert rate(load.locust_command("http://x", users, duration_s=60, prefix=tmp_path / "p", spawn_rate=10)) == (
        "10", "50")
    assert experiment_args("--spawn-rate", "2.5").spawn_rate == 2.5
    for bad in ("0", "-1", "nan", "x"):
        with pytest.raises(SystemExit):
            experiment_args("--spawn-rate", bad)


def test_rounds_alternate_the_order_and_keep_each_rounds_results_in_configuration_order(monkeypatch, tmp_path):
    """A B, B A, A B: a machine that speeds up or slows down over the run favours neither side."""
    ran = []

    def run_config(config, loads, args, work_dir, *, tag=""):
        ran.append((config.name, tag))
        return types.SimpleNamespace(config=config.name, tag=tag)

    monkeypatch.setattr(experiment, "run_config", run_config)
    configs = [experiment.CONFIGS_BY_NAME["naive"], experiment.CONFIGS_BY_NAME["default"]]
    rounds = experiment.run_rounds(configs, [], experiment_args("--rounds", "3"), tmp_path)
    assert ran == [("naive", "-round1"), ("default", "-round1"), ("default", "-round2"), ("naive", "-round2"),
                   ("naive", "-round3"), ("default", "-round3")]
    assert [[(result.config, result.tag) for result in results] for results in rounds] == [
        [("naive", f"-round{number}"), ("default", f"-round{number}")] for number in (1, 2, 3)]
    ran.clear()
    assert experiment.run_rounds(configs, [], experiment_args(), tmp_path) == [
        [types.SimpleNamespace(config="naive", tag=""), types.SimpleNamespace(config="default", tag="")]]
    for bad in ("0", "-2", "1.5", "x", "2,3"):
        with pytest.raises(SystemExit):
            experiment_args("--rounds", bad)


def test_the_floor_scenario_runs_the_floor_app_beside_this_tree():
    """The floor is a comparison, not a server configuration: the experiment leaves it out, the
    floor scenario runs scripts/floor_app.py (with and without the server's Batcher) under the same
    gunicorn.conf.py beside this tree over every protocol, and PyTriton, each divided by the floors."""
    assert "floor" not in experiment_args().configs and "floor-batcher" not in experiment_args().configs
    assert experiment_args("--configs", "default,floor").configs == ["default", "floor"]
    args = parse_args(["floor"])
    assert args.layouts == ["predict-1w", "default-1w", "binary-1w", "grpc-1w", "flask-batcher", "floor-batcher",
                            "pytriton", "pytriton-binary"] and args.models == ["tiny", "wide"]
    assert {name: layouts.LAYOUTS_BY_NAME[name].protocol for name in args.layouts} == {
        "predict-1w": "predict", "default-1w": "v2", "binary-1w": "v2-binary", "grpc-1w": "grpc",
        "flask-batcher": "predict", "floor-batcher": "predict", "pytriton": "v2", "pytriton-binary": "v2-binary"}
    servers = {name: layouts.layout_server(layouts.LAYOUTS_BY_NAME[name], args, "m.keras", REPO / f"{name}.log")
               for name in ("flask-batcher", "floor-batcher", "predict-1w")}
    assert servers["flask-batcher"].config.app == servers["floor-batcher"].config.app == (
        "--pythonpath", "scripts", "floor_app:app")
    assert "FLOOR_BATCHER" not in servers["flask-batcher"].env
    assert servers["floor-batcher"].env["FLOOR_BATCHER"] == "true"
    assert servers["predict-1w"].config.app == experiment.CONFIGS_BY_NAME["default"].app
    assert layouts.SCENARIOS["floor"][4] == ["flask-batcher", "floor-batcher", "pytriton"]
    with pytest.raises(SystemExit):
        experiment_args("--configs", "default,nonesuch")


def test_the_load_bodies_carry_the_same_row_over_every_protocol():
    """v2 binary: the JSON header, then the row's float32 bytes, the header's length in its header;
    gRPC: one length-prefixed PredictRequest of the same row."""
    from tensorflow_serving.apis import predict_pb2

    row = np.arange(4, dtype=np.float32)[None, :] / 8
    body, headers = layouts.binary_body(row)
    length = int(headers["Inference-Header-Content-Length"])
    header = json.loads(body[:length])
    assert header["inputs"][0]["parameters"] == {"binary_data_size": 16} and header["inputs"][0]["shape"] == [1, 4]
    assert np.frombuffer(body[length:], "<f4").tolist() == row[0].tolist()
    message = layouts.grpc_body(row)
    assert message[0] == 0 and int.from_bytes(message[1:5], "big") == len(message) - 5
    request = predict_pb2.PredictRequest.FromString(message[5:])
    tensor = request.inputs["features"]
    assert request.model_spec.name == "default" and [d.size for d in tensor.tensor_shape.dim] == [1, 4]
    assert np.frombuffer(tensor.tensor_content, "<f4").tolist() == row[0].tolist()


def test_h2load_output_is_read_and_unfinished_calls_count_as_errors():
    output = ("finished in 3.00s, 1126.67 req/s, 202.18KB/s\nrequests: 3380 total, 3412 started, 3380 done, "
              "3379 succeeded, 1 failed, 0 errored, 0 timeout\n                     min         max         mean\n"
              "time for request:     7.68ms     55.54ms     28.22ms      7.20ms    69.44%\n")
    parsed = load.parse_h2load(output)
    assert (parsed.requests, parsed.duration_s, parsed.mean_ms, parsed.p50_ms) == (3379, 3.0, 28.22, None)
    assert parsed.errors == "1 non-2xx/3xx answers, 1 socket connect errors"


def test_a_configuration_runs_with_its_own_settings_only(monkeypatch, tmp_path):
    """The caller's server and Locust variables would change every configuration alike: none is inherited."""
    for name, value in {"MAX_BATCH_SIZE": "7", "BATCHING": "true", "LOCUST_ROWS": "3",
                        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "BENCHMARK_UNRELATED": "kept"}.items():
        monkeypatch.setenv(name, value)
    server = common.Server(experiment.CONFIGS_BY_NAME["naive"], model_path="model.keras", log_path=tmp_path / "n.log")
    assert {name: server.env.get(name) for name in ("MAX_BATCH_SIZE", "BATCHING", "PREDICT_METHOD", "LOCUST_ROWS",
                                                    "PROMETHEUS_MULTIPROC_DIR", "MODEL_PATH", "BENCHMARK_UNRELATED")
            } == {"MAX_BATCH_SIZE": None, "BATCHING": "false", "PREDICT_METHOD": "keras_predict", "LOCUST_ROWS": None,
                  "PROMETHEUS_MULTIPROC_DIR": None, "MODEL_PATH": "model.keras", "BENCHMARK_UNRELATED": "kept"}
    assert server.env["BIND"] == f"127.0.0.1:{server.port}" and server.log_path == tmp_path / "n.log"
    floor = common.Server(experiment.CONFIGS_BY_NAME["floor"], model_path=None, log_path=tmp_path / "f.log")
    assert floor.env["GRPC_BIND"] == "" and "MODEL_PATH" not in floor.env
    assert floor.command(workers=1)[-4:] == ["--pythonpath", "scripts", "floor_app:app", "--workers=1"]


def test_the_command_names_every_scenario():
    done = subprocess.run([sys.executable, "-m", "scripts.benchmark", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m scripts.benchmark")
    assert re.findall(r"^    (\S+)", done.stdout, re.M) == [
        "experiment", "peers", "model-processes", "variable-length", "floor", "profile", "gpu", "handler"]


# ---------------------------------------------------------------- one quick run, end to end


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """`experiment --quick` beside the server of HEAD (a second tree, its own server), seconds a load."""
    out, work = tmp_path_factory.mktemp("benchmark-out") / "page.md", tmp_path_factory.mktemp("benchmark-work")
    # 4 s a load, not --quick's 2: on a loaded machine Locust's first request came after 2 s now and then, and
    # a point had none; 4 s leave it that much again, where 6 s spent 8 s more of the suite on figures that
    # are checked only for being there. Both trees and both kinds of load stay: the run fails if any breaks.
    command = [sys.executable, "-m", "scripts.benchmark", "experiment", "--quick", "--duration", "4", "--configs",
               "default", "--baseline-ref", "HEAD", "--out", str(out), "--work-dir", str(work)]
    env = {key: value for key, value in os.environ.items() if not key.startswith("LOCUST_")}
    # A session of its own, so that a timeout stops the servers and Locust it started as well.
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BENCHMARK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"experiment --quick ran past {BENCHMARK_TIMEOUT_S} s:\n{output[-5000:]}")
    assert proc.returncode == 0, output[-5000:]
    return out.read_text(), work


@pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 90)
def test_a_quick_run_measures_every_configuration_and_load_without_failures(quick_run):
    markdown, work = quick_run
    baseline = f"baseline@{git('rev-parse', '--short', 'HEAD')}"
    rows = table_rows(markdown, "| configuration | users | requests | failures")
    assert [(row[0], row[1]) for row in rows] == [
        (f"`{config}`", users) for config in (baseline, "default") for users in ("1", "closed loop")]
    for config, users, requests, failures, mean, _, _, p99, rps, *_ in rows:
        assert int(failures) == 0 and int(requests) > 0, (config, users)
        assert all(is_number(cell) for cell in (mean, p99, rps)), (config, users)
    model_alone = table_rows(markdown, "| batch | model.predict ms/call")
    assert [row[0] for row in model_alone] == [str(size) for size in sorted({1, 2, 4, 8} | set(
        bucket_sizes(SETTINGS.max_batch_size)))]
    assert all(is_number(cell) for row in model_alone for cell in row[1:6]), model_alone
    ceiling = table_rows(markdown, "| configuration | req/s | rows per call | ceiling rows/s")
    assert [row[0] for row in ceiling] == [f"`{baseline}`", "`default`"]
    assert all(is_number(cell) for row in ceiling for cell in row[1:4] + row[5:]), ceiling
    assert re.search(rf"- `default` ÷ `{baseline}`: server CPU outside predict per request -?[\d.,]+×", markdown)


@pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 90)
def test_a_quick_run_serves_each_tree_with_its_default_access_log(quick_run):
    """Each server ran from its own tree, and logged every answered /predict: the access log is part
    of each request's cost."""
    _, work = quick_run
    (results,) = json.loads((work / "results.json").read_text())
    cwd = {result["config"]: result["cwd"] for result in results}
    baseline = f"baseline@{git('rev-parse', '--short', 'HEAD')}"
    assert cwd["default"] == str(REPO) and cwd[baseline] != str(REPO) and "benchmark-baseline-" in cwd[baseline]
    answered = sum(stats["requests"] for stats in results[1]["loads"].values())
    logged = (work / "gunicorn-default.log").read_text().count("path=/predict status=200")
    assert answered > 0 and logged >= answered
    after_idle = json.loads((work / "model_alone.json").read_text())["after_idle_ms"]
    assert len(after_idle) == 2  # --quick's count
