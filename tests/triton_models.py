"""Triton's qa models for the tests (built by scripts/triton_models.py), and the servers Triton's
test.sh scripts start, as this server: a repository laid out as theirs, its models served with
the settings that match their config.pbtxt."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from scripts.triton_models import build, model_config, repository
from tests.conftest import Server


@pytest.fixture(scope="session")
def triton_models(tmp_path_factory) -> Path:
    """Built once per test session (a few seconds of TensorFlow)."""
    return build(tmp_path_factory.mktemp("triton_models"))


@contextmanager
def triton_server(built: Path, folder: Path, *, repository_names: tuple[str, ...], served: tuple[str, ...],
                  env: dict[str, str] | None = None, more: tuple[dict[str, Any], ...] = ()) -> Iterator[Server]:
    """A server as one of Triton's test.sh starts it: MODEL_REPOSITORY holds `repository_names`
    (the index counts them), `served` are loaded from it with their SETTINGS; `more` are MODEL_CONFIG
    entries of models of our own beside them (`path` a built model's name)."""
    models = repository(built, folder / "models", repository_names)
    document = model_config(models, served)
    document["models"] += [{**entry, "path": str(built / entry["path"])} for entry in more]
    config = folder / "models.json"
    config.write_text(json.dumps(document))
    server = Server(folder, {"MODEL_CONFIG": str(config), "MODEL_REPOSITORY": str(models),
                             "MODEL_POLL_SECONDS": "0", **(env or {})})
    server.start()
    try:
        yield server
    finally:
        server.stop()
