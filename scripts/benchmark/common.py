"""What every scenario shares: configurations, the measured server, the results page, the machine."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Any

import psutil
import requests

from app.ops.settings import documented
from scripts.live_server import REPO, SERVER_COMMAND, LiveServer

COMMAND = "python -m scripts.benchmark"
DOCS = REPO / "docs"
# Server knobs that would leak from the caller's environment into every configuration.
SERVER_VARIABLES = {name for name, _, _ in documented()} | {
    "WORKERS", "THREADS", "BIND", "TIMEOUT", "GRACEFUL_TIMEOUT", "KEEPALIVE", "GUNICORN_CMD_ARGS",
    "PROMETHEUS_MULTIPROC_DIR"}
LOCUST_VARIABLES = {"LOCUST_SHAPE", "LOCUST_ROWS", "LOCUST_PATH", "LOCUST_MODEL", "LOCUST_WAIT_MIN", "LOCUST_PROTOCOL",
                    "LOCUST_WAIT_MAX", "LOCUST_SUMMARY_FILE"}
# The wide-input model: build_default_model's arguments.
WIDE_MODEL = {"features": 1024, "depth": 3, "outputs": 1000}
WIDE_MODEL_NAME = "1,024 floats in, 4 × 4,096 hidden, 1,000 out dense, ~235 MB of float32 weights"
DEFAULT_MODEL_NAME = "the built-in default model (4 → 4096 ×5 → 3 dense, ~268 MB of float32)"
FLOOR_APP = ("--pythonpath", "scripts", "floor_app:app")
# Folders of the machine a run was made on: a page shows its command without them.
LOCAL_FLAGS = ("--out", "--work-dir", "--model-path", "--pytriton-python", "--litserve-python")


def log(message: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


def fmt(value: float | None, digits: int = 1) -> str:
    """A figure for a table: – where unknown, thousands without decimals."""
    if value is None:
        return "–"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.{digits}f}"


def ratio(numerator: float | None, denominator: float | None, digits: int = 1) -> str:
    if not numerator or not denominator:
        return "–"
    value = numerator / denominator
    return f"{value:.{digits}f}×" if value < 100 else f"{value:,.0f}×"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def names(known: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: names from `known`, separated by commas."""
    def parse(text: str) -> list[str]:
        chosen = [part.strip() for part in text.split(",") if part.strip()]
        if not chosen or any(name not in known for name in chosen):
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(known)}; got {text!r}")
        return chosen
    return parse


def add_page_arguments(parser: argparse.ArgumentParser, page: Path) -> None:
    parser.add_argument("--out", type=Path, default=page, help="the page to write (default %(default)s)")
    parser.add_argument("--work-dir", type=Path, help="keep the servers' logs, the load generator's output and the "
                        "raw results here (default: a temporary folder)")


def add_model_arguments(parser: argparse.ArgumentParser, *, default: str) -> None:
    """The model every server of a run serves, and an older tree to run beside this one."""
    add = parser.add_argument
    add("--model", choices=("default", "wide"), default=default,
        help=f"the built-in default model, or the wide-input model ({WIDE_MODEL_NAME}), built from seeds")
    # Absolute: a baseline's server runs in a tree of its own.
    add("--model-path", type=lambda path: str(Path(path).resolve()),
        help="serve this model (any MODEL_PATH); wins over --model")
    add("--baseline-ref", metavar="REF", help="also run the server of this git commit as baseline@<sha>")


def model_name(args: argparse.Namespace) -> str:
    if args.model_path:
        return Path(args.model_path).name
    return f"the wide-input model ({WIDE_MODEL_NAME})" if args.model == "wide" else DEFAULT_MODEL_NAME


def model_path(args: argparse.Namespace, work_dir: Path) -> str | None:
    """Every server's MODEL_PATH (None: the built-in model), the wide model built for it first."""
    return args.model_path or (build_wide_model(work_dir) if args.model == "wide" else None)


