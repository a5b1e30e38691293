"""Variable-length inputs under load: padding off, padded to the longest, and length buckets, in one run.

A text-classifier-like model built from seeds (scripts/text_model.py): Embedding(2000, 64,
mask_zero) → Dense(256) per token → masked average pooling → Dense(3), with per-token scores as a
second output. For each mode a real Gunicorn server (one worker, MAX_BATCH_SIZE=32) is loaded by
wrk, a closed loop of connections that each send one row at a time, its length log-normal (median 40) clipped to
8-256 tokens. Waste is padded ÷ real input elements, from the server's
`model_server_length_padding_*_elements_total` counters. wrk runs on the server's cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import requests

from . import common
from .common import DOCS, Config, Server, log, markdown_table, metric_totals, run_child, run_scenario
from .load import run_wrk

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


def run_mode(model_path: Path, env: dict[str, str], *, clients: int, seconds: float, work_dir: Path,
             log_path: Path) -> dict:
    from scripts.text_model import token_rows

    server = Server(Config("variable-length", 1, {"MAX_BATCH_SIZE": "32", **env}, "one worker"),
                    model_path=str(model_path), log_path=log_path)
    with server.running():
        url = server.url + "/v1/models/default:predict"
        bodies = [json.dumps({"instances": token_rows(int(n), seed=i, vocab=VOCAB).tolist()})
                  for i, n in enumerate(lengths(4096, seed=0))]
        (work_dir / "bodies.json").write_text("\n".join(bodies) + "\n")
        for body in bodies[:8]:  # the first answers, before the clock starts
            requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60).raise_for_status()
        before, _ = metric_totals(requests.get(server.url + "/metrics", timeout=30).text)
        load, _ = run_wrk(url, work_dir / "bodies.json", duration_s=seconds, threads=1, connections=clients)
        after, _ = metric_totals(requests.get(server.url + "/metrics", timeout=30).text)
        calls, real, padded = (after.get(name, 0.0) - before.get(name, 0.0) for name in (CALLS, REAL, PADDED))
    return {"requests": load.requests, "errors": load.errors, "rps": load.rps, "p50": load.p50_ms, "p99": load.p99_ms,
            "per_call": load.requests / calls if calls else float("nan"), "waste": padded / real if real else None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=20, help="seconds of load per mode (default 20)")
    parser.add_argument("--clients", type=int, default=16, help="wrk's connections (default 16)")
    common.add_page_arguments(parser, PAGE)


def run(args: argparse.Namespace) -> int:
    def measure_all(work_dir: Path, machine: dict[str, str]) -> tuple[list[str], bool]:
        model_path = work_dir / "text.keras"
        run_child("scripts.benchmark.variable_length:save_text_model", work_dir / "build.log", path=str(model_path))
        results = {}
        for number, (mode, env) in enumerate(MODES.items()):
            results[mode] = run_mode(model_path, env, clients=args.clients, seconds=args.seconds, work_dir=work_dir,
                                     log_path=work_dir / f"gunicorn-mode{number}.log")
            log(f"{mode}: {results[mode]}")
        rows = [(mode, f"{r['rps']:.1f}", f"{r['p50']:.0f}", f"{r['p99']:.0f}", f"{r['per_call']:.1f}",
                 "–" if r["waste"] is None else f"{r['waste']:.2f}", r["requests"], r["errors"] or 0)
                for mode, r in results.items()]
        return [__doc__.split("\n\n", 1)[1].replace("\n", " ").strip(), "",
                *markdown_table(("mode", "requests/s", "p50 ms", "p99 ms", "requests per call", "waste", "requests",
                                 "errors"), rows)], any(r["errors"] for r in results.values())

    return run_scenario(args, "Variable-length inputs: benchmark", measure_all)
