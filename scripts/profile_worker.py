"""Where one worker's time goes under closed-loop load: a py-spy profile, per stage.

    python scripts/profile_worker.py --model wide --baseline-ref 166bcbf     # docs/profile.md, ~6 min
    python scripts/profile_worker.py --model wide --out /tmp/profile         # this tree alone

For each tree (this one, and with --baseline-ref a git worktree of that commit), a real
`gunicorn -c gunicorn.conf.py wsgi:app` with one worker serves the model while a headless
Locust runs a closed loop (no think time, one row per request). Then, unless --no-floor,
the floor: the same Gunicorn configuration serving scripts/floor_app.py, Flask and a model
thread running the same model, with nothing of app/ in a request's path; and floor-batcher,
the same with the server's batching engine as the model thread. py-spy (PyPI) samples each
worker twice, one load run each:

- `--gil`: only the thread holding the GIL, i.e. where the worker's Python runs. Each sample
  is put in the stage of the frame nearest the leaf that belongs to one (STAGES in
  scripts/profile_worker.py): so numpy called from the codec counts as the codec, Werkzeug's
  proxies called from a view as Flask. Shares of GIL samples are turned into GIL
  milliseconds per request with the share of wall time the GIL was held (GIL samples ÷
  sampling ticks).
- wall (`--idle`): every thread, idle or not; the samples say what each kind of thread spends
  its time on, waiting included.

A third load run, without py-spy, reads each thread's CPU time from /proc before and after:
CPU per request by kind of thread, the kind told by the name Python gave the thread.

py-spy runs `--nonblocking` (it never pauses the worker) at a low rate, so it slows the worker
little; it still takes CPU on the same cores, so the req/s beside a profile are below a
benchmark's. The report states how many samples py-spy could not read.
"""

from __future__ import annotations

import argparse
import ast
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts import benchmark  # noqa: E402  (servers, Locust, the wide model)

# The batching engine's files: app/batching/ (app/batching.py in trees before it was a package).
ENGINE = "app/batching"
BATCH_THREAD_STAGE = "batch thread: gather, pad, deliver"
QUEUE_STAGE = "request thread: queue and wait"
# (stage, substrings of a py-spy frame "function (path:line)"), tried in order for each frame
# from the leaf up; the first frame that matches any names the stage.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("model: TensorFlow call", ("tensorflow/", "keras/", "app/models.py")),
    # Before the decode row: both are in app/codec.py, told apart by function.
    ("JSON encode", tuple(f"{name} (app/codec.py" for name in (
        "encode_response", "_jsonable", "_squeezed", "_batch_size", "_non_finite_json", "_token", "_encode_strings"))),
    ("JSON decode and checks", ("(app/codec.py", "(app/classify.py")),
    ("access log", ("app/logs.py", "logging/")),
    ("metrics", ("prometheus_client/", "app/metrics.py")),
    # The engine's frames (and the futures it settles) count for the thread they run on: see stage_of.
    (BATCH_THREAD_STAGE, ()),
    (QUEUE_STAGE, (ENGINE, "app/registry.py", "concurrent/futures/_base.py")),
    ("body limits", ("app/limits.py",)),
    ("views (app/api.py)", ("app/api.py", "app/errors.py")),
    ("floor app: parse, hand to the model thread, wait", ("floor_app.py",)),
    ("Flask and Werkzeug", ("flask/", "werkzeug/")),
    ("Gunicorn: HTTP, threads, polling", ("gunicorn/", "selectors.py", "concurrent/futures/thread.py", "app/worker.py")),
    ("gRPC server", ("grpc/",)),
]
OTHER_STAGE = "other"
# Thread roles for the wall profile, by the thread's root frames.
ROLES: list[tuple[str, tuple[str, ...]]] = [
    ("access-log thread", ("AccessWriter._run",)),
    ("request threads", ("concurrent/futures/thread.py",)),
    ("main thread (Gunicorn's poller)", ("ThreadWorker.run", "Arbiter.run")),
    ("gRPC threads", ("grpc/",)),
]
WAITING = ("Condition.wait", "Event.wait", "lock.acquire", "select (selectors.py", "EpollSelector.select",
           "_worker (concurrent/futures/thread.py", "Thread._wait_for_tstate_lock",
           # gRPC's server thread polls its completion queue in C, without the GIL.
           "_serve (grpc/_server.py")
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
FLOOR = benchmark.CONFIGS_BY_NAME["floor"]
FLOOR_BATCHER = benchmark.CONFIGS_BY_NAME["floor-batcher"]


