"""Reproduce the experiment: the model alone, then real servers under real Locust load.

    python -m scripts.benchmark                        # full run (about 24 min): docs/benchmarks.md, .png
    python -m scripts.benchmark --quick --out /tmp/b   # a minute or two, for CI: never overwrites docs/
    python -m scripts.benchmark --configs naive,default --users 1,20 --duration 10

1. The model alone: time and CPU per call at batch sizes 1, 2, 4, ... with Keras'
   model.predict and with the server's predict path (a compiled tf.function).
2. Each server configuration as a real `gunicorn -c gunicorn.conf.py wsgi:app`, loaded by a
   real headless Locust (locustfile.py) at several user counts with 1-3 s think time, then
   in a closed loop (no think time) for throughput. Locust's own CPU use is measured too,
   so that a saturated load generator is not mistaken for a slow server.
3. Ratios, tables and a plot.
4. REST against gRPC: the `default` configuration loaded in a closed loop over HTTP/JSON and
   over TensorFlow Serving's gRPC API (LOCUST_PROTOCOL=grpc), with the server's CPU per request.
5. The closed loop against the model's own ceiling: the batch sizes each server actually
   ran (from its /metrics), what the model alone does with those same batches back to back,
   and the server's CPU per request split into the model's own and everything else.

The built-in default model is used unless --model wide (1,024 floats in, 4 x 4,096 hidden,
1,000 out, ~235 MB, built from seeds at the start of the run) or --model-path is given.
--baseline-ref REF adds the configuration `baseline@<sha>`: the server of commit REF (checked
out into a temporary git worktree), its defaults, 1 worker, the same model, side by side with
`default`. Nothing here asserts a timing: the numbers are whatever this machine gives.

Performance issue's setup (wide model, one row per request, 32 clients in the closed loop,
1 and 50 users with think time), before and after in one run:

    python -m scripts.benchmark --model wide --closed-loop-users 32 --users 1,50 --configs default \\
        --baseline-ref REF --no-protocols
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from scripts.live_server import REPO

from .configs import CONFIGS, CONFIGS_BY_NAME, SERVER_BUCKETS, WIDE_MODEL_NAME

COMMAND = "python -m scripts.benchmark"


@dataclasses.dataclass(frozen=True)
class Options:
    """A run's command line, with every default filled in (the quick run's where --quick is given)."""

    quick: bool
    out: Path
    duration: int
    configs: list[str]
    users: list[int]
    closed_loop_users: int
    protocol_users: list[int]  # empty: no REST and gRPC comparison
    max_batch: int
    model: str
    model_path: str | None
    baseline_ref: str | None
    rounds: int
    spawn_rate: float | None
    idle_calls: int
    work_dir: Path | None
    server_start_timeout: float
    batch_sizes: list[int]
    call_budget: float
    model_alone_timeout: float
    argv_shown: list[str]
    served_model_path: str | None  # model_path, or the wide model's file once it is built
    # Internal: part 1 and the wide model are made in a child process, so that TensorFlow is not loaded here.
    model_alone_json: Path | None = None
    build_wide_model: Path | None = None


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected whole numbers of 1 or more, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    values = _int_list(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one whole number of 1 or more, got {text!r}")
    return values[0]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return value


def _config_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in CONFIGS_BY_NAME]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS_BY_NAME)}")
    return names


def _what_to_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="seconds, not minutes: 2 configurations, users 1 and 5, 3 s each, batch sizes 1..8")
    parser.add_argument("--out", type=Path, default=REPO / "docs",
                        help="folder for benchmarks.md and benchmarks.png (default docs/)")
    parser.add_argument("--duration", type=int, help="seconds per load point (default 30; quick 3)")
    parser.add_argument("--configs", type=_config_list,
                        help=f"comma-separated subset of: {', '.join(CONFIGS_BY_NAME)} (default all but floor; "
                             "quick naive,default)")
    parser.add_argument("--users", type=_int_list, help="user counts with think time (default 1,5,20,50; quick 1,5)")
    parser.add_argument("--closed-loop-users", type=int,
                        help="users of the closed loop, 0 to skip it (default 64; quick 16)")
    parser.add_argument("--protocol-users", type=_int_list,
                        help="closed-loop user counts of the REST and gRPC comparison (default 1,50; quick 1,5)")
    parser.add_argument("--no-protocols", action="store_true", help="skip the REST and gRPC comparison")
    parser.add_argument("--max-batch", type=int, help="largest batch size of part 1 (default 64; quick 8)")
    parser.add_argument("--model", choices=("default", "wide"), default="default",
                        help=f"the built-in default model, or the wide-input model ({WIDE_MODEL_NAME}), "
                             "built from seeds at the start of the run")
    parser.add_argument("--model-path", help="serve and time this model (any MODEL_PATH); wins over --model")
    parser.add_argument("--baseline-ref", metavar="REF",
                        help="also run the server of this git commit (a temporary worktree), defaults and 1 worker, "
                             "as configuration baseline@<sha>, side by side with default")


def _how_to_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=_positive_int, default=1,
                        help="run every configuration this many times, in alternating order, and report each "
                             "round and the median of each round's ratios (default 1)")
    parser.add_argument("--spawn-rate", type=_positive_float,
                        help="users Locust starts a second (default: all at once, their first requests together)")
    parser.add_argument("--idle-calls", type=int,
                        help="batch-1 calls of the model alone, each after 1-3 s idle (default 8; quick 2)")
    parser.add_argument("--work-dir", type=Path,
                        help="keep raw Locust output and server logs here (default: a temp folder)")
    parser.add_argument("--server-start-timeout", type=float, default=300)
    parser.add_argument("--model-alone-json", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--batch-sizes", type=_int_list, help=argparse.SUPPRESS)
    parser.add_argument("--call-budget", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--build-wide-model", type=Path, help=argparse.SUPPRESS)


def parse_args(argv: Sequence[str]) -> Options:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    _what_to_run(parser)
    _how_to_run(parser)
    args = parser.parse_args(argv)
    quick = args.quick
    model_path = str(Path(args.model_path).resolve()) if args.model_path else None
    # Every size the servers pad to, so that their batches can be timed alone.
    max_batch = args.max_batch or (8 if quick else 64)
    batch_sizes = args.batch_sizes or sorted({2**power for power in range(16) if 2**power <= max_batch}
                                             | set(SERVER_BUCKETS))
    return Options(
        quick=quick, out=args.out, duration=args.duration or (3 if quick else 30),
        configs=args.configs or (["naive", "default"] if quick else
                                 [config.name for config in CONFIGS if config.in_full_run]),
        users=args.users or ([1, 5] if quick else [1, 5, 20, 50]),
        closed_loop_users=(16 if quick else 64) if args.closed_loop_users is None else args.closed_loop_users,
        protocol_users=[] if args.no_protocols else (args.protocol_users or ([1, 5] if quick else [1, 50])),
        max_batch=max_batch, model=args.model, model_path=model_path, baseline_ref=args.baseline_ref,
        rounds=args.rounds, spawn_rate=args.spawn_rate,
        idle_calls=(2 if quick else 8) if args.idle_calls is None else args.idle_calls,
        work_dir=args.work_dir, server_start_timeout=args.server_start_timeout, batch_sizes=batch_sizes,
        call_budget=args.call_budget or (0.5 if quick else 3.0), model_alone_timeout=300 if quick else 900,
        argv_shown=list(argv), served_model_path=model_path, model_alone_json=args.model_alone_json,
        build_wide_model=args.build_wide_model)


def without_flags(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """argv less these flags and their values (`--out DIR` and `--out=DIR`): a report shows
    its command without the folders of the machine it ran on."""
    shown, skip = [], False
    for part in argv:
        if skip:
            skip = False
        elif part in flags:
            skip = True
        elif not part.startswith(tuple(f"{flag}=" for flag in flags)):
            shown.append(part)
    return shown


def command_line(options: Options) -> str:
    """The command as run, less the flags that only name local folders."""
    shown = without_flags(options.argv_shown, ("--out", "--work-dir", "--model-path"))
    if options.model_path:
        shown.append(f"--model-path {Path(options.model_path).name}")
    return " ".join([COMMAND, *shown])
