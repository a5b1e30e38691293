"""What is run: the server configurations, the load points, and a baseline commit's tree."""

from __future__ import annotations

import dataclasses
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from app.batching import bucket_sizes  # imports no TensorFlow
from app.settings import Settings, documented
from scripts.live_server import REPO, SERVER_COMMAND

LOCUSTFILE = REPO / "locustfile.py"
# Server knobs that would leak from the caller's environment into every configuration.
SERVER_DEFAULTS = {name: default for name, default, _ in documented()}
SERVER_VARIABLES = set(SERVER_DEFAULTS) | {
    "WORKERS", "THREADS", "BIND", "TIMEOUT", "GRACEFUL_TIMEOUT", "KEEPALIVE", "GUNICORN_CMD_ARGS",
    "PROMETHEUS_MULTIPROC_DIR"}
LOCUST_VARIABLES = {"LOCUST_SHAPE", "LOCUST_ROWS", "LOCUST_PATH", "LOCUST_MODEL", "LOCUST_WAIT_MIN", "LOCUST_PROTOCOL",
                    "LOCUST_WAIT_MAX", "LOCUST_SUMMARY_FILE"}
THINK_TIME_S = (1.0, 3.0)
CLOSED_LOOP_LABEL = "closed loop"
# The performance issue's wide-input model: build_default_model's arguments.
WIDE_MODEL = {"features": 1024, "depth": 3, "outputs": 1000}
WIDE_MODEL_NAME = "1,024 floats in, 4 × 4,096 hidden, 1,000 out dense, ~235 MB of float32 weights"
# The batch bucket sizes every configuration pads to (the server's default MAX_BATCH_SIZE).
SERVER_BUCKETS = bucket_sizes(Settings().max_batch_size)
REFERENCE = "default"


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    workers: int
    env: dict[str, str]
    what: str
    baseline: bool  # a configuration the default is compared against
    tree: Path = REPO  # the checkout whose gunicorn.conf.py and app/ it runs
    app: tuple[str, ...] = SERVER_COMMAND[-1:]  # what Gunicorn serves, with any flags it needs
    in_full_run: bool = True  # run when --configs is not given

    @property
    def predict_path(self) -> str:
        """The part-1 timing that matches this configuration's predict calls."""
        return "keras_predict" if self.env.get("PREDICT_METHOD") == "keras_predict" else "function"


@dataclasses.dataclass(frozen=True)
class Load:
    label: str
    users: int
    think_s: tuple[float, float]

    @property
    def closed_loop(self) -> bool:
        return self.think_s == (0.0, 0.0)


FLOOR_APP = ("--pythonpath", "scripts", "floor_app:app")
# naive and unbatched-* use the server's benchmark-only settings (BATCHING, PREDICT_METHOD).
CONFIGS = [
    Config("naive", 1, {"PREDICT_METHOD": "keras_predict", "BATCHING": "false"},
           "Keras model.predict per request, no batching: the article's starting point", True),
    Config("unbatched-1w", 1, {"BATCHING": "false"},
           "our compiled predict path, one request per call, 1 worker", True),
    Config("unbatched-2w", 2, {"BATCHING": "false"},
           "our compiled predict path, one request per call, 2 workers", True),
    Config("timeout-500ms", 1, {"BATCH_TIMEOUT_MS": "500"},
           "batching that waits up to 500 ms for a batch to fill, as the article did", True),
    Config("timeout-20ms", 1, {"BATCH_TIMEOUT_MS": "20"},
           "batching that waits up to 20 ms for a batch to fill", True),
    Config("default", 1, {}, "the shipped default: batch as soon as the model is free, 1 worker", False),
    Config("default-2w", 2, {}, "the shipped default with 2 workers", False),
    # MODEL_PROCESSES (docs/scaling.md#model-processes): one model copy whatever the worker count.
    Config("default-4w", 4, {}, "the shipped default with 4 workers", False, in_full_run=False),
    Config("procs-1w", 1, {"MODEL_PROCESSES": "1"}, "1 model process, 1 worker", False, in_full_run=False),
    Config("procs-2w", 2, {"MODEL_PROCESSES": "1"}, "1 model process, 2 workers", False, in_full_run=False),
    Config("procs-4w", 4, {"MODEL_PROCESSES": "1"}, "1 model process, 4 workers", False, in_full_run=False),
    # Not servers: what Gunicorn and Flask cost around the same model (scripts/floor_app.py).
    Config("floor", 1, {"GRPC_BIND": ""}, "the floor: Gunicorn and Flask around the same model, nothing of app/ in a "
           "request (scripts/floor_app.py; fixed answers)", True, app=FLOOR_APP, in_full_run=False),
    Config("floor-batcher", 1, {"GRPC_BIND": "", "FLOOR_BATCHER": "true"}, "the floor with the server's batching "
           "engine as its model thread (scripts/floor_app.py, FLOOR_BATCHER=true; fixed answers)", True,
           app=FLOOR_APP, in_full_run=False),
]
CONFIGS_BY_NAME = {config.name: config for config in CONFIGS}


@contextmanager
def baseline_tree(ref: str) -> Iterator[tuple[Path, str]]:
    """Commit `ref` checked out in a temporary detached git worktree, and its short sha; removed after."""
    short = subprocess.run(["git", "rev-parse", "--short", f"{ref}^{{commit}}"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="benchmark-baseline-") as folder:
        tree = Path(folder) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), ref], cwd=REPO, check=True,
                       capture_output=True, text=True)
        try:
            yield tree, short
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)


def baseline_config(tree: Path, short_sha: str) -> Config:
    return Config(f"baseline@{short_sha}", 1, {}, f"the server of commit {short_sha}: its defaults, 1 worker",
                  True, tree)