@dataclasses.dataclass
class Profile:
    label: str
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
    return ENGINE in root or "ModelThread._run" in root


def role_of(stack: str) -> str:
    if on_batch_thread(stack):
        return "batch thread"
    for role, needles in ROLES:
        if any(needle in stack for needle in needles):
            return role
    return "other threads"


def is_waiting(stack: str) -> bool:
    leaf = stack.rsplit(";", 1)[-1]
    return any(needle in leaf for needle in WAITING)


def read_raw(path: Path) -> collections.Counter:
    """py-spy's raw (collapsed) format: 'frame;frame;... count' per line."""
    samples: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            samples[stack] += int(count)
    return samples


def py_spy() -> str:
    return str(Path(sys.executable).parent / "py-spy")


def record(pid: int, *, seconds: float, rate: int, gil: bool, out: Path) -> tuple[collections.Counter, int]:
    command = [py_spy(), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
               "--nonblocking", "--format", "raw", "--output", str(out)]
    command += ["--gil"] if gil else ["--idle"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120)
    errors = 0
    for line in (finished.stdout + finished.stderr).splitlines():
        # py-spy> Wrote raw flamegraph data to '...'. Samples: 306 Errors: 97
        if "Errors:" in line:
            errors = int(line.rsplit("Errors:", 1)[1].split()[0])
    if finished.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed ({finished.returncode}): {finished.stderr[-2000:]}")
    return read_raw(out), errors


