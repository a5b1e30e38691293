"""Settings: defaults, parsing, and start-up errors that name the variable and the value."""

from __future__ import annotations

import json
import re

import pytest

from app.ops.settings import ModelConfig, Settings, SettingsError, documented, model_configs
from tests.conftest import REPO


def test_defaults_without_environment():
    settings = Settings.from_env({})
    assert settings.model_path is None
    assert (settings.max_batch_size, settings.batch_timeout_ms, settings.max_queue_rows) == (32, 0.0, 128)
    assert settings.batching is True
    assert settings.predict_method == "function"


def test_values_are_parsed_from_the_environment():
    settings = Settings.from_env({
        "MODEL_PATH": "/models/m.keras", "MAX_BATCH_SIZE": " 64 ", "BATCH_TIMEOUT_MS": "2.5",
        "BATCHING": "off", "PREDICT_METHOD": "keras_predict", "LOG_LEVEL": "debug", "GPU_MEMORY_LIMIT_MB": "2048",
    })
    assert settings.model_path == "/models/m.keras"
    assert settings.max_batch_size == 64
    assert settings.batch_timeout_ms == 2.5
    assert settings.batching is False
    assert settings.predict_method == "keras_predict"
    assert settings.log_level == "DEBUG"
    assert settings.gpu_memory_limit_mb == 2048


@pytest.mark.parametrize(
    "name,value,allowed",
    [
        ("MAX_BATCH_SIZE", "0", "a whole number of 1 or more"),
        ("MAX_BATCH_SIZE", "lots", "a whole number of 1 or more"),
        ("MAX_QUEUE_ROWS", "-5", "a whole number of 1 or more"),
        ("BATCH_TIMEOUT_MS", "-1", "a number of 0 or more"),
        ("BATCH_TIMEOUT_MS", "nan", "a number of 0 or more"),
        ("REQUEST_TIMEOUT_MS", "0", "a number above 0"),
        ("BATCHING", "maybe", "true or false"),
        ("PREDICT_METHOD", "fast", "'function' or 'keras_predict'"),
        ("MODEL_NAME", "../etc", "letters, digits"),
        ("LOG_LEVEL", "loud", "DEBUG, INFO"),
        ("TF_INTRA_OP_THREADS", "-1", "a whole number of 0 or more"),
    ],
)
def test_bad_value_names_variable_value_and_what_is_allowed(name, value, allowed):
    with pytest.raises(SettingsError) as error:
        Settings.from_env({name: value})
    assert str(error.value).startswith(f"{name}={value!r} is not valid: expected {allowed}")


def test_settings_page_documents_every_setting():
    page = (REPO / "docs" / "settings.md").read_text()
    table = set(re.findall(r"^\| `([A-Z_]+)` \|", page, flags=re.MULTILINE))
    names = {name for name, _, _ in documented()}
    assert names <= table, f"not in docs/settings.md: {sorted(names - table)}"


def write_config(tmp_path, document) -> dict[str, str]:
    path = tmp_path / "models.json"
    path.write_text(json.dumps(document))
    return {"MODEL_CONFIG": str(path), "MAX_BATCH_SIZE": "16"}


def test_model_config_gives_each_model_its_batching_settings(tmp_path):
    env = write_config(tmp_path, {"default": "b", "models": [
        {"name": "a", "path": "/models/a", "batch_timeout_ms": 5},
        {"name": "b", "max_batch_size": 64, "max_queue_rows": 256},
    ]})
    configs = model_configs(Settings.from_env(env))
    assert configs == [
        ModelConfig(name="b", path=None, max_batch_size=64, batch_timeout_ms=0.0, max_queue_rows=256),
        ModelConfig(name="a", path="/models/a", max_batch_size=16, batch_timeout_ms=5.0, max_queue_rows=128),
    ]


