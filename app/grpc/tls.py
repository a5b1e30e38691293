"""TLS for the gRPC API, from TensorFlow Serving's SSLConfig file (--ssl_config_file).

GRPC_SSL_CONFIG_FILE names a `tensorflow.serving.SSLConfig` in protobuf text format, as TF
Serving reads it (model_servers/server.cc, BuildServerCredentials):

    server_key: "-----BEGIN PRIVATE KEY-----\n..."
    server_cert: "-----BEGIN CERTIFICATE-----\n..."
    custom_ca: "-----BEGIN CERTIFICATE-----\n..."     # the CA that signs client certificates
    client_verify: true                               # clients must present one it signed

The PEM texts are inside the file, not paths to them. tensorflow-serving-api does not ship
ssl_config_pb2, so the message is declared here, with config/ssl_config.proto's field numbers.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

_FIELDS = (("server_key", 1, "TYPE_STRING"), ("server_cert", 2, "TYPE_STRING"), ("custom_ca", 3, "TYPE_STRING"),
           ("client_verify", 4, "TYPE_BOOL"))


def _ssl_config_class() -> type:
    proto = descriptor_pb2.FileDescriptorProto(name="tensorflow_serving/config/ssl_config.proto",
                                               package="tensorflow.serving", syntax="proto3")
    message = proto.message_type.add(name="SSLConfig")
    for name, number, kind in _FIELDS:
        message.field.add(name=name, number=number, type=descriptor_pb2.FieldDescriptorProto.Type.Value(kind),
                          label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    # A pool of its own: the real ssl_config_pb2, if some package brings it, registers the same name.
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.serving.SSLConfig"))


SSLConfig = _ssl_config_class()


def read_ssl_config(path: str) -> Any:
    """The SSLConfig in the text file at `path`; ValueError naming the file and the fault."""
    where = f"GRPC_SSL_CONFIG_FILE={path!r}"
    try:
        with open(path, encoding="utf-8") as config_file:
            config = text_format.Parse(config_file.read(), SSLConfig())
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it: {exc.strerror}") from None
    except text_format.ParseError as exc:
        raise ValueError(f"{where}: not an SSLConfig in text format: {exc}") from None
    if not config.server_key or not config.server_cert:
        raise ValueError(f"{where}: server_key and server_cert are both required")
    if config.client_verify and not config.custom_ca:
        # grpc's Python server needs the roots it checks client certificates against.
        raise ValueError(f"{where}: client_verify needs custom_ca, the CA that signs client certificates")
    return config


def server_credentials(path: str) -> grpc.ServerCredentials:
    config = read_ssl_config(path)
    return grpc.ssl_server_credentials(
        [(config.server_key.encode(), config.server_cert.encode())],
        root_certificates=config.custom_ca.encode() or None,
        require_client_auth=config.client_verify,
    )


def add_port(server: grpc.Server, bind: str, ssl_config_file: str | None) -> int:
    """Listen on `bind`: with TLS when an SSLConfig file is set, in plaintext otherwise; the port bound."""
    if not ssl_config_file:
        return server.add_insecure_port(bind)
    return server.add_secure_port(bind, server_credentials(ssl_config_file))