def mean(values: Iterable[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return sum(known) / len(known) if known else None


@dataclasses.dataclass(frozen=True)
class Config:
    """A server to measure: `app` is what Gunicorn serves from `tree` (this checkout, or a baseline's)."""

    name: str
    workers: int
    env: dict[str, str]
    what: str
    tree: Path = REPO
    app: tuple[str, ...] = SERVER_COMMAND[-1:]
    in_full_run: bool = True  # run when --configs is not given


@dataclasses.dataclass(frozen=True)
class Load:
    label: str
    users: int
    think_s: tuple[float, float] = (0.0, 0.0)  # none: a closed loop


@dataclasses.dataclass(frozen=True)
class MetricSnapshot:
    """The batch-size histogram and predict time of one /metrics page, added up over models and labels."""

    buckets: dict[float, float] = dataclasses.field(default_factory=dict)  # le -> cumulative predict calls
    rows: float = 0.0
    calls: float = 0.0
    predict_s: float = 0.0


def metric_totals(text: str) -> tuple[dict[str, float], dict[float, float]]:
    """A /metrics page's samples added up by name over every series, and the batch-size histogram's buckets."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    buckets: dict[float, float] = {}  # le -> cumulative predict calls
    for sample in (sample for family in text_string_to_metric_families(text) for sample in family.samples):
        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        if sample.name == "model_server_batch_size_rows_bucket":
            buckets[float(sample.labels["le"])] = buckets.get(float(sample.labels["le"]), 0.0) + sample.value
    return totals, buckets


def metric_snapshot(text: str) -> MetricSnapshot:
    totals, buckets = metric_totals(text)
    return MetricSnapshot(buckets, totals.get("model_server_batch_size_rows_sum", 0.0),
                          totals.get("model_server_batch_size_rows_count", 0.0),
                          totals.get("model_server_predict_duration_seconds_sum", 0.0))


class Server(LiveServer):
    """A configuration's Gunicorn, from its tree, with its own settings only: the caller's server and Locust
    variables are not inherited. The access log stays on, as by default: writing it is part of a request's cost."""

    def __init__(self, config: Config, *, model_path: str | None, log_path: Path) -> None:
        env = dict(config.env) | ({"MODEL_PATH": model_path} if model_path else {})
        super().__init__(log_path.parent, env, app=config.app, cwd=config.tree,
                         drop_env=SERVER_VARIABLES | LOCUST_VARIABLES, log_name=log_path.name)
        self.config = config

    @contextmanager
    def running(self, *, workers: int = 1, within_s: float = 300) -> Iterator[Server]:
        """Started and ready, then stopped: also when it never became ready."""
        try:
            self.start(workers=workers, ready_within_s=within_s)
            yield self
        finally:
            self.stop()

    def metrics(self) -> MetricSnapshot | None:
        """The batching figures of /metrics (all workers added up), or None where it cannot be read."""
        try:
            answer = requests.get(self.url + "/metrics", timeout=10)
        except (requests.ConnectionError, requests.Timeout):
            return None
        return metric_snapshot(answer.text) if answer.status_code == 200 else None

    def cpu_seconds(self) -> float:
        """User + system CPU of the server's whole process tree, alive now; one that has exited counts nothing."""
        return sum(times.user + times.system for times in self._each("cpu_times"))

    def rss_bytes(self) -> int:
        """Resident memory of every process of the server added up (pages shared after a fork counted in each)."""
        return sum(memory.rss for memory in self._each("memory_info"))

    def _each(self, method: str) -> Iterator[Any]:
        for process in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                yield getattr(process, method)()

    def wait_quiet(self, *, within_s: float, idle_share: float = 0.05, window_s: float = 0.5) -> float:
        """Wait until the server uses under `idle_share` of a core: the last load's backlog is done."""
        started = time.monotonic()
        before = self.cpu_seconds()
        while time.monotonic() - started < within_s:
            time.sleep(window_s)  # a CPU rate needs a window; there is no event for "idle"
            now = self.cpu_seconds()
            if now - before < idle_share * window_s:
                break
            before = now
        return time.monotonic() - started

    def stop(self, *, signum: int = signal.SIGTERM, within_s: float = 60) -> int:
        """Stop it; one that had to be killed is logged, not raised: the other configurations still run."""
        try:
            return super().stop(signum=signum, within_s=within_s)
        except subprocess.TimeoutExpired:
            log(f"{self.config.name}: killed after it did not stop within {within_s:g} s; see {self.log_path.name}")
            return -signal.SIGKILL


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot, over all its cores (a hypervisor's steal left out)."""
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + getattr(times, "irq", 0.0) + getattr(times, "softirq", 0.0)


def failure(exc: Exception, server: LiveServer) -> str:
    """One line for a page: the first line of the error, and where the server's log is."""
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first_line} (see {server.log_path.name})"


def machine_facts() -> dict[str, str]:
    """The machine, the load on it at the start, and the package versions."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    facts = {"CPU": cpu, "cores": f"{psutil.cpu_count(logical=True)} logical, {psutil.cpu_count(logical=False)} "
             f"physical", "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB", "OS": platform.platform(),
             "load average at start (1, 5, 15 min)": ", ".join(f"{value:.2f}" for value in os.getloadavg()),
             "python": platform.python_version()}
    for name in ("tensorflow-cpu", "keras", "gunicorn", "flask", "locust", "nvidia-pytriton"):
        with contextlib.suppress(package_metadata.PackageNotFoundError):
            facts[name] = package_metadata.version(name)
    return facts


def without_flags(argv: Sequence[str], flags: Sequence[str] = LOCAL_FLAGS) -> list[str]:
    """argv less these flags and their values (`--out DIR` and `--out=DIR`)."""
    shown, skip = [], False
    for part in argv:
        if not skip and part not in flags and not part.startswith(tuple(f"{flag}=" for flag in flags)):
            shown.append(part)
        skip = not skip and part in flags  # the next part is this flag's value
    return shown


def write_page(path: Path, title: str, *, scenario: str, argv: Sequence[str], started: datetime.datetime,
               elapsed_s: float, machine: dict[str, str], body: Sequence[str]) -> Path:
    """A scenario's one results page: its latest run, the machine, the command that made it."""
    command = " ".join([COMMAND, scenario, *without_flags(argv)])
    lines = [f"# {title}", "", f"Generated by `{command}` on {started:%Y-%m-%d %H:%M} UTC in {elapsed_s / 60:.1f} min: "
             "the latest run, not asserted by any test; re-run the command to measure your machine.", "",
             "## Machine", "", *markdown_table(("", ""), machine.items()), "", *body]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip("\n") + "\n")
    return path


def run_scenario(args: Any, title: str, measure: Callable[[Path, dict[str, str]], tuple[list[str], bool]]) -> int:
    """A scenario from end to end: the machine as it starts, `measure` in a working folder (the page's body
    and whether anything failed), the page; exit status 1 where anything failed."""
    started, clock = datetime.datetime.now(datetime.UTC), time.monotonic()
    machine = machine_facts()  # the load average at the start, before anything of this run
    if args.work_dir:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(args.work_dir) if args.work_dir else tempfile.TemporaryDirectory(
            prefix="benchmark-") as work_dir:
        body, failed = measure(Path(work_dir), machine)
    page = write_page(args.out, title, scenario=args.scenario, argv=args.argv, started=started,
                      elapsed_s=time.monotonic() - clock, machine=machine, body=body)
    log(f"wrote {page}")
    return 1 if failed else 0


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
    return Config(f"baseline@{short_sha}", 1, {}, f"the server of commit {short_sha}: its defaults, 1 worker", tree)


def run_child(function: str, log_path: Path, *, timeout_s: float = 900, **kwargs: Any) -> None:
    """`module:function(**kwargs)` in a child process, so that TensorFlow is never loaded in this one."""
    env = {key: value for key, value in os.environ.items() if key not in SERVER_VARIABLES}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    module, name = function.split(":")
    code = f"import json, sys; from {module} import {name}; {name}(**json.loads(sys.argv[1]))"
    with open(log_path, "wb") as output:
        subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], cwd=REPO, env=env, check=True,
                       timeout=timeout_s, stdout=output, stderr=subprocess.STDOUT)


def save_wide_model(path: str) -> None:
    from app.core.models import build_default_model

    build_default_model(**WIDE_MODEL).save(path)


def build_wide_model(work_dir: Path) -> str:
    """The wide-input model, built from seeds and saved once for every server of a run."""
    path = work_dir / "wide.keras"
    log(f"building the wide model ({WIDE_MODEL_NAME})")
    run_child("scripts.benchmark.common:save_wide_model", work_dir / "build_model.log", path=str(path))
    return str(path)
