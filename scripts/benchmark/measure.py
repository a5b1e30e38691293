"""Part 2: each configuration's server started, loaded at every load point, and stopped."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from .configs import CONFIGS_BY_NAME, REFERENCE, Config, Load
from .locust import run_locust
from .metrics import batch_delta
from .options import Options
from .results import ConfigResult, LoadStats, ProtocolLoad, ProtocolResult
from .runlog import log
from .server import Server
from .text import fmt

PROTOCOLS = ("http", "grpc")


def measure_load(server: Server, load: Load, options: Options, *, prefix: Path, what: str,
                 protocol: str = "http") -> LoadStats:
    """One load point against a running server, with the server's CPU over it."""
    server.wait_quiet(within_s=60)
    # /metrics is read outside the CPU window: the scrape is not part of the load.
    metrics_before = server.metrics()
    cpu_before = server.cpu_seconds()
    url = locust_host(server, protocol)
    stats = run_locust(url, load, duration_s=options.duration, prefix=prefix, protocol=protocol,
                       spawn_rate=options.spawn_rate)
    stats.server_cpu_s = server_cpu_s = server.cpu_seconds() - cpu_before
    metrics_after = server.metrics()
    if metrics_before and metrics_after:
        stats.server_batches = batch_delta(metrics_before, metrics_after)
    stats.server_cpu_ms_per_request = server_cpu_s / stats.requests * 1000 if stats.requests else None
    stats.server_cpu_share = server_cpu_s / stats.locust_wall_s
    log(f"{what}: {stats.requests} requests, {stats.failures} failed, mean {fmt(stats.mean_ms)} ms, "
        f"{fmt(stats.rps)} req/s, locust {stats.locust_cpu_share:.0%} of a core")
    return stats


def locust_host(server: Server, protocol: str) -> str:
    """Locust's --host for a LOCUST_PROTOCOL: the HTTP address, or the gRPC one with a scheme."""
    return server.url if protocol in ("http", "v2") else f"grpc://{server.grpc_target}"


def failure(exc: Exception, server: Server) -> str:
    """One line for the report: the first line of the error, and where the server's log is."""
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first_line} (see {server.log_path.name})"


def run_config(config: Config, loads: Sequence[Load], options: Options, work_dir: Path, *,
               tag: str = "") -> ConfigResult:
    """Start the configuration's server, run every load point against it, stop it. `tag` names a round's files."""
    server = Server(config, model_path=options.served_model_path,
                    log_path=work_dir / f"gunicorn-{config.name}{tag}.log")
    result = ConfigResult(config.name)
    try:
        result.start_s = _start(server, options)
        assert server.proc is not None
        result.cwd = psutil.Process(server.proc.pid).cwd()  # the tree it really runs, as the OS sees it
        log(f"{config.name}: ready in {result.start_s:.1f} s")
        for load in loads:
            result.loads[load.label] = measure_load(server, load, options, prefix=work_dir / (
                f"{config.name}{tag}-{load.label.replace(' ', '_')}"), what=f"{config.name}{tag} {load.label}")
    except Exception as exc:  # one configuration failing should not lose the others' numbers
        result.error = failure(exc, server)
        log(f"{config.name}: {result.error}")
    finally:
        server.stop()
    return result


def _start(server: Server, options: Options) -> float:
    """Start the server; the seconds until every worker was ready."""
    started = time.monotonic()
    server.start(ready_within_s=options.server_start_timeout)
    return time.monotonic() - started


def run_rounds(configs: Sequence[Config], loads: Sequence[Load], options: Options,
               work_dir: Path) -> list[list[ConfigResult]]:
    """Every configuration, `options.rounds` times; each round's results in the order of `configs`.

    The order alternates from one round to the next (A B, B A, A B, ...), so that a machine
    growing faster or slower over the run favours neither side of a ratio.
    """
    rounds = []
    for number in range(options.rounds):
        order = list(configs) if number % 2 == 0 else list(configs)[::-1]
        tag = f"-round{number + 1}" if options.rounds > 1 else ""
        by_name = {config.name: run_config(config, loads, options, work_dir, tag=tag) for config in order}
        rounds.append([by_name[config.name] for config in configs])
    return rounds


def run_protocols(options: Options, work_dir: Path) -> ProtocolResult:
    """The reference configuration once, loaded over REST and over gRPC at each closed-loop user count."""
    config = CONFIGS_BY_NAME[REFERENCE]
    server = Server(config, model_path=options.served_model_path, log_path=work_dir / "gunicorn-protocols.log")
    result = ProtocolResult(config.name)
    try:
        result.start_s = _start(server, options)
        for users in options.protocol_users:
            load = Load(f"{users} closed", users, (0.0, 0.0))
            for protocol in PROTOCOLS:
                stats = measure_load(server, load, options, prefix=work_dir / f"protocols-{protocol}-{users}",
                                     what=f"{protocol} {users} users closed loop", protocol=protocol)
                result.loads.append(ProtocolLoad(protocol, users, stats))
    except Exception as exc:
        result.error = failure(exc, server)
        log(f"protocols: {result.error}")
    finally:
        server.stop()
    return result
