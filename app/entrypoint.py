"""The image's entrypoint: this server's own settings, or TensorFlow Serving's image conventions.

    docker run IMAGE                                      the CMD as it is: Gunicorn on BIND
                                                          (0.0.0.0:8000), gRPC on 8500
    docker run -e MODEL_NAME=m -v $PWD/m:/models/m IMAGE  as tensorflow/serving runs: model m
                                                          from MODEL_BASE_PATH/m (/models/m),
                                                          REST on 8501, gRPC on 8500
    docker run IMAGE --model_config_file=/c --enable_batching   the same, with those flags

TF Serving's image starts `tensorflow_model_server --port=8500 --rest_api_port=8501
--model_name=${MODEL_NAME} --model_base_path=${MODEL_BASE_PATH}/${MODEL_NAME} "$@"`; so does
this one, through app.tfs_flags, once a TF Serving variable or a flag asks for it: a
MODEL_BASE_PATH, or a MODEL_NAME other than this server's own default name (`default`, which
docker-compose.yml passes), with neither MODEL_PATH nor MODEL_CONFIG. REST then also answers on
BIND (8000 unless set), where the image's HEALTHCHECK asks. Any other command runs as given.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from app import tfs_flags

# TF Serving image's defaults (tensorflow_serving/tools/docker/Dockerfile).
DEFAULT_MODEL_NAME = "model"
DEFAULT_MODEL_BASE_PATH = "/models"
SERVER_COMMAND = ("gunicorn", "-c", "gunicorn.conf.py", "wsgi:app")
# Where the image's HEALTHCHECK asks: BIND, as gunicorn.conf.py reads it.
HEALTHCHECK_BIND = "0.0.0.0:8000"


def tf_serving_flags(argv: Sequence[str], environ: Mapping[str, str]) -> list[str] | None:
    """tensorflow_model_server's flags for this start, or None where the command runs as given."""
    flags = list(argv) if argv and argv[0].startswith("-") else None
    if flags is None:
        ours = any(environ.get(name) for name in ("MODEL_PATH", "MODEL_CONFIG"))
        tf_serving = bool(environ.get("MODEL_BASE_PATH")) or environ.get("MODEL_NAME", "default") not in (
            "", "default")
        if tuple(argv) not in (SERVER_COMMAND, ()) or ours or not tf_serving:
            return None
        flags = []
    name = environ.get("MODEL_NAME") or DEFAULT_MODEL_NAME
    base = (environ.get("MODEL_BASE_PATH") or DEFAULT_MODEL_BASE_PATH).rstrip("/")
    # The image's flags first: a flag given again later wins, as in TensorFlow's flag parser.
    return ["--port=8500", "--rest_api_port=8501", f"--model_name={name}", f"--model_base_path={base}/{name}",
            *flags]


def main() -> None:
    argv = sys.argv[1:]
    flags = tf_serving_flags(argv, os.environ)
    if flags is not None:
        tfs_flags.main(flags, also_bind=(os.environ.get("BIND") or HEALTHCHECK_BIND,))
    if not argv:
        argv = list(SERVER_COMMAND)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