@pytest.mark.parametrize("document,message", [
    ({"models": []}, "expected an object with a non-empty 'models' list"),
    ({"models": [{"name": "a", "batch_size": 3}]}, "models[0] has unknown key(s) ['batch_size']"),
    ({"models": [{"name": "a"}, {"name": "a"}]}, "model names must be unique"),
    ({"models": [{"name": "a"}], "default": "z"}, "'default' is 'z', which is not one of ['a']"),
    ({"models": [{"name": "../a"}]}, "models[0].name='../a' is not valid"),
    ({"models": [{"name": "a", "max_batch_size": 0}]}, "models[0].max_batch_size='0' is not valid"),
])
def test_bad_model_config_names_the_file_and_the_problem(tmp_path, document, message):
    env = write_config(tmp_path, document)
    with pytest.raises(SettingsError) as error:
        model_configs(Settings.from_env(env))
    assert str(error.value).startswith(f"MODEL_CONFIG={env['MODEL_CONFIG']!r}: ")
    assert message in str(error.value)


@pytest.mark.parametrize("env,expected", [
    ({}, 64),                                               # 2 x MAX_BATCH_SIZE
    ({"MAX_QUEUE_ROWS": "16"}, 16),                          # never more than the queue holds
    ({"MAX_REQUEST_ROWS": "100"}, 100),
    ({"MAX_REQUEST_ROWS": "100", "MAX_QUEUE_ROWS": "50"}, 50),
])
def test_request_row_limit_is_derived_from_the_batch_size_unless_set(env, expected):
    (config,) = model_configs(Settings.from_env(env))
    assert config.max_request_rows == expected


def test_batches_fill_under_load_unless_turned_off():
    assert Settings.from_env({}).batch_fill_under_load is True
    assert Settings.from_env({"BATCH_FILL_UNDER_LOAD": "false"}).batch_fill_under_load is False


def test_restricted_api_groups_are_read_in_tritons_syntax():
    settings = Settings.from_env({
        "HTTP_RESTRICTED_API": "model-repository:Admin-Key=admin-value; inference, metadata:infer-key=s3cret=2",
        "GRPC_RESTRICTED_PROTOCOL": "health:k=v"})
    assert settings.http_restricted_api == ((("model-repository",), "admin-key", "admin-value"),
                                            (("inference", "metadata"), "infer-key", "s3cret=2"))
    assert settings.grpc_restricted_protocol == ((("health",), "k", "v"),)
    assert Settings.from_env({}).http_restricted_api == ()


@pytest.mark.parametrize("env, message", [
    # Triton's words (command_line_parser.cc), after the variable's name.
    ({"HTTP_RESTRICTED_API": "model-reposit:k=v"}, "HTTP_RESTRICTED_API: unknown restricted api 'model-reposit'"),
    ({"GRPC_RESTRICTED_PROTOCOL": "health:a=1;health,inference:b=2"},
     "GRPC_RESTRICTED_PROTOCOL: restricted protocol 'health' can not be specified in multiple config groups"),
    # The value is a credential: an error shows the categories and keys, never a value.
    ({"HTTP_RESTRICTED_API": "inference:k="}, "HTTP_RESTRICTED_API='inference:k=<hidden>' is not valid"),
    ({"HTTP_RESTRICTED_API": "inference:s3cret"}, "HTTP_RESTRICTED_API='<hidden>' is not valid"),
    ({"HTTP_RESTRICTED_API": "k=v"}, "HTTP_RESTRICTED_API='<hidden>' is not valid"),
    ({"RESTRICTED_MODEL_CONTROL": "k=v", "GRPC_RESTRICTED_PROTOCOL": "model-repository:k=v"},
     "RESTRICTED_MODEL_CONTROL and GRPC_RESTRICTED_PROTOCOL both restrict 'model-repository': set one of them"),
])
def test_bad_restricted_api_groups_stop_start_up_in_tritons_words(env, message):
    with pytest.raises(SettingsError) as error:
        Settings.from_env(env)
    assert str(error.value).startswith(message)
    assert "s3cret" not in str(error.value)
