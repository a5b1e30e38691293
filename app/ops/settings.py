"""Settings: read once from the environment, validated, frozen.

Each setting names its environment variable, its default and a small pure validator,
as Gunicorn's config does. A bad value stops start-up with a message that names the
variable, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from app.ops import queue_policy, tfs_config


class SettingsError(ValueError):
    pass


def numeral(value: str) -> str:
    """Number text as an environment or config file gives it: ASCII only. int() and float() would
    also read '１６' (fullwidth), Arabic-Indic digits and '1_000'; nothing else reading these does."""
    if not value.isascii() or "_" in value:
        raise ValueError
    return value


def validate_pos_int(value: str) -> int:
    number = int(numeral(value))
    if number < 1:
        raise ValueError
    return number


def validate_non_neg_int(value: str) -> int:
    number = int(numeral(value))
    if number < 0:
        raise ValueError
    return number


def validate_non_neg_float(value: str) -> float:
    number = float(numeral(value))
    if not number >= 0 or number == float("inf"):
        raise ValueError
    return number


def validate_finite_float(value: str) -> float:
    number = float(numeral(value))
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError
    return number


def validate_pos_float(value: str) -> float:
    number = float(numeral(value))
    if not 0 < number < float("inf"):
        raise ValueError
    return number


def validate_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError


def validate_choice(*choices: str) -> Callable[[str], str]:
    def validate(value: str) -> str:
        if value not in choices:
            raise ValueError
        return value

    validate.allowed = " or ".join(repr(choice) for choice in choices)  # type: ignore[attr-defined]
    return validate


# A header name that is also a valid gRPC metadata key: lowercase token characters, no "-bin"
# suffix (binary metadata) and no "grpc-" prefix (reserved).
_RESTRICTION_KEY = re.compile(r"[a-z0-9][a-z0-9_.-]*")


def validate_restriction(value: str) -> str:
    if not value:
        return ""
    key, equals, secret = value.partition("=")
    key = key.strip().lower()
    if not equals or not secret or not _RESTRICTION_KEY.fullmatch(key) or key.endswith("-bin") \
            or key.startswith("grpc-"):
        raise ValueError
    return f"{key}={secret}"


def _shown_restriction(raw: str) -> str:
    # The value is a credential: an error names the header but never what follows "=" (and all of
    # it when there is no "=", since then it may be the secret alone).
    key, equals, _ = raw.partition("=")
    return repr(f"{key}=<hidden>") if equals else "<hidden>"


validate_restriction.shown = _shown_restriction  # type: ignore[attr-defined]


# Triton's restricted API categories (src/restricted_features.h), in its spelling.
RESTRICTED_CATEGORIES = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
                         "statistics", "trace", "logging")
# One group of a restricted-API setting: the categories it restricts, the header and its value.
RestrictedGroup = tuple[tuple[str, ...], str, str]


def _restricted_groups(noun: str) -> Callable[[str], tuple[RestrictedGroup, ...]]:
    """A validator of Triton's `--http-restricted-api` / `--grpc-restricted-protocol` values, one
    `<category>[,<category>...]:<key>=<value>` group each, groups separated by ';'. As Triton
    refuses them: an unknown category, or one named in two groups (the words are its own)."""

    def validate(value: str) -> tuple[RestrictedGroup, ...]:
        groups: list[RestrictedGroup] = []
        seen: set[str] = set()
        for text in value.split(";") if value else []:
            names, colon, restriction = text.strip().partition(":")
            categories = tuple(name.strip() for name in names.split(","))
            if not colon or not all(categories):
                raise ValueError
            for category in categories:
                if category not in RESTRICTED_CATEGORIES:
                    raise SettingsError(f"unknown restricted {noun} '{category}'")
                if category in seen:
                    raise SettingsError(f"restricted {noun} '{category}' can not be specified in multiple "
                                        "config groups")
                seen.add(category)
            key, _, secret = validate_restriction(restriction).partition("=")
            groups.append((categories, key, secret))
        return tuple(groups)

    validate.shown = _shown_groups  # type: ignore[attr-defined]
    return validate


def _shown_groups(raw: str) -> str:
    # Categories and keys are shown, never a value.
    return repr(";".join(f"{names}:{key}=<hidden>" if equals else "<hidden>"
                         for names, _, rest in (group.partition(":") for group in raw.split(";"))
                         for key, equals, _ in [rest.partition("=")]))


validate_restricted_api = _restricted_groups("api")
validate_restricted_protocol = _restricted_groups("protocol")


# Matched with fullmatch: "$" would also match before a final newline ("abc\n").
MODEL_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def validate_model_name(value: str) -> str:
    if not MODEL_NAME_PATTERN.fullmatch(value):
        raise ValueError
    return value


def validate_optional_path(value: str) -> str | None:
    return value or None


def validate_optional_text(value: str) -> str:
    return value


# A handler: `package.module`, `package.module:object` (a dotted attribute path) or a `.py` file.
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
_HANDLER_MODULE = re.compile(f"{_DOTTED}(:{_DOTTED})?")


def validate_handler(value: str) -> str | None:
    if not value:
        return None
    if value.endswith(".py") or _HANDLER_MODULE.fullmatch(value):
        return value
    raise ValueError


def validate_log_level(value: str) -> str:
    upper = value.upper()
    if upper not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError
    return upper


def validate_length_buckets(value: str) -> tuple[int, ...]:
    # "16,32,64" from the environment; [16, 32, 64] from a JSON model config (as its text).
    text = value.strip().strip("[]()").strip()
    if not text:
        return ()
    lengths = tuple(int(numeral(part)) for part in text.split(","))
    if any(length < 1 for length in lengths) or list(lengths) != sorted(set(lengths)):
        raise ValueError
    return lengths


# absl::SimpleAtoi's int32: optional sign, decimal digits, surrounding whitespace allowed.
_INT32_TEXT = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+[ \t\n\v\f\r]*")
_CHANNEL_ARGUMENT_KEY = re.compile(r"[A-Za-z0-9_.-]+")


def validate_grpc_channel_arguments(value: str) -> tuple[tuple[str, int | str], ...]:
    """TF Serving's --grpc_channel_arguments: `key=value` pairs, comma-separated.

    As model_servers/server.cc reads them: a value that parses as a 32-bit integer is passed to
    grpc-core as one, any other as a string. A key given twice keeps its first value, as
    grpc-core does with the duplicate arguments TF Serving hands it (grpc 1.85's server keeps
    the first). An item without exactly one `=` is refused (TF Serving reads out of bounds on
    one without, and drops what follows a second); spaces around a key are dropped.
    grpc.so_reuseport must stay on: every worker binds the same port.
    """
    arguments: dict[str, int | str] = {}
    for item in value.split(",") if value else []:
        key, _, text = item.partition("=")
        key = key.strip()  # no argument name has spaces; "a=1, b=2" means b
        if not _CHANNEL_ARGUMENT_KEY.fullmatch(key) or item.count("=") != 1:
            raise ValueError
        number = int(text) if _INT32_TEXT.fullmatch(text) else None
        arguments.setdefault(key, number if number is not None and -2**31 <= number < 2**31 else text)
    if arguments.get("grpc.so_reuseport", 1) != 1:
        raise ValueError
    return tuple(arguments.items())


def validate_metrics_path(value: str) -> str:
    if value and (not value.startswith("/") or any(char.isspace() or char in "?#" for char in value)):
        raise ValueError
    return value


def validate_fraction(value: str) -> float:
    number = float(numeral(value))
    if not 0 <= number <= 1:
        raise ValueError
    return number


# sockaddr_un holds 108 bytes with the final NUL; the socket is bound as PATH.<pid>.<n> first.
MAX_SOCKET_PATH = 107 - len(".4194304.0")


def validate_socket_path(value: str) -> str:
    if value and len(os.path.abspath(value).encode()) > MAX_SOCKET_PATH:
        raise ValueError
    return value


_ALLOWED: dict[Callable[[str], Any], str] = {
    validate_length_buckets: "increasing whole numbers of 1 or more, comma-separated (`16,32,64`), or empty",
    validate_pos_int: "a whole number of 1 or more",
    validate_non_neg_int: "a whole number of 0 or more",
    validate_non_neg_float: "a number of 0 or more",
    validate_pos_float: "a number above 0",
    validate_finite_float: "a number",
    validate_bool: "true or false (1/0, yes/no, on/off)",
    validate_model_name: "letters, digits, '_', '.' or '-', starting with a letter or digit, at most 64",
    validate_optional_path: "a path",
    validate_handler: "`package.module`, `package.module:object` or a path to a `.py` file, or empty",
    validate_optional_text: "text",
    validate_log_level: "DEBUG, INFO, WARNING, ERROR or CRITICAL",
    validate_grpc_channel_arguments: "TF Serving's `key=value,key=value` (a 32-bit integer value passes as one, "
                                     "any other as text), or empty; not `grpc.so_reuseport` other than 1",
    validate_metrics_path: "a URL path starting with `/`, or empty",
    validate_fraction: "a number from 0 to 1",
    validate_restriction: "`key=value`: a header name (lowercase letters, digits, '-', '_' or '.'; not `grpc-...` "
                          "nor `...-bin`) and a value; or empty",
    validate_socket_path: f"a path of at most {MAX_SOCKET_PATH} bytes once absolute, or empty",
    validate_restricted_api: "Triton's `<category>[,<category>...]:<key>=<value>` groups, separated by ';', "
                             f"each category one of {', '.join(RESTRICTED_CATEGORIES)}; or empty",
    validate_restricted_protocol: "Triton's `<category>[,<category>...]:<key>=<value>` groups, separated by ';', "
                                  f"each category one of {', '.join(RESTRICTED_CATEGORIES)}; or empty",
}


def allowed(validator: Callable[[str], Any]) -> str:
    """What a validator accepts, in words: for error messages and the settings page."""
    return getattr(validator, "allowed", None) or _ALLOWED.get(validator, "a valid value")


def _env(name: str, validator: Callable[[str], Any], default: Any, help: str, *, section: str = "Other") -> Any:
    """One setting: its variable, validator, default, a one-line help and the page section it is listed in."""
    return dataclasses.field(
        default=default, metadata={"env": name, "validate": validator, "help": help, "section": section})


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every setting of the app. Its field is its whole definition: docs/settings.md is generated from it."""

    model_path: str | None = _env(
        "MODEL_PATH", validate_optional_path, None,
        "A `.keras` or `.h5` file, a SavedModel folder, or a base folder of numbered versions (the newest "
        "is served). Unset: the built-in default model.", section="Models")
    model_name: str = _env(
        "MODEL_NAME", validate_model_name, "default", "Name the model is served under (`/v1/models/{name}`).",
        section="Models")
    model_config: str | None = _env(
        "MODEL_CONFIG", validate_optional_path, None,
        "A JSON file (or TF Serving's ModelServerConfig in text format) naming several models, each with "
        "its own batching settings and versions; replaces "
        "`MODEL_PATH` ([configuration](configuration.md#several-models)).", section="Models")
    model_poll_seconds: float = _env(
        "MODEL_POLL_SECONDS", validate_non_neg_float, 5.0,
        "How often a base folder of numbered versions is checked for versions to load or unload; 0: never.",
        section="Models")
    model_config_poll_seconds: float = _env(
        "MODEL_CONFIG_POLL_SECONDS", validate_non_neg_float, 0.0,
        "How often `MODEL_CONFIG` is read again; models added, removed or changed there are loaded, unloaded "
        "or changed live ([TF Serving](tf-serving.md#live-model-config)); 0: never.", section="Models")
    model_repository: str | None = _env(
        "MODEL_REPOSITORY", validate_optional_path, None,
        "A folder of model folders (`name/version/`, as TF Serving and Triton lay them out) that v2's "
        "repository extension lists and, with `MODEL_CONTROL_MODE=explicit`, loads from "
        "([repository](api-v2.md#model-repository)).", section="Models")
    model_control_mode: str = _env(
        "MODEL_CONTROL_MODE", validate_choice("none", "explicit"), "none",
        "Triton's name: `explicit` lets v2's repository load and unload change the models served, in every "
        "process; `none` refuses them (503). Needs `MODEL_REPOSITORY`.", section="Models")
    restricted_model_control: str = _env(
        "RESTRICTED_MODEL_CONTROL", validate_restriction, "",
        "`key=value`: the `model-repository` category of `HTTP_RESTRICTED_API` and `GRPC_RESTRICTED_PROTOCOL` "
        "at once, TF Serving's HandleReloadConfigRequest included; gRPC also takes the bare metadata key `key`. "
        "Empty: not restricted.", section="Models")
    http_restricted_api: tuple[RestrictedGroup, ...] = _env(
        "HTTP_RESTRICTED_API", validate_restricted_api, (),
        "Triton's `--http-restricted-api`: v2 REST routes of these categories answer 403 without header "
        "`key: value` (`inference,metadata:infer-key=s3cret;model-repository:admin-key=...`) "
        "([restricted APIs](api-v2.md#restricted-apis)).", section="Models")
    grpc_restricted_protocol: tuple[RestrictedGroup, ...] = _env(
        "GRPC_RESTRICTED_PROTOCOL", validate_restricted_protocol, (),
        "Triton's `--grpc-restricted-protocol`: v2 gRPC methods of these categories answer UNAVAILABLE "
        "without metadata `triton-grpc-protocol-<key>: <value>`; same syntax as `HTTP_RESTRICTED_API`.",
        section="Models")
    model_handler: str | None = _env(
        "MODEL_HANDLER", validate_handler, None,
        "The handler of `MODEL_PATH`'s model: Python code the server runs around it, per request "
        "([handlers](handlers.md)). With `MODEL_CONFIG`, a model's `\"handler\"` names it instead.",
        section="Models")
    model_repository_handlers: bool = _env(
        "MODEL_REPOSITORY_HANDLERS", validate_bool, False,
        "true: v2's repository load imports `MODEL_REPOSITORY/<name>/handler.py` as that model's handler; "
        "false refuses to load a folder that holds one ([handlers](handlers.md#security)).", section="Models")
    max_batch_size: int = _env(
        "MAX_BATCH_SIZE", validate_pos_int, 32,
        "Most rows in one predict call. Batches are padded to a bucket: the powers of two below it, and itself.",
        section="Batching")
    batch_timeout_ms: float = _env(
        "BATCH_TIMEOUT_MS", validate_non_neg_float, 0.0,
        "How long a batch may wait for more rows, counted from its oldest request. "
        "0: dispatch as soon as the model is free.", section="Batching")
    max_queue_rows: int = _env(
        "MAX_QUEUE_ROWS", validate_pos_int, 128,
        "Rows that may wait per model and worker; beyond, 503 with `Retry-After`.", section="Batching")
    batch_fill_under_load: bool = _env(
        "BATCH_FILL_UNDER_LOAD", validate_bool, True,
        "With `BATCH_TIMEOUT_MS=0`: when the model falls behind, a batch that is not full may wait for more rows, "
        "at most as long as the last predict call took ([the fill rule](batching.md)). false: always dispatch "
        "as soon as the model is free.", section="Batching")
    pad_variable_length: bool = _env(
        "PAD_VARIABLE_LENGTH", validate_bool, False,
        "true: requests whose rows differ only in dimensions the signature declares `None` share a predict "
        "call, padded with `PAD_VALUE`, their outputs cut back to their own length; a start-up check leaves it "
        "off where padding changes the answers ([variable-length inputs](batching.md#variable-length-inputs)).",
        section="Batching")
    pad_value: float = _env(
        "PAD_VALUE", validate_finite_float, 0.0,
        "The value variable-length inputs are padded with (string inputs: the empty string); 0 suits Keras "
        "`mask_zero` embeddings.", section="Batching")
    length_buckets: tuple[int, ...] = _env(
        "LENGTH_BUCKETS", validate_length_buckets, (),
        "With `PAD_VARIABLE_LENGTH`: lengths are padded to the next of these (past the largest: not padded), "
        "only requests of one bucket share a call, and each bucket is warmed at start. Empty: padded to the "
        "batch's longest, any lengths share a call.", section="Batching")
    request_timeout_ms: float = _env(
        "REQUEST_TIMEOUT_MS", validate_pos_float, 30000.0,
        "Deadline of a request (a gRPC client's own deadline may shorten it); past it, 504, and a request "
        "still queued is dropped without running.", section="Requests and limits")
    max_request_rows: int = _env(
        "MAX_REQUEST_ROWS", validate_non_neg_int, 0,
        "Most rows one request may hold; beyond, 413. 0: 2 × `MAX_BATCH_SIZE`, at most `MAX_QUEUE_ROWS`.",
        section="Requests and limits")
    max_request_bytes: int = _env(
        "MAX_REQUEST_BYTES", validate_non_neg_int, 0,
        "Largest body; beyond, 413. 0: the longest JSON a valid request can be, from the models' "
        "signatures and `MAX_REQUEST_ROWS` (16 MiB where a model takes strings or dimensions of any size).",
        section="Requests and limits")
    large_body_bytes: int = _env(
        "LARGE_BODY_BYTES", validate_pos_int, 256 * 1024,
        "Bodies larger than this (and chunked ones that grow past it) need one of `LARGE_BODY_SLOTS`.",
        section="Requests and limits")
    large_body_slots: int = _env(
        "LARGE_BODY_SLOTS", validate_pos_int, 2,
        "Large bodies read and handled at once per worker; others wait until their deadline, then 503.",
        section="Requests and limits")
    # BATCHING and PREDICT_METHOD exist for the benchmark's naive baselines (scripts/benchmark/configs.py).
    batching: bool = _env(
        "BATCHING", validate_bool, True,
        "Benchmark only. false: every request gets its own predict call, one at a time per worker (the naive "
        "server).", section="Benchmark comparisons")
    predict_method: str = _env(
        "PREDICT_METHOD", validate_choice("function", "keras_predict"), "function",
        "Benchmark only. `function`: a compiled `tf.function`; `keras_predict`: Keras `model.predict` (slow, the "
        "naive server).",
        section="Benchmark comparisons")
    tf_intra_op_threads: int = _env(
        "TF_INTRA_OP_THREADS", validate_non_neg_int, 0,
        "TensorFlow intra-op threads per worker; 0: usable CPUs ÷ workers, at least 1.", section="TensorFlow")
    tf_inter_op_threads: int = _env(
        "TF_INTER_OP_THREADS", validate_non_neg_int, 0,
        "TensorFlow inter-op threads per worker; 0: usable CPUs ÷ workers, at least 1.", section="TensorFlow")
    gpu_memory_limit_mb: int = _env(
        "GPU_MEMORY_LIMIT_MB", validate_non_neg_int, 0,
        "GPU memory per worker process (per model process with `MODEL_PROCESSES`: one GPU each); 0: grow as "
        "needed. Workers × limit must fit the card.",
        section="TensorFlow")
    gpu_memory_fraction: float = _env(
        "GPU_MEMORY_FRACTION", validate_fraction, 0.0,
        "TF Serving's `--per_process_gpu_memory_fraction`: GPU memory per worker (or model) process as a "
        "fraction of each GPU's total (from the CUDA driver); 0: grow as needed. Not with `GPU_MEMORY_LIMIT_MB`.",
        section="TensorFlow")
    log_level: str = _env("LOG_LEVEL", validate_log_level, "INFO", "Logging level of the app and Gunicorn.",
                          section="Logs and probes")
    log_format: str = _env(
        "LOG_FORMAT", validate_choice("text", "json"), "text",
        "`text`, or `json`: every line one JSON object, access lines included.", section="Logs and probes")
    access_log: bool = _env("ACCESS_LOG", validate_bool, True, "One access-log line per request.",
                            section="Logs and probes")
    access_log_probes: bool = _env(
        "ACCESS_LOG_PROBES", validate_bool, False,
        "true: `/healthz`, `/readyz` and `/metrics` are access-logged too.", section="Logs and probes")
    metrics_path: str = _env(
        "METRICS_PATH", validate_metrics_path, "",
        "A second path serving what `/metrics` serves, as TF Serving's `--monitoring_config_file` asks "
        "(`/monitoring/prometheus/metrics`); empty: `/metrics` only.", section="Logs and probes")
    readyz_detail: bool = _env(
        "READYZ_DETAIL", validate_bool, False,
        "true: `/readyz` also shows model sources and the worker's pid.", section="Logs and probes")
    grpc_bind: str = _env(
        "GRPC_BIND", validate_optional_text, "0.0.0.0:8500",
        "Address of TensorFlow Serving's gRPC API in every worker; empty: no gRPC.", section="gRPC")
    grpc_socket_path: str = _env(
        "GRPC_SOCKET_PATH", validate_socket_path, "",
        "TF Serving's `--grpc_socket_path`: gRPC also on this Unix socket, served by one worker at a time, "
        "another taking over when it stops ([TF Serving](tf-serving.md#grpc-on-a-unix-socket)); empty: none.",
        section="gRPC")
    grpc_channel_arguments: tuple[tuple[str, int | str], ...] = _env(
        "GRPC_CHANNEL_ARGUMENTS", validate_grpc_channel_arguments, (),
        "TF Serving's `--grpc_channel_arguments` (`grpc.max_connection_age_ms=2000,...`), passed to every "
        "worker's gRPC server in place of its own values ([TF Serving](tf-serving.md#grpc-channel-arguments)).",
        section="gRPC")
    grpc_max_connections: int = _env(
        "GRPC_MAX_CONNECTIONS", validate_non_neg_int, 0,
        "Open gRPC connections per worker; beyond, new ones are closed at once. 0: a quarter of the "
        "process's descriptor limit (`ulimit -n`).", section="gRPC")
    grpc_max_streams_per_connection: int = _env(
        "GRPC_MAX_STREAMS_PER_CONNECTION", validate_non_neg_int, 0,
        "Calls at once on one gRPC connection (HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`). 0: none advertised. "
        "With grpc 1.85 a limit of N refuses a connection's streams after about N + 4 calls: set it only "
        "above the calls a connection makes in its life, or leave it 0.", section="gRPC")
    grpc_max_metadata_bytes: int = _env(
        "GRPC_MAX_METADATA_BYTES", validate_pos_int, 16 * 1024,
        "Largest header list of a gRPC call, advertised and enforced; beyond, the call is refused.",
        section="gRPC")
    grpc_connection_idle_ms: float = _env(
        "GRPC_CONNECTION_IDLE_MS", validate_pos_float, 60000.0,
        "A gRPC connection without a call for this long is closed (GOAWAY).", section="gRPC")
    grpc_connection_age_ms: float = _env(
        "GRPC_CONNECTION_AGE_MS", validate_pos_float, 600000.0,
        "A gRPC connection this old is asked to close (GOAWAY); its calls still running are cancelled "
        "`REQUEST_TIMEOUT_MS` later.", section="gRPC")
    grpc_receive_timeout_ms: float = _env(
        "GRPC_RECEIVE_TIMEOUT_MS", validate_pos_float, 10000.0,
        "A gRPC call whose request message has not arrived this long after its headers is cancelled "
        "(Health: at most 1 s).", section="gRPC")
    grpc_ssl_config_file: str | None = _env(
        "GRPC_SSL_CONFIG_FILE", validate_optional_path, None,
        "TF Serving's `--ssl_config_file`: an SSLConfig in protobuf text format (`server_key`, `server_cert`, "
        "`custom_ca`, `client_verify`); gRPC then takes TLS only ([TLS](tls.md)). Unset: plaintext gRPC.",
        section="gRPC")
    enable_signature_method_name_check: bool = _env(
        "ENABLE_SIGNATURE_METHOD_NAME_CHECK", validate_bool, False,
        "TF Serving's `--enable_signature_method_name_check`: Classify, Regress and MultiInference take only "
        "signatures whose method name says so. Off, as in TF Serving: any signature whose input and outputs "
        "fit, as TF2 SavedModels need ([API](api.md#classify-regress-and-multiinference)).",
        section="TensorFlow Serving")
    enable_model_warmup: bool = _env(
        "ENABLE_MODEL_WARMUP", validate_bool, True,
        "TF Serving's `--enable_model_warmup`: replay a version's `assets.extra/tf_serving_warmup_requests` "
        "before it is served; a record that fails stops the version loading ([warm-up](tls.md#warm-up)).",
        section="TensorFlow Serving")
    tracing: str = _env(
        "TRACING", validate_choice("off", "otlp", "console"), "off",
        "OpenTelemetry traces of every request and predict call ([tracing](tracing.md)): `otlp` sends them "
        "where the standard `OTEL_EXPORTER_OTLP_*` variables say (OTLP over HTTP), `console` prints them.",
        section="Tracing")
    otel_sdk_disabled: bool = _env(
        "OTEL_SDK_DISABLED", validate_bool, False,
        "The OpenTelemetry SDK's own switch: true keeps tracing off whatever `TRACING` says.", section="Tracing")

    grpc_tensor_content: bool = _env(
        "GRPC_TENSOR_CONTENT", validate_bool, False,
        "true: gRPC Predict writes numeric outputs as raw `tensor_content` bytes instead of the typed fields "
        "(`float_val`, ...), as TF Serving's `--enable_serialization_as_tensor_content` does.", section="gRPC")

    model_processes: int = _env(
        "MODEL_PROCESSES", validate_non_neg_int, 0,
        "Model processes apart from the workers, each loading the models once and running the batchers; "
        "workers hand them rows through shared memory ([model processes](scaling.md#model-processes)). 0: "
        "every worker loads its own copy. With GPUs: a multiple of the GPUs visible, one GPU each.",
        section="Model processes")
    model_process_arena_mb: int = _env(
        "MODEL_PROCESS_ARENA_MB", validate_pos_int, 32,
        "Shared memory per worker and model process, each way, for the rows handed over; an array that does "
        "not fit travels over the socket instead.", section="Model processes")

    payload_log_sampling_rate: float = _env(
        "PAYLOAD_LOG_SAMPLING_RATE", validate_fraction, 0.0,
        "Share of predictions written as TF Serving `PredictionLog` records, drawn at random per request; a "
        "model's `payload_log_sampling_rate` in `MODEL_CONFIG` (a ModelServerConfig's `logging_config`) "
        "overrides it ([payload logging](operations.md#payload-logging)). 0: none.", section="Payload logging")
    payload_log_dir: str | None = _env(
        "PAYLOAD_LOG_DIR", validate_optional_path, None,
        "Folder of the sampled records: TFRecord files, one set per process.", section="Payload logging")
    payload_log_max_file_bytes: int = _env(
        "PAYLOAD_LOG_MAX_FILE_BYTES", validate_pos_int, 64 * 1024 * 1024,
        "A payload log file is closed and the next one begun before it grows past this.",
        section="Payload logging")
    payload_log_buffer_records: int = _env(
        "PAYLOAD_LOG_BUFFER_RECORDS", validate_pos_int, 1000,
        "Sampled records waiting per process, in each of two buffers (files, CloudEvents); beyond, dropped "
        "and counted.", section="Payload logging")
    payload_log_url: str = _env(
        "PAYLOAD_LOG_URL", validate_optional_text, "",
        "Also post each sampled request and response as CloudEvents here, as KServe's logger does; empty: "
        "none.", section="Payload logging")

    def __post_init__(self) -> None:
        if self.model_control_mode == "explicit" and not self.model_repository:
            raise SettingsError("MODEL_CONTROL_MODE='explicit' loads models from MODEL_REPOSITORY: set it")
        if self.model_control_mode == "explicit" and self.model_config_poll_seconds:
            # As Triton, which refuses explicit control with polling: the file would undo a load at its next read.
            raise SettingsError("MODEL_CONTROL_MODE='explicit' and MODEL_CONFIG_POLL_SECONDS="
                                f"{self.model_config_poll_seconds:g} both change the models served: set one of them")
        if self.restricted_model_control:
            for name, groups in (("HTTP_RESTRICTED_API", self.http_restricted_api),
                                 ("GRPC_RESTRICTED_PROTOCOL", self.grpc_restricted_protocol)):
                if any("model-repository" in categories for categories, _, _ in groups):
                    raise SettingsError(f"RESTRICTED_MODEL_CONTROL and {name} both restrict 'model-repository': "
                                        "set one of them")
        if self.model_handler and self.model_config:
            raise SettingsError(f"MODEL_HANDLER={self.model_handler!r} names the handler of MODEL_PATH's model; with "
                                "MODEL_CONFIG, name it in the model's entry (\"handler\")")
        if self.model_repository_handlers and not self.model_repository:
            raise SettingsError("MODEL_REPOSITORY_HANDLERS=true imports handler.py from MODEL_REPOSITORY's folders: "
                                "set MODEL_REPOSITORY")
        if self.gpu_memory_limit_mb and self.gpu_memory_fraction:
            raise SettingsError(
                f"GPU_MEMORY_LIMIT_MB={self.gpu_memory_limit_mb} and GPU_MEMORY_FRACTION={self.gpu_memory_fraction:g} "
                "both cap GPU memory: set one of them")

    @property
    def tracing_on(self) -> bool:
        return self.tracing != "off" and not self.otel_sdk_disabled

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        values = {}
        for field in dataclasses.fields(cls):
            name = field.metadata["env"]
            if name in environ:
                values[field.name] = parse(name, environ[name], field.metadata["validate"])
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One served model: where it comes from and how its batcher behaves."""

    name: str
    path: str | None
    max_batch_size: int
    batch_timeout_ms: float
    max_queue_rows: int
    max_request_rows: int = 0
    # TF Serving's model_version_policy: ("latest", N newest), ("all", ()), ("specific", versions).
    version_policy: tuple[str, int | tuple[int, ...]] = ("latest", 1)
    version_labels: tuple[tuple[str, int], ...] = ()
    pad_variable_length: bool = False
    pad_value: float = 0.0
    length_buckets: tuple[int, ...] = ()
    payload_log_sampling_rate: float = 0.0
    priorities: queue_policy.Priorities = queue_policy.ONE_LEVEL
    # The operator's handler (app/core/handlers.py): MODEL_HANDLER, the file's "handler", or a
    # repository folder's handler.py with MODEL_REPOSITORY_HANDLERS. Never a reload's.
    handler: str | None = None

    def __post_init__(self) -> None:
        # 0 derives the limit: a request may span a few batches, never more than the queue holds.
        wanted = self.max_request_rows or 2 * self.max_batch_size
        object.__setattr__(self, "max_request_rows", min(wanted, self.max_queue_rows))


# The per-model keys of a MODEL_CONFIG file, with the validator of the same env setting.
_MODEL_KEYS: dict[str, Callable[[str], Any]] = {
    "max_batch_size": validate_pos_int,
    "batch_timeout_ms": validate_non_neg_float,
    "max_queue_rows": validate_pos_int,
    "max_request_rows": validate_non_neg_int,
    "pad_variable_length": validate_bool,
    "pad_value": validate_finite_float,
    "length_buckets": validate_length_buckets,
    "payload_log_sampling_rate": validate_fraction,
}


def model_configs(settings: Settings) -> list[ModelConfig]:
    """The models to serve, the default (POST /predict) first.

    Without MODEL_CONFIG: one model, MODEL_NAME from MODEL_PATH. With it, a JSON file:
    {"models": [{"name": "a", "path": "/models/a", "max_batch_size": 16}, ...],
     "default": "a"}; a model without "path" is the built-in default model. A model may
    also name TF Serving's "model_version_policy" ({"latest": {"num_versions": 2}},
    {"all": {}} or {"specific": {"versions": [1, 2]}}) and "version_labels"
    ({"stable": 1, "canary": 2}). A file that is not JSON is read as TF Serving's
    ModelServerConfig in text format.
    """
    if settings.model_config is None:
        defaults = {key: getattr(settings, key) for key in _MODEL_KEYS}
        return [ModelConfig(settings.model_name, settings.model_path, handler=settings.model_handler, **defaults)]
    where = f"MODEL_CONFIG={settings.model_config!r}"
    try:
        with open(settings.model_config, "rb") as config_file:
            content = config_file.read()
    except OSError as exc:
        raise SettingsError(f"{where}: cannot read it as JSON: {exc}") from None
    try:
        document = json.loads(content)
    except ValueError as exc:
        try:
            document = tfs_config.model_config_json(content.decode(errors="replace"))
        except tfs_config.FlagError as text_error:
            raise SettingsError(f"{where}: cannot read it as JSON ({exc}) nor as a ModelServerConfig "
                                f"({text_error})") from None
    return configs_from_document(document, settings, where)


def configs_from_document(document: Any, settings: Settings, where: str) -> list[ModelConfig]:
    """The models a MODEL_CONFIG document ({"models": [...], "default": ...}) names, the default first."""
    defaults = {key: getattr(settings, key) for key in _MODEL_KEYS}
    entries = document.get("models") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise SettingsError(f"{where}: expected an object with a non-empty 'models' list")
    configs = [_model_config(entry, index, defaults, where) for index, entry in enumerate(entries)]
    if where == RELOAD:
        configs = _operators_handlers(configs, settings)
    names = [config.name for config in configs]
    if len(set(names)) != len(names):
        raise SettingsError(f"{where}: model names must be unique; got {names}")
    default = document.get("default", names[0])
    if default not in names:
        raise SettingsError(f"{where}: 'default' is {default!r}, which is not one of {names}")
    return sorted(configs, key=lambda config: config.name != default)


# Where a reloaded config came from, as its errors name it: TF Serving's HandleReloadConfigRequest,
# and v2's repository load and unload, which edit the config served (app/core/registry.py).
RELOAD = "ReloadConfigRequest"


def _model_config(entry: Any, index: int, defaults: dict[str, Any], where: str) -> ModelConfig:
    if not isinstance(entry, dict):
        raise SettingsError(f"{where}: models[{index}] must be an object")
    if "handler" in entry and where == RELOAD:
        # A handler is code: only the operator's settings and file name one, never a reload.
        raise SettingsError(f"{where}: models[{index}].handler: a handler is named only by MODEL_HANDLER or the "
                            "MODEL_CONFIG file")
    unknown = set(entry) - {"name", "path", "handler", *_VERSION_KEYS, *_MODEL_KEYS, *queue_policy.KEYS}
    if unknown:
        raise SettingsError(f"{where}: models[{index}] has unknown key(s) {sorted(unknown)}; "
                            f"allowed: name, path, handler, {', '.join(_VERSION_KEYS)}, {', '.join(_MODEL_KEYS)}, "
                            f"{', '.join(queue_policy.KEYS)}")
    values = dict(defaults)
    try:
        name = parse(f"models[{index}].name", str(entry.get("name", "")), validate_model_name)
        for key, validator in _MODEL_KEYS.items():
            if key in entry:
                values[key] = parse(f"models[{index}].{key}", str(entry[key]), validator)
    except SettingsError as exc:
        raise SettingsError(f"{where}: {exc}") from None
    path = entry.get("path")
    if path is not None and not isinstance(path, str):
        raise SettingsError(f"{where}: models[{index}].path must be a string")
    handler = entry.get("handler")
    if handler is not None:
        if not isinstance(handler, str):
            raise SettingsError(f"{where}: models[{index}].handler must be a string")
        values["handler"] = parse(f"{where}: models[{index}].handler", handler, validate_handler)
    try:
        policy = _version_policy(entry.get("model_version_policy", {"latest": {}}))
        labels = _version_labels(entry.get("version_labels", {}))
        priorities = queue_policy.from_entry(entry)
    except ValueError as exc:
        raise SettingsError(f"{where}: models[{index}].{exc}") from None
    return ModelConfig(name=name, path=path or None, version_policy=policy, version_labels=labels,
                       priorities=priorities, **values)


_VERSION_KEYS = ("model_version_policy", "version_labels")


def _operators_handlers(configs: list[ModelConfig], settings: Settings) -> list[ModelConfig]:
    """A reload's models, each with the handler the operator gave a model of its name and path:
    MODEL_HANDLER, the MODEL_CONFIG file, or with MODEL_REPOSITORY_HANDLERS its repository folder's
    handler.py. A model no operator source names is served without one."""
    given = {(config.name, _real(config.path)): config.handler for config in model_configs(settings)
             if config.handler}
    bound = []
    for config in configs:
        handler = given.get((config.name, _real(config.path))) or _repository_handler(config, settings)
        bound.append(dataclasses.replace(config, handler=handler) if handler else config)
    return bound


def _repository_handler(config: ModelConfig, settings: Settings) -> str | None:
    if not (settings.model_repository_handlers and settings.model_repository and config.path):
        return None
    folder = os.path.join(settings.model_repository, config.name)
    handler = os.path.join(folder, "handler.py")
    return handler if _real(config.path) == _real(folder) and os.path.isfile(handler) else None


def _real(path: str | None) -> str | None:
    return None if path is None else os.path.realpath(path)


def _version_policy(value: Any) -> tuple[str, int | tuple[int, ...]]:
    """TF Serving's FileSystemStoragePathSourceConfig.ServableVersionPolicy, in JSON."""
    expected = ('model_version_policy must be one of {"latest": {"num_versions": N}}, {"all": {}}, '
                '{"specific": {"versions": [1, 2]}}')
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"{expected}; got {json.dumps(value)}")
    (kind, body), = value.items()
    if kind == "latest" and isinstance(body, dict) and set(body) <= {"num_versions"}:
        count = body.get("num_versions", 1)
        if isinstance(count, int) and not isinstance(count, bool) and count >= 1:
            return "latest", count
    elif kind == "all" and body == {}:
        return "all", ()
    elif kind == "specific" and isinstance(body, dict) and set(body) == {"versions"}:
        versions = body["versions"]
        if (isinstance(versions, list) and versions
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in versions)):
            return "specific", tuple(sorted(set(versions)))
    raise ValueError(f"{expected}; got {json.dumps(value)}")


