"""The published experiment: the model alone, then real servers under Locust, 1 user against 20.

The model alone (a child process) is timed per batch size with Keras' model.predict and the server's
compiled predict path; each configuration's real Gunicorn is loaded by headless Locust with 1-3 s think
time, then in a closed loop, whose req/s is set against the model's own ceiling at the batches each
server ran. --baseline-ref REF adds the server of commit REF.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from app.core.batching import bucket_sizes
from app.ops.settings import Settings

from . import common
from .common import FLOOR_APP, Config, Load, Server, fmt, log, markdown_table, ratio
from .load import BatchDelta, LoadStats, measure_load

THINK_TIME_S = (1.0, 3.0)
# A smoke run's user thinks briefly: a 2 s point gets several requests, where 1-3 s could leave none.
QUICK_THINK_TIME_S = (0.05, 0.2)
CLOSED_LOOP_LABEL = "closed loop"
REFERENCE = "default"
# The batch bucket sizes every configuration pads to (the server's default MAX_BATCH_SIZE).
SERVER_BUCKETS = bucket_sizes(Settings().max_batch_size)
# naive and unbatched-* use the server's benchmark-only settings (BATCHING, PREDICT_METHOD).
CONFIGS = [
    Config("naive", 1, {"PREDICT_METHOD": "keras_predict", "BATCHING": "false"},
           "Keras model.predict per request, no batching: the article's starting point"),
    Config("unbatched-1w", 1, {"BATCHING": "false"}, "our compiled predict path, one request per call, 1 worker"),
    Config("unbatched-2w", 2, {"BATCHING": "false"}, "our compiled predict path, one request per call, 2 workers"),
    Config("timeout-500ms", 1, {"BATCH_TIMEOUT_MS": "500"}, "batching that waits up to 500 ms for a batch to fill"),
    Config("timeout-20ms", 1, {"BATCH_TIMEOUT_MS": "20"}, "batching that waits up to 20 ms for a batch to fill"),
    Config(REFERENCE, 1, {}, "the shipped default: batch as soon as the model is free, 1 worker"),
    Config("default-2w", 2, {}, "the shipped default with 2 workers"),
    Config("procs-2w", 2, {"MODEL_PROCESSES": "1"}, "1 model process, 2 workers", in_full_run=False),
    # Not servers: what Gunicorn and Flask cost around the same model (scripts/floor_app.py, fixed answers).
    Config("floor", 1, {"GRPC_BIND": ""}, "Gunicorn and Flask around the same model with a model thread of its "
           "own, nothing of app/ in a request", app=FLOOR_APP, in_full_run=False),
    Config("floor-batcher", 1, {"GRPC_BIND": "", "FLOOR_BATCHER": "true"}, "the floor with the server's batching "
           "engine as its model thread", app=FLOOR_APP, in_full_run=False),
]
CONFIGS_BY_NAME = {config.name: config for config in CONFIGS}


def _numbers(kind: type, *, one: bool = False) -> Any:
    """An argparse type: numbers above 0, separated by commas (one of them with `one`)."""
    def parse(text: str) -> Any:
        with contextlib.suppress(ValueError):
            values = [kind(part) for part in text.split(",") if part.strip()]
            if values and all(value > 0 and math.isfinite(value) for value in values) and not (one and len(values) > 1):
                return values[0] if one else values
        raise argparse.ArgumentTypeError(f"expected {'a' if one else ''} {kind.__name__} above 0, got {text!r}")
    return parse


def add_arguments(parser: argparse.ArgumentParser, *, page: Path) -> None:
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke test: naive and default, 1 user thinking 0.05-0.2 s, 2 s a load")
    common.add_page_arguments(parser, page)
    common.add_model_arguments(parser, default="default")
    add("--duration", type=_numbers(float, one=True), help="seconds per load point (default 30)")
    add("--configs", type=common.names(list(CONFIGS_BY_NAME)), help=f"of: {', '.join(CONFIGS_BY_NAME)}")
    add("--users", type=_numbers(int), help="user counts with 1-3 s think time (default 1,20)")
    add("--closed-loop-users", type=int, help="users of the closed loop, 0 to skip it (default 64)")
    add("--rounds", type=_numbers(int, one=True), default=1,
        help="run every configuration this many times in alternating order; report each round's ratios' median")
    add("--spawn-rate", type=_numbers(float, one=True), help="users Locust starts a second (default: all at once)")
    add("--server-start-timeout", type=float, default=300)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Every default filled in, the quick run's where --quick is given."""
    quick = args.quick
    args.duration = args.duration or (2 if quick else 30)
    args.configs = args.configs or (["naive", REFERENCE] if quick else [c.name for c in CONFIGS if c.in_full_run])
    args.users = args.users or ([1] if quick else [1, 20])
    if args.closed_loop_users is None:  # 0 skips the closed loop
        args.closed_loop_users = 4 if quick else 64
    args.batch_sizes = SERVER_BUCKETS  # every size the servers pad to, so that their batches can be timed alone
    args.idle_calls, args.call_budget = (2, 0.3) if quick else (8, 3.0)  # the model alone's calls after idling, s
    args.think_s = QUICK_THINK_TIME_S if quick else THINK_TIME_S  # also the model alone's idle pause
    return args


