"""Part 1, the model alone: time and CPU per call of both predict paths, in a child process.

TensorFlow is loaded only in the child (`python -m scripts.benchmark --model-alone-json ...`),
never in the process that runs the servers and Locust.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from app.settings import Settings
from scripts.live_server import REPO

from .configs import SERVER_VARIABLES, WIDE_MODEL, WIDE_MODEL_NAME
from .results import AfterIdle, BatchTiming, CallTiming, ModelAlone
from .runlog import log


def model_alone(model_path: str | None, batch_sizes: Sequence[int], *, budget_s: float,
                idle_calls: int, think_s: tuple[float, float]) -> ModelAlone:
    """Time per call, items/s and CPU of both predict paths, then batch-1 calls after idling."""
    import numpy as np

    from app import runtime
    from app.models import example_batch, load_model

    # TensorFlow's thread pools as in one worker of a default server, so its calls are the ones timed here.
    runtime.configure(Settings(), workers=1)
    model = load_model(model_path, name="default")
    rng = np.random.default_rng(0)

    def random_batch(size: int) -> dict[str, Any]:
        return {name: rng.standard_normal(array.shape).astype(array.dtype)
                for name, array in example_batch(model, size).items()}

    rows = []
    for batch_size in batch_sizes:
        batch = random_batch(batch_size)
        function = time_calls(functools.partial(model.predict, batch), budget_s=budget_s, batch_size=batch_size)
        keras_predict = None
        if model.keras_model is not None:
            keras_input = batch[model.inputs[0].name] if len(model.inputs) == 1 else batch
            # batch_size = the batch: one step per call (Keras' default of 32 would split 64 rows in two).
            call = functools.partial(model.keras_model.predict, keras_input, verbose=0, batch_size=batch_size)
            keras_predict = time_calls(call, budget_s=budget_s, batch_size=batch_size)
        rows.append(BatchTiming(batch_size, function, keras_predict))
    one_row = random_batch(1)
    after_idle = time_after_idle(lambda: model.predict(one_row), calls=idle_calls, think_s=think_s,
                                 rng=random.Random(0))
    return ModelAlone(rows, after_idle)


def time_calls(call: Callable[[], Any], *, budget_s: float, batch_size: int, max_calls: int = 200) -> CallTiming:
    for _ in range(2):  # the first calls of a shape trace and allocate
        call()
    wall: list[float] = []
    cpu_started = time.process_time()
    stop_at = time.perf_counter() + budget_s
    while len(wall) < max_calls and (len(wall) < 3 or time.perf_counter() < stop_at):
        started = time.perf_counter()
        call()
        wall.append(time.perf_counter() - started)
    cpu_s = time.process_time() - cpu_started
    wall.sort()
    median_s = wall[len(wall) // 2]
    return CallTiming(calls=len(wall), median_ms=median_s * 1000, mean_ms=sum(wall) / len(wall) * 1000,
                      items_per_s=batch_size / median_s, cpu_ms_per_call=cpu_s / len(wall) * 1000,
                      cpu_ms_per_row=cpu_s / len(wall) / batch_size * 1000)


def time_after_idle(call: Callable[[], Any], *, calls: int, think_s: tuple[float, float],
                    rng: random.Random) -> AfterIdle:
    """Batch-1 calls, each after an idle pause drawn like a Locust user's think time.

    After an idle second the weights may have left the caches and TensorFlow's threads gone to
    sleep: this, not a back-to-back call, is what one user with think time can hope for.
    """
    call()
    wall = []
    for _ in range(calls):
        time.sleep(rng.uniform(*think_s))  # the idle time itself is what is measured against
        started = time.perf_counter()
        call()
        wall.append(time.perf_counter() - started)
    ordered = sorted(wall)
    return AfterIdle(calls=calls, think_s=think_s, mean_ms=sum(wall) / calls * 1000,
                     median_ms=ordered[calls // 2] * 1000, wall_ms=[value * 1000 for value in wall])


def write_model_alone(out: Path, model_path: str | None, batch_sizes: Sequence[int], *, budget_s: float,
                      idle_calls: int, think_s: tuple[float, float]) -> None:
    """The child's side of run_model_alone."""
    alone = model_alone(model_path, batch_sizes, budget_s=budget_s, idle_calls=idle_calls, think_s=think_s)
    out.write_text(json.dumps(dataclasses.asdict(alone)))


def run_model_alone(work_dir: Path, *, model_path: str | None, batch_sizes: Sequence[int], call_budget_s: float,
                    idle_calls: int, timeout_s: float) -> ModelAlone:
    out = work_dir / "model_alone.json"
    command = [*child_command(), "--model-alone-json", str(out), "--batch-sizes", ",".join(map(str, batch_sizes)),
               "--call-budget", str(call_budget_s), "--idle-calls", str(idle_calls)]
    if model_path:
        command += ["--model-path", model_path]
    log(f"model alone: batch sizes {list(batch_sizes)}, then {idle_calls} calls after idling")
    run_child(command, work_dir / "model_alone.log", timeout_s=timeout_s)
    return ModelAlone.from_json(json.loads(out.read_text()))


def build_wide_model(work_dir: Path) -> str:
    """The issue's wide-input model, built from seeds and saved once for every configuration."""
    path = work_dir / "wide.keras"
    log(f"building the wide model ({WIDE_MODEL_NAME})")
    run_child([*child_command(), "--build-wide-model", str(path)], work_dir / "build_model.log", timeout_s=600)
    return str(path)


def save_wide_model(path: Path) -> None:
    from app.models import build_default_model

    build_default_model(**WIDE_MODEL).save(path)


def child_command() -> list[str]:
    return [sys.executable, "-m", "scripts.benchmark"]


def run_child(command: list[str], log_path: Path, *, timeout_s: float) -> None:
    """The benchmark again, in a child process: TensorFlow is never loaded in this one."""
    env = {key: value for key, value in os.environ.items() if key not in SERVER_VARIABLES}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    with open(log_path, "wb") as output:
        subprocess.run(command, cwd=REPO, env=env, check=True, timeout=timeout_s,
                       stdout=output, stderr=subprocess.STDOUT)