def _version_labels(value: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(value, dict):
        raise ValueError(f'version_labels must be an object like {{"stable": 1, "canary": 2}}; got {json.dumps(value)}')
    for label, version in value.items():
        if not MODEL_NAME_PATTERN.fullmatch(label) or not isinstance(version, int) or isinstance(version, bool) \
                or version < 0:
            raise ValueError(f"version_labels: {label!r}: {json.dumps(version)} is not valid: expected a label "
                             "of letters, digits, '_', '.' or '-' naming a version number")
    return tuple(sorted(value.items()))


def parse(name: str, raw: str, validator: Callable[[str], Any]) -> Any:
    try:
        return validator(raw.strip())
    except SettingsError as exc:  # the validator's own words (Triton's, for its settings)
        raise SettingsError(f"{name}: {exc}") from None
    except (ValueError, TypeError):
        shown = getattr(validator, "shown", repr)(raw)
        raise SettingsError(f"{name}={shown} is not valid: expected {allowed(validator)}") from None


def documented() -> list[tuple[str, Any, str]]:
    """(variable, default, help) for every setting of the app (the rest the server reads are in SERVER_KNOBS)."""
    return [(f.metadata["env"], f.default, f.metadata["help"]) for f in dataclasses.fields(Settings)]


GUNICORN_SECTION = "Gunicorn (gunicorn.conf.py)"


@dataclasses.dataclass(frozen=True)
class ServerKnob:
    """A variable read outside the Settings object, for the settings page: a Gunicorn setting that
    gunicorn.conf.py reads, or one read before Gunicorn starts (TF Serving's command line) or by
    a part that runs without the settings."""

    env: str
    default: Any  # None where it is derived, and described by default_text
    allowed: str
    help: str
    default_text: str = ""
    section: str = GUNICORN_SECTION


SERVER_KNOBS = (
    ServerKnob("BIND", "0.0.0.0:8000", "host:port", "Gunicorn's HTTP address."),
    ServerKnob("WORKERS", None, allowed(validate_pos_int),
               "Gunicorn worker processes; each loads every model and runs its own batchers "
               "([scaling](scaling.md#the-default-worker-count)). Usable CPUs: the process's CPU affinity, "
               "capped by its cgroup's CPU quota rounded up.", default_text="usable CPUs ÷ 4, at least 1"),
    ServerKnob("THREADS", None, allowed(validate_pos_int),
               "Request threads per worker: more than the queue holds, so overload meets the queue's fast 503 "
               "rather than waiting unseen for a thread ([scaling](scaling.md)).",
               default_text="`MAX_QUEUE_ROWS` + 2 × `MAX_BATCH_SIZE`"),
    ServerKnob("TIMEOUT", 120, allowed(validate_pos_int),
               "Seconds a worker may stay silent (model loading included) before Gunicorn restarts it."),
    ServerKnob("GRACEFUL_TIMEOUT", 30, allowed(validate_pos_int),
               "Seconds a stopping worker has to answer what it accepted; must be longer than the longest "
               "`BATCH_TIMEOUT_MS`."),
    ServerKnob("KEEPALIVE", 5, allowed(validate_pos_int), "Seconds an idle keep-alive connection stays open."),
    ServerKnob("PROMETHEUS_MULTIPROC_DIR", None, "a path",
               "Where workers write their metrics for `/metrics` to add up; its `.db` files are removed at start.",
               default_text="a fresh temporary folder"),
    ServerKnob("TFS_LISTEN_HOST", "0.0.0.0", "an address",
               "The address TF Serving's command line (`python -m app.tfs_flags`) listens on (TF Serving: all).",
               section="TensorFlow Serving"),
    ServerKnob("MODEL_BASE_PATH", None, "a path", "The image runs TF Serving's command line on "
               "`MODEL_BASE_PATH/MODEL_NAME` ([image](tf-serving.md#the-docker-image)).",
               default_text="`/models`", section="TensorFlow Serving"),
    ServerKnob("POD_NAMESPACE", None, "a name", "Payload CloudEvents' `ce-namespace`, as KServe's logger's.",
               default_text="empty", section="Payload logging"),
)


def server_knob(env: str) -> ServerKnob:
    return next(knob for knob in SERVER_KNOBS if knob.env == env)


def _default_text(value: Any) -> str:
    if value is None:
        return "unset"
    if value == ():
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


# The page's short forms of the most common allowed values (an error message gives them in full).
_SHORT_ALLOWED = {
    allowed(validate_pos_int): "whole, ≥ 1", allowed(validate_non_neg_int): "whole, ≥ 0",
    allowed(validate_bool): "true/false", allowed(validate_non_neg_float): "≥ 0",
    allowed(validate_pos_float): "> 0", allowed(validate_fraction): "0 to 1",
    allowed(validate_length_buckets): "increasing, ≥ 1 (`16,32,64`), or empty",
    allowed(validate_grpc_channel_arguments): "`key=value,...`, or empty",
    allowed(validate_restriction): "`key=value`, or empty",
    allowed(validate_restricted_api): "`<category>,...:<key>=<value>;...`, or empty",
    allowed(validate_restricted_protocol): "`<category>,...:<key>=<value>;...`, or empty",
}


def settings_markdown() -> str:
    """docs/settings.md: every setting, grouped by section, from the definitions above."""
    sections: dict[str, list[tuple[str, str, str, str]]] = {}
    for field in dataclasses.fields(Settings):
        meta = field.metadata
        text = allowed(meta["validate"])
        row = (meta["env"], _default_text(field.default), _SHORT_ALLOWED.get(text, text), meta["help"])
        sections.setdefault(meta["section"], []).append(row)
    for knob in SERVER_KNOBS:
        default = knob.default_text or _default_text(knob.default)
        row = (knob.env, default, _SHORT_ALLOWED.get(knob.allowed, knob.allowed), knob.help)
        sections.setdefault(knob.section, []).append(row)
    lines = [
        "# Settings reference",
        "",
        "<!-- Generated from app/ops/settings.py by `.venv/bin/python scripts/settings_doc.py`;",
        "     edit the definitions there, not this page (tests/test_docs.py fails when it is stale). -->",
        "",
        "Every setting is an environment variable, read once at start and validated: a bad value stops",
        "start-up with a message that names the variable, the value and what is allowed (numbers in ASCII",
        "digits; true/false also as 1/0, yes/no, on/off). Gunicorn's command-line flags",
        "(`--workers=2 --timeout=180`) override the Gunicorn settings.",
        "[Configuration](configuration.md) explains how they fit together.",
    ]
    for section, rows in sections.items():
        lines += ["", f"## {section}", "", "| variable | default | allowed | meaning |", "|---|---|---|---|"]
        lines += [f"| `{env}` | {default} | {allowed_text} | {help} |" for env, default, allowed_text, help in rows]
    return "\n".join(lines) + "\n"

