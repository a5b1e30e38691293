"""`tensorflow_model_server`'s command line, translated to this server's settings.

    python -m app.tfs_flags --port=8500 --rest_api_port=8501 --model_name=m --model_base_path=/models/m

starts the same Gunicorn server as the Dockerfile, with the environment the flags map to.
Flags are read as TensorFlow's flag parser reads them (`--name=value`, `-name=value`, a bare
`--name` for a boolean true) with TF Serving's defaults (model_servers/main.cc, server.h).
Each flag is one of three kinds:

- mapped: it sets one of our settings (`--port` sets GRPC_BIND, `--model_base_path`
  MODEL_PATH, `--model_config_file` MODEL_CONFIG, ...);
- accepted: it is allowed and changes nothing here, because what it tunes does not exist
  here (`--num_load_threads`) or is already what this server does;
- refused: a feature this server lacks, asked for with a value other than TF Serving's
  default (`--platform_config_file=...`, `--use_alts_credentials`). An unknown flag is refused
  too. Either stops start-up with a message naming the flag.

The ModelServerConfig (`--model_config_file`), BatchingParameters
(`--batching_parameters_file`) and MonitoringConfig (`--monitoring_config_file`) text formats
are parsed with protobuf's text_format into their messages, then written as our JSON model
config, batching settings and METRICS_PATH.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from app.ops.settings import (
    allowed,
    numeral,
    server_knob,
    validate_grpc_channel_arguments,
    validate_metrics_path,
    validate_socket_path,
)

# FlagError and the ModelServerConfig reading live below the settings (app/ops/tfs_config.py), which read
# MODEL_CONFIG's text format with them; the flags' tests and callers find them here too.
from app.ops.tfs_config import FlagError, model_config_document, model_config_json  # noqa: F401

MAPPED, ACCEPTED, REFUSED = "mapped", "accepted", "refused"
# TF Serving's REST port in its Docker image and docs; this server always answers HTTP.
DEFAULT_REST_PORT = 8501
# max_enqueued_batches x max_batch_size can reach millions of rows (TF Serving's own test file
# asks for 128 million); the queue also sets the threads each Gunicorn worker starts, so it is capped.
MAX_QUEUE_ROWS_CAP = 1024
# PrometheusExporter::kPrometheusPath: where an enabled prometheus_config without a path serves.
PROMETHEUS_PATH = "/monitoring/prometheus/metrics"


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    raise ValueError("expected true or false")


def _int(text: str) -> int:
    return int(numeral(text.strip()))


def _float(text: str) -> float:
    return float(numeral(text.strip()))


def _text(text: str) -> str:
    return text


@dataclasses.dataclass(frozen=True)
class Flag:
    name: str
    parse: Callable[[str], Any]
    default: Any
    kind: str
    help: str


def _flags() -> dict[str, Flag]:
    """Every flag of tensorflow_model_server, its default there, and what it does here."""
    table = [
        ("port", _int, 8500, MAPPED, "GRPC_BIND=0.0.0.0:PORT; 0: no gRPC"),
        ("rest_api_port", _int, 0, MAPPED, f"BIND=0.0.0.0:PORT; 0: {DEFAULT_REST_PORT} (HTTP is never off here)"),
        ("rest_api_timeout_in_ms", _int, 30000, MAPPED, "REQUEST_TIMEOUT_MS"),
        ("rest_api_num_threads", _int, 0, MAPPED, "THREADS (per worker); 0: derived"),
        ("model_name", _text, "default", MAPPED, "MODEL_NAME"),
        ("model_base_path", _text, "", MAPPED, "MODEL_PATH"),
        ("model_config_file", _text, "", MAPPED, "MODEL_CONFIG (written as JSON from the ModelServerConfig)"),
        ("file_system_poll_wait_seconds", _int, 1, MAPPED, "MODEL_POLL_SECONDS"),
        ("enable_batching", _bool, False, MAPPED, "BATCHING"),
        ("batching_parameters_file", _text, "", MAPPED, "MAX_BATCH_SIZE, BATCH_TIMEOUT_MS, MAX_QUEUE_ROWS"),
        ("tensorflow_intra_op_parallelism", _int, 0, MAPPED, "TF_INTRA_OP_THREADS"),
        ("tensorflow_inter_op_parallelism", _int, 0, MAPPED, "TF_INTER_OP_THREADS"),
        ("tensorflow_session_parallelism", _int, 0, MAPPED, "TF_INTRA_OP_THREADS and TF_INTER_OP_THREADS"),
        ("saved_model_tags", _text, "", ACCEPTED, "only 'serve' (the MetaGraph loaded here)"),
        ("enable_model_warmup", _bool, True, MAPPED,
         "ENABLE_MODEL_WARMUP: assets.extra/tf_serving_warmup_requests replayed before a version serves"),
        ("num_request_iterations_for_warmup", _int, 0, ACCEPTED, "no effect"),
        ("num_load_threads", _int, 0, ACCEPTED, "no effect: each worker loads its models"),
        ("num_unload_threads", _int, 0, ACCEPTED, "no effect"),
        ("max_num_load_retries", _int, 5, ACCEPTED, "no effect: a new version is retried at each poll"),
        ("load_retry_interval_micros", _int, 60_000_000, ACCEPTED, "no effect"),
        ("flush_filesystem_caches", _bool, True, ACCEPTED, "no effect"),
        ("grpc_max_threads", _int, 0, ACCEPTED, "no effect: gRPC shares the worker's threads"),
        ("enable_profiler", _bool, True, ACCEPTED, "no effect: there is no profiler service"),
        ("skip_initialize_tpu", _bool, False, ACCEPTED, "no effect"),
        ("enable_signature_method_name_check", _bool, False, MAPPED, "ENABLE_SIGNATURE_METHOD_NAME_CHECK"),
        ("enable_serialization_as_tensor_content", _bool, False, MAPPED, "GRPC_TENSOR_CONTENT"),
        ("model_config_file_poll_wait_seconds", _int, 0, MAPPED,
         "MODEL_CONFIG_POLL_SECONDS; above 0, MODEL_CONFIG is the file itself, read again at each poll"),
        ("grpc_socket_path", _text, "", MAPPED,
         "GRPC_SOCKET_PATH (made absolute): gRPC also on this Unix socket, from one worker at a time"),
        ("grpc_channel_arguments", _text, "", MAPPED,
         "GRPC_CHANNEL_ARGUMENTS: passed to every worker's gRPC server, replacing its own values"),
        ("ssl_config_file", _text, "", MAPPED, "GRPC_SSL_CONFIG_FILE: TLS for gRPC from TF Serving's SSLConfig"),
        ("monitoring_config_file", _text, "", MAPPED,
         f"METRICS_PATH: prometheus_config's path (`{PROMETHEUS_PATH}` when unset) if enabled; "
         "/metrics serves them too"),
        ("per_process_gpu_memory_fraction", _float, 0.0, MAPPED,
         "GPU_MEMORY_FRACTION, 0 to 1 (above 1, TF Serving's unified memory, is refused)"),
        ("rest_api_enable_cors_support", _bool, False, REFUSED, "no CORS headers"),
        ("platform_config_file", _text, "", REFUSED, "TensorFlow SavedModels only"),
        ("prefer_tflite_model", _bool, False, REFUSED, "no TensorFlow Lite"),
        ("use_alts_credentials", _bool, False, REFUSED, "no ALTS"),
        ("enable_grpc_healthcheck_service", _bool, False, ACCEPTED,
         "no effect: grpc.health.v1.Health is always served"),
        ("allow_version_labels_for_unavailable_models", _bool, False, REFUSED, "labels name loaded versions"),
        ("thread_pool_factory_config_file", _text, "", REFUSED, "no thread pool factory"),
        ("mixed_precision", _text, "", REFUSED, "no mixed precision mode"),
        ("version", _bool, False, REFUSED, "no version display"),
    ]
    return {name: Flag(name, parse, default, kind, help) for name, parse, default, kind, help in table}


FLAGS = _flags()


def markdown_table() -> str:
    """The flags table of docs/tf-serving.md, made from FLAGS so the page cannot drift from the code."""
    def shown(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        return f'"{value}"' if isinstance(value, str) else str(value)

    rows = ["| flag | TF Serving's default | here | what it does here |", "|---|---|---|---|"]
    for kind in (MAPPED, ACCEPTED, REFUSED):
        rows += [f"| `--{flag.name}` | `{shown(flag.default)}` | {kind} | {flag.help} |"
                 for flag in FLAGS.values() if flag.kind == kind]
    return "\n".join(rows) + "\n"


def parse_flags(argv: Sequence[str]) -> dict[str, Any]:
    """Flag name -> value for every flag given, checked; an unknown or refused one raises FlagError."""
    values: dict[str, Any] = {}
    for arg in argv:
        if not arg.startswith("-") or arg in ("-", "--"):
            raise FlagError(f"unexpected argument {arg!r}: tensorflow_model_server takes only --flag=value")
        name, has_value, text = arg.lstrip("-").partition("=")
        flag = FLAGS.get(name)
        if flag is None:
            raise FlagError(f"unknown flag --{name}: tensorflow_model_server has no such flag")
        if not has_value:
            if flag.parse is not _bool:
                raise FlagError(f"--{name} needs a value: --{name}=...")
            text = "true"
        try:
            value = flag.parse(text)
        except ValueError as exc:
            raise FlagError(f"--{name}={text}: {exc}") from None
        if flag.kind == REFUSED and value != flag.default:
            raise FlagError(f"--{name}={text} is not supported by this server ({flag.help})")
        if name == "saved_model_tags" and value not in ("", "serve"):
            raise FlagError(f"--saved_model_tags={text}: only the 'serve' MetaGraph is loaded here")
        _check(name, text, value)
        values[name] = value
    return values


def _check(name: str, text: str, value: Any) -> None:
    """What a mapped flag's setting would refuse at start, refused now with the flag's name."""
    if name == "per_process_gpu_memory_fraction" and not 0 <= value <= 1:
        raise FlagError(f"--{name}={text}: must be from 0 to 1 here; above 1 (unified memory) is not supported")
    if name == "grpc_channel_arguments":
        try:
            validate_grpc_channel_arguments(value)
        except ValueError:
            raise FlagError(f"--{name}={text}: expected {allowed(validate_grpc_channel_arguments)}") from None
    if name == "grpc_socket_path":
        try:
            validate_socket_path(value)
        except ValueError:
            raise FlagError(f"--{name}={text}: expected {allowed(validate_socket_path)}") from None


# BatchingParameters (servables/tensorflow/session_bundle_config.proto) is not in the
# tensorflow-serving-api package: its fields, for a message built here to parse the text.
_BATCHING_FIELDS = [
    ("max_batch_size", 1, "Int64Value"), ("batch_timeout_micros", 2, "Int64Value"),
    ("max_enqueued_batches", 3, "Int64Value"), ("num_batch_threads", 4, "Int64Value"),
    ("thread_pool_name", 5, "StringValue"), ("allowed_batch_sizes", 6, None),
    ("pad_variable_length_inputs", 7, None), ("enable_large_batch_splitting", 8, "BoolValue"),
    ("max_execution_batch_size", 9, "Int64Value"),
]


def _batching_message() -> Any:
    from google.protobuf import (
        descriptor_pb2,
        descriptor_pool,
        message_factory,
        wrappers_pb2,
    )

    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
    file = descriptor_pb2.FileDescriptorProto(name="batching_parameters.proto", package="tensorflow.serving",
                                              syntax="proto3", dependency=["google/protobuf/wrappers.proto"])
    message = file.message_type.add(name="BatchingParameters")
    kinds = descriptor_pb2.FieldDescriptorProto
    for name, number, wrapper in _BATCHING_FIELDS:
        field = message.field.add(name=name, number=number)
        if wrapper:
            field.type, field.type_name = kinds.TYPE_MESSAGE, f".google.protobuf.{wrapper}"
            field.label = kinds.LABEL_OPTIONAL
        elif name == "allowed_batch_sizes":
            field.type, field.label = kinds.TYPE_INT64, kinds.LABEL_REPEATED
        else:
            field.type, field.label = kinds.TYPE_BOOL, kinds.LABEL_OPTIONAL
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.serving.BatchingParameters"))()


def batching_settings(text: str) -> dict[str, str]:
    """A BatchingParameters in text format, as our batching settings (environment names).

    max_batch_size -> MAX_BATCH_SIZE; batch_timeout_micros -> BATCH_TIMEOUT_MS;
    max_enqueued_batches x max_batch_size -> MAX_QUEUE_ROWS (at most MAX_QUEUE_ROWS_CAP).
    num_batch_threads, thread_pool_name, allowed_batch_sizes, enable_large_batch_splitting
    and max_execution_batch_size are accepted without effect: here one thread per signature
    runs batches, padded to warmed sizes of its own, and large requests are always split.
    pad_variable_length_inputs -> PAD_VARIABLE_LENGTH=true, padding with PAD_VALUE (0) rather than
    TF Serving's first element, and only where the start-up check finds the model masks padding.
    """
    from google.protobuf import text_format

    parameters = _batching_message()
    try:
        text_format.Parse(text, parameters)
    except text_format.ParseError as exc:
        raise FlagError(f"Error parsing text-format tensorflow.serving.BatchingParameters: {exc}") from None
    settings: dict[str, str] = {}
    if parameters.pad_variable_length_inputs:
        settings["PAD_VARIABLE_LENGTH"] = "true"
    size = parameters.max_batch_size.value if parameters.HasField("max_batch_size") else None
    if size is not None:
        if size < 1:
            raise FlagError(f"--batching_parameters_file: max_batch_size must be at least 1; got {size}")
        settings["MAX_BATCH_SIZE"] = str(size)
    if parameters.HasField("batch_timeout_micros"):
        micros = parameters.batch_timeout_micros.value
        if micros < 0:
            raise FlagError(f"--batching_parameters_file: batch_timeout_micros must not be negative; got {micros}")
        settings["BATCH_TIMEOUT_MS"] = f"{micros / 1000:g}"
    if parameters.HasField("max_enqueued_batches"):
        batches = parameters.max_enqueued_batches.value
        if batches < 1:
            raise FlagError(f"--batching_parameters_file: max_enqueued_batches must be at least 1; got {batches}")
        # TF Serving's default max_batch_size is 1000 when the file does not set it.
        settings["MAX_QUEUE_ROWS"] = str(min(batches * (size or 1000), MAX_QUEUE_ROWS_CAP))
    return settings


# MonitoringConfig (config/monitoring_config.proto) is not in the tensorflow-serving-api package
# either: declared here with its field numbers, in a pool of its own, to parse the text.
def _monitoring_config() -> Any:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    file = descriptor_pb2.FileDescriptorProto(name="tensorflow_serving/config/monitoring_config.proto",
                                              package="tensorflow.serving", syntax="proto3")
    kinds = descriptor_pb2.FieldDescriptorProto
    prometheus = file.message_type.add(name="PrometheusConfig")
    prometheus.field.add(name="enable", number=1, type=kinds.TYPE_BOOL, label=kinds.LABEL_OPTIONAL)
    prometheus.field.add(name="path", number=2, type=kinds.TYPE_STRING, label=kinds.LABEL_OPTIONAL)
    file.message_type.add(name="MonitoringConfig").field.add(
        name="prometheus_config", number=1, type=kinds.TYPE_MESSAGE, label=kinds.LABEL_OPTIONAL,
        type_name=".tensorflow.serving.PrometheusConfig")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.serving.MonitoringConfig"))()


def metrics_path(text: str) -> str:
    """A MonitoringConfig in text format, as METRICS_PATH: empty unless prometheus_config is enabled,
    then its path, or TF Serving's own when it names none (model_servers/http_server.cc)."""
    from google.protobuf import text_format

    config = _monitoring_config()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise FlagError(f"Error parsing text-format tensorflow.serving.MonitoringConfig: {exc}") from None
    if not config.prometheus_config.enable:
        return ""
    path = config.prometheus_config.path or PROMETHEUS_PATH
    try:
        return validate_metrics_path(path)
    except ValueError:
        raise FlagError(f"--monitoring_config_file: prometheus_config path {path!r}: expected "
                        f"{allowed(validate_metrics_path)}") from None


