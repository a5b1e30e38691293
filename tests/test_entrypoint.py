"""The image's entrypoint (app/entrypoint.py): TF Serving's image conventions translated,
this server's own start left as it is. Pure functions: no image is built here."""

from __future__ import annotations

import sys

import pytest

from app import tfs_flags
from app.entrypoint import SERVER_COMMAND, tf_serving_flags

IMAGE_FLAGS = ["--port=8500", "--rest_api_port=8501"]


def env_of(flags, config_dir="/nonexistent"):
    return tfs_flags.environment(tfs_flags.parse_flags(flags), read=lambda path: 'model_config_list { config { '
                                 'name: "m" base_path: "/models/m" } }', config_dir=str(config_dir))


@pytest.mark.parametrize("argv, environ", [
    ([], {}),
    (list(SERVER_COMMAND), {}),
    (list(SERVER_COMMAND), {"MODEL_PATH": "/models/m", "MODEL_NAME": "m"}),
    (list(SERVER_COMMAND), {"MODEL_CONFIG": "/cfg/models.json", "MODEL_NAME": "m"}),
    (["python", "-c", "print(1)"], {"MODEL_NAME": "m"}),
    (list(SERVER_COMMAND), {"MODEL_NAME": "default", "MODEL_PATH": "", "MODEL_CONFIG": ""}),
], ids=["nothing", "the CMD", "our MODEL_PATH", "our MODEL_CONFIG", "another command", "docker-compose.yml's"])
def test_without_tf_servings_variables_or_flags_the_command_runs_as_given(argv, environ):
    assert tf_serving_flags(argv, environ) is None


def test_model_name_alone_serves_models_slash_name_on_tf_servings_ports():
    flags = tf_serving_flags(list(SERVER_COMMAND), {"MODEL_NAME": "m"})
    assert flags == [*IMAGE_FLAGS, "--model_name=m", "--model_base_path=/models/m"]
    env = env_of(flags)
    assert (env["BIND"], env["GRPC_BIND"], env["MODEL_NAME"], env["MODEL_PATH"]) == (
        "0.0.0.0:8501", "0.0.0.0:8500", "m", "/models/m")


def test_model_base_path_moves_the_models_folder():
    assert tf_serving_flags([], {"MODEL_BASE_PATH": "/mnt/store/", "MODEL_NAME": "m"}) == [
        *IMAGE_FLAGS, "--model_name=m", "--model_base_path=/mnt/store/m"]


def test_arguments_are_tensorflow_model_server_flags_after_the_images_own(tmp_path):
    """TF Serving's documented `docker run ... IMAGE --model_config_file=... --enable_batching`."""
    flags = tf_serving_flags(["--model_config_file=/models/models.config", "--enable_batching"], {})
    assert flags == [*IMAGE_FLAGS, "--model_name=model", "--model_base_path=/models/model",
                     "--model_config_file=/models/models.config", "--enable_batching"]
    env = env_of(flags, tmp_path)
    assert (env["BATCHING"], "MODEL_PATH" in env, env["BIND"]) == ("true", False, "0.0.0.0:8501")
    # A flag given again wins, as in TensorFlow's flag parser.
    assert env_of(tf_serving_flags(["--rest_api_port=9001"], {}))["BIND"] == "0.0.0.0:9001"


def test_an_unknown_flag_still_stops_start_up_naming_it():
    with pytest.raises(tfs_flags.FlagError, match="unknown flag --no_such_flag"):
        tfs_flags.parse_flags(tf_serving_flags(["--no_such_flag=1"], {}))


def test_rest_also_answers_on_the_port_the_images_healthcheck_asks():
    assert tfs_flags.gunicorn_command({"BIND": "0.0.0.0:8501"}, ("0.0.0.0:8000",)) == [
        sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "-b", "0.0.0.0:8501", "-b", "0.0.0.0:8000",
        "wsgi:app"]
    # Asked for 8000 itself: bound once. Without extra addresses: gunicorn.conf.py's BIND.
    assert "-b" not in tfs_flags.gunicorn_command({"BIND": "0.0.0.0:8000"}, ("0.0.0.0:8000",))
    assert "-b" not in tfs_flags.gunicorn_command({"BIND": "0.0.0.0:8501"})
