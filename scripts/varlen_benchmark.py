"""Variable-length inputs under load: padding off, padded to the longest, and length buckets, in one run.

    python scripts/varlen_benchmark.py --seconds 20 --clients 16 --out docs/variable-length-benchmark.md

Builds a text-classifier-like model from seeds (scripts/text_model.py), then for each mode
starts a real Gunicorn server (one worker) and runs closed-loop clients that each send one
request of one row at a time, its length drawn from a log-normal spread clipped to 8-256
tokens. Reports requests/s, p50/p99 latency, requests per predict call, and the padding waste
(padded ÷ real input elements) from the server's own metrics.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.live_server import LiveServer  # noqa: E402
from scripts.text_model import build_text_model, token_rows  # noqa: E402

VOCAB = 2000
MIN_LENGTH, MAX_LENGTH = 8, 256
MODES = {
    "padding off": {"PAD_VARIABLE_LENGTH": "false"},
    "padded to the longest": {"PAD_VARIABLE_LENGTH": "true", "LENGTH_BUCKETS": ""},
    "length buckets 16,32,64,128,256": {"PAD_VARIABLE_LENGTH": "true", "LENGTH_BUCKETS": "16,32,64,128,256"},
}


def lengths(count: int, seed: int) -> np.ndarray:
    """Token counts as texts have them: most short, a long tail (median about 40)."""
    drawn = np.random.default_rng(seed).lognormal(mean=np.log(40), sigma=0.8, size=count)
    return np.clip(drawn.astype(int), MIN_LENGTH, MAX_LENGTH)


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def run_mode(model_path: Path, env: dict[str, str], *, clients: int, seconds: float, log_dir: Path) -> dict:
    server = LiveServer(log_dir, {"MODEL_PATH": str(model_path), "MAX_BATCH_SIZE": "32", **env})
    server.start(workers=1)
    try:
        url = server.url + "/v1/models/default:predict"
        bodies = [{"instances": token_rows(int(n), seed=i, vocab=VOCAB).tolist()}
                  for i, n in enumerate(lengths(4096, seed=0))]
        for body in bodies[:8]:  # the connection pool and the first answers, before the clock starts
            requests.post(url, json=body, timeout=60).raise_for_status()
        calls_before = metric(server.url, "model_server_batch_size_requests_count")
        real_before = metric(server.url, "model_server_length_padding_real_elements_total")
        padded_before = metric(server.url, "model_server_length_padding_padded_elements_total")
        latencies: list[float] = []
        errors: list[str] = []
        stop_at = time.monotonic() + seconds

        def client(index: int) -> None:
            session = requests.Session()
            position = index
            while time.monotonic() < stop_at:
                body = bodies[position % len(bodies)]
                position += clients
                started = time.perf_counter()
                response = session.post(url, json=body, timeout=60)
                if response.status_code != 200:
                    errors.append(response.text[:200])
                    continue
                latencies.append(time.perf_counter() - started)

        threads = [threading.Thread(target=client, args=(index,)) for index in range(clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        calls = metric(server.url, "model_server_batch_size_requests_count") - calls_before
        real = metric(server.url, "model_server_length_padding_real_elements_total") - real_before
        padded = metric(server.url, "model_server_length_padding_padded_elements_total") - padded_before
    finally:
        server.stop()
    milliseconds = np.array(latencies) * 1000
    return {"requests": len(latencies), "errors": len(errors), "rps": len(latencies) / elapsed,
            "p50": float(np.percentile(milliseconds, 50)), "p99": float(np.percentile(milliseconds, 99)),
            "per_call": len(latencies) / calls if calls else float("nan"),
            "waste": padded / real if real else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="write the results as a Markdown page here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_path = Path(scratch) / "text.keras"
        build_text_model(vocab=VOCAB, width=64, hidden=256).save(model_path)
        results = {}
        for mode, env in MODES.items():
            results[mode] = run_mode(model_path, env, clients=args.clients, seconds=args.seconds,
                                     log_dir=Path(scratch))
            print(mode, results[mode], flush=True)
    rows = [f"| {mode} | {r['rps']:.1f} | {r['p50']:.0f} | {r['p99']:.0f} | {r['per_call']:.1f} | "
            f"{r['waste']:.2f} | {r['requests']} | {r['errors']} |" if mode != "padding off" else
            f"| {mode} | {r['rps']:.1f} | {r['p50']:.0f} | {r['p99']:.0f} | {r['per_call']:.1f} | – "
            f"| {r['requests']} | {r['errors']} |" for mode, r in results.items()]
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs seen, Python {platform.python_version()}"
    page = "\n".join([
        "# Variable-length inputs: benchmark",
        "",
        "<!-- Written by `python scripts/varlen_benchmark.py`; rerun it rather than edit the table. -->",
        "",
        f"One run of `python scripts/varlen_benchmark.py --seconds {args.seconds:g} --clients {args.clients}` "
        f"({machine}). The model is a text classifier built from seeds: Embedding({VOCAB}, 64, mask_zero) "
        "→ Dense(256) per token → masked average pooling → Dense(3), with per-token scores as a second "
        "output. One Gunicorn worker, `MAX_BATCH_SIZE=32`, `BATCH_TIMEOUT_MS=0`. Closed-loop clients send "
        f"one row each, its length log-normal (median 40) clipped to {MIN_LENGTH}-{MAX_LENGTH} tokens.",
        "Waste is padded ÷ real input elements, from the server's "
        "`model_server_length_padding_*_elements_total` counters. The clients run on the same CPUs as "
        "the server, and the machine may be shared: compare the rows of one run with each other.",
        "",
        "| mode | requests/s | p50 ms | p99 ms | requests per call | waste | requests | errors |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    if args.out:
        args.out.write_text(page)
    print(page)


if __name__ == "__main__":
    main()
