"""scripts/benchmark --quick end to end: real servers, real Locust, a report and a plot.

Only the shape of the report is checked: timings are whatever the machine gives. The
arithmetic behind the figures (calls per batch size from a /metrics page, the model's
ceiling at those batches, the CPU split) is checked exactly, from given inputs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import types

import pytest
from conftest import REPO
from prometheus_client import CollectorRegistry, generate_latest

from app.batching import bucket_sizes
from app.metrics import Metrics
from app.settings import Settings
from scripts import benchmark
from scripts.benchmark import measure

BENCHMARK_TIMEOUT_S = 300
# The run happens in the first test's set-up: leave room past our own timeout to stop it cleanly.
pytestmark = pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 90)


def quick_configs() -> list[str]:
    """The quick run's configurations: the baseline of --baseline-ref HEAD first."""
    return [f"baseline@{git('rev-parse', '--short', 'HEAD')}", "naive", "default"]


def run_quick_benchmark(out, work_dir) -> subprocess.CompletedProcess:
    # --baseline-ref HEAD: the before/after machinery end to end (a second tree, its own server).
    command = [sys.executable, "-m", "scripts.benchmark", "--quick", "--out", str(out),
               "--work-dir", str(work_dir), "--baseline-ref", "HEAD"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("LOCUST_")}
    # A session of its own, so that a timeout stops the servers and Locust it started as well.
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BENCHMARK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"benchmark --quick ran past {BENCHMARK_TIMEOUT_S} s:\n{output[-5000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, output)


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
    return re.fullmatch(r"[\d,]+(\.\d+)?", cell) is not None


def is_signed_number(cell: str) -> bool:
    # CPU outside predict is a difference of two measurements: on a busy machine it can dip below 0.
    return re.fullmatch(r"-?[\d,]+(\.\d+)?", cell) is not None


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    # The plot needs it; pinned in requirements-dev.txt. Skipped (and listed by -ra) where it is missing.
    pytest.importorskip("matplotlib")
    out, work = tmp_path_factory.mktemp("benchmark-out"), tmp_path_factory.mktemp("benchmark-work")
    run = run_quick_benchmark(out, work)
    assert run.returncode == 0, run.stdout[-5000:]
    return out, work


@pytest.fixture(scope="module")
def quick_report(quick_run):
    return quick_run[0]


def test_quick_benchmark_writes_a_report_and_a_plot(quick_report):
    markdown = (quick_report / "benchmarks.md").read_text()
    for heading in ("## Machine", "## Versions", "## Settings", "## 1. The model alone", "## 2. Servers under load",
                    "## 3. Throughput and CPU in the closed loop", "## 4. Ratios", "## 5. The load generator",
                    "## 6. REST and gRPC"):
        assert heading in markdown
    assert "A quick run" in markdown
    plot = (quick_report / "benchmarks.png").read_bytes()
    assert plot.startswith(b"\x89PNG") and len(plot) > 10_000


def test_model_alone_table_has_numbers_for_every_batch_size(quick_report):
    rows = table_rows((quick_report / "benchmarks.md").read_text(), "| batch | model.predict ms/call")
    # --quick's sizes up to 8, and every size the server pads a batch to.
    expected = sorted({1, 2, 4, 8} | set(bucket_sizes(Settings().max_batch_size)))
    assert [row[0] for row in rows] == [str(size) for size in expected]
    for row in rows:
        assert all(is_number(cell) for cell in row[1:6]) and is_number(row[7]), row


def test_load_table_has_every_configuration_and_load_without_failures(quick_report):
    rows = table_rows((quick_report / "benchmarks.md").read_text(), "| configuration | users | requests | failures")
    assert [(row[0], row[1]) for row in rows] == [
        (f"`{config}`", load) for config in quick_configs() for load in ("1", "5", "closed loop")
    ]
    for config, load, requests, failures, mean, p50, p95, p99, rps, *_ in rows:
        assert int(failures) == 0, (config, load)
        if load == "closed loop":
            assert int(requests) > 0 and is_number(mean) and is_number(p99) and is_number(rps), (config, load)


