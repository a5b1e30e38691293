"""tensorflow_model_server's flags and config files translated to our settings (pure functions)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from app import tfs_flags
from app.tfs_flags import FlagError, environment, parse_flags

# TF Serving's testdata/good_model_config.txt, with its placeholders filled in.
GOOD_MODEL_CONFIG = """model_config_list: {
  config: { name: "half_plus_two", base_path: "/models/half_plus_two", model_platform: "tensorflow" },
  config: { name: "half_plus_three", base_path: "/models/half_plus_three", model_platform: "tensorflow" }
}"""
# The Sicara article's batching file, and TF Serving's testdata/batching_config.txt.
SICARA_BATCHING = ("max_batch_size { value: 20 } batch_timeout_micros { value: 500000 } "
                   "max_enqueued_batches { value: 100 } num_batch_threads { value: 8 }")
TF_SERVING_BATCHING = ("max_batch_size { value: 128 }\nbatch_timeout_micros { value: 0 }\n"
                       "max_enqueued_batches { value: 1000000 }\nnum_batch_threads { value: 8 }\n")


def env_for(argv, files=None, config_dir=None):
    files = files or {}

    def read(path):
        if path not in files:
            raise FileNotFoundError(2, "No such file or directory")
        return files[path]

    # No config_dir: nothing may be written (only a ModelServerConfig is, and only once read).
    return environment(parse_flags(argv), read=read, config_dir=str(config_dir or "/nonexistent"))


def test_the_docker_image_command_line_maps_to_ports_model_and_no_batching():
    """TF Serving's image runs: --port=8500 --rest_api_port=8501 --model_name=... --model_base_path=..."""
    env = env_for(["--port=8500", "--rest_api_port=8501", "--model_name=m", "--model_base_path=/models/m"])
    assert env == {"GRPC_BIND": "0.0.0.0:8500", "BIND": "0.0.0.0:8501", "MODEL_PATH": "/models/m",
                   "MODEL_NAME": "m", "MODEL_POLL_SECONDS": "1", "BATCHING": "false"}


def test_tf_serving_defaults_apply_to_flags_left_out():
    env = env_for(["--model_base_path=/models/default"])
    assert (env["GRPC_BIND"], env["BIND"], env["MODEL_NAME"], env["BATCHING"]) == (
        "0.0.0.0:8500", "0.0.0.0:8501", "default", "false")
    assert "REQUEST_TIMEOUT_MS" not in env and "TF_INTRA_OP_THREADS" not in env


def test_flags_take_tensorflows_forms():
    values = parse_flags(["-port=9000", "--enable_batching", "--flush_filesystem_caches=false",
                          "--rest_api_timeout_in_ms=1500", "--tensorflow_session_parallelism=3"])
    assert values == {"port": 9000, "enable_batching": True, "flush_filesystem_caches": False,
                      "rest_api_timeout_in_ms": 1500, "tensorflow_session_parallelism": 3}
    env = env_for(["--model_base_path=/m", "--port=0", "--rest_api_timeout_in_ms=1500",
                   "--tensorflow_session_parallelism=3", "--tensorflow_intra_op_parallelism=2"])
    assert (env["GRPC_BIND"], env["REQUEST_TIMEOUT_MS"], env["TF_INTRA_OP_THREADS"], env["TF_INTER_OP_THREADS"]) == (
        "", "1500", "2", "3")


@pytest.mark.parametrize("argv, message", [
    (["--no_such_flag=1"], "unknown flag --no_such_flag"),
    (["--platform_config_file=/p.config"], "--platform_config_file=/p.config is not supported"),
    (["--rest_api_enable_cors_support"], "--rest_api_enable_cors_support=true is not supported"),
    (["--per_process_gpu_memory_fraction=1.5"], "above 1 (unified memory) is not supported"),
    (["--per_process_gpu_memory_fraction=-0.1"], "must be from 0 to 1 here"),
    (["--grpc_channel_arguments=grpc.max_connection_age_ms"], "--grpc_channel_arguments=grpc.max_connection_age_ms: "
                                                              "expected TF Serving's `key=value,key=value`"),
    (["--grpc_channel_arguments=a=1,,b=2"], "--grpc_channel_arguments=a=1,,b=2: expected"),
    (["--grpc_channel_arguments=grpc.so_reuseport=0"], "not `grpc.so_reuseport` other than 1"),
    ([f"--grpc_socket_path=/{'s' * 97}"], "expected a path of at most 97 bytes once absolute"),
    (["--port=http"], "--port=http: invalid literal"),
    (["--model_name"], "--model_name needs a value"),
    (["--enable_batching=maybe"], "--enable_batching=maybe: expected true or false"),
    (["--saved_model_tags=serve,gpu"], "only the 'serve' MetaGraph"),
    (["model"], "takes only --flag=value"),
])
def test_unknown_unsupported_and_malformed_flags_stop_with_a_message_naming_them(argv, message):
    with pytest.raises(FlagError, match=re.escape(message)):
        parse_flags(argv)