def environment(values: Mapping[str, Any], *, read: Callable[[str], str], config_dir: str,
                host: str = "0.0.0.0") -> dict[str, str]:
    """The settings (environment variables) the parsed flags map to. `read` reads a config
    file; a ModelServerConfig becomes a JSON file in `config_dir`. Ports listen on `host`,
    all interfaces as TF Serving's do unless TFS_LISTEN_HOST names one."""
    def value(name: str) -> Any:
        return values.get(name, FLAGS[name].default)

    env: dict[str, str] = {}
    port = value("port")
    env["GRPC_BIND"] = f"{host}:{port}" if port else ""
    env["BIND"] = f"{host}:{value('rest_api_port') or DEFAULT_REST_PORT}"
    if "rest_api_timeout_in_ms" in values:
        env["REQUEST_TIMEOUT_MS"] = str(value("rest_api_timeout_in_ms"))
    if value("rest_api_num_threads"):
        env["THREADS"] = str(value("rest_api_num_threads"))
    if value("enable_serialization_as_tensor_content"):
        env["GRPC_TENSOR_CONTENT"] = "true"
    if value("ssl_config_file"):
        env["GRPC_SSL_CONFIG_FILE"] = os.path.abspath(value("ssl_config_file"))
    if value("grpc_socket_path"):
        # Relative to where the command ran, as TF Serving's; Gunicorn runs from the repository.
        env["GRPC_SOCKET_PATH"] = os.path.abspath(value("grpc_socket_path"))
    if value("grpc_channel_arguments"):
        env["GRPC_CHANNEL_ARGUMENTS"] = value("grpc_channel_arguments")
    if value("per_process_gpu_memory_fraction"):
        env["GPU_MEMORY_FRACTION"] = repr(value("per_process_gpu_memory_fraction"))
    if value("monitoring_config_file"):
        path = metrics_path(_read(read, value("monitoring_config_file"), "monitoring_config_file"))
        if path:
            env["METRICS_PATH"] = path
    for flag, setting in (("enable_model_warmup", "ENABLE_MODEL_WARMUP"),
                          ("enable_signature_method_name_check", "ENABLE_SIGNATURE_METHOD_NAME_CHECK")):
        if flag in values:
            env[setting] = "true" if values[flag] else "false"
    env["MODEL_POLL_SECONDS"] = str(value("file_system_poll_wait_seconds"))
    env["BATCHING"] = "true" if value("enable_batching") else "false"
    env.update(_models(value, read=read, config_dir=config_dir))
    if value("batching_parameters_file"):
        if not value("enable_batching"):
            raise FlagError("--batching_parameters_file needs --enable_batching")
        env.update(batching_settings(_read(read, value("batching_parameters_file"), "batching_parameters_file")))
    session_threads = value("tensorflow_session_parallelism")
    for flag, setting in (("tensorflow_intra_op_parallelism", "TF_INTRA_OP_THREADS"),
                          ("tensorflow_inter_op_parallelism", "TF_INTER_OP_THREADS")):
        if value(flag) or session_threads:
            env[setting] = str(value(flag) or session_threads)
    return env


