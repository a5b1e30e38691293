"""The report's comparing sections: ratios, the load generator, REST and gRPC, the ceiling, rounds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .configs import REFERENCE, THINK_TIME_S, Config, Load
from .metrics import ceiling_figures
from .results import Ceiling, ConfigResult, LoadStats, ModelAlone, ProtocolResult
from .text import fmt, load_name, markdown_table, ratio

# A load generator above this share of one core may itself have limited the load.
LOCUST_BUSY_SHARE = 0.8
PROTOCOL_NAMES = {"http": "REST (HTTP/JSON)", "grpc": "gRPC (TensorProto)"}


def _mean(result: ConfigResult, label: str) -> float | None:
    stats = result.loads.get(label)
    return stats.mean_ms if stats else None


def _rps(result: ConfigResult, label: str) -> float | None:
    stats = result.loads.get(label)
    return stats.rps if stats else None


def ratio_lines(by_config: dict[str, ConfigResult], open_loads: Sequence[Load], closed: Load | None,
                ceiling: tuple[float, int] | None, configs: dict[str, Config]) -> list[str]:
    reference = by_config.get(REFERENCE)
    if not reference or not reference.loads:
        return [f"No ratios: the `{REFERENCE}` configuration was not run."]
    labels = [load.label for load in open_loads] + ([closed.label] if closed else [])
    lines = [f"Mean latency of each configuration ÷ mean latency of `{REFERENCE}` "
             "(above 1×: the default answered faster).", ""]
    rows = [(f"`{name}`", *(ratio(_mean(result, label), _mean(reference, label)) for label in labels))
            for name, result in by_config.items() if name != REFERENCE]
    lines += markdown_table(["configuration", *(load_name(label) for label in labels)], rows) + [""]
    for load in open_loads:
        ref_mean = _mean(reference, load.label)
        parts = [f"`{name}` {fmt(mean)} ms ({ratio(mean, ref_mean)})" for name, result in by_config.items()
                 if name != REFERENCE and configs[name].baseline and (mean := _mean(result, load.label)) and ref_mean]
        if parts and ref_mean:
            lines.append(f"- {load_name(load.label)}: `{REFERENCE}` {fmt(ref_mean)} ms mean; " + ", ".join(parts) + ".")
    if closed and (ref_rps := _rps(reference, closed.label)):
        parts = [f"`{name}` {fmt(rps)} req/s (the default serves {ratio(ref_rps, rps)} as many)"
                 for name, result in by_config.items() if name != REFERENCE and (rps := _rps(result, closed.label))]
        lines += ["", f"- Closed-loop throughput: `{REFERENCE}` {fmt(ref_rps)} req/s; " + ", ".join(parts) + "."]
        if ceiling:
            lines.append(f"- The model alone peaks at {ceiling[0]:,.0f} rows/s (batch {ceiling[1]}): "
                         f"`{REFERENCE}` serves {ref_rps / ceiling[0]:.0%} of that ceiling over HTTP, "
                         "with the load generator on the same cores.")
    return lines


def load_generator_lines(by_config: dict[str, ConfigResult]) -> list[str]:
    points = [(name, label, stats) for name, result in by_config.items() for label, stats in result.loads.items()]
    if not points:
        return ["No load was run."]
    name, label, stats = max(points, key=lambda point: point[2].locust_cpu_share)
    lines = [f"Locust ran as one process (one core at most). Its busiest run was `{name}`, {load_name(label)}: "
             f"{stats.locust_cpu_share:.0%} of a core on average, {stats.locust_peak_share:.0%} in its "
             "busiest second."]
    limited = [f"`{config}` {load_name(load)}" for config, load, stats in points
               if stats.locust_cpu_share >= LOCUST_BUSY_SHARE]
    if limited:
        lines.append("**The load generator was near saturation** (≥ "
                     f"{LOCUST_BUSY_SHARE:.0%} of a core) in: " + ", ".join(limited)
                     + ". There, throughput is a floor for the server's, not its limit; run Locust with "
                     "`--processes` or from another machine to push further.")
    else:
        lines.append(f"It stayed under {LOCUST_BUSY_SHARE:.0%} of a core everywhere, so it was not the bottleneck; "
                     "but on a small machine it shares the cores with the server, and its CPU is CPU the "
                     "server did not get.")
    return lines


def protocol_lines(protocols: ProtocolResult) -> list[str]:
    lines = [f"The `{protocols.config}` configuration (one server) loaded in a closed loop (no think time), "
             "one random row per call: over REST, Locust's FastHttpUser POSTs JSON to /predict; over gRPC, "
             "a Locust user calls TensorFlow Serving's PredictionService/Predict with the "
             "`tensorflow-serving-api` stubs, the row as `tensor_content`. Both reach the same batcher. "
             "Server CPU per request: the workers' and master's user + system CPU over the load point, "
             "÷ the requests answered. Locust's gRPC user imports TensorFlow (for the stubs' protos) "
             "before its run starts; its start-up CPU counts in its Locust CPU.", ""]
    if protocols.error and not protocols.loads:
        return lines + [f"Not measured: {protocols.error}"]
    rows = [(PROTOCOL_NAMES[entry.protocol], entry.users, entry.stats.requests, entry.stats.failures,
             fmt(entry.stats.mean_ms), fmt(entry.stats.p50_ms), fmt(entry.stats.p99_ms), fmt(entry.stats.rps),
             fmt(entry.stats.server_cpu_ms_per_request, 2), f"{entry.stats.locust_cpu_share:.0%}")
            for entry in protocols.loads]
    lines += markdown_table(["protocol", "users", "requests", "failures", "mean ms", "p50 ms", "p99 ms", "req/s",
                             "server CPU ms/request", "Locust CPU"], rows) + [""]
    by_key = {(entry.protocol, entry.users): entry.stats for entry in protocols.loads}
    for users in sorted({entry.users for entry in protocols.loads}):
        rest, grpc_ = by_key.get(("http", users)), by_key.get(("grpc", users))
        if rest and grpc_ and rest.server_cpu_ms_per_request and grpc_.server_cpu_ms_per_request:
            lines.append(f"- {users} {'user' if users == 1 else 'users'}: server CPU per request "
                         f"{fmt(rest.server_cpu_ms_per_request, 2)} ms over REST, "
                         f"{fmt(grpc_.server_cpu_ms_per_request, 2)} ms over gRPC (REST ÷ gRPC "
                         f"{ratio(rest.server_cpu_ms_per_request, grpc_.server_cpu_ms_per_request)}); throughput "
                         f"{fmt(rest.rps)} and {fmt(grpc_.rps)} req/s; mean latency {fmt(rest.mean_ms)} and "
                         f"{fmt(grpc_.mean_ms)} ms.")
    return lines


def load_ceiling(config: Config, stats: LoadStats, alone: ModelAlone) -> Ceiling:
    """ceiling_figures for one load point, from its /metrics batches and part 1's timings."""
    if stats.server_batches is None or stats.server_cpu_s is None:
        return Ceiling()
    return ceiling_figures(stats.server_batches, alone.timings(config.predict_path), requests=stats.requests,
                           rps=stats.rps, server_cpu_s=stats.server_cpu_s)


