"""Headless Locust runs (locustfile.py) against a server: their figures, and Locust's own CPU."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from scripts.live_server import REPO

from .configs import LOCUST_VARIABLES, LOCUSTFILE, Load
from .results import LoadStats
from .runlog import log

SUMMARY_FIELDS = ("answers_with_batch_headers", "mean_batch_rows", "mean_batch_requests")


def locust_command(url: str, load: Load, *, duration_s: int, prefix: Path,
                   spawn_rate: float | None = None) -> list[str]:
    """Headless Locust; with no spawn rate every user starts at once (Locust spawns
    floor(rate) users per step, one step a second)."""
    rate = load.users if spawn_rate is None else spawn_rate
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "-u", str(load.users), "-r", f"{rate:g}", "-t", f"{duration_s}s", "--host", url,
            "--csv", str(prefix), "--json-file", str(prefix), "--only-summary", "--loglevel", "WARNING"]


def spawning(spawn_rate: float | None) -> str:
    if spawn_rate is None:
        return "all users started at once (their first requests arrive together)"
    return f"users started {spawn_rate:g} a second"


def run_locust(url: str, load: Load, *, duration_s: int, prefix: Path, protocol: str = "http",
               spawn_rate: float | None = None) -> LoadStats:
    """One headless Locust run; its stats, and its own CPU use (measured, not guessed)."""
    summary_path = prefix.with_name(prefix.name + "_batches.json")
    env = {key: value for key, value in os.environ.items() if key not in LOCUST_VARIABLES}
    env.update({"LOCUST_WAIT_MIN": str(load.think_s[0]), "LOCUST_WAIT_MAX": str(load.think_s[1]),
                "LOCUST_SUMMARY_FILE": str(summary_path), "LOCUST_PROTOCOL": protocol})
    command = locust_command(url, load, duration_s=duration_s, prefix=prefix, spawn_rate=spawn_rate)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    returncode, peak_share = _run_and_sample(command, env, prefix.with_name(prefix.name + ".log"),
                                             within_s=duration_s + 60)
    wall_s = time.monotonic() - started
    if returncode not in (0, 1):  # 1: some requests failed, counted below; anything else: Locust itself
        log(f"locust exited with {returncode}; see {prefix.name}.log in the working folder")
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # RUSAGE_CHILDREN grows only when a child is reaped: between the two reads, only Locust was.
    locust_cpu_s = (children_after.ru_utime - children_before.ru_utime) + (
        children_after.ru_stime - children_before.ru_stime)
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    stats = parse_locust_stats(prefix)
    return dataclasses.replace(
        stats,
        # Over the run time, not Locust's "first to last request", which says little for a few requests.
        rps=stats.requests / duration_s,
        locust_exit_code=returncode, locust_wall_s=wall_s, locust_cpu_s=locust_cpu_s,
        locust_cpu_share=locust_cpu_s / wall_s if wall_s else 0.0, locust_peak_share=peak_share,
        **{name: summary[name] for name in SUMMARY_FIELDS if name in summary})


def _run_and_sample(command: list[str], env: dict[str, str], log_path: Path, *, within_s: float) -> tuple[int, float]:
    """Run Locust to its end; its exit code and its busiest second's share of a core."""
    started = time.monotonic()
    with open(log_path, "wb") as output:
        proc = psutil.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
        peak_share = 0.0
        try:
            proc.cpu_percent()
            while proc.poll() is None and time.monotonic() - started < within_s:
                time.sleep(1.0)  # sampling Locust's CPU once a second
                try:
                    peak_share = max(peak_share, proc.cpu_percent() / 100)
                except psutil.NoSuchProcess:
                    break
            if proc.poll() is None:
                proc.terminate()  # past its run time and a minute's grace: let it write its stats
            return proc.wait(30), peak_share
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def parse_locust_stats(prefix: Path) -> LoadStats:
    """Percentiles from the Aggregated row of <prefix>_stats.csv; counts and mean from the JSON.

    Locust rewrites the CSV once a second, so it may miss the last second's requests; the
    JSON file is written once, at exit, with every request counted.
    """
    stats: dict[str, Any] = {}
    csv_path = Path(f"{prefix}_stats.csv")
    if csv_path.exists():
        with open(csv_path, newline="") as file:
            for row in csv.DictReader(file):
                if row["Name"] == "Aggregated":
                    stats.update(
                        requests=int(row["Request Count"]), failures=int(row["Failure Count"]),
                        mean_ms=float(row["Average Response Time"]), p50_ms=_number(row["50%"]),
                        p95_ms=_number(row["95%"]), p99_ms=_number(row["99%"]), max_ms=_number(row["100%"]))
    json_path = Path(f"{prefix}.json")
    if json_path.exists():
        entries = json.loads(json_path.read_text())
        stats["requests"] = sum(entry["num_requests"] for entry in entries)
        stats["failures"] = sum(entry["num_failures"] for entry in entries)
        if stats["requests"]:
            stats["mean_ms"] = sum(entry["total_response_time"] for entry in entries) / stats["requests"]
    return LoadStats(**stats)


def _number(text: str) -> float | None:
    return None if text in ("", "N/A") else float(text)
