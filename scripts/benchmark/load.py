"""The load generators: headless Locust (locustfile.py) and wrk, their figures, and their own CPU."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .common import LOCUST_VARIABLES, REPO, Load, Server, fmt, log

LOCUSTFILE = REPO / "locustfile.py"


@dataclasses.dataclass
class BatchDelta:
    """The predict calls a server ran between two /metrics snapshots, by the batch size they were padded to."""

    calls_per_bucket: dict[int, int]
    rows: int
    calls: int
    predict_s: float


@dataclasses.dataclass
class LoadStats:
    """One load point: Locust's figures, Locust's own CPU, and the server's CPU and batches over it."""

    requests: int = 0
    failures: int = 0
    mean_ms: float | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    rps: float = 0.0
    locust_wall_s: float = 0.0
    locust_cpu_share: float = 0.0
    mean_batch_rows: float | None = None  # the X-Batch-Size of the answers (locustfile.py's LOCUST_SUMMARY_FILE)
    server_batches: BatchDelta | None = None
    server_cpu_s: float | None = None
    server_cpu_share: float | None = None


def locust_command(url: str, load: Load, *, duration_s: float, prefix: Path,
                   spawn_rate: float | None = None) -> list[str]:
    """Headless Locust; with no spawn rate every user starts at once (Locust spawns
    floor(rate) users per step, one step a second)."""
    rate = load.users if spawn_rate is None else spawn_rate
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "-u", str(load.users), "-r", f"{rate:g}", "-t", f"{duration_s:g}s", "--host", url,
            "--csv", str(prefix), "--json-file", str(prefix), "--only-summary", "--loglevel", "WARNING"]


def run_locust(url: str, load: Load, *, duration_s: float, prefix: Path, protocol: str = "http",
               spawn_rate: float | None = None) -> LoadStats:
    """One headless Locust run; its stats, and its own CPU use (measured, not guessed)."""
    summary_path = prefix.with_name(prefix.name + "_batches.json")
    env = {key: value for key, value in os.environ.items() if key not in LOCUST_VARIABLES}
    env.update({"LOCUST_WAIT_MIN": str(load.think_s[0]), "LOCUST_WAIT_MAX": str(load.think_s[1]),
                "LOCUST_SUMMARY_FILE": str(summary_path), "LOCUST_PROTOCOL": protocol})
    command = locust_command(url, load, duration_s=duration_s, prefix=prefix, spawn_rate=spawn_rate)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    with open(prefix.with_name(prefix.name + ".log"), "wb") as output:
        # Past its run time and a minute's grace, subprocess kills it.
        returncode = subprocess.run(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
                                    timeout=duration_s + 60).returncode
    wall_s = time.monotonic() - started
    if returncode not in (0, 1):  # 1: some requests failed, counted below; anything else: Locust itself
        log(f"locust exited with {returncode}; see {prefix.name}.log in the working folder")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # RUSAGE_CHILDREN grows only when a child is reaped: between the two reads, only Locust was.
    cpu_s = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    stats = parse_locust_stats(prefix)
    return dataclasses.replace(
        stats, rps=stats.requests / duration_s,  # over the run time, not Locust's first-to-last request
        locust_wall_s=wall_s, locust_cpu_share=cpu_s / wall_s if wall_s else 0.0,
        mean_batch_rows=summary.get("mean_batch_rows"))


def parse_locust_stats(prefix: Path) -> LoadStats:
    """Counts, mean and percentiles from the JSON Locust writes once, at exit, with every request (its CSV,
    rewritten once a second, misses the last second's: a 2 s run's percentiles, now and then all of them)."""
    stats: dict[str, Any] = {}
    json_path = Path(f"{prefix}.json")
    if json_path.exists():
        entries = json.loads(json_path.read_text())
        stats["requests"] = sum(entry["num_requests"] for entry in entries)
        stats["failures"] = sum(entry["num_failures"] for entry in entries)
        if stats["requests"]:
            stats["mean_ms"] = sum(entry["total_response_time"] for entry in entries) / stats["requests"]
            times: dict[float, int] = {}  # Locust's rounded response times (ms) -> requests, over every entry
            for entry in entries:
                for ms, count in entry["response_times"].items():
                    times[float(ms)] = times.get(float(ms), 0) + count
            stats.update({f"p{share}_ms": _percentile(times, share / 100) for share in (50, 95, 99)})
    return LoadStats(**stats)


def _percentile(times: dict[float, int], share: float) -> float:
    """Locust's own percentile (its CSV's): the largest time with more than `share` of the requests below it."""
    total, ordered = sum(times.values()), sorted(times, reverse=True)
    above = itertools.accumulate(times[ms] for ms in ordered)  # requests at or above each time
    return next(ms for ms, count in zip(ordered, above, strict=True) if total - count <= int(total * share))


