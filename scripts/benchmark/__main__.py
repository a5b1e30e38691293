"""`python -m scripts.benchmark <scenario> [options]`, from the repository root."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence

from scripts.benchmark import experiment, gpu, handler, layouts, profile, variable_length
from scripts.benchmark.common import COMMAND, DOCS

# name: (one line of help, add the scenario's arguments, run it)
SCENARIOS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "experiment": ("the published experiment: the model alone, then servers under Locust, 1 user against 20",
                   lambda parser: experiment.add_arguments(parser, page=DOCS / "benchmarks.md"),
                   lambda args: experiment.run(experiment.resolve(args), title="Benchmarks")),
    "peers": ("this server beside PyTriton and the small Flask batcher, under wrk",
              lambda parser: layouts.add_arguments(parser, scenario="peers"), layouts.run),
    "model-processes": ("MODEL_PROCESSES=1 beside the default and PyTriton, under wrk",
                        lambda parser: layouts.add_arguments(parser, scenario="model-processes"), layouts.run),
    "variable-length": ("padding off, to the longest, and length buckets", variable_length.add_arguments,
                        variable_length.run),
    "floor": ("this tree over /predict, v2 JSON and binary, TF gRPC beside the floors (scripts/floor_app.py) and "
              "PyTriton, under wrk and h2load", lambda parser: layouts.add_arguments(parser, scenario="floor"),
              layouts.run),
    "profile": ("where one worker's time goes: py-spy per stage and per thread", profile.add_arguments, profile.run),
    "gpu": ("the wide model on Keras's JAX backend on one GPU, alone and served (needs no TensorFlow)",
            gpu.add_arguments, gpu.run),
    "handler": ("the image example's handler on camera photos beside LitServe and PyTriton, under wrk, and the "
                "physical limit", handler.add_arguments, handler.run),
}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    scenarios = parser.add_subparsers(dest="scenario", required=True, metavar="scenario")
    for name, (what, add_arguments, _) in SCENARIOS.items():
        add_arguments(scenarios.add_parser(name, help=what, description=what))
    args = parser.parse_args(argv)
    args.argv = list(argv)[1:]
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # SIGTERM as SystemExit, so that the finally blocks stop the servers and the load generators.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return SCENARIOS[args.scenario][2](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