def _models(value: Callable[[str], Any], *, read: Callable[[str], str], config_dir: str) -> dict[str, str]:
    """The settings that name the models: a config file (polled, or read once into `config_dir`), or one base path."""
    if value("model_config_file") and value("model_config_file_poll_wait_seconds") > 0:
        # Read again at each poll, so the file itself, checked now.
        model_config_json(_read(read, value("model_config_file"), "model_config_file"))
        return {"MODEL_CONFIG": os.path.abspath(value("model_config_file")),
                "MODEL_CONFIG_POLL_SECONDS": str(value("model_config_file_poll_wait_seconds"))}
    if value("model_config_file"):
        config = model_config_json(_read(read, value("model_config_file"), "model_config_file"))
        path = os.path.join(config_dir, "model_config.json")
        with open(path, "w", encoding="utf-8") as config_file:
            json.dump(config, config_file)
        return {"MODEL_CONFIG": path}
    if value("model_base_path"):
        # Relative to where the command ran, as TF Serving's; Gunicorn runs from the repository.
        return {"MODEL_PATH": os.path.abspath(value("model_base_path")), "MODEL_NAME": value("model_name")}
    raise FlagError("--model_base_path or --model_config_file is required")


def check_model_base_path(values: Mapping[str, Any], env: Mapping[str, str]) -> None:
    """A --model_base_path that is not there stops start-up here, in words that name the flag the
    user gave: past this point it is MODEL_PATH, a variable they never set."""
    if "MODEL_PATH" in env and not os.path.exists(env["MODEL_PATH"]):
        raise FlagError(f"--model_base_path={values['model_base_path']}: no such file or folder")