def locust_host(server: Server, protocol: str) -> str:
    """Locust's --host for a LOCUST_PROTOCOL: the HTTP address, or the gRPC one with a scheme."""
    return server.url if protocol in ("http", "v2") else f"grpc://{server.grpc_target}"


def batch_delta(before: Any, after: Any, buckets: list[int]) -> BatchDelta:
    """Predict calls per padded batch size, real rows and predict seconds between two MetricSnapshots. The
    histogram counts real rows per call cumulatively (le=1, 2, 4, ...): the calls in (lower, upper] were
    padded to the smallest bucket size >= upper (or the largest, which no call exceeds)."""
    calls: dict[int, int] = {}
    previous = 0.0
    for upper in sorted(after.buckets):
        cumulative = after.buckets[upper] - before.buckets.get(upper, 0.0)
        count = round(cumulative - previous)
        previous = cumulative
        if count:
            padded = next((size for size in buckets if size >= upper), buckets[-1])
            calls[padded] = calls.get(padded, 0) + count
    return BatchDelta(calls_per_bucket=calls, rows=round(after.rows - before.rows),
                      calls=round(after.calls - before.calls), predict_s=after.predict_s - before.predict_s)


def measure_load(server: Server, load: Load, *, duration_s: float, prefix: Path, what: str, buckets: list[int],
                 protocol: str = "http", spawn_rate: float | None = None) -> LoadStats:
    """One Locust load point against a running server, with the server's CPU and batches over it."""
    server.wait_quiet(within_s=60)
    # /metrics is read outside the CPU window: the scrape is not part of the load.
    metrics_before = server.metrics()
    cpu_before = server.cpu_seconds()
    stats = run_locust(locust_host(server, protocol), load, duration_s=duration_s, prefix=prefix, protocol=protocol,
                       spawn_rate=spawn_rate)
    stats.server_cpu_s = server.cpu_seconds() - cpu_before
    metrics_after = server.metrics()
    if metrics_before and metrics_after:
        stats.server_batches = batch_delta(metrics_before, metrics_after, buckets)
    stats.server_cpu_share = stats.server_cpu_s / stats.locust_wall_s
    log(f"{what}: {stats.requests} requests, {stats.failures} failed, mean {fmt(stats.mean_ms)} ms, "
        f"{fmt(stats.rps)} req/s, locust {stats.locust_cpu_share:.0%} of a core")
    return stats


# wrk's Lua hooks: POST the body file's lines (one JSON body each) in turn; with headers the whole file as one
# body (v2 binary); or, from a listing (write_listing), each listed file as one body with its own headers (v2
# binary bodies whose JSON headers differ in length). At the end one JSON line with the counts and
# percentiles (microseconds) from wrk's own histogram.
WRK_SUMMARY = "WRK_SUMMARY "
WRK_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
%(headers)s
local bodies, own_headers, sent, mode = {}, {}, 0, "%(mode)s"
if mode == "whole" then
  local file = io.open("%(body)s", "rb"); bodies[1] = file:read("*a"); file:close()
