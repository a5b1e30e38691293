"""Where one worker's time goes under closed-loop load: a py-spy profile, per stage and per thread.

For each tree (this one; with --baseline-ref a git worktree of that commit; unless --no-floor
the floor and floor-batcher of scripts/floor_app.py), a real Gunicorn with one worker serves the
model while headless Locust runs a closed loop, one row per request. py-spy (PyPI) samples the
thread holding the GIL (`--gil`); each sample is put in the stage of the frame nearest the leaf that
belongs to one (STAGES). A second run, without py-spy, reads each thread's CPU time from /proc.
py-spy runs `--nonblocking` at a low rate; it still takes CPU on the same cores, so the req/s
beside a profile are below a benchmark's.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from . import common
from .common import DOCS, Config, Load, Server, fmt, log, markdown_table
from .experiment import CONFIGS_BY_NAME
from .load import run_locust

PAGE = DOCS / "profile.md"
PY_SPY = str(Path(sys.executable).parent / "py-spy")
FLOOR, FLOOR_BATCHER = CONFIGS_BY_NAME["floor"], CONFIGS_BY_NAME["floor-batcher"]
# The batching engine's files: app/core/batching/ (app/batching/ and app/batching.py in older trees).
ENGINE = ("app/core/batching/", "app/batching")
BATCH_THREAD_STAGE = "batch thread: gather, pad, deliver"
QUEUE_STAGE = "request thread: queue and wait"
# (stage, substrings of a py-spy frame "function (path:line)"), tried in order for each frame
# from the leaf up; the first frame that matches any names the stage.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("model: TensorFlow call", ("tensorflow/", "keras/", "app/models.py", "app/core/models.py")),
    # Before the decode row: both are in the codec (app/wire/codec.py), told apart by function.
    ("JSON encode", tuple(f"{name} ({path}" for path in ("app/codec.py", "app/wire/codec.py") for name in (
        "encode_response", "_answer_body", "_jsonable", "_squeezed", "_batch_size", "_non_finite_json", "_token",
        "_encode_strings"))),
    ("JSON decode and checks", ("(app/codec.py", "(app/classify.py", "(app/wire/")),
    ("access log", ("app/logs.py", "app/ops/logs.py", "logging/")),
    ("metrics", ("prometheus_client/", "app/metrics.py", "app/ops/metrics.py")),
    # The engine's frames (and the futures it settles) count for the thread they run on: see stage_of.
    (BATCH_THREAD_STAGE, ()),
    (QUEUE_STAGE, (*ENGINE, "app/registry.py", "app/core/registry.py", "concurrent/futures/_base.py")),
    ("body limits", ("app/limits.py", "app/http/bodies.py")),
    ("views (app/http/tfs.py)", ("app/api.py", "app/errors.py", "app/http/", "app/core/errors.py")),
    ("floor app: parse, hand to the model thread, wait", ("floor_app.py",)),
    ("Flask and Werkzeug", ("flask/", "werkzeug/")),
    ("Gunicorn: HTTP, threads, polling",
     ("gunicorn/", "selectors.py", "concurrent/futures/thread.py", "app/worker.py")),
    ("gRPC server", ("grpc/",)),
]
OTHER_STAGE = "other"
# Kinds of thread for the CPU table, by the name Python gave the thread (a prefix of it).
THREAD_KINDS: list[tuple[str, tuple[str, ...]]] = [
    ("request threads", ("ThreadPoolExecutor",)),
    ("main thread (Gunicorn's poller)", ("MainThread",)),
    ("batch thread", ("batcher-", "floor-model")),
    ("access-log thread", ("access-log",)),
]
OTHER_PYTHON_THREADS = "other Python threads"
# Threads Python did not start: TensorFlow's pools, and gRPC's where it serves.
NATIVE_THREADS = "threads without Python (TensorFlow's pools, gRPC's)"


@dataclasses.dataclass
class Profile:
    samples: collections.Counter  # stack -> count
    errors: int
    ticks: int  # sampling ticks over the recording (rate × seconds)


def stage_of(stack: str) -> str:
    for frame in reversed(stack.split(";")):
        for stage, needles in STAGES:
            if any(needle in frame for needle in needles):
                return BATCH_THREAD_STAGE if stage == QUEUE_STAGE and on_batch_thread(stack) else stage
    return OTHER_STAGE


def on_batch_thread(stack: str) -> bool:
    """The thread's outermost frame past threading.py is the engine's (or the floor's model thread):
    told by file, so that no name inside the engine is needed."""
    root = next((frame for frame in stack.split(";") if "(threading.py" not in frame), "")
    return any(path in root for path in ENGINE) or "ModelThread._run" in root


def read_raw(path: Path) -> collections.Counter:
    """py-spy's raw (collapsed) format: 'frame;frame;... count' per line."""
    samples: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            samples[stack] += int(count)
    return samples


def record(pid: int, *, seconds: float, rate: int, out: Path) -> tuple[collections.Counter, int]:
    command = [PY_SPY, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
               "--nonblocking", "--gil", "--format", "raw", "--output", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120)
    if finished.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed ({finished.returncode}): {finished.stderr[-2000:]}")
    # py-spy> Wrote raw flamegraph data to '...'. Samples: 306 Errors: 97
    errors = re.findall(r"Errors: (\d+)", finished.stdout + finished.stderr)
    return read_raw(out), int(errors[-1]) if errors else 0


def thread_names(pid: int) -> dict[int, str]:
    """The name Python gave each of its threads, by native thread id (`py-spy dump`)."""
    dump = subprocess.run([PY_SPY, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                          timeout=120)
    if dump.returncode != 0:
        raise RuntimeError(f"py-spy dump failed ({dump.returncode}): {dump.stderr[-2000:]}")
    return parse_thread_names(dump.stdout)


def parse_thread_names(dump: str) -> dict[int, str]:
    # Thread 25162 (idle): "MainThread"
    return {int(tid): name for tid, name in re.findall(r'^Thread (\d+) \([^)]*\): "(.*)"$', dump, re.M)}


def thread_cpu(pid: int, *, proc: Path = Path("/proc")) -> dict[int, float]:
    """User + system CPU seconds of each thread of a process so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for task in (proc / str(pid) / "task").iterdir():
        try:
            # After the command's closing parenthesis (a name may hold spaces): field 3 onwards.
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # the thread ended between the listing and the read
        seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return seconds


def thread_kind(name: str | None) -> str:
    if name is None:
        return NATIVE_THREADS
    return next((kind for kind, prefixes in THREAD_KINDS if name.startswith(prefixes)), OTHER_PYTHON_THREADS)


def cpu_by_kind(before: dict[int, float], after: dict[int, float], names: dict[int, str]) -> collections.Counter:
    """CPU seconds each kind of thread used between two readings; a thread new since counts whole."""
    used: collections.Counter = collections.Counter()
    for tid, seconds in after.items():
        used[thread_kind(names.get(tid))] += seconds - before.get(tid, 0.0)
    return used


def gil_table(results: Sequence[dict[str, Any]]) -> list[str]:
    columns = []  # per result: GIL samples by stage, their total, and GIL ms per request
    for result in results:
        profile: Profile = result["gil"]
        by_stage: collections.Counter = collections.Counter()
        for stack, count in profile.samples.items():
            by_stage[stage_of(stack)] += count
        total = sum(by_stage.values()) or 1
        # The share of wall time the GIL was held (samples ÷ ticks), over the requests answered meanwhile.
        columns.append((by_stage, total, total / profile.ticks * result["seconds"] * 1000 / (
            result["gil_requests_in_window"] or 1)))
    rows = [[stage, *(cell for by_stage, total, ms in columns for cell in (
        f"{by_stage[stage] / total:.1%}", f"{by_stage[stage] / total * ms:.3f}"))]
            for stage in [*(stage for stage, _ in STAGES), OTHER_STAGE] if any(c[0][stage] for c in columns)]
    rows.append(["**all (GIL held)**", *(cell for _, _, ms in columns for cell in ("100%", f"**{ms:.3f}**"))])
    return markdown_table(["stage", *(f"{result['label']}: {what}" for result in results
                                      for what in ("share of GIL samples", "GIL ms/request"))], rows)


def cpu_table(results: Sequence[dict[str, Any]]) -> list[str]:
    kinds = [kind for kind, _ in THREAD_KINDS] + [OTHER_PYTHON_THREADS, NATIVE_THREADS]
    header = ["thread", *[f"{result['label']}: CPU ms/request" for result in results]]

    def per_request(result: dict[str, Any], seconds: float) -> str:
        return f"{seconds * 1000 / result['cpu_requests']:.3f}" if result["cpu_requests"] else "–"

    rows = [[kind, *[per_request(result, result["cpu"][kind]) for result in results]] for kind in kinds
            if any(result["cpu"][kind] for result in results)]
    rows.append(["**all Python threads**", *[
        f"**{per_request(result, sum(result['cpu'].values()) - result['cpu'][NATIVE_THREADS])}**"
        for result in results]])
    rows.append(["all", *[per_request(result, sum(result["cpu"].values())) for result in results]])
    rows.append(["req/s in this run", *[fmt(result.get("cpu_rps")) for result in results]])
    return markdown_table(header, rows)


def profile_server(config: Config, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    label = config.name
    server = Server(config, model_path=args.model_path, log_path=work / f"gunicorn-{label}.log")
    result: dict[str, Any] = {"label": label, "seconds": args.seconds}
    # py-spy records in this thread pool while Locust loads the server from this thread.
    with server.running(), concurrent.futures.ThreadPoolExecutor(1) as recorder:
        workers = [process.pid for process in server.processes()[1:]]
        if len(workers) != 1:
            raise RuntimeError(f"expected one worker, found {workers}")
        pid = workers[0]
        load = Load("closed loop", args.users)
        # A first run settles the worker (its first batches of each size, its thread pool).
        run_locust(server.url, load, duration_s=10, prefix=work / f"{label}-settle")
        spy = recorder.submit(record, pid, seconds=args.seconds, rate=args.rate, out=work / f"{label}-gil.txt")
        stats = run_locust(server.url, load, duration_s=int(args.seconds) + 4, prefix=work / f"{label}-gil")
        samples, errors = spy.result()
        result["gil"] = Profile(samples, errors, int(args.rate * args.seconds))
        result["gil_rps"], result["gil_requests_in_window"] = stats.rps, stats.rps * args.seconds
        log(f"{label} gil: {sum(samples.values())} samples, {errors} errors, {stats.rps:.0f} req/s")
        before = thread_cpu(pid)
        stats = run_locust(server.url, load, duration_s=int(args.seconds), prefix=work / f"{label}-cpu")
        result["cpu"] = cpu_by_kind(before, thread_cpu(pid), thread_names(pid))
        result["cpu_rps"], result["cpu_requests"] = stats.rps, stats.requests
    return result


def report_lines(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = [__doc__.split("\n\n", 1)[1].replace("\n", " ").strip(), "",
             f"- Model: {args.model_name}; one worker, the server's defaults otherwise; a Locust closed loop of "
             f"{args.users} users on the same machine.",
             f"- py-spy {args.py_spy_version}, `--nonblocking`, {args.rate} samples/s for {args.seconds:g} s.", "",
             "## Load while profiling", "",
             *markdown_table(["tree", "req/s during the profile", "unread samples"],
                             [(r["label"], fmt(r.get("gil_rps")), r["gil"].errors) for r in results]), "",
             "## Where the GIL goes (`--gil`)", "",
             "Each row: the share of GIL-holding samples in that stage, and that share of the GIL time per request "
             "(GIL held share × profile seconds ÷ requests answered meanwhile).", "", *gil_table(results), ""]
    lines += ["## CPU per request, by thread (`/proc`)", "",
              "A load run without py-spy: each thread's user + system CPU from /proc/PID/task before and after, by "
              "the name Python gave the thread, ÷ the requests Locust counted.", "", *cpu_table(results), ""]
    if any(result["label"] == FLOOR.name for result in results):
        lines += [f"`{FLOOR.name}` is scripts/floor_app.py: Gunicorn and Flask, one JSON parse and a model thread of "
                  f"its own, a fixed answer. `{FLOOR_BATCHER.name}` has the server's Batcher as its model thread: its "
                  f"Python threads' CPU less `{FLOOR.name}`'s is what the batching engine costs, this tree's less "
                  f"`{FLOOR_BATCHER.name}`'s the rest of the server (codec, request ids, access lines, metrics, "
                  "limits, routing).", ""]
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser, default="wide")
    common.add_page_arguments(parser, PAGE)
    add = parser.add_argument
    add("--no-floor", dest="floor", action="store_false", help="leave out the floor and floor-batcher")
    add("--users", type=int, default=32)
    add("--seconds", type=float, default=20)
    add("--rate", type=int, default=100)


def run(args: argparse.Namespace) -> int:
    args.py_spy_version = metadata.version("py-spy")

    def measure_all(work: Path, machine: dict[str, str]) -> tuple[list[str], bool]:
        args.model_name, args.model_path = common.model_name(args), common.model_path(args, work)
        with contextlib.ExitStack() as stack:
            configs = [common.baseline_config(*stack.enter_context(common.baseline_tree(args.baseline_ref)))
                       ] if args.baseline_ref else []
            configs += [Config("this tree", 1, {}, "one worker, defaults"), *([FLOOR, FLOOR_BATCHER] * args.floor)]
            results = [profile_server(config, args, work) for config in configs]
        return report_lines(results, args), False

    return common.run_scenario(args, "Profile of one worker under closed-loop load", measure_all)