@dataclasses.dataclass(frozen=True)
class CallTiming:
    """Back-to-back calls of one predict path at one batch size."""

    calls: int
    median_ms: float
    items_per_s: float
    cpu_ms_per_call: float
    cpu_ms_per_row: float


@dataclasses.dataclass(frozen=True)
class BatchTiming:
    batch: int
    function: CallTiming  # the server's compiled predict path
    keras_predict: CallTiming | None = None  # Keras' model.predict, where the model is a Keras one


@dataclasses.dataclass(frozen=True)
class ModelAlone:
    batches: list[BatchTiming]
    after_idle_ms: list[float]  # batch-1 calls, each after an idle pause like a user's think time

    @property
    def after_idle_mean_ms(self) -> float | None:
        return statistics.mean(self.after_idle_ms) if self.after_idle_ms else None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelAlone:
        return cls([BatchTiming(row["batch"], CallTiming(**row["function"]),
                                CallTiming(**row["keras_predict"]) if row.get("keras_predict") else None)
                    for row in data["batches"]], data["after_idle_ms"])

    def timings(self, method: str) -> dict[int, CallTiming]:
        """Per batch size, the timing of the predict path a server's PREDICT_METHOD names, where it was timed."""
        found = {row.batch: row.keras_predict if method == "keras_predict" else row.function
                 for row in self.batches}
        return {size: timing for size, timing in found.items() if timing is not None}


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
    median_s = statistics.median(wall)
    return CallTiming(calls=len(wall), median_ms=median_s * 1000,
                      items_per_s=batch_size / median_s, cpu_ms_per_call=cpu_s / len(wall) * 1000,
                      cpu_ms_per_row=cpu_s / len(wall) / batch_size * 1000)


def save_model_alone(out: str, model_path: str | None, batch_sizes: list[int], budget_s: float,
                     idle_calls: int, idle_pause_s: tuple[float, float] = THINK_TIME_S) -> None:
    """The child's side: both predict paths timed per batch size, then batch-1 calls after idling."""
    import numpy as np

    from app.core.models import example_batch, load_model
    from app.ops import runtime

    # TensorFlow's thread pools as in one worker of a default server, so its calls are the ones timed here.
    runtime.configure(Settings(), workers=1)
    model = load_model(model_path, name="default")
    rng = np.random.default_rng(0)

    def random_batch(size: int) -> dict[str, Any]:
        return {name: rng.standard_normal(array.shape).astype(array.dtype)
                for name, array in example_batch(model, size).items()}

    rows = []
    for size in batch_sizes:
        batch = random_batch(size)
        function = time_calls(functools.partial(model.predict, batch), budget_s=budget_s, batch_size=size)
        keras_predict = None
        if model.keras_model is not None:
            keras_input = batch[model.inputs[0].name] if len(model.inputs) == 1 else batch
            # batch_size = the batch: one step per call (Keras' default of 32 would split 64 rows in two).
            call = functools.partial(model.keras_model.predict, keras_input, verbose=0, batch_size=size)
            keras_predict = time_calls(call, budget_s=budget_s, batch_size=size)
        rows.append(BatchTiming(size, function, keras_predict))
    one_row, pauses = random_batch(1), random.Random(0)
    model.predict(one_row)
    after_idle = []
    for _ in range(idle_calls):
        # After an idle second the weights may have left the caches: what one user with think time gets.
        time.sleep(pauses.uniform(*idle_pause_s))
        started = time.perf_counter()
        model.predict(one_row)
        after_idle.append((time.perf_counter() - started) * 1000)
    Path(out).write_text(json.dumps(dataclasses.asdict(ModelAlone(rows, after_idle))))