def test_ratios_compare_the_default_with_the_naive_server(quick_report):
    rows = table_rows((quick_report / "benchmarks.md").read_text(), "| configuration | 1 user")
    assert [row[0] for row in rows] == [f"`{config}`" for config in quick_configs() if config != "default"]
    assert all(re.fullmatch(r"[\d,.]+×", row[-1]) for row in rows), rows


def test_rest_and_grpc_rows_have_server_cpu_per_request(quick_report):
    markdown = (quick_report / "benchmarks.md").read_text()
    rows = table_rows(markdown, "| protocol | users | requests")
    assert [(row[0], row[1]) for row in rows] == [
        (protocol, users) for users in ("1", "5") for protocol in ("REST (HTTP/JSON)", "gRPC (TensorProto)")]
    for protocol, users, requests, failures, *_, cpu_per_request, locust_cpu in rows:
        assert int(requests) > 0 and int(failures) == 0, (protocol, users)
        assert is_number(cpu_per_request), (protocol, users)
    assert re.search(r"- 5 users: server CPU per request [\d.]+ ms over REST, [\d.]+ ms over gRPC", markdown)


def test_new_section_compares_the_closed_loop_with_the_models_own_ceiling(quick_report):
    markdown = (quick_report / "benchmarks.md").read_text()
    assert "## 7. Closed loop against the model's own ceiling" in markdown
    rows = table_rows(markdown, "| configuration | req/s | rows per call | ceiling rows/s")
    assert [row[0] for row in rows] == [f"`{config}`" for config in quick_configs()]
    for name, rps, batch_rows, ceiling, ratio, predict_wall, cpu, predict_cpu, other_cpu in rows:
        assert all(is_number(cell) for cell in (rps, batch_rows, ceiling, predict_wall, cpu, predict_cpu)), name
        assert re.fullmatch(r"[\d,]+%", ratio) and is_signed_number(other_cpu), name
    assert rows[1][2] == "1.0"  # the naive server never batches: every call is one row
    baseline = quick_configs()[0]
    assert re.search(rf"- `default` ÷ `{baseline}`: req/s [\d.,]+×; server CPU outside predict per request "
                     r"-?[\d.,]+× \(-?[\d.]+ against -?[\d.]+ ms\)", markdown)


def test_one_user_is_set_against_a_bare_call_after_idling(quick_run):
    out, work = quick_run
    after_idle = json.loads((work / "model_alone.json").read_text())["after_idle"]
    assert after_idle["calls"] == len(after_idle["wall_ms"]) == 2  # --quick's count
    one_user = {result["config"]: result["loads"]["1"]
                for result in json.loads((work / "results.json").read_text())["servers"]}
    rows = table_rows((out / "benchmarks.md").read_text(), "| configuration | 1 user mean ms")
    assert [row[0] for row in rows] == [f"`{config}`" for config in quick_configs()]
    for name, mean, p50, bare, difference in rows:
        expected = one_user[name.strip("`")]["mean_ms"] - after_idle["mean_ms"]
        assert bare == benchmark.fmt(after_idle["mean_ms"], 2) and is_number(bare), name
        assert difference == benchmark.fmt(expected, 2) and is_signed_number(difference), name


def test_servers_run_with_their_default_access_log(quick_run):
    """The access log is part of each request's cost: every answered /predict is logged."""
    _, work = quick_run
    results = json.loads((work / "results.json").read_text())
    default = next(result for result in results["servers"] if result["config"] == "default")
    answered = sum(stats["requests"] for stats in default["loads"].values())
    logged = (work / "gunicorn-default.log").read_text().count("path=/predict status=200")
    assert answered > 0 and logged >= answered


def observed_metrics(calls: list[tuple[str, int, float]], metrics: Metrics | None = None) -> str:
    """A real /metrics page after predict calls of (model, real rows, predict seconds)."""
    metrics = metrics or Metrics(CollectorRegistry())
    for model, rows, seconds in calls:
        metrics.observer(model).batch_done(rows=rows, requests=rows, padded_rows=0, predict_s=seconds)
    return generate_latest(metrics.registry).decode()