CEILING_PROSE = (
    "The closed loop ({users} users, one row per request). `rows per call`: the real rows "
    "per predict call, from the server's `model_server_batch_size_rows` histogram over the load point; "
    "each call was padded to the next bucket size. `ceiling`: the rows/s of the model alone (part 1, "
    "the configuration's predict path) running those same padded calls back to back: real rows ÷ "
    "Σ calls × median ms per call. `ratio`: req/s ÷ ceiling. `predict wall`: the server's own "
    "`model_server_predict_duration_seconds` ÷ requests. Server CPU per request (master and workers, "
    "psutil) is split into `predict` (Σ calls × the model alone's CPU per call at that size) and "
    "`everything else` (the rest: HTTP, JSON, Flask, logging, batching, metrics).")


def ceiling_lines(by_config: dict[str, ConfigResult], configs: dict[str, Config], alone: ModelAlone,
                  closed: Load | None, open_loads: Sequence[Load]) -> list[str]:
    lines = closed_ceiling_lines(by_config, configs, alone, closed) if closed else []
    one_user = next((load for load in open_loads if load.users == 1), None)
    return lines + (one_user_lines(by_config, alone, one_user) if one_user else [])


def closed_ceiling_lines(by_config: dict[str, ConfigResult], configs: dict[str, Config], alone: ModelAlone,
                         closed: Load) -> list[str]:
    lines = [CEILING_PROSE.format(users=closed.users), ""]
    figures, rows = {}, []
    for name, result in by_config.items():
        stats = result.loads.get(closed.label)
        if not stats:
            continue
        figures[name] = numbers = load_ceiling(configs[name], stats, alone)
        rows.append((f"`{name}`", fmt(stats.rps), fmt(numbers.mean_batch_rows), fmt(numbers.ceiling_rows_per_s),
                     f"{numbers.ratio:.0%}" if numbers.ratio else "–", fmt(numbers.predict_wall_ms_per_request, 2),
                     fmt(numbers.cpu_ms_per_request, 2), fmt(numbers.predict_cpu_ms_per_request, 2),
                     fmt(numbers.other_cpu_ms_per_request, 2)))
    lines += markdown_table(["configuration", "req/s", "rows per call", "ceiling rows/s", "ratio",
                             "predict wall ms/request", "server CPU ms/request", "of which predict",
                             "of which everything else"], rows) + [""]
    reference = figures.get(REFERENCE)
    for name, numbers in figures.items():
        if name.startswith("baseline@") and reference:
            ours, theirs = reference.other_cpu_ms_per_request, numbers.other_cpu_ms_per_request
            lines.append(f"- `{REFERENCE}` ÷ `{name}`: req/s "
                         f"{ratio(_rps(by_config[REFERENCE], closed.label), _rps(by_config[name], closed.label))}; "
                         f"server CPU outside predict per request {ratio(ours, theirs)} "
                         f"({fmt(ours, 2)} against {fmt(theirs, 2)} ms).")
    return lines + [""]