@dataclasses.dataclass
class ConfigResult:
    """One configuration's server and its load points, by load label; `error` where it failed."""

    config: str
    loads: dict[str, LoadStats] = dataclasses.field(default_factory=dict)
    cwd: str | None = None  # the tree the server really ran, as the OS saw it
    error: str | None = None


def run_config(config: Config, loads: Sequence[Load], args: argparse.Namespace, work_dir: Path, *,
               tag: str = "") -> ConfigResult:
    """Start the configuration's server, run every load point against it, stop it."""
    server = Server(config, model_path=args.served_model_path, log_path=work_dir / f"gunicorn-{config.name}{tag}.log")
    result = ConfigResult(config.name)
    measure = functools.partial(measure_load, server, duration_s=args.duration, buckets=SERVER_BUCKETS,
                                spawn_rate=args.spawn_rate)
    started = time.monotonic()
    try:
        with server.running(workers=config.workers, within_s=args.server_start_timeout):
            log(f"{config.name}: ready in {time.monotonic() - started:.1f} s")
            result.cwd = server.processes()[0].cwd()  # the master's
            for load in loads:
                name = f"{config.name}{tag}-{load.label.replace(' ', '_')}"
                result.loads[load.label] = measure(load, prefix=work_dir / name, what=name)
    except Exception as exc:  # one configuration failing should not lose the others' numbers
        result.error = common.failure(exc, server)
        log(f"{config.name}: {result.error}")
    return result


def run_rounds(configs: Sequence[Config], loads: Sequence[Load], args: argparse.Namespace,
               work_dir: Path) -> list[list[ConfigResult]]:
    """Every configuration, `args.rounds` times, in alternating order (A B, B A, ...) so that a machine growing
    faster or slower favours neither side of a ratio; each round's results in the order of `configs`."""
    rounds = []
    for number in range(args.rounds):
        order = list(configs) if number % 2 == 0 else list(configs)[::-1]
        tag = f"-round{number + 1}" if args.rounds > 1 else ""
        by_name = {config.name: run_config(config, loads, args, work_dir, tag=tag) for config in order}
        rounds.append([by_name[config.name] for config in configs])
    return rounds


@dataclasses.dataclass(frozen=True)
class Ceiling:
    """The model alone at the batches a server ran, beside the server's own figures; None where unknown."""

    mean_batch_rows: float | None = None
    predict_wall_ms_per_request: float | None = None
    cpu_ms_per_request: float | None = None
    ceiling_rows_per_s: float | None = None
    ratio: float | None = None
    predict_cpu_ms_per_request: float | None = None
    other_cpu_ms_per_request: float | None = None