elseif mode == "lines" then
  for line in io.lines("%(body)s") do bodies[#bodies + 1] = line end
else
  for line in io.lines("%(body)s") do
    local fields, headers = {}, {}
    for field in line:gmatch("[^\\t]+") do fields[#fields + 1] = field end
    local file = io.open(fields[1], "rb"); bodies[#bodies + 1] = file:read("*a"); file:close()
    for name, value in pairs(wrk.headers) do headers[name] = value end
    for index = 2, #fields do
      local name, value = fields[index]:match("^(.-): (.*)$"); headers[name] = value
    end
    own_headers[#bodies] = headers
  end
end

function request()
  sent = sent %% #bodies + 1
  return wrk.format(nil, nil, own_headers[sent], bodies[sent])
end

function done(summary, latency, requests)
  io.write(string.format(
    '%(marker)s{"requests": %%d, "duration_us": %%d, "non_2xx_3xx": %%d, "connect": %%d, "read": %%d, ' ..
    '"write": %%d, "timeout": %%d, "p50_us": %%d, "p99_us": %%d, "mean_us": %%.1f}\\n',
    summary.requests, summary.duration, summary.errors.status, summary.errors.connect, summary.errors.read,
    summary.errors.write, summary.errors.timeout, latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


def write_listing(folder: Path, name: str, bodies: Sequence[tuple[bytes, Mapping[str, str]]]) -> Path:
    """Each body in a file of its own, and their listing for run_wrk(..., listing=True): a line per body, its
    file's path and then each of its own headers as "Name: value", separated by tabs."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for number, (body, headers) in enumerate(bodies):
        path = (folder / f"{name}-{number:03d}.body").resolve()
        path.write_bytes(body)
        lines.append("\t".join([str(path), *(f"{header}: {value}" for header, value in headers.items())]))
    listing = folder / f"{name}.listing"
    listing.write_text("\n".join(lines) + "\n")
    return listing


@dataclasses.dataclass
class WrkResult:
    requests: int
    duration_s: float
    non_2xx_3xx: int
    socket_errors: dict[str, int]
    p50_ms: float | None  # None: h2load gives no percentiles
    p99_ms: float | None
    mean_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s

    @property
    def errors(self) -> str | None:
        """What makes the load unfit to report, or None."""
        found = [f"{self.non_2xx_3xx} non-2xx/3xx answers"] if self.non_2xx_3xx else []
        found += [f"{count} socket {kind} errors" for kind, count in self.socket_errors.items() if count]
        return ", ".join(found) or None


def parse_wrk(output: str) -> WrkResult:
    """wrk's output with WRK_SCRIPT's summary line; its text form is cross-checked for non-2xx answers."""
    lines = [line for line in output.splitlines() if line.startswith(WRK_SUMMARY)]
    if len(lines) != 1:
        raise ValueError(f"no single {WRK_SUMMARY.strip()} line in wrk's output:\n{output}")
    summary = json.loads(lines[0][len(WRK_SUMMARY):])
    result = WrkResult(
        requests=summary["requests"], duration_s=summary["duration_us"] / 1e6, non_2xx_3xx=summary["non_2xx_3xx"],
        socket_errors={kind: summary[kind] for kind in ("connect", "read", "write", "timeout")},
        p50_ms=summary["p50_us"] / 1000, p99_ms=summary["p99_us"] / 1000, mean_ms=summary["mean_us"] / 1000)
    if "Non-2xx or 3xx responses" in output and not result.non_2xx_3xx:
        raise ValueError(f"wrk reported non-2xx answers its summary did not count:\n{output}")
    return result


def run_wrk(url: str, body: Path, *, duration_s: float, threads: int, connections: int,
            log_path: Path | None = None, headers: dict[str, str] | None = None,
            listing: bool = False) -> tuple[WrkResult, float]:
    """One closed-loop wrk run POSTing the lines of `body` in turn to `url` (with `headers`: the whole file as one
    body; with `listing`: the bodies write_listing listed there); its result and wrk's own CPU seconds."""
    script = body.with_suffix(".lua")
    lines = "\n".join(f'wrk.headers["{name}"] = "{value}"' for name, value in (headers or {}).items())
    mode = "listing" if listing else "whole" if headers else "lines"
    script.write_text(WRK_SCRIPT % {"body": body.resolve(), "marker": WRK_SUMMARY, "mode": mode, "headers": lines})
    command = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{duration_s:g}s", "--latency",
               "--timeout", "30s", "-s", str(script), url]
    output, cpu_s = run_generator(command, duration_s, log_path)
    return parse_wrk(output), cpu_s


def run_generator(command: list[str], duration_s: float, log_path: Path | None) -> tuple[str, float]:
    """Run a load generator to its end: its output, and its own CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, capture_output=True, text=True, timeout=duration_s + 120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if log_path is not None:
        log_path.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} exited with {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def parse_h2load(output: str) -> WrkResult:
    """h2load's summary: calls that ended but did not succeed count as failed answers."""
    found = re.search(r"finished in ([\d.]+)s.*?requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, "
                      r"(\d+) failed, (\d+) errored.*?time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)", output, re.S)
    if not found:
        raise ValueError(f"no summary in h2load's output:\n{output}")
    seconds, finished, succeeded, failed, errored, mean, unit = found.groups()
    return WrkResult(int(succeeded), float(seconds), int(finished) - int(succeeded),
                     {"connect": int(failed), "read": int(errored), "write": 0, "timeout": 0}, None, None,
                     float(mean) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit])


def run_h2load(url: str, body: Path, *, duration_s: float, connections: int,
               log_path: Path | None = None) -> tuple[WrkResult, float]:
    """A closed-loop h2load run of gRPC calls (`body`: one length-prefixed message) to `url` (http://host:port/
    Service/Method), as run_wrk. h2load cannot read gRPC's status trailers: the caller counts the rows served."""
    command = ["h2load", "-c", str(connections), "-m", "1", "-t", "1", "-D", f"{duration_s:g}", "-d", str(body),
               "-H", "content-type: application/grpc", "-H", "te: trailers", url]
    output, cpu_s = run_generator(command, duration_s, log_path)
    return parse_h2load(output), cpu_s
