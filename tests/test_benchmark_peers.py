"""The peers scenario's pure parts: the page's tables, Locust's host, PyTriton's command line.

The scenario itself runs PyTriton from a virtualenv of its own and is not run here.
"""

from __future__ import annotations

from pathlib import Path

from app.settings import Settings
from scripts.benchmark import common, peers
from scripts.benchmark.load import LoadStats, locust_host


def stats(requests: int, rps: float, p50: float, p99: float, cpu_ms: float, cores: float) -> LoadStats:
    return LoadStats(requests=requests, rps=rps, p50_ms=p50, p99_ms=p99, server_cpu_ms_per_request=cpu_ms,
                     server_cpu_share=cores)


LOADS = [
    peers.PeerLoad(peers.OURS, "v2", 8, stats(1200, 40.0, 150.0, 400.0, 20.0, 0.8)),
    peers.PeerLoad(peers.OURS, "v2-grpc", 8, stats(1500, 50.0, 120.0, 300.0, 16.0, 0.8)),
    peers.PeerLoad(peers.OURS, "http", 8, stats(900, 30.0, 200.0, 450.0, 24.0, 0.8)),
    peers.PeerLoad(peers.PYTRITON, "v2", 8, stats(960, 32.0, 200.0, 500.0, 25.0, 0.8)),
    peers.PeerLoad(peers.PYTRITON, "v2-grpc", 8, stats(1500, 50.0, 120.0, 240.0, 32.0, 1.6)),
    peers.PeerLoad(peers.FLASK, "http", 8, stats(1800, 60.0, 100.0, 300.0, 12.0, 0.9)),
]


def test_peer_table_has_one_row_per_server_protocol_and_users():
    table = peers.peer_table(LOADS)
    assert table[0].startswith("| server | protocol | users | requests |")
    assert table[2:] == [
        "| this server | v2 HTTP | 8 | 1,200 | 0 | 40.0 | 150 | 400 | 20.0 | 0.80 |",
        "| this server | v2 gRPC | 8 | 1,500 | 0 | 50.0 | 120 | 300 | 16.0 | 0.80 |",
        "| this server | TF Serving REST | 8 | 900 | 0 | 30.0 | 200 | 450 | 24.0 | 0.80 |",
        "| PyTriton | v2 HTTP | 8 | 960 | 0 | 32.0 | 200 | 500 | 25.0 | 0.80 |",
        "| PyTriton | v2 gRPC | 8 | 1,500 | 0 | 50.0 | 120 | 240 | 32.0 | 1.60 |",
        "| Flask batcher | TF Serving REST | 8 | 1,800 | 0 | 60.0 | 100 | 300 | 12.0 | 0.90 |",
    ]


def test_ratio_table_divides_this_server_by_each_peer_per_protocol():
    assert peers.ratio_table(LOADS)[2:] == [
        "| PyTriton | v2 HTTP | 8 | 1.25 | 0.75 | 0.80 |",
        "| PyTriton | v2 gRPC | 8 | 1.00 | 1.00 | 0.50 |",
        "| Flask batcher | TF Serving REST | 8 | 0.50 | 2.00 | 2.00 |",
    ]


def test_ratio_table_leaves_out_a_side_that_was_not_measured():
    only_peers = [load for load in LOADS if load.server != peers.OURS]
    assert peers.ratio_table(only_peers)[2:] == []
    missing_cpu = [LOADS[0], peers.PeerLoad(peers.PYTRITON, "v2", 8, LoadStats(requests=5, rps=1.0))]
    assert peers.ratio_table(missing_cpu)[2:] == ["| PyTriton | v2 HTTP | 8 | 40.00 | – | – |"]


def test_each_side_is_loaded_over_the_protocols_it_speaks():
    assert {name: protocols for name, (_, protocols) in peers.SIDES.items()} == {
        peers.OURS: ("v2", "v2-grpc", "http", "grpc"), peers.PYTRITON: ("v2", "v2-grpc"), peers.FLASK: ("http",)}
    flask = peers.SIDES[peers.FLASK][0]
    assert flask.app == common.FLOOR_APP and flask.env == {"GRPC_BIND": ""}


def test_locust_host_is_http_for_rest_and_grpc_for_grpc(tmp_path):
    server = common.Server(peers.SIDES[peers.OURS][0], model_path=None, log_path=tmp_path / "x.log")
    assert locust_host(server, "http") == locust_host(server, "v2") == server.url
    assert locust_host(server, "grpc") == locust_host(server, "v2-grpc") == f"grpc://{server.grpc_target}"
    assert server.env["GRPC_MAX_STREAMS_PER_CONNECTION"] == "1000"


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


def test_page_gives_every_figure_and_the_answers_difference():
    text = "\n".join(peers.report_lines(peers.PeerRun(loads=LOADS, max_abs_difference=0.0), duration_s=30))
    assert "a closed loop of N Locust users for 30 s each" in text
    assert "the largest difference between their scores was 0." in text
    assert "| PyTriton | v2 gRPC | 8 | 1,500 | 0 | 50.0 | 120 | 240 | 32.0 | 1.60 |" in text
    assert "## Errors" not in text
    failed = peers.PeerRun(loads=LOADS, errors={peers.PYTRITON: "not run: python is missing"})
    assert peers.report_lines(failed, duration_s=30)[-2:] == ["", "- PyTriton: not run: python is missing"]
