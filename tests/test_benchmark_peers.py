"""scripts/benchmark/peers.py's pure parts: the report's tables, Locust's host, PyTriton's command line.

The benchmark itself runs PyTriton from a virtualenv of its own and is not run here.
"""

from __future__ import annotations

from pathlib import Path

from app.settings import Settings
from scripts import benchmark
from scripts.benchmark import peers
from scripts.benchmark.measure import locust_host


def stats(requests: int, rps: float, p50: float, p99: float, cpu_ms: float, cores: float) -> benchmark.LoadStats:
    return benchmark.LoadStats(requests=requests, rps=rps, p50_ms=p50, p99_ms=p99, server_cpu_ms_per_request=cpu_ms,
                               server_cpu_share=cores)


LOADS = [
    peers.PeerLoad(peers.OURS, "v2", 8, stats(1200, 40.0, 150.0, 400.0, 20.0, 0.8)),
    peers.PeerLoad(peers.OURS, "v2-grpc", 8, stats(1500, 50.0, 120.0, 300.0, 16.0, 0.8)),
    peers.PeerLoad(peers.PYTRITON, "v2", 8, stats(960, 32.0, 200.0, 500.0, 25.0, 0.8)),
    peers.PeerLoad(peers.PYTRITON, "v2-grpc", 8, stats(1500, 50.0, 120.0, 240.0, 32.0, 1.6)),
]


def test_peer_table_has_one_row_per_server_protocol_and_users():
    table = peers.peer_table(LOADS)
    assert table[0].startswith("| server | protocol | users | requests |")
    assert table[2:] == [
        "| this server | HTTP | 8 | 1,200 | 0 | 40.0 | 150 | 400 | 20.0 | 0.80 |",
        "| this server | gRPC | 8 | 1,500 | 0 | 50.0 | 120 | 300 | 16.0 | 0.80 |",
        "| PyTriton | HTTP | 8 | 960 | 0 | 32.0 | 200 | 500 | 25.0 | 0.80 |",
        "| PyTriton | gRPC | 8 | 1,500 | 0 | 50.0 | 120 | 240 | 32.0 | 1.60 |",
    ]


def test_ratio_table_divides_this_server_by_pytriton_per_protocol():
    assert peers.ratio_table(LOADS)[2:] == [
        "| HTTP | 8 | 1.25 | 0.75 | 0.80 |",
        "| gRPC | 8 | 1.00 | 1.00 | 0.50 |",
    ]


def test_ratio_table_leaves_out_a_side_that_was_not_measured():
    only_pytriton = [load for load in LOADS if load.server == peers.PYTRITON]
    assert peers.ratio_table(only_pytriton)[2:] == []
    missing_cpu = [LOADS[0], peers.PeerLoad(peers.PYTRITON, "v2", 8, benchmark.LoadStats(requests=5, rps=1.0))]
    assert peers.ratio_table(missing_cpu)[2:] == ["| HTTP | 8 | 40.00 | – | – |"]


def test_locust_host_is_http_for_rest_and_grpc_for_grpc(tmp_path):
    server = benchmark.Server(benchmark.CONFIGS_BY_NAME["default"], model_path=None, log_path=tmp_path / "x.log")
    assert locust_host(server, "http") == locust_host(server, "v2") == server.url
    assert locust_host(server, "grpc") == locust_host(server, "v2-grpc") == f"grpc://{server.grpc_target}"


def test_pytriton_listens_on_the_ports_it_is_measured_on(tmp_path):
    server = peers.PyTritonServer(python=Path("py"), model_path="m.keras", log_path=tmp_path / "p.log")
    command = server.command()
    flags = dict(zip(command[2::2], command[3::2], strict=True))
    assert command[:2] == ["py", str(peers.PYTRITON_SCRIPT)]
    assert flags == {"--model-path": "m.keras", "--model-name": "default", "--http-port": str(server.port),
                     "--grpc-port": server.grpc_target.rsplit(":", 1)[1],
                     "--max-batch-size": str(Settings().max_batch_size)}
    assert server.url == f"http://127.0.0.1:{server.port}" and server.grpc_target.startswith("127.0.0.1:")
    assert server.metrics() is None


def test_report_names_the_command_and_every_figure(tmp_path):
    run = peers.PeerRun(loads=LOADS, max_abs_difference=0.0)
    path = peers.write_report(tmp_path, run, argv=["--users", "8"], duration_s=30, started_at="then",
                              machine={"cores": "2"})
    text = path.read_text()
    assert "`python -m scripts.benchmark.peers --users 8`" in text
    assert "the largest difference between their scores was 0." in text
    assert "| PyTriton | gRPC | 8 | 1,500 | 0 | 50.0 | 120 | 240 | 32.0 | 1.60 |" in text
    assert "## Errors" not in text
