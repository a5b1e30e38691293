"""TLS for gRPC from TF Serving's SSLConfig file, and its method-name check when asked for.

Certificates are made here with the openssl command: a CA that signs the server's and a
client's certificate, and a second CA whose client the server must refuse. A live server
runs with GRPC_SSL_CONFIG_FILE (client_verify on) and ENABLE_SIGNATURE_METHOD_NAME_CHECK;
TF Serving's stubs reach it over real secure channels.
"""

from __future__ import annotations

import json
import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import requests
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tensorflow_serving.apis import prediction_service_pb2_grpc

from app.grpc import tls
from tests.conftest import Server
from tests.test_grpc import examples_input, save_classify_regress
from tests.test_tfs_inference import (
    CLASSIFY_METHOD,
    REGRESS_METHOD,
    classify_request,
    multi_request,
    save_half_plus_two_tf2,
)

TIMEOUT_S = 60
METHOD_NAME_MESSAGE = ("Expected classification signature method_name to be tensorflow/serving/classify. "
                       "Was: tensorflow/serving/predict")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(folder: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=folder)


def make_signed(folder: Path, name: str, ca: str, *, server: bool = False) -> None:
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=folder)
    extensions = folder / f"{name}.ext"
    extensions.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n" if server else "extendedKeyUsage=clientAuth\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", extensions.name, cwd=folder)


def ssl_config_text(folder: Path, *, client_verify: bool, custom_ca: bool = True) -> str:
    """An SSLConfig in text format, the PEM texts inside it, as TF Serving's docs write one."""
    lines = [f"server_key: {json.dumps((folder / 'server.key').read_text())}",
             f"server_cert: {json.dumps((folder / 'server.pem').read_text())}"]
    if custom_ca:
        lines.append(f"custom_ca: {json.dumps((folder / 'ca.pem').read_text())}")
    lines.append(f"client_verify: {'true' if client_verify else 'false'}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("certificates")
    make_ca(folder, "ca")
    make_ca(folder, "other_ca")
    make_signed(folder, "server", "ca", server=True)
    make_signed(folder, "client", "ca")
    make_signed(folder, "stranger", "other_ca")
    return folder


def credentials(folder: Path, client: str | None) -> grpc.ChannelCredentials:
    root = (folder / "ca.pem").read_bytes()
    if client is None:
        return grpc.ssl_channel_credentials(root)
    return grpc.ssl_channel_credentials(root, (folder / f"{client}.key").read_bytes(),
                                        (folder / f"{client}.pem").read_bytes())


@pytest.fixture(scope="module")
def served(tmp_path_factory, certificates):
    folder = tmp_path_factory.mktemp("tls")
    save_half_plus_two_tf2(folder / "tf2")
    save_classify_regress(folder / "examples")
    config = folder / "models.json"
    config.write_text(json.dumps({"models": [{"name": "tf2", "path": str(folder / "tf2")},
                                             {"name": "examples", "path": str(folder / "examples")}]}))
    ssl_config = folder / "ssl_config.txt"
    ssl_config.write_text(ssl_config_text(certificates, client_verify=True))
    server = Server(folder, {"MODEL_CONFIG": str(config), "GRPC_SSL_CONFIG_FILE": str(ssl_config),
                             "ENABLE_SIGNATURE_METHOD_NAME_CHECK": "true", "MODEL_POLL_SECONDS": "0"})
    server.start()
    yield server
    server.stop()


def stub_for(server: Server, channel_credentials: grpc.ChannelCredentials | None):
    channel = (grpc.secure_channel(server.grpc_target, channel_credentials) if channel_credentials is not None
               else grpc.insecure_channel(server.grpc_target))
    return channel, prediction_service_pb2_grpc.PredictionServiceStub(channel)


# -- TLS --------------------------------------------------------------------------------------------


def test_a_client_with_a_certificate_the_ca_signed_is_served_over_tls(served, certificates):
    from tensorflow_serving.apis import classification_pb2

    request = classification_pb2.ClassificationRequest(input=examples_input([[1, 2]]))
    request.model_spec.name, request.model_spec.signature_name = "examples", "classify"
    channel, stub = stub_for(served, credentials(certificates, "client"))
    with channel:
        response, call = stub.Classify.with_call(request, timeout=TIMEOUT_S, metadata=(("x-request-id", "over-tls"),))

    assert [[(c.label, c.score) for c in row.classes] for row in response.result.classifications] == [
        [("neg", -3.0), ("pos", 3.0)]]
    # The id rides with the answer over TLS too (app/ops/patches.py, initial_metadata_with_the_answer).
    assert dict(call.initial_metadata())["x-request-id"] == "over-tls"


@pytest.mark.parametrize("client", [None, "stranger", "plaintext"])
def test_with_client_verify_a_client_without_a_trusted_certificate_is_refused(served, certificates, client):
    channel_credentials = None if client == "plaintext" else credentials(certificates, client)
    channel, stub = stub_for(served, channel_credentials)
    with channel, pytest.raises(grpc.RpcError) as raised:
        stub.Classify(classify_request("examples", "classify", [1.0]), timeout=TIMEOUT_S)

    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


def test_without_client_verify_any_client_that_trusts_the_server_is_served(tmp_path, certificates):
    """tls.add_port, as GrpcServer binds with it, on a bare gRPC server: client_verify false, no
    custom_ca; a plaintext client still gets nothing."""
    ssl_config = tmp_path / "ssl_config.txt"
    ssl_config.write_text(ssl_config_text(certificates, client_verify=False, custom_ca=False))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = tls.add_port(server, "127.0.0.1:0", str(ssl_config))
    server.start()
    try:
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials(certificates, None)) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as raised:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
    finally:
        server.stop(None)

    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("text, message", [
    ("server_key: 'k'\nserver_cert: 'c'\nclient_verifyy: true\n", "not an SSLConfig in text format"),
    ("server_key: 'k'\n", "server_key and server_cert are both required"),
    ("server_key: 'k'\nserver_cert: 'c'\nclient_verify: true\n", "client_verify needs custom_ca"),
])
def test_a_bad_ssl_config_names_the_file_and_the_fault(tmp_path, text, message):
    path = tmp_path / "ssl_config.txt"
    path.write_text(text)

    with pytest.raises(ValueError) as raised:
        tls.read_ssl_config(str(path))

    assert f"GRPC_SSL_CONFIG_FILE={str(path)!r}" in str(raised.value) and message in str(raised.value)


