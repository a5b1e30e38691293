"""scripts/benchmark.py --quick end to end: real servers, real Locust, a report and a plot.

Only the shape of the report is checked: timings are whatever the machine gives.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import REPO

# The plot needs it; pinned in requirements-dev.txt. Skipped (and listed by -ra) where it is missing.
pytest.importorskip("matplotlib")

BENCHMARK_TIMEOUT_S = 300
# The run happens in the first test's set-up: leave room past our own timeout to stop it cleanly.
pytestmark = pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 90)


def run_quick_benchmark(out, work_dir) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "scripts" / "benchmark.py"), "--quick", "--out", str(out),
               "--work-dir", str(work_dir)]
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


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark-out")
    run = run_quick_benchmark(out, tmp_path_factory.mktemp("benchmark-work"))
    assert run.returncode == 0, run.stdout[-5000:]
    return out


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
    assert [row[0] for row in rows] == ["1", "2", "4", "8"]
    for row in rows:
        assert all(is_number(cell) for cell in row[1:6]), row


def test_load_table_has_every_configuration_and_load_without_failures(quick_report):
    rows = table_rows((quick_report / "benchmarks.md").read_text(), "| configuration | users | requests | failures")
    assert [(row[0], row[1]) for row in rows] == [
        (f"`{config}`", load) for config in ("naive", "default") for load in ("1", "5", "closed loop")
    ]
    for config, load, requests, failures, mean, p50, p95, p99, rps, *_ in rows:
        assert int(failures) == 0, (config, load)
        if load == "closed loop":
            assert int(requests) > 0 and is_number(mean) and is_number(p99) and is_number(rps), (config, load)


def test_ratios_compare_the_default_with_the_naive_server(quick_report):
    rows = table_rows((quick_report / "benchmarks.md").read_text(), "| configuration | 1 user")
    assert rows[0][0] == "`naive`"
    assert re.fullmatch(r"[\d,.]+×", rows[0][-1]), rows


def test_rest_and_grpc_rows_have_server_cpu_per_request(quick_report):
    markdown = (quick_report / "benchmarks.md").read_text()
    rows = table_rows(markdown, "| protocol | users | requests")
    assert [(row[0], row[1]) for row in rows] == [
        (protocol, users) for users in ("1", "5") for protocol in ("REST (HTTP/JSON)", "gRPC (TensorProto)")]
    for protocol, users, requests, failures, *_, cpu_per_request, locust_cpu in rows:
        assert int(requests) > 0 and int(failures) == 0, (protocol, users)
        assert is_number(cpu_per_request), (protocol, users)
    assert re.search(r"- 5 users: server CPU per request [\d.]+ ms over REST, [\d.]+ ms over gRPC", markdown)