def thread_names(pid: int) -> dict[int, str]:
    """The name Python gave each of its threads, by native thread id (`py-spy dump`)."""
    dump = subprocess.run([py_spy(), "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
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


def server_config(label: str, tree: Path) -> benchmark.Config:
    return benchmark.Config(label, 1, {}, f"{label}: one worker, defaults", False, tree)


def profile_server(config: benchmark.Config, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    label = config.name
    server = benchmark.Server(config, model_path=args.model_path, log_path=work / f"gunicorn-{label}.log")
    result: dict[str, Any] = {"label": label}
    # py-spy records in this thread pool while Locust loads the server from this thread.
    recorder = concurrent.futures.ThreadPoolExecutor(1)
    try:
        server.start(ready_within_s=300)
        workers = [process.pid for process in server.processes()[1:]]
        if len(workers) != 1:
            raise RuntimeError(f"expected one worker, found {workers}")
        pid = workers[0]
        load = benchmark.Load("closed loop", args.users, (0.0, 0.0))
        # A first run settles the worker (its first batches of each size, its thread pool).
        benchmark.run_locust(server.url, load, duration_s=10, prefix=work / f"{label}-settle")
        for mode in ("gil", "wall"):
            out = work / f"{label}-{mode}.txt"
            started = time.monotonic()
            spy = recorder.submit(record, pid, seconds=args.seconds, rate=args.rate, gil=mode == "gil", out=out)
            stats = benchmark.run_locust(server.url, load, duration_s=int(args.seconds) + 4,
                                         prefix=work / f"{label}-{mode}")
            samples, errors = spy.result()
            result[mode] = Profile(label, samples, errors, int(args.rate * args.seconds))
            result[f"{mode}_rps"] = stats.rps
            result[f"{mode}_requests_in_window"] = (stats.rps) * args.seconds
            benchmark.log(f"{label} {mode}: {sum(samples.values())} samples, {errors} errors, "
                          f"{stats.rps:.0f} req/s, {time.monotonic() - started:.0f} s")
        before = thread_cpu(pid)
        stats = benchmark.run_locust(server.url, load, duration_s=int(args.seconds), prefix=work / f"{label}-cpu")
        after = thread_cpu(pid)
        result["cpu"] = cpu_by_kind(before, after, thread_names(pid))
        result["cpu_rps"] = stats.rps
        result["cpu_requests"] = stats.requests
        benchmark.log(f"{label} cpu: {sum(result['cpu'].values()):.1f} s over {result['cpu_requests']} requests")
    finally:
        recorder.shutdown(wait=True)
        server.stop()
    return result


def gil_table(results: Sequence[dict[str, Any]]) -> list[str]:
    stages = [stage for stage, _ in STAGES] + [OTHER_STAGE]
    header = ["stage"]
    per_result = []
    for result in results:
        profile: Profile = result["gil"]
        total = sum(profile.samples.values()) or 1
        by_stage: collections.Counter = collections.Counter()
        for stack, count in profile.samples.items():
            by_stage[stage_of(stack)] += count
        held_share = total / profile.ticks  # of wall time, the GIL was held
        requests = result["gil_requests_in_window"] or 1
        ms_per_request = held_share * result["seconds"] * 1000 / requests
        per_result.append((by_stage, total, ms_per_request))
        header += [f"{result['label']}: share of GIL samples", f"{result['label']}: GIL ms/request"]
    rows = []
    for stage in stages:
        if not any(by_stage[stage] for by_stage, _, _ in per_result):
            continue
        row = [stage]
        for by_stage, total, ms in per_result:
            row += [f"{by_stage[stage] / total:.1%}", f"{by_stage[stage] / total * ms:.3f}"]
        rows.append(row)
    total_row = ["**all (GIL held)**"]
    for _, total, ms in per_result:
        total_row += ["100%", f"**{ms:.3f}**"]
    rows.append(total_row)
    return benchmark.markdown_table(header, rows)


def wall_table(results: Sequence[dict[str, Any]]) -> list[str]:
    header = ["thread", *[f"{result['label']}: {what}" for result in results for what in ("threads sampled", "busy share")]]
    roles: dict[str, list[Any]] = {}
    for index, result in enumerate(results):
        profile: Profile = result["wall"]
        count: collections.Counter = collections.Counter()
        busy: collections.Counter = collections.Counter()
        for stack, samples in profile.samples.items():
            role = role_of(stack)
            count[role] += samples
            if not is_waiting(stack):
                busy[role] += samples
        for role in count:
            roles.setdefault(role, [None] * len(results))[index] = (count[role] / profile.ticks, busy[role] / count[role])
    rows = []
    for role, cells in roles.items():
        row = [role]
        for cell in cells:
            row += ["–", "–"] if cell is None else [f"{cell[0]:.1f}", f"{cell[1]:.0%}"]
        rows.append(row)
    return benchmark.markdown_table(header, rows)


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
    rows.append(["req/s in this run", *[benchmark.fmt(result.get("cpu_rps")) for result in results]])
    return benchmark.markdown_table(header, rows)


def top_frames(profile: Profile, limit: int = 12) -> list[str]:
    """The leaf frames that held the GIL most: what a stage's share is made of."""
    leaves: collections.Counter = collections.Counter()
    for stack, count in profile.samples.items():
        leaves[(stack.rsplit(";", 1)[-1], stage_of(stack))] += count
    total = sum(leaves.values()) or 1
    rows = [(f"`{frame.replace('|', '/')}`", f"{count / total:.1%}", stage) for (frame, stage), count in
            leaves.most_common(limit)]
    return benchmark.markdown_table(["leaf frame holding the GIL", "share", "stage"], rows)


def description() -> str:
    """The module's account of the method: its docstring less the title and the usage lines."""
    return __doc__.split("\n\n", 2)[2].split("py-spy runs")[0].strip()


def floor_description() -> str:
    """What the floor app keeps and drops: the second paragraph of its docstring, on one line."""
    # Read, not imported: importing it loads the model.
    docstring = ast.get_docstring(ast.parse((REPO / "scripts" / "floor_app.py").read_text())) or ""
    return " ".join(docstring.split("\n\n")[2].split())


def write_report(out: Path, results: list[dict[str, Any]], args: argparse.Namespace, started: datetime.datetime) -> Path:
    lines = ["# Profile of one worker under closed-loop load", "",
             f"Generated by `{' '.join(['python scripts/profile_worker.py', *args.argv_shown])}` on "
             f"{started:%Y-%m-%d %H:%M} UTC.", "", description(),
             "", "## Machine", ""]
    lines += benchmark.markdown_table(["", ""], benchmark.machine_facts().items()) + [""]
    lines += [f"- Model: {args.model_name}; one worker, the server's defaults otherwise; Locust closed loop of "
              f"{args.users} users, one row per request, on the same machine.",
              f"- py-spy {args.py_spy_version}, `--nonblocking`, {args.rate} samples/s for {args.seconds:g} s per mode.",
              ""]
    lines += ["## Load while profiling", ""]
    rows = [(result["label"], benchmark.fmt(result.get("gil_rps")), benchmark.fmt(result.get("wall_rps")),
             result["gil"].errors, result["wall"].errors) for result in results]
    lines += benchmark.markdown_table(["tree", "req/s during --gil", "req/s during wall", "unread samples --gil",
                               "unread samples wall"], rows) + [""]
    lines += ["## Where the GIL goes (`--gil`)", "",
              "Each row: the share of GIL-holding samples in that stage, and that share of the GIL time per "
              "request (GIL held share × profile seconds ÷ requests answered meanwhile).", ""]
    lines += gil_table(results) + [""]
    for result in results:
        lines += [f"### {result['label']}: leaf frames", ""] + top_frames(result["gil"]) + [""]
    lines += ["## What each thread does (wall, `--idle`)", "",
              "`threads sampled`: samples ÷ sampling ticks, i.e. how many such threads exist on average; "
              "`busy share`: of their samples, those not waiting on a lock, condition or poll.", ""]
    lines += wall_table(results) + [""]
    lines += ["## CPU per request, by thread (`/proc`)", "",
              "A load run without py-spy: each thread's user + system CPU from /proc/PID/task before and "
              "after, by the name Python gave the thread, ÷ the requests Locust counted.", ""]
    lines += cpu_table(results) + [""]
    if any(result["label"] == FLOOR.name for result in results):
        lines += [f"`{FLOOR.name}` is scripts/floor_app.py. {floor_description()} Its batches are not held to fill "
                  "under load, so its TensorFlow threads' CPU per request is not the server's; its Python "
                  "threads' is the floor under the server's.", ""]
    if any(result["label"] == FLOOR_BATCHER.name for result in results):
        lines += [f"`{FLOOR_BATCHER.name}` is the same app with FLOOR_BATCHER=true: the server's Batcher "
                  "(app/batching/, its defaults) in place of the model thread, fed one seeded row a request. "
                  f"Its Python threads' CPU less `{FLOOR.name}`'s is what the batching engine costs; this "
                  f"tree's less `{FLOOR_BATCHER.name}`'s is the rest of the server: the codec, request ids, "
                  "access lines, metrics, body limits and version routing.", ""]
    lines += ["## Reproduce", "", "```", f"pip install py-spy=={args.py_spy_version}",
              "python scripts/profile_worker.py --model wide --baseline-ref <commit>", "```", ""]
    path = out / "profile.md"
    path.write_text("\n".join(lines))
    return path


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", choices=("default", "wide"), default="wide")
    parser.add_argument("--model-path", help="profile with this MODEL_PATH instead")
    parser.add_argument("--baseline-ref", help="also profile this commit (a temporary git worktree), first")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="leave out the floor and floor-batcher (scripts/floor_app.py)")
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rate", type=int, default=100)
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args(argv)
    args.argv_shown = benchmark.without_flags(argv, ("--out", "--work-dir", "--model-path"))
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    from importlib import metadata

    args.py_spy_version = metadata.version("py-spy")
    with tempfile.TemporaryDirectory(prefix="profile-") as temp:
        work = args.work_dir or Path(temp)
        work.mkdir(parents=True, exist_ok=True)
        if args.model_path:
            args.model_name = Path(args.model_path).name
        elif args.model == "wide":
            args.model_path = benchmark.build_wide_model(work)
            args.model_name = "the wide model (1,024 floats in, 4 × 4,096 hidden, 1,000 out)"
        else:
            args.model_name = "the built-in default model"
        results = []
        with contextlib.ExitStack() as stack:
            configs: list[benchmark.Config] = []
            if args.baseline_ref:
                tree, short_sha = stack.enter_context(benchmark.baseline_tree(args.baseline_ref))
                configs.append(server_config(f"baseline@{short_sha}", tree))
            configs.append(server_config("this tree", REPO))
            if args.floor:
                configs += [FLOOR, FLOOR_BATCHER]
            for config in configs:
                result = profile_server(config, args, work)
                result["seconds"] = args.seconds
                results.append(result)
        args.out.mkdir(parents=True, exist_ok=True)
        path = write_report(args.out, results, args, started)
    benchmark.log(f"wrote {path}")
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
