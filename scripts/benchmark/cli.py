"""The command line: parts 1 to 3 in order, results.json in the working folder, the report and plot in --out."""

from __future__ import annotations

import dataclasses
import datetime
import json
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from .configs import CLOSED_LOOP_LABEL, CONFIGS_BY_NAME, THINK_TIME_S, Load, baseline_config, baseline_tree
from .machine import machine_facts
from .measure import run_protocols, run_rounds
from .model_alone import build_wide_model, run_model_alone, save_wide_model, write_model_alone
from .options import Options, parse_args
from .plot import write_plot
from .report import Run, write_report
from .runlog import log


def expected_minutes(options: Options, loads: Sequence[Load]) -> float:
    """A rough forecast from runs on a 2-core machine: Locust's own start and the idle wait add ~2 s a load."""
    model_alone_s = len(options.batch_sizes) * (2 * options.call_budget + 1) + 10 + options.idle_calls * 2.5
    build_s = 15 if options.model == "wide" and not options.model_path else 0
    per_config_s = 10 + len(loads) * (options.duration + 2)
    configs = (len(options.configs) + (1 if options.baseline_ref else 0)) * options.rounds
    protocols_s = (10 + 2 * len(options.protocol_users) * (options.duration + 8)) if options.protocol_users else 0
    return (build_s + model_alone_s + configs * per_config_s + protocols_s) / 60


@contextmanager
def working_folder(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="benchmark-") as folder:
        yield Path(folder)


def load_points(options: Options) -> list[Load]:
    loads = [Load(str(users), users, THINK_TIME_S) for users in options.users]
    if options.closed_loop_users:
        loads.append(Load(CLOSED_LOOP_LABEL, options.closed_loop_users, (0.0, 0.0)))
    return loads


def measure(options: Options, loads: list[Load], work_dir: Path, stack: ExitStack) -> Run:
    """Parts 1 and 2 (and the REST and gRPC comparison); the raw results into work_dir/results.json."""
    started_at, started = datetime.datetime.now(datetime.UTC), time.monotonic()
    machine = machine_facts()
    configs = [CONFIGS_BY_NAME[name] for name in options.configs]
    if options.baseline_ref:
        configs.insert(0, baseline_config(*stack.enter_context(baseline_tree(options.baseline_ref))))
    log(f"working folder {work_dir}; configurations {[config.name for config in configs]}; loads "
        f"{[load.label for load in loads]}; {options.duration} s each; "
        f"expect about {expected_minutes(options, loads):.0f} min")
    if options.model == "wide" and not options.model_path:
        options = dataclasses.replace(options, served_model_path=build_wide_model(work_dir))
    alone = run_model_alone(work_dir, model_path=options.served_model_path, batch_sizes=options.batch_sizes,
                            call_budget_s=options.call_budget, idle_calls=options.idle_calls,
                            timeout_s=options.model_alone_timeout)
    rounds = run_rounds(configs, loads, options, work_dir)
    protocols = run_protocols(options, work_dir) if options.protocol_users else None
    (work_dir / "results.json").write_text(json.dumps({
        "model_alone": dataclasses.asdict(alone), "servers": [dataclasses.asdict(result) for result in rounds[0]],
        "rounds": [[dataclasses.asdict(result) for result in results] for results in rounds],
        "protocols": dataclasses.asdict(protocols) if protocols else None}, indent=1))
    return Run(options, alone, rounds, loads, machine, started_at, time.monotonic() - started, protocols,
               configs={config.name: config for config in configs})


def child_main(options: Options) -> bool:
    """The parts that run in a child process, so that TensorFlow is never loaded in the parent."""
    if options.build_wide_model:
        save_wide_model(options.build_wide_model)
        return True
    if options.model_alone_json:
        write_model_alone(options.model_alone_json, options.model_path, options.batch_sizes,
                          budget_s=options.call_budget, idle_calls=options.idle_calls, think_s=THINK_TIME_S)
        return True
    return False


def main(argv: Sequence[str]) -> int:
    options = parse_args(argv)
    # SIGTERM as SystemExit, so that the finally blocks stop the servers and Locust.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if child_main(options):
        return 0
    started = time.monotonic()
    options.out.mkdir(parents=True, exist_ok=True)
    with working_folder(options.work_dir) as work_dir, ExitStack() as stack:
        run = measure(options, load_points(options), work_dir, stack)
        report = write_report(options.out, run)
        plot = write_plot(options.out, run.rounds[0], run.loads)
    log(f"wrote {report} and {plot} in {(time.monotonic() - started) / 60:.1f} min")
    print(report.read_text())
    failed = any(result.error for results in run.rounds for result in results)
    return 1 if failed or (run.protocols and run.protocols.error) else 0
