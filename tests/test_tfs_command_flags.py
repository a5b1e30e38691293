"""TF Serving's testPrometheusEndpoint, testPredictUDS and testGoodGrpcChannelArgs, against this server.

tensorflow_model_server_test.py starts `tensorflow_model_server` through RunServer, whose
command line always carries --grpc_socket_path and --grpc_channel_arguments (with its own
`grpc.so_reuseaddr=1`); the three tests differ in --monitoring_config_file and the channel
arguments. Here one server, started through `python -m app.tfs_flags`, takes the union of
their flags (each test's own flags are a subset; none changes another's answer) with two
Gunicorn workers, so that the Unix socket is served by one of several. The assertions are
TF Serving's: '# TYPE' on the Prometheus page; Predict x=2.0 -> y=3.0, DT_FLOAT, one value,
model 'default', signature 'serving_default', version 123 (VerifyPredictRequest).
The server also takes TF Serving's documented `--enable_batching --batching_parameters_file=...`,
with the Sicara article's file, whose values reach the served model's batcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest
import requests
from tensorflow_serving.apis import prediction_service_pb2_grpc

from tests.conftest import REPO, Server, free_port, wait_for
from tests.test_tfs_flags import SICARA_BATCHING
from tests.tfs_models import (
    assert_y,
    predict_x,
    tfs_models,  # noqa: F401  (a fixture)
)

# TF Serving's testdata/monitoring_config.txt, as written.
MONITORING_CONFIG = 'prometheus_config: {\n  enable: true,\n  path: "/monitoring/prometheus/metrics"\n}\n'
# testGoodGrpcChannelArgs' arguments, and RunServer's own appended.
CHANNEL_ARGUMENTS = "grpc.max_connection_age_ms=2000,grpc.lb_policy_name=grpclb,grpc.so_reuseaddr=1"
RPC_TIMEOUT_S = 5.0  # RunServer's RPC_TIMEOUT
HTTP_REST_TIMEOUT_MS = 5000
WORKERS = 2


@pytest.fixture(scope="module")
def server(tfs_models, tmp_path_factory):  # noqa: F811
    files = tmp_path_factory.mktemp("tfs-command")
    (files / "monitoring_config.txt").write_text(MONITORING_CONFIG)
    (files / "batching.config").write_text(SICARA_BATCHING)
    running = Server(tmp_path_factory.mktemp("tfs-command-logs"), {"TFS_LISTEN_HOST": "127.0.0.1",
                                                                   "WORKERS": str(WORKERS)})
    running.grpc_target = f"127.0.0.1:{free_port()}"
    running.socket_path = str(files / "tf-serving.sock")
    command = [sys.executable, "-m", "app.tfs_flags", f"--port={running.grpc_target.split(':')[1]}",
               f"--rest_api_port={running.port}", f"--rest_api_timeout_in_ms={HTTP_REST_TIMEOUT_MS}",
               f"--grpc_socket_path={running.socket_path}", "--model_name=default",
               f"--model_base_path={tfs_models['half_plus_two']}",
               f"--monitoring_config_file={files / 'monitoring_config.txt'}",
               f"--grpc_channel_arguments={CHANNEL_ARGUMENTS}",
               "--enable_batching", f"--batching_parameters_file={files / 'batching.config'}"]
    running._log = open(running.log_path, "wb")  # noqa: SIM115  (Server.stop closes it)
    running.proc = subprocess.Popen(command, cwd=REPO, env=running.env, stdout=running._log, stderr=subprocess.STDOUT)
    try:
        running.wait_ready(workers=WORKERS)
        yield running
    finally:
        running.stop()


def predict(target: str):
    with grpc.insecure_channel(target) as channel:
        return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
            predict_x("default", 2.0, output_filter=False), RPC_TIMEOUT_S)


def socket_owners(server) -> list[int]:
    """The workers listening on a socket bound as PATH.<pid>.<n> (the one renamed to PATH)."""
    prefix = server.socket_path + "."
    return [process.pid for process in server.processes()[1:]
            if any(connection.laddr.startswith(prefix) for connection in process.net_connections(kind="unix"))]


def test_prometheus_endpoint(server):
    """testPrometheusEndpoint: the page at the config's path carries metric type information."""
    page = requests.get(f"{server.url}/monitoring/prometheus/metrics", timeout=60)
    assert page.status_code == 200
    assert "# TYPE" in page.text
    # The same families as /metrics: the same exposition, at the path the config names.
    families = {line for line in page.text.splitlines() if line.startswith("# TYPE")}
    assert families == {line for line in requests.get(f"{server.url}/metrics", timeout=60).text.splitlines()
                        if line.startswith("# TYPE")}


def test_the_sicara_batching_file_sets_the_served_models_batcher(server):
    """max_batch_size 20 and batch_timeout_micros 500000 (500 ms), and Predict answers with them."""
    served = requests.get(f"{server.url}/readyz", timeout=60).json()["models"]["default"]
    assert (served["max_batch_size"], served["batch_timeout_ms"]) == (20, 500.0)
    assert_y(predict(server.grpc_target), 3.0, model="default")


def test_predict_uds(server):
    """testPredictUDS: Predict over unix:PATH answers as over the port."""
    assert_y(predict(f"unix:{server.socket_path}"), 3.0, model="default")


def test_good_grpc_channel_args(server):
    """testGoodGrpcChannelArgs: the server starts with the arguments, and Predict answers."""
    assert_y(predict(server.grpc_target), 3.0, model="default")


def test_a_channel_argument_replaces_the_servers_own_value(server):
    """grpc.max_connection_age_ms=2000 replaces GRPC_CONNECTION_AGE_MS (10 minutes): the server
    sends GOAWAY to a two-second-old connection, and the client's channel leaves READY."""
    states: list[grpc.ChannelConnectivity] = []
    with grpc.insecure_channel(server.grpc_target) as channel:
        channel.subscribe(states.append)
        assert_y(prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
            predict_x("default", 2.0, output_filter=False), RPC_TIMEOUT_S), 3.0, model="default")
        # The callbacks come on grpc's own thread: READY may not be noted yet when Predict returns.
        wait_for(lambda: grpc.ChannelConnectivity.READY in states, what="the channel's READY")
        # Within 30 s: GRPC_CONNECTION_IDLE_MS (60 s) cannot be what ends the connection.
        wait_for(lambda: states[-1] != grpc.ChannelConnectivity.READY, within_s=30, what="the connection's GOAWAY")
    assert states[states.index(grpc.ChannelConnectivity.READY) + 1] == grpc.ChannelConnectivity.IDLE


def test_one_worker_serves_the_socket_and_another_takes_it_over_when_it_is_killed(server):
    owner, = socket_owners(server)
    others = {process.pid for process in server.processes()[1:]} - {owner}
    os.kill(owner, signal.SIGKILL)
    # The other worker holds the socket's lock once the kernel has released the dead one's.
    assert_y(wait_for(lambda: _predict_or_none(f"unix:{server.socket_path}"), within_s=60,
                      what="Predict on the socket after its worker died"), 3.0, model="default")
    # A worker that was waiting took over, not the master's replacement for the dead one.
    successor, = socket_owners(server)
    assert successor in others
    server.wait_ready(workers=WORKERS)  # the master's replacement for the killed worker, for later tests


def _predict_or_none(target: str):
    try:
        return predict(target)
    except grpc.RpcError:
        return None