def test_tf_servings_defaults_for_refused_features_are_accepted():
    """Its own default values name no feature: --grpc_socket_path= or --enable_profiler=true pass."""
    assert parse_flags(["--grpc_socket_path=", "--enable_profiler=true", "--model_config_file_poll_wait_seconds=0",
                        "--enable_serialization_as_tensor_content=false"]) == {
        "grpc_socket_path": "", "enable_profiler": True, "model_config_file_poll_wait_seconds": 0,
        "enable_serialization_as_tensor_content": False}


# TF Serving's testdata/monitoring_config.txt, as written.
TF_SERVING_MONITORING = 'prometheus_config: {\n  enable: true,\n  path: "/monitoring/prometheus/metrics"\n}\n'


@pytest.mark.parametrize("text, path", [
    (TF_SERVING_MONITORING, "/monitoring/prometheus/metrics"),
    ('prometheus_config { enable: true path: "/tfs/metrics" }', "/tfs/metrics"),
    # No path: PrometheusExporter::kPrometheusPath, as http_server.cc chooses.
    ("prometheus_config { enable: true }", "/monitoring/prometheus/metrics"),
])
def test_an_enabled_monitoring_config_sets_the_metrics_path(text, path):
    env = env_for(["--model_base_path=/m", "--monitoring_config_file=/mon.txt"], {"/mon.txt": text})
    assert env["METRICS_PATH"] == path


@pytest.mark.parametrize("text", ["", 'prometheus_config { enable: false path: "/tfs/metrics" }'])
def test_a_monitoring_config_not_enabled_adds_no_path(text):
    assert "METRICS_PATH" not in env_for(["--model_base_path=/m", "--monitoring_config_file=/mon.txt"],
                                         {"/mon.txt": text})


@pytest.mark.parametrize("text, message", [
    ("prometheus_config { enabled: true }", "Error parsing text-format tensorflow.serving.MonitoringConfig: "),
    ('prometheus_config { enable: true path: "metrics" }', "prometheus_config path 'metrics': expected a URL path"),
])
def test_a_bad_monitoring_config_is_refused(text, message):
    with pytest.raises(FlagError, match=re.escape(message)):
        env_for(["--model_base_path=/m", "--monitoring_config_file=/mon.txt"], {"/mon.txt": text})