def test_calls_per_padded_batch_size_from_the_metrics_page(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = Metrics(CollectorRegistry())
    before = benchmark.metric_snapshot(observed_metrics([("a", 1, 0.25), ("a", 3, 0.5)], metrics))
    # Two models: the page has one series each, added up. Real rows r are padded to the next power of 2.
    after = benchmark.metric_snapshot(observed_metrics(
        [("a", 1, 0.125), ("b", 2, 0.25), ("a", 3, 0.5), ("b", 5, 1.0), ("a", 32, 2.0), ("b", 17, 0.125)], metrics))
    delta = benchmark.batch_delta(before, after, bucket_sizes(32))
    assert delta == benchmark.BatchDelta(calls_per_bucket={1: 1, 2: 1, 4: 1, 8: 1, 32: 2}, rows=60, calls=6,
                                         predict_s=4.0)


def test_a_max_batch_size_off_the_powers_of_two_pads_to_itself(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = Metrics(CollectorRegistry())
    empty = benchmark.metric_snapshot(observed_metrics([], metrics))
    # The histogram's bucket le=64 holds 33..64 rows; with MAX_BATCH_SIZE 48 the server padded them to 48.
    after = benchmark.metric_snapshot(observed_metrics([("m", 40, 0.5), ("m", 20, 0.5)], metrics))
    assert benchmark.batch_delta(empty, after, bucket_sizes(48)).calls_per_bucket == {48: 1, 32: 1}


def timing(median_ms: float, cpu_ms_per_call: float) -> benchmark.CallTiming:
    """Only the median and the CPU per call enter the ceiling; the other figures are never read."""
    return benchmark.CallTiming(calls=3, median_ms=median_ms, mean_ms=median_ms, items_per_s=0.0,
                                cpu_ms_per_call=cpu_ms_per_call, cpu_ms_per_row=0.0)


TIMINGS = {1: timing(10.0, 8.0), 4: timing(20.0, 16.0), 8: timing(40.0, 30.0)}


def test_ceiling_ratio_and_cpu_split_at_the_batches_the_server_ran():
    # 2 calls at batch 1 and 3 padded to 4: 14 real rows; the model alone needs 2 x 10 + 3 x 20 = 80 ms.
    batches = benchmark.BatchDelta(calls_per_bucket={1: 2, 4: 3}, rows=14, calls=5, predict_s=0.7)
    figures = benchmark.ceiling_figures(batches, TIMINGS, requests=14, rps=7.0, server_cpu_s=0.5)
    assert dataclasses.asdict(figures) == pytest.approx({
        "mean_batch_rows": 14 / 5,
        "ceiling_rows_per_s": 14 / 0.080,  # 175 rows/s
        "ratio": 7.0 / 175,
        "predict_wall_ms_per_request": 700 / 14,
        "cpu_ms_per_request": 500 / 14,
        "predict_cpu_ms_per_request": (2 * 8 + 3 * 16) / 14,  # 64 ms of the model's own CPU
        "other_cpu_ms_per_request": (500 - 64) / 14,
    }, rel=1e-12)


def test_no_ceiling_for_a_batch_size_part_one_did_not_time():
    batches = benchmark.BatchDelta(calls_per_bucket={1: 1, 16: 1}, rows=10, calls=2, predict_s=0.1)
    figures = benchmark.ceiling_figures(batches, TIMINGS, requests=10, rps=5.0, server_cpu_s=0.2)
    assert figures.ceiling_rows_per_s is None and figures.ratio is None
    assert figures.other_cpu_ms_per_request is None
    assert figures.cpu_ms_per_request == pytest.approx(20.0) and figures.mean_batch_rows == 5.0


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def test_baseline_tree_is_the_commit_and_is_removed_even_on_error():
    with pytest.raises(RuntimeError, match="inside"):
        with benchmark.baseline_tree("HEAD") as (tree, short_sha):
            assert short_sha == git("rev-parse", "--short", "HEAD")
            assert (tree / "gunicorn.conf.py").read_text() == git("show", "HEAD:gunicorn.conf.py") + "\n"
            assert str(tree) in git("worktree", "list")
            config = benchmark.baseline_config(tree, short_sha)
            assert (config.name, config.workers, config.env, config.tree) == (f"baseline@{short_sha}", 1, {}, tree)
            raise RuntimeError("inside")
    assert not tree.exists()
    assert str(tree) not in git("worktree", "list")


def test_baseline_server_ran_from_its_own_tree(quick_run):
    _, work = quick_run
    cwd = {result["config"]: result["cwd"] for result in json.loads((work / "results.json").read_text())["servers"]}
    baseline = quick_configs()[0]
    assert cwd["default"] == str(REPO) and cwd["naive"] == str(REPO)
    assert cwd[baseline] != str(REPO) and "benchmark-baseline-" in cwd[baseline]


def test_locust_starts_every_user_at_once_unless_given_a_spawn_rate(tmp_path):
    """Locust starts floor(rate) users a step, one step a second: -r = users starts them together."""
    load = benchmark.Load("50", 50, (1.0, 3.0))

    def rate(command):
        return command[command.index("-r") + 1], command[command.index("-u") + 1]

    together = benchmark.locust_command("http://x", load, duration_s=60, prefix=tmp_path / "p")
    assert rate(together) == ("50", "50")
    ramped = benchmark.locust_command("http://x", load, duration_s=60, prefix=tmp_path / "p", spawn_rate=10)
    assert rate(ramped) == ("10", "50")
    assert benchmark.spawning(None).startswith("all users started at once")
    assert benchmark.spawning(10.0) == "users started 10 a second"
    assert benchmark.parse_args(["--spawn-rate", "2.5"]).spawn_rate == 2.5
    for bad in ("0", "-1", "nan", "x"):
        with pytest.raises(SystemExit):
            benchmark.parse_args(["--spawn-rate", bad])


def test_rounds_alternate_the_order_and_keep_each_rounds_results_in_configuration_order(monkeypatch, tmp_path):
    """A B, B A, A B: a machine that speeds up or slows down over the run favours neither side."""
    ran = []

    def run_config(config, loads, args, work_dir, *, tag=""):
        ran.append((config.name, tag))
        return types.SimpleNamespace(config=config.name, tag=tag)

    monkeypatch.setattr(measure, "run_config", run_config)
    configs = [benchmark.CONFIGS_BY_NAME["naive"], benchmark.CONFIGS_BY_NAME["default"]]
    args = benchmark.parse_args(["--rounds", "3"])
    rounds = benchmark.run_rounds(configs, [], args, tmp_path)
    assert ran == [("naive", "-round1"), ("default", "-round1"), ("default", "-round2"), ("naive", "-round2"),
                   ("naive", "-round3"), ("default", "-round3")]
    assert [[(result.config, result.tag) for result in results] for results in rounds] == [
        [("naive", f"-round{number}"), ("default", f"-round{number}")] for number in (1, 2, 3)]
    ran.clear()
    assert benchmark.run_rounds(configs, [], benchmark.parse_args([]), tmp_path) == [
        [types.SimpleNamespace(config="naive", tag=""), types.SimpleNamespace(config="default", tag="")]]
    for bad in ("0", "-2", "1.5", "x", "2,3"):
        with pytest.raises(SystemExit):
            benchmark.parse_args(["--rounds", bad])


def test_rounds_report_the_median_of_each_rounds_ratio_not_the_ratio_of_medians():
    """Three rounds, the default's req/s 1.2, 1.5 and 1.4 times the baseline's; the median ratio is
    1.40 where the ratio of the median req/s would be 300 / 240 = 1.25."""
    closed = benchmark.Load(benchmark.CLOSED_LOOP_LABEL, 32, (0.0, 0.0))
    one = benchmark.Load("1", 1, (1.0, 3.0))

    def stats(rps, mean):
        return benchmark.LoadStats(rps=rps, mean_ms=mean, p99_ms=2 * mean)

    rounds = [[benchmark.ConfigResult("baseline@abc", {"1": stats(1, 10.0), closed.label: stats(250, 100.0)}),
               benchmark.ConfigResult("default", {"1": stats(1, 8.0), closed.label: stats(300, 80.0)})]
              for _ in range(3)]
    for results, (base_rps, rps) in zip(rounds, [(250, 300), (200, 300), (240, 336)]):
        results[0].loads[closed.label].rps, results[1].loads[closed.label].rps = base_rps, rps
    configs = {"baseline@abc": benchmark.Config("baseline@abc", 1, {}, "", True), "default": benchmark.CONFIGS_BY_NAME["default"]}
    alone = benchmark.ModelAlone(batches=[], after_idle=benchmark.AfterIdle(
        calls=0, think_s=(1.0, 3.0), mean_ms=0.0, median_ms=0.0, wall_ms=[]))
    lines = benchmark.round_lines(rounds, configs, alone, [one, closed])
    assert "| **median** | **1.00** | **10.00** | **20.00** | **1.00** | **8.00** | **16.00** | **1.25×** |" in lines
    assert lines.index("### 1 user") < lines.index("### The closed loop")
    closed_rows = lines[lines.index("### The closed loop"):]
    assert "| 2 | 200 | 100 | 200 | – | 300 | 80.00 | 160 | – | 1.50× |" in closed_rows
    assert "| **median** | **240** | **100** | **200** | **–** | **300** | **80.00** | **160** | **–** | **1.40×** |" in closed_rows


def test_the_floor_runs_only_when_named_and_serves_the_floor_app():
    """The floor is a comparison, not a server configuration: a full run leaves it out,
    --configs floor runs scripts/floor_app.py under the same gunicorn.conf.py."""
    assert "floor" not in benchmark.parse_args([]).configs
    assert benchmark.parse_args(["--configs", "default,floor"]).configs == ["default", "floor"]
    assert "floor-batcher" not in benchmark.parse_args([]).configs
    floor, floor_batcher = benchmark.CONFIGS_BY_NAME["floor"], benchmark.CONFIGS_BY_NAME["floor-batcher"]
    assert floor.app == floor_batcher.app == ("--pythonpath", "scripts", "floor_app:app")
    assert floor.tree == floor_batcher.tree == benchmark.REPO
    assert "FLOOR_BATCHER" not in floor.env and floor_batcher.env["FLOOR_BATCHER"] == "true"


def test_a_configuration_runs_with_its_own_settings_only(monkeypatch, tmp_path):
    """The caller's server and Locust variables would change every configuration alike: none is inherited."""
    for name, value in {"MAX_BATCH_SIZE": "7", "BATCHING": "true", "LOCUST_ROWS": "3",
                        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "BENCHMARK_UNRELATED": "kept"}.items():
        monkeypatch.setenv(name, value)
    server = benchmark.Server(benchmark.CONFIGS_BY_NAME["naive"], model_path="model.keras", log_path=tmp_path / "n.log")
    assert {name: server.env.get(name) for name in ("MAX_BATCH_SIZE", "BATCHING", "PREDICT_METHOD", "LOCUST_ROWS",
                                                    "PROMETHEUS_MULTIPROC_DIR", "MODEL_PATH", "BENCHMARK_UNRELATED")
            } == {"MAX_BATCH_SIZE": None, "BATCHING": "false", "PREDICT_METHOD": "keras_predict", "LOCUST_ROWS": None,
                  "PROMETHEUS_MULTIPROC_DIR": None, "MODEL_PATH": "model.keras", "BENCHMARK_UNRELATED": "kept"}
    assert server.env["BIND"] == f"127.0.0.1:{server.port}" and server.log_path == tmp_path / "n.log"
    floor = benchmark.Server(benchmark.CONFIGS_BY_NAME["floor"], model_path=None, log_path=tmp_path / "f.log")
    assert floor.env["GRPC_BIND"] == "" and "MODEL_PATH" not in floor.env
    assert floor.command(workers=1)[-4:] == ["--pythonpath", "scripts", "floor_app:app", "--workers=1"]


@pytest.mark.parametrize("command", [["-m", "scripts.benchmark"], ["scripts/benchmark"]])
def test_both_documented_commands_start_the_benchmark(command):
    done = subprocess.run([sys.executable, *command, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m scripts.benchmark") and "--baseline-ref" in done.stdout