def one_user_lines(by_config: dict[str, ConfigResult], alone: ModelAlone, one_user: Load) -> list[str]:
    after_idle = alone.after_idle
    lines = [f"One user with {THINK_TIME_S[0]:g}–{THINK_TIME_S[1]:g} s think time against a bare call of the "
             f"model after the same idle time (part 1: mean {fmt(after_idle.mean_ms, 2)} ms over "
             f"{after_idle.calls} calls): the difference is what the server adds to one request.", ""]
    rows = []
    for name, result in by_config.items():
        stats = result.loads.get(one_user.label)
        if not stats or stats.mean_ms is None:
            continue
        rows.append((f"`{name}`", fmt(stats.mean_ms, 2), fmt(stats.p50_ms, 2), fmt(after_idle.mean_ms, 2),
                     fmt(stats.mean_ms - after_idle.mean_ms, 2)))
    return lines + markdown_table(["configuration", "1 user mean ms", "1 user p50 ms",
                                   "bare call after idle, mean ms", "difference ms"], rows)


def round_lines(rounds: list[list[ConfigResult]], configs: dict[str, Config], alone: ModelAlone,
                loads: Sequence[Load]) -> list[str]:
    """Each round's figures per load point, and the median of each round's ratios to the reference."""
    names = [result.config for result in rounds[0]]
    lines = [f"{len(rounds)} rounds. In each, every configuration's server is started afresh and runs every load "
             "point; the order alternates from round to round. Sections 1–7 are round 1. A ratio is taken within "
             "a round, between runs minutes apart, and then the median over the rounds: a machine's speed can "
             "drift more between rounds than between neighbouring runs.", ""]
    for load in loads:
        lines += [f"### {load_name(load.label).capitalize()}", ""] + round_table(rounds, names, configs, alone, load)
        lines += [""]
    return lines


def round_table(rounds: list[list[ConfigResult]], names: list[str], configs: dict[str, Config], alone: ModelAlone,
                load: Load) -> list[str]:
    """One load point over the rounds: each configuration's figures, then the ratios to the reference."""
    others = [name for name in names if name != REFERENCE]
    columns = ["req/s", "mean ms", "p99 ms"] + (["CPU outside predict ms/request"] if load.closed_loop else [])
    header = ["round", *[f"`{name}` {column}" for name in names for column in columns]]
    if REFERENCE in names:
        header += [(f"`{REFERENCE}` ÷ `{name}` req/s" if load.closed_loop else f"`{name}` ÷ `{REFERENCE}` mean")
                   for name in others]
    table = [round_row(results, names, others, configs, alone, load) for results in rounds]
    ratios_from = len(names) * len(columns)

    def cell(value: float | None, column: int) -> str:
        return f"{value:.2f}×" if column >= ratios_from and value is not None else fmt(value, 2)

    rows = [[str(number), *(cell(value, column) for column, value in enumerate(row))]
            for number, row in enumerate(table, 1)]
    medians = [statistics.median(values) if (values := [value for row in table if (value := row[column]) is not None])
               else None for column in range(len(header) - 1)]
    rows.append(["**median**", *(f"**{cell(value, column)}**" for column, value in enumerate(medians))])
    return markdown_table(header, rows)


def round_row(results: list[ConfigResult], names: list[str], others: list[str], configs: dict[str, Config],
              alone: ModelAlone, load: Load) -> list[float | None]:
    by_name = {result.config: result.loads.get(load.label) for result in results}
    row: list[float | None] = []
    for name in names:
        stats = by_name[name]
        row += [stats.rps, stats.mean_ms, stats.p99_ms] if stats else [None, None, None]
        if load.closed_loop:
            row.append(load_ceiling(configs[name], stats, alone).other_cpu_ms_per_request if stats else None)
    if REFERENCE in names:
        reference = by_name[REFERENCE]
        for name in others:
            stats = by_name[name]
            top, bottom = ((reference and reference.rps, stats and stats.rps) if load.closed_loop
                           else (stats and stats.mean_ms, reference and reference.mean_ms))
            row.append(top / bottom if top and bottom else None)
    return row