def _read(read: Callable[[str], str], path: str, flag: str) -> str:
    try:
        return read(path)
    except OSError as exc:
        raise FlagError(f"--{flag}={path}: {exc.strerror or exc}") from None


def _read_file(path: str) -> str:
    with open(path, encoding="utf-8") as config_file:
        return config_file.read()


def gunicorn_command(env: Mapping[str, str], also_bind: Sequence[str] = ()) -> list[str]:
    """The Gunicorn command line; `also_bind`: addresses served beside BIND (given as -b, which
    replaces gunicorn.conf.py's single BIND)."""
    extra = [address for address in also_bind if address != env["BIND"]]
    binds = [arg for address in (env["BIND"], *extra) for arg in ("-b", address)] if extra else []
    return [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", *binds, "wsgi:app"]


def main(argv: Sequence[str] | None = None, *, also_bind: Sequence[str] = ()) -> None:
    """Translate the flags and replace this process with Gunicorn, run from the repository."""
    try:
        values = parse_flags(sys.argv[1:] if argv is None else argv)
        env = environment(values, read=_read_file, config_dir=tempfile.mkdtemp(prefix="tfs-flags-"),
                          host=os.environ.get("TFS_LISTEN_HOST") or server_knob("TFS_LISTEN_HOST").default)
        check_model_base_path(values, env)
    except FlagError as exc:
        sys.exit(f"tensorflow_model_server flags: {exc}")
    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.chdir(repository)
    os.execve(sys.executable, gunicorn_command(env, also_bind), {**os.environ, **env})


if __name__ == "__main__":
    main()