def ceiling_figures(batches: BatchDelta, timings: dict[int, CallTiming], *, requests: int, rps: float,
                    server_cpu_s: float) -> Ceiling:
    """Ceiling: the real rows served ÷ the time the model alone takes to run the same calls back to back.
    Predict CPU: the model's own CPU for those calls; everything else is the server's CPU less that."""
    measured = Ceiling(mean_batch_rows=batches.rows / batches.calls if batches.calls else None,
                       predict_wall_ms_per_request=batches.predict_s / requests * 1000 if requests else None,
                       cpu_ms_per_request=server_cpu_s / requests * 1000 if requests else None)
    calls = batches.calls_per_bucket
    if not calls or not requests or any(size not in timings for size in calls):
        return measured
    alone_s = sum(count * timings[size].median_ms for size, count in calls.items()) / 1000
    predict_cpu_s = sum(count * timings[size].cpu_ms_per_call for size, count in calls.items()) / 1000
    ceiling = batches.rows / alone_s
    return dataclasses.replace(measured, ceiling_rows_per_s=ceiling, ratio=rps / ceiling,
                               predict_cpu_ms_per_request=predict_cpu_s / requests * 1000,
                               other_cpu_ms_per_request=(server_cpu_s - predict_cpu_s) / requests * 1000)


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything one page is written from."""

    args: argparse.Namespace
    alone: ModelAlone
    rounds: list[list[ConfigResult]]  # round 1 is the one the tables show
    loads: list[Load]
    configs: dict[str, Config]

    @property
    def by_config(self) -> dict[str, ConfigResult]:
        return {result.config: result for result in self.rounds[0]}

    @property
    def closed(self) -> Load | None:
        return next((load for load in self.loads if not any(load.think_s)), None)

    def ceiling(self, name: str, stats: LoadStats) -> Ceiling:
        if stats.server_batches is None or stats.server_cpu_s is None:
            return Ceiling()
        timings = self.alone.timings(self.configs[name].env.get("PREDICT_METHOD", ""))
        return ceiling_figures(stats.server_batches, timings, requests=stats.requests, rps=stats.rps,
                               server_cpu_s=stats.server_cpu_s)


def load_name(label: str) -> str:
    return "the closed loop" if label == CLOSED_LOOP_LABEL else f"{label} user" if label == "1" else f"{label} users"


def report_lines(run: Run) -> list[str]:
    args, closed = run.args, run.closed
    model = common.model_name(args)
    spawning = f"users started {args.spawn_rate:g} a second" if args.spawn_rate else "all users started at once"
    lines = ["**A quick run**: a smoke test of the benchmark, not measurements.", ""] if args.quick else []
    lines += ["## Settings", "", f"Model: {model}. Each load point: {args.duration:g} s of headless Locust "
              f"(`locustfile.py`, one process), {spawning}, one random row per request, {args.think_s[0]:g}–"
              f"{args.think_s[1]:g} s think time" + (f"; then a closed loop of {closed.users} users" if closed else "")
              + ". Server CPU: user + system time of the server's processes over each load point.", "",
              *markdown_table(["configuration", "workers", "environment", "what it is"], [
                  (f"`{name}`", config.workers, " ".join(f"{k}={v}" for k, v in config.env.items()) or "(defaults)",
                   config.what) for name in run.by_config if (config := run.configs[name])]), ""]
    lines += ["## The model alone", ""] + model_alone_lines(run.alone, args.think_s) + [""]
    lines += ["## Servers under load", ""] + load_lines(run.by_config) + [""]
    lines += ["## Ratios", ""] + ratio_lines(run) + [""]
    lines += ["## Against the model's own ceiling", ""] + ceiling_lines(run) + [""]
    if len(run.rounds) > 1:
        lines += ["## Rounds", ""] + round_lines(run) + [""]
    return lines


def model_alone_lines(alone: ModelAlone, idle_pause_s: tuple[float, float]) -> list[str]:
    lines = ["One process, no server: median wall time per call, rows per second, and CPU time (all threads) of "
             "Keras' `model.predict` and of the server's predict path (the compiled `tf.function` the batcher "
             "calls), TensorFlow's thread pools sized as in one worker.", ""]
    rows = [(row.batch, fmt(k.median_ms) if (k := row.keras_predict) else "–", fmt(k.items_per_s) if k else "–",
             fmt(row.function.median_ms), fmt(row.function.items_per_s), fmt(row.function.cpu_ms_per_row, 2),
             ratio(k.median_ms, row.function.median_ms) if k else "–", fmt(row.function.cpu_ms_per_call, 2))
            for row in alone.batches]
    lines += markdown_table(["batch", "model.predict ms/call", "model.predict rows/s", "predict path ms/call",
                             "predict path rows/s", "predict path CPU ms/row", "model.predict ÷ predict path",
                             "predict path CPU ms/call"], rows) + [""]
    if alone.batches:
        best = max(alone.batches, key=lambda row: row.function.items_per_s)
        lines += [f"Ceiling: **{best.function.items_per_s:,.0f} rows/s** at batch {best.batch}.", ""]
    return lines + [f"After idling {idle_pause_s[0]:g}–{idle_pause_s[1]:g} s, a batch-1 call took "
                    f"**{fmt(alone.after_idle_mean_ms, 2)} ms** on average ({len(alone.after_idle_ms)} calls)."]


def load_lines(by_config: dict[str, ConfigResult]) -> list[str]:
    lines = ["Client-side latency in ms (Locust's, including HTTP and JSON); req/s is requests ÷ run time; "
             "`batch rows` is the mean X-Batch-Size of the answers; `server CPU` in cores.", ""]
    header = ["configuration", "users", "requests", "failures", "mean", "p50", "p95", "p99", "req/s",
              "batch rows", "server CPU", "Locust CPU"]
    rows: list[Sequence[Any]] = []
    for name, result in by_config.items():
        if result.error and not result.loads:
            rows.append((f"`{name}`", "failed: " + result.error, *["–"] * (len(header) - 2)))
        rows += [(f"`{name}`", label, s.requests, s.failures, fmt(s.mean_ms), fmt(s.p50_ms), fmt(s.p95_ms),
                  fmt(s.p99_ms), fmt(s.rps), fmt(s.mean_batch_rows), fmt(s.server_cpu_share, 2),
                  f"{s.locust_cpu_share:.0%}") for label, s in result.loads.items()]
    return lines + markdown_table(header, rows)


def ratio_lines(run: Run) -> list[str]:
    reference = run.by_config.get(REFERENCE)
    if not reference or not reference.loads:
        return [f"No ratios: the `{REFERENCE}` configuration was not run."]
    labels = [load.label for load in run.loads]

    def mean_ms(result: ConfigResult, label: str) -> float | None:
        return stats.mean_ms if (stats := result.loads.get(label)) else None

    rows = [(f"`{name}`", *(ratio(mean_ms(result, label), mean_ms(reference, label)) for label in labels))
            for name, result in run.by_config.items() if name != REFERENCE]
    lines = [f"Mean latency ÷ `{REFERENCE}`'s (above 1×: the default answered faster).", "",
             *markdown_table(["configuration", *map(load_name, labels)], rows)]
    closed = run.closed
    if closed and (ref_rps := getattr(reference.loads.get(closed.label), "rps", None)):
        parts = [f"`{name}` {fmt(stats.rps)} ({ratio(ref_rps, stats.rps)})" for name, result in run.by_config.items()
                 if name != REFERENCE and (stats := result.loads.get(closed.label)) and stats.rps]
        lines += ["", f"Closed-loop req/s: `{REFERENCE}` {fmt(ref_rps)}; " + ", ".join(parts) + "."]
    return lines


def ceiling_lines(run: Run) -> list[str]:
    lines = []
    closed = run.closed
    if closed:
        lines += [f"The closed loop ({closed.users} users). `rows per call` from the server's "
                  "`model_server_batch_size_rows`; `ceiling`: the model alone running those same padded calls back "
                  "to back (real rows ÷ Σ calls × median ms per call); `ratio`: req/s ÷ ceiling. Server CPU per "
                  "request splits into `predict` (Σ calls × the model alone's CPU per call) and everything else.", ""]
        rows, figures = [], {}
        for name, result in run.by_config.items():
            if stats := result.loads.get(closed.label):
                figures[name] = c = run.ceiling(name, stats)
                rows.append((f"`{name}`", fmt(stats.rps), fmt(c.mean_batch_rows), fmt(c.ceiling_rows_per_s),
                             f"{c.ratio:.0%}" if c.ratio else "–", fmt(c.predict_wall_ms_per_request, 2),
                             fmt(c.cpu_ms_per_request, 2), fmt(c.predict_cpu_ms_per_request, 2),
                             fmt(c.other_cpu_ms_per_request, 2)))
        lines += markdown_table(["configuration", "req/s", "rows per call", "ceiling rows/s", "ratio",
                                 "predict wall ms/request", "server CPU ms/request", "of which predict",
                                 "of which everything else"], rows) + [""]
        ours = figures.get(REFERENCE)
        for name, theirs in figures.items():
            if name.startswith("baseline@") and ours:
                lines.append(f"- `{REFERENCE}` ÷ `{name}`: server CPU outside predict per request "
                             f"{ratio(ours.other_cpu_ms_per_request, theirs.other_cpu_ms_per_request)} "
                             f"({fmt(ours.other_cpu_ms_per_request, 2)} against "
                             f"{fmt(theirs.other_cpu_ms_per_request, 2)} ms).")
    idle = run.alone.after_idle_mean_ms
    rows = [(f"`{name}`", fmt(stats.mean_ms, 2), fmt(idle, 2), fmt(stats.mean_ms - idle, 2) if idle is not None
             else "–") for name, result in run.by_config.items()
            if (stats := result.loads.get("1")) and stats.mean_ms is not None]
    if rows:
        lines += ["", "One user against a bare call of the model after the same idle time: the difference is what "
                  "the server adds to one request.", "",
                  *markdown_table(["configuration", "1 user mean ms", "bare call after idle ms", "difference ms"],
                                  rows)]
    return lines


def round_lines(run: Run) -> list[str]:
    """The closed loop round by round: req/s and CPU outside predict, and the median of each round's ratio."""
    names, closed = [result.config for result in run.rounds[0]], run.closed
    if closed is None:
        return []
    others = [name for name in names if name != REFERENCE] if REFERENCE in names else []
    table: list[list[float | None]] = []
    for results in run.rounds:
        stats = {result.config: result.loads.get(closed.label) for result in results}
        row: list[float | None] = []
        for name in names:
            row += (stats[name].rps, run.ceiling(name, stats[name]).other_cpu_ms_per_request) if stats[name] else (
                None, None)
        reference = stats.get(REFERENCE)
        table.append(row + [reference.rps / other.rps if reference and (other := stats[name]) and other.rps else None
                            for name in others])
    medians = [statistics.median(known) if (known := [row[i] for row in table if row[i] is not None]) else None
               for i in range(len(table[0]))]
    rows = [[label, *(f"{v:.2f}×" if i >= 2 * len(names) and v is not None else fmt(v, 2) for i, v in enumerate(row))]
            for label, row in [*((str(n), row) for n, row in enumerate(table, 1)), ("median", medians)]]
    return [f"The closed loop in {len(run.rounds)} rounds, every server started afresh, the order alternating. A "
            "ratio is taken within a round, then the median over the rounds: a machine drifts more between rounds.",
            "", *markdown_table(["round", *[f"`{n}` {c}" for n in names for c in ("req/s", "CPU outside predict ms")],
                                 *[f"`{REFERENCE}` ÷ `{n}` req/s" for n in others]], rows)]


