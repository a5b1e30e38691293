"""Variable-length inputs under load: padding off, padded to the longest, and length buckets, in one run.

A text-classifier-like model built from seeds (scripts/text_model.py): Embedding(2000, 64,
mask_zero) → Dense(256) per token → masked average pooling → Dense(3), with per-token scores as a
second output. For each mode a real Gunicorn server (one worker, MAX_BATCH_SIZE=32) is loaded by
closed-loop clients that each send one row at a time, its length log-normal (median 40) clipped to
8-256 tokens. Waste is padded ÷ real input elements, from the server's
`model_server_length_padding_*_elements_total` counters. The clients run on the server's cores.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np
import requests

from scripts.live_server import LiveServer

from .common import DOCS, log, markdown_table, metric_sum, run_child, run_scenario

PAGE = DOCS / "variable-length-benchmark.md"
VOCAB = 2000
MIN_LENGTH, MAX_LENGTH = 8, 256
MODES = {
    "padding off": {"PAD_VARIABLE_LENGTH": "false"},
    "padded to the longest": {"PAD_VARIABLE_LENGTH": "true", "LENGTH_BUCKETS": ""},
    "length buckets 16,32,64,128,256": {"PAD_VARIABLE_LENGTH": "true", "LENGTH_BUCKETS": "16,32,64,128,256"},
}
CALLS = "model_server_batch_size_requests_count"
REAL = "model_server_length_padding_real_elements_total"
PADDED = "model_server_length_padding_padded_elements_total"


def lengths(count: int, seed: int) -> np.ndarray:
    """Token counts as texts have them: most short, a long tail (median about 40)."""
    drawn = np.random.default_rng(seed).lognormal(mean=np.log(40), sigma=0.8, size=count)
    return np.clip(drawn.astype(int), MIN_LENGTH, MAX_LENGTH)


def save_text_model(path: str) -> None:
    from scripts.text_model import build_text_model

    build_text_model(vocab=VOCAB, width=64, hidden=256).save(path)


def closed_loop(url: str, bodies: list[dict], *, clients: int, seconds: float) -> tuple[list[float], int, float]:
    """`clients` threads posting bodies back to back; latencies of the answered, errors, elapsed seconds."""
    latencies: list[float] = []
    errors = [0]
    stop_at = time.monotonic() + seconds

    def client(index: int) -> None:
        with requests.Session() as session:
            position = index
            while time.monotonic() < stop_at:
                started = time.perf_counter()
                answer = session.post(url, json=bodies[position % len(bodies)], timeout=60)
                position += clients
                if answer.status_code == 200:
                    latencies.append(time.perf_counter() - started)
                else:
                    errors[0] += 1

    threads = [threading.Thread(target=client, args=(index,)) for index in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, errors[0], time.monotonic() - started


def run_mode(model_path: Path, env: dict[str, str], *, clients: int, seconds: float, log_dir: Path) -> dict:
    from scripts.text_model import token_rows

    server = LiveServer(log_dir, {"MODEL_PATH": str(model_path), "MAX_BATCH_SIZE": "32", **env}).start(workers=1)
    try:
        url = server.url + "/v1/models/default:predict"
        bodies = [{"instances": token_rows(int(n), seed=i, vocab=VOCAB).tolist()}
                  for i, n in enumerate(lengths(4096, seed=0))]
        for body in bodies[:8]:  # the first answers, before the clock starts
            requests.post(url, json=body, timeout=60).raise_for_status()
        before = {name: metric_sum(server.url, name) for name in (CALLS, REAL, PADDED)}
        latencies, errors, elapsed = closed_loop(url, bodies, clients=clients, seconds=seconds)
        calls, real, padded = (metric_sum(server.url, name) - before[name] for name in (CALLS, REAL, PADDED))
    finally:
        server.stop()
    milliseconds = np.array(latencies) * 1000
    return {"requests": len(latencies), "errors": errors, "rps": len(latencies) / elapsed,
            "p50": float(np.percentile(milliseconds, 50)), "p99": float(np.percentile(milliseconds, 99)),
            "per_call": len(latencies) / calls if calls else float("nan"), "waste": padded / real if real else None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=20, help="seconds of load per mode (default 20)")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients (default 16)")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write (default %(default)s)")
    parser.add_argument("--work-dir", type=Path)


def run(args: argparse.Namespace) -> int:
    def measure_all(work_dir: Path, machine: dict[str, str]) -> tuple[list[str], bool]:
        model_path = work_dir / "text.keras"
        run_child("scripts.benchmark.variable_length:save_text_model", work_dir / "build.log", path=str(model_path))
        results = {}
        for mode, env in MODES.items():
            results[mode] = run_mode(model_path, env, clients=args.clients, seconds=args.seconds, log_dir=work_dir)
            log(f"{mode}: {results[mode]}")
        rows = [(mode, f"{r['rps']:.1f}", f"{r['p50']:.0f}", f"{r['p99']:.0f}", f"{r['per_call']:.1f}",
                 "–" if r["waste"] is None else f"{r['waste']:.2f}", r["requests"], r["errors"])
                for mode, r in results.items()]
        return [__doc__.split("\n\n", 1)[1].replace("\n", " ").strip(), "",
                *markdown_table(("mode", "requests/s", "p50 ms", "p99 ms", "requests per call", "waste", "requests",
                                 "errors"), rows)], any(r["errors"] for r in results.values())

    return run_scenario(args, "Variable-length inputs: benchmark", measure_all)
