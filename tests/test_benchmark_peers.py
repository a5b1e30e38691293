"""The peers scenario's parts: which servers stand beside this one, how each is started and loaded.

The scenario itself runs PyTriton from a virtualenv of its own and is not run here; its runner is
the model-processes scenario's (tests/test_process_bench.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from app.ops.settings import Settings
from scripts.benchmark import common, layouts
from scripts.benchmark.__main__ import parse_args
from scripts.benchmark.load import locust_host


def test_peers_stand_this_server_beside_pytriton_and_the_flask_batcher_on_the_wide_model():
    args = parse_args(["peers"])
    assert (args.layouts, args.models) == (["default-1w", "pytriton", "flask-batcher"], ["wide"])
    assert args.out == common.DOCS / "peers-benchmark.md"
    processes = parse_args(["model-processes"])
    assert processes.layouts == ["default-1w", "default-2w", "default-4w", "procs-1w", "procs-2w", "procs-4w",
                                 "pytriton"]
    assert (processes.models, processes.out) == (["tiny", "wide"], common.DOCS / "model-processes-benchmark.md")


def test_the_flask_batcher_is_the_floor_app_under_the_same_gunicorn_configuration(tmp_path):
    args = parse_args(["peers"])
    flask = layouts.layout_server(layouts.LAYOUTS_BY_NAME["flask-batcher"], args, "m.keras", tmp_path / "f.log")
    assert flask.config.app == common.FLOOR_APP
    assert flask.env["GRPC_BIND"] == "" and flask.env["MODEL_PATH"] == "m.keras"
    assert "FLOOR_BATCHER" not in flask.env and flask.command(workers=1)[-4:] == [*common.FLOOR_APP, "--workers=1"]
    ours = layouts.layout_server(layouts.LAYOUTS_BY_NAME["procs-2w"], args, "m.keras", tmp_path / "p.log")
    assert (ours.config.workers, ours.env["MODEL_PROCESSES"], ours.config.app) == (2, "1", ("wsgi:app",))


def test_the_flask_batcher_gets_the_same_row_as_tf_servings_rest_body():
    rows = np.array([[0.1, -2.5, 1e-3]], dtype=np.float32)
    (row,) = json.loads(layouts.predict_body(rows))["instances"]
    assert np.array_equal(np.asarray([row], dtype=np.float32), rows)


def test_locust_host_is_http_for_rest_and_grpc_for_grpc(tmp_path):
    server = common.Server(common.Config("default", 1, {}, ""), model_path=None, log_path=tmp_path / "x.log")
    assert locust_host(server, "http") == locust_host(server, "v2") == server.url
    assert locust_host(server, "grpc") == locust_host(server, "v2-grpc") == f"grpc://{server.grpc_target}"


def test_pytriton_listens_on_the_ports_it_is_measured_on(tmp_path):
    server = layouts.PyTritonServer(python=Path("py"), model_path="m.keras", log_path=tmp_path / "p.log")
    command = server.command()
    flags = dict(zip(command[2::2], command[3::2], strict=True))
    assert command[:2] == ["py", str(layouts.PYTRITON_SCRIPT)]
    assert flags == {"--model-path": "m.keras", "--model-name": "default", "--http-port": str(server.port),
                     "--grpc-port": server.grpc_target.rsplit(":", 1)[1],
                     "--max-batch-size": str(Settings().max_batch_size)}
    assert server.url == f"http://127.0.0.1:{server.port}" and server.grpc_target.startswith("127.0.0.1:")
    assert server.metrics() is None