def measure(args: argparse.Namespace, work_dir: Path, stack: ExitStack) -> Run:
    """The model alone and every configuration; the raw results into work_dir/results.json."""
    configs = [CONFIGS_BY_NAME[name] for name in args.configs]
    if args.baseline_ref:
        configs.insert(0, common.baseline_config(*stack.enter_context(common.baseline_tree(args.baseline_ref))))
    loads = [Load(str(users), users, args.think_s) for users in args.users]
    if args.closed_loop_users:
        loads.append(Load(CLOSED_LOOP_LABEL, args.closed_loop_users))
    log(f"working folder {work_dir}; configurations {[c.name for c in configs]}; loads {[x.label for x in loads]}")
    args.served_model_path = common.model_path(args, work_dir)
    log(f"model alone: batch sizes {args.batch_sizes}, then {args.idle_calls} calls after idling")
    common.run_child("scripts.benchmark.experiment:save_model_alone", work_dir / "model_alone.log",
                     out=str(work_dir / "model_alone.json"), model_path=args.served_model_path,
                     batch_sizes=args.batch_sizes, budget_s=args.call_budget, idle_calls=args.idle_calls,
                     idle_pause_s=args.think_s)
    alone = ModelAlone.from_json(json.loads((work_dir / "model_alone.json").read_text()))
    rounds = run_rounds(configs, loads, args, work_dir)
    (work_dir / "results.json").write_text(json.dumps(
        [[dataclasses.asdict(result) for result in results] for results in rounds], indent=1))
    return Run(args, alone, rounds, loads, {config.name: config for config in configs})


def run(args: argparse.Namespace, *, title: str) -> int:
    def measure_all(work_dir: Path, machine: dict[str, str]) -> tuple[list[str], bool]:
        with ExitStack() as stack:
            result = measure(args, work_dir, stack)
        return report_lines(result), any(result.error for results in result.rounds for result in results)

    return common.run_scenario(args, title, measure_all)