def test_socket_path_channel_arguments_and_gpu_fraction_map_to_their_settings(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    env = env_for(["--model_base_path=/m", "--port=0", "--grpc_socket_path=tfs.sock",
                   "--grpc_channel_arguments=grpc.max_connection_age_ms=2000,grpc.lb_policy_name=grpclb",
                   "--per_process_gpu_memory_fraction=0.25"])
    assert {key: env[key] for key in ("GRPC_BIND", "GRPC_SOCKET_PATH", "GRPC_CHANNEL_ARGUMENTS",
                                      "GPU_MEMORY_FRACTION")} == {
        "GRPC_BIND": "", "GRPC_SOCKET_PATH": str(tmp_path / "tfs.sock"),
        "GRPC_CHANNEL_ARGUMENTS": "grpc.max_connection_age_ms=2000,grpc.lb_policy_name=grpclb",
        "GPU_MEMORY_FRACTION": "0.25"}


# The flags issue 26 lists whose translation no other test here gives a value other than the
# default: each changes exactly its own setting, or (grpc_max_threads) nothing at all.
@pytest.mark.parametrize("flag, changed", [
    ("--file_system_poll_wait_seconds=5", {"MODEL_POLL_SECONDS": "5"}),
    ("--rest_api_num_threads=6", {"THREADS": "6"}),
    ("--tensorflow_inter_op_parallelism=2", {"TF_INTER_OP_THREADS": "2"}),
    ("--tensorflow_intra_op_parallelism=3", {"TF_INTRA_OP_THREADS": "3"}),
    ("--grpc_max_threads=9", {}),
])
def test_poll_and_thread_flags_change_only_their_own_setting(flag, changed):
    left_out = env_for(["--model_base_path=/m"])
    env = env_for(["--model_base_path=/m", flag])
    assert {key: value for key, value in env.items() if left_out.get(key) != value} == changed


def test_tf_servings_defaults_of_the_new_flags_set_nothing():
    env = env_for(["--model_base_path=/m", "--grpc_socket_path=", "--grpc_channel_arguments=",
                   "--per_process_gpu_memory_fraction=0", "--monitoring_config_file="])
    assert not {"GRPC_SOCKET_PATH", "GRPC_CHANNEL_ARGUMENTS", "GPU_MEMORY_FRACTION", "METRICS_PATH"} & set(env)


def test_a_model_server_config_becomes_our_json_model_config(tmp_path):
    env = env_for(["--model_config_file=/cfg/models.conf"], {"/cfg/models.conf": GOOD_MODEL_CONFIG}, tmp_path)
    assert json.loads(Path(env["MODEL_CONFIG"]).read_text()) == {"models": [
        {"name": "half_plus_two", "path": "/models/half_plus_two"},
        {"name": "half_plus_three", "path": "/models/half_plus_three"}], "default": "half_plus_two"}
    assert "MODEL_PATH" not in env


def test_a_polled_model_server_config_is_read_from_the_file_itself():
    """The poll reads the file again, so MODEL_CONFIG names it rather than a JSON copy made once."""
    env = env_for(["--model_config_file=/cfg/models.conf", "--model_config_file_poll_wait_seconds=60"],
                  {"/cfg/models.conf": GOOD_MODEL_CONFIG})
    assert (env["MODEL_CONFIG"], env["MODEL_CONFIG_POLL_SECONDS"]) == ("/cfg/models.conf", "60")
    with pytest.raises(FlagError, match="Error parsing text-format"):
        env_for(["--model_config_file=/cfg/bad.conf", "--model_config_file_poll_wait_seconds=60"],
                {"/cfg/bad.conf": "improperly formatted file"})


def test_tensor_content_flag_sets_grpc_tensor_content():
    env = env_for(["--model_base_path=/m", "--enable_serialization_as_tensor_content"])
    assert env["GRPC_TENSOR_CONTENT"] == "true"
    assert "GRPC_TENSOR_CONTENT" not in env_for(["--model_base_path=/m"])


def test_tls_warmup_and_method_name_flags_map_to_their_settings():
    env = env_for(["--model_base_path=/m", "--ssl_config_file=/etc/ssl.conf", "--enable_model_warmup=false",
                   "--enable_signature_method_name_check"])
    assert (env["GRPC_SSL_CONFIG_FILE"], env["ENABLE_MODEL_WARMUP"], env["ENABLE_SIGNATURE_METHOD_NAME_CHECK"]) == (
        "/etc/ssl.conf", "false", "true")
    left_out = env_for(["--model_base_path=/m"])
    assert not {"GRPC_SSL_CONFIG_FILE", "ENABLE_MODEL_WARMUP", "ENABLE_SIGNATURE_METHOD_NAME_CHECK"} & set(left_out)


def test_pad_variable_length_inputs_turns_on_padding_with_its_start_up_check():
    assert tfs_flags.batching_settings("max_batch_size { value: 8 } pad_variable_length_inputs: true") == {
        "MAX_BATCH_SIZE": "8", "PAD_VARIABLE_LENGTH": "true"}


def test_version_policies_and_labels_carry_over():
    config = tfs_flags.model_config_json("""model_config_list { config {
        name: "m" base_path: "/models/m" model_platform: "tensorflow"
        model_version_policy { specific { versions: 1 versions: 2 } }
        version_labels { key: "stable" value: 1 } version_labels { key: "canary" value: 2 } }
      config { name: "n" base_path: "/models/n" model_version_policy { all {} } }
      config { name: "o" base_path: "/models/o" model_version_policy { latest { num_versions: 2 } } } }""")
    assert config["models"] == [
        {"name": "m", "path": "/models/m", "model_version_policy": {"specific": {"versions": [1, 2]}},
         "version_labels": {"stable": 1, "canary": 2}},
        {"name": "n", "path": "/models/n", "model_version_policy": {"all": {}}},
        {"name": "o", "path": "/models/o", "model_version_policy": {"latest": {"num_versions": 2}}}]


@pytest.mark.parametrize("text, message", [
    # testBadModelConfig
    ("improperly formatted file", "Error parsing text-format tensorflow.serving.ModelServerConfig"),
    ('model_config_list { config { name: "m" base_path: "/m" model_platform: "tflite" } }',
     "model_platform 'tflite' is not supported"),
    ("model_config_list { }", "holds no config"),
])
def test_a_bad_model_server_config_is_refused_with_tf_servings_words(text, message):
    with pytest.raises(FlagError, match=message):
        tfs_flags.model_config_json(text)


def test_batching_parameters_files_map_onto_our_batcher():
    assert tfs_flags.batching_settings(SICARA_BATCHING) == {
        "MAX_BATCH_SIZE": "20", "BATCH_TIMEOUT_MS": "500", "MAX_QUEUE_ROWS": "1024"}  # 100 x 20 capped
    assert tfs_flags.batching_settings(TF_SERVING_BATCHING) == {
        "MAX_BATCH_SIZE": "128", "BATCH_TIMEOUT_MS": "0", "MAX_QUEUE_ROWS": "1024"}
    assert tfs_flags.batching_settings("max_batch_size { value: 8 } max_enqueued_batches { value: 4 } "
                                       "allowed_batch_sizes: 4 allowed_batch_sizes: 8") == {
        "MAX_BATCH_SIZE": "8", "MAX_QUEUE_ROWS": "32"}
    env = env_for(["--model_base_path=/m", "--enable_batching", "--batching_parameters_file=/b.txt"],
                  {"/b.txt": SICARA_BATCHING})
    assert (env["BATCHING"], env["MAX_BATCH_SIZE"], env["BATCH_TIMEOUT_MS"]) == ("true", "20", "500")


@pytest.mark.parametrize("text, message", [
    ("max_batch_size: 20", "Error parsing text-format tensorflow.serving.BatchingParameters"),
    ("max_batch_size { value: 0 }", "max_batch_size must be at least 1"),
    ("batch_timeout_micros { value: -5 }", "batch_timeout_micros must not be negative"),
])
def test_a_bad_batching_parameters_file_is_refused(text, message):
    with pytest.raises(FlagError, match=message):
        tfs_flags.batching_settings(text)


def test_config_files_and_required_flags_are_checked():
    with pytest.raises(FlagError, match="--model_base_path or --model_config_file is required"):
        env_for(["--port=8500"])
    with pytest.raises(FlagError, match="--model_config_file=/nowhere.conf: No such file"):
        env_for(["--model_config_file=/nowhere.conf"])
    with pytest.raises(FlagError, match="--batching_parameters_file needs --enable_batching"):
        env_for(["--model_base_path=/m", "--batching_parameters_file=/b.txt"], {"/b.txt": SICARA_BATCHING})


def test_the_docs_flag_table_is_the_codes():
    from tests.conftest import REPO

    assert tfs_flags.markdown_table() in (REPO / "docs" / "tf-serving.md").read_text()


def test_a_model_base_path_that_is_not_there_is_refused_naming_the_flag(tmp_path, monkeypatch):
    """Refused before Gunicorn starts, so the error names the flag given, not MODEL_PATH, which
    the user never set; and a relative path is the one below where the command ran."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tfs_flags.os, "execve", lambda *args: pytest.fail("Gunicorn started"))
    with pytest.raises(SystemExit) as stopped:
        tfs_flags.main(["--model_name=m", "--model_base_path=models/m"])
    assert stopped.value.code == "tensorflow_model_server flags: --model_base_path=models/m: no such file or folder"
    (tmp_path / "models" / "m").mkdir(parents=True)
    started = []
    monkeypatch.setattr(tfs_flags.os, "execve", lambda path, argv, env: started.append(env))
    tfs_flags.main(["--model_name=m", "--model_base_path=models/m"])
    assert started[0]["MODEL_PATH"] == str(tmp_path / "models" / "m")