def test_an_ssl_config_reads_every_field_of_tf_servings_message(tmp_path, certificates):
    path = tmp_path / "ssl_config.txt"
    path.write_text(ssl_config_text(certificates, client_verify=True))

    config = tls.read_ssl_config(str(path))

    assert (config.server_key, config.server_cert, config.custom_ca, config.client_verify) == (
        (certificates / "server.key").read_text(), (certificates / "server.pem").read_text(),
        (certificates / "ca.pem").read_text(), True)


# -- ENABLE_SIGNATURE_METHOD_NAME_CHECK -----------------------------------------------------------


def test_with_the_method_name_check_a_tf2_signature_is_refused_over_grpc_and_rest(served, certificates):
    channel, stub = stub_for(served, credentials(certificates, "client"))
    with channel:
        with pytest.raises(grpc.RpcError) as classify:
            stub.Classify(classify_request("tf2", "classify_x_to_y", [2.0]), timeout=TIMEOUT_S)
        with pytest.raises(grpc.RpcError) as multi:
            stub.MultiInference(multi_request("tf2", [("regress_x_to_y", REGRESS_METHOD),
                                                      ("classify_x_to_y", CLASSIFY_METHOD)], [2.0]), timeout=TIMEOUT_S)
    rest = requests.post(served.url + "/v1/models/tf2:classify", timeout=TIMEOUT_S,
                         json={"signature_name": "classify_x_to_y", "examples": [{"x": 2.0}]})

    assert (classify.value.code(), classify.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, METHOD_NAME_MESSAGE)
    assert multi.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert multi.value.details() == ("Expected regression signature method_name to be tensorflow/serving/regress. "
                                     "Was: tensorflow/serving/predict")
    assert (rest.status_code, rest.json()["error"]) == (400, METHOD_NAME_MESSAGE)
