"""The image example under load beside LitServe and PyTriton, and the physical limit: the handler scenario.

The image example (examples/image_classifier/: Pillow decodes a JPEG and resizes it to 224 × 224, a
small Keras CNN scores it, the top 5 labels and scores come back) under wrk in a closed loop: 16
camera-like photos in turn (examples/image_classifier/photos.py) as TF Serving REST `{"b64": ...}` (b64) or as
a v2 binary BYTES tensor (bytes; PyTriton's of shape [1, 1]). LitServe (scripts/litserve_server.py: its
batching API, max batch 32, its default batch_timeout 0) and PyTriton (scripts/pytriton_server.py
--photos) run the same decode, model and top 5. Every server's answers to the 16 photos are checked
against the model's own first. CPU is the server's whole process tree's. The limit: usable cores ÷ the
CPU time of one decode and resize, measured alone before any server starts.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import requests

from . import common, layouts
from .common import DOCS, REPO, Config, Server, fmt, log, markdown_table, mean, run_child
from .layouts import Measured
from .load import run_wrk, write_listing

PAGE = DOCS / "handler-benchmark.md"
LITSERVE_PYTHON = REPO / ".venv-litserve" / "bin" / "python"
LITSERVE_SCRIPT = REPO / "scripts" / "litserve_server.py"
HANDLER = "examples.image_classifier.handler"
MODEL = "default"
PHOTOS = 16
# Issue 56's targets on a 2-core machine: this server's best layout over each of these.
TARGETS = (("LitServe's better layout", 1.2), ("PyTriton", 1.0), ("the limit", 0.8))
PROTOCOLS = ("b64", "bytes", "bytes-triton")  # TF Serving REST {"b64"}; v2 binary BYTES of shape [1], [1, 1]


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    what: str
    protocol: str  # one of PROTOCOLS
    workers: int = 0  # this server: Gunicorn workers, 0 for its default; LitServe: inference processes
    model_processes: int = 0
    in_full_run: bool = True

    @property
    def peer(self) -> str | None:
        return next((peer for peer in ("litserve", "pytriton") if self.name.startswith(peer)), None)


LAYOUTS = [
    Layout("default-b64", "default", "b64"),
    Layout("default-bytes", "default", "bytes"),
    Layout("procs-2w-b64", "MODEL_PROCESSES=1, 2 workers", "b64", 2, 1),
    Layout("procs-2w-bytes", "MODEL_PROCESSES=1, 2 workers", "bytes", 2, 1),
    # On 2 cores the default is 1 worker, whose request threads share one GIL: a model per worker
    # is what a CPU-bound decode needs there, and LitServe's 2-worker layout is its counterpart.
    Layout("default-2w-bytes", "2 workers, a model each", "bytes", 2),
    Layout("litserve-1", "LitServe, 1 worker", "b64", 1),
    Layout("litserve-2", "LitServe, 2 workers", "b64", 2),
    Layout("pytriton", "PyTriton", "bytes-triton"),
    Layout("procs-1w-bytes", "MODEL_PROCESSES=1, 1 worker", "bytes", 1, 1, in_full_run=False),
]
LAYOUTS_BY_NAME = {layout.name: layout for layout in LAYOUTS}


def alive(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


def survivors(processes: Sequence[psutil.Process], within_s: float) -> list[psutil.Process]:
    """Those of `processes` still alive after up to `within_s`: not all are ours to wait on, so poll."""
    deadline = time.monotonic() + within_s
    while any(alive(process) for process in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [process for process in processes if alive(process)]


class LitServeServer(layouts.PeerServer):
    """scripts/litserve_server.py on a free loopback port, in a process group of its own; ready once /health
    answers 200 (every inference worker set up)."""

    ready_path = "/health"
    own_group = True

    def __init__(self, *, python: Path, model_path: str, log_path: Path, name: str, workers: int) -> None:
        super().__init__(Config(name, workers, {}, "LitServe"), model_path=model_path, log_path=log_path)
        self.python, self.model_path = python, model_path

    def command(self, *, workers: int = 1) -> list[str]:
        return [str(self.python), str(LITSERVE_SCRIPT), "--model-path", self.model_path, "--port", str(self.port),
                "--workers", str(workers), "--max-batch-size", "32"]

    def stop(self, *, signum: int = signal.SIGTERM, within_s: float = 10) -> int:
        """Signal the whole group at once, and SIGKILL it past `within_s`: LitServe's spawned inference workers,
        Manager and forked API servers do not stop with its main process (SIGTERM to it alone left processes
        running 30 s later)."""
        if self.proc is None:
            return 0
        try:
            processes = self.processes()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)
            if left := survivors(processes, within_s):
                log(f"{self.config.name}: {len(left)} processes left {within_s:g} s after the signal; killed")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                survivors(left, 10)  # gone before the next server starts
            return self.proc.wait()
        finally:
            if self._log is not None:
                self._log.close()


class PhotoTritonServer(layouts.PyTritonServer):
    def command(self, *, workers: int = 1) -> list[str]:
        return [*super().command(workers=workers), "--photos"]


def layout_server(layout: Layout, args: argparse.Namespace, model_path: str, log_path: Path) -> Server:
    if layout.peer == "litserve":
        return LitServeServer(python=args.litserve_python, model_path=model_path, log_path=log_path,
                              name=layout.name, workers=layout.workers)
    if layout.peer == "pytriton":
        return PhotoTritonServer(python=args.pytriton_python, model_path=model_path, log_path=log_path,
                                 name=layout.name)
    env = {"MODEL_HANDLER": HANDLER, "GRPC_BIND": ""}
    env |= {"MODEL_PROCESSES": str(layout.model_processes)} if layout.model_processes else {}
    return Server(Config(layout.name, workers_of(layout), env, described(layout)), model_path=model_path,
                  log_path=log_path)


def workers_of(layout: Layout) -> int:
    from app.ops.runtime import default_workers, usable_cpus

    return layout.workers or default_workers(usable_cpus().count)


def described(layout: Layout) -> str:
    """What a layout is, its worker count named where it is this server's default for the machine."""
    if layout.workers or layout.peer:
        return layout.what
    count = workers_of(layout)
    return f"{layout.what} ({count} worker{'s' if count > 1 else ''})"


def url_of(layout: Layout, server: Server) -> str:
    if layout.peer == "litserve":
        return server.url + "/predict"
    return server.url + (f"/v1/models/{MODEL}:predict" if layout.protocol == "b64" else f"/v2/models/{MODEL}/infer")


# ---------------------------------------------------------------- bodies and answers


def b64_body(jpeg: bytes) -> bytes:
    """One photo as TF Serving REST's row format takes bytes (LitServe's script takes the same)."""
    return json.dumps({"instances": [{"b64": base64.b64encode(jpeg).decode()}]}).encode()


def bytes_body(jpeg: bytes, *, shape: Sequence[int] = (1,)) -> tuple[bytes, dict[str, str]]:
    """One photo as a v2 binary request, a BYTES element (4-byte little-endian length, then the bytes), and its
    headers. PyTriton's BYTES input has the per-row shape [1] (Triton's dims may not be empty): shape [1, 1]."""
    element = len(jpeg).to_bytes(4, "little") + jpeg
    header = json.dumps({"inputs": [{"name": "image_bytes", "shape": list(shape), "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(element)}}]}).encode()
    return header + element, {"Content-Type": "application/octet-stream",
                              "Inference-Header-Content-Length": str(len(header))}


def bodies_of(protocol: str, jpegs: Sequence[bytes]) -> list[tuple[bytes, dict[str, str]]]:
    if protocol == "b64":
        return [(b64_body(jpeg), {"Content-Type": "application/json"}) for jpeg in jpegs]
    return [bytes_body(jpeg, shape=(1, 1) if protocol == "bytes-triton" else (1,)) for jpeg in jpegs]


def flat(values: Any) -> list[Any]:
    return [item for value in values for item in (flat(value) if isinstance(value, list) else [value])]


def top_of(protocol: str, answer: dict[str, Any]) -> tuple[list[str], list[float]]:
    """The labels and scores of a one-photo answer: TF Serving's row format, or v2's outputs."""
    if protocol == "b64":
        (prediction,) = answer["predictions"]
        labels, scores = prediction["labels"], prediction["scores"]
    else:
        outputs = {output["name"]: output for output in answer["outputs"]}
        labels, scores = flat(outputs["labels"]["data"]), flat(outputs["scores"]["data"])
    # TF Serving's REST answers bytes that are not UTF-8 as {"b64": ...}.
    return [base64.b64decode(label["b64"]).decode() if isinstance(label, dict) else label for label in labels], scores


def difference(protocol: str, answer: dict[str, Any], expected: dict[str, Any]) -> float:
    """How far an answer's scores are from the model's own top 5; a RuntimeError when its labels differ."""
    labels, scores = top_of(protocol, answer)
    if labels != expected["labels"] or len(scores) != len(expected["scores"]):
        raise RuntimeError(f"check request: answered {labels} {scores}, the model's own {expected['labels']} "
                           f"{expected['scores']}")
    return float(np.max(np.abs(np.asarray(scores, np.float32) - np.asarray(expected["scores"], np.float32))))


def check_answers(protocol: str, url: str, bodies: Sequence[tuple[bytes, dict[str, str]]],
                  expected: Sequence[dict[str, Any]]) -> float:
    """Each body sent once, as the load sends it; the largest score difference from the model's own (0: exact).
    Labels must be equal and scores within 1e-6."""
    largest = 0.0
    for (body, headers), wanted in zip(bodies, expected, strict=True):
        answer = requests.post(url, data=body, headers=headers, timeout=60)
        if answer.status_code != 200:
            raise RuntimeError(f"check request: {answer.status_code} {answer.text[:500]}")
        largest = max(largest, difference(protocol, answer.json(), wanted))
    if largest > 1e-6:
        raise RuntimeError(f"check request: scores differ from the model's by up to {largest:g}")
    return largest


# ---------------------------------------------------------------- in children: the model, the limit


def build(folder: str, count: int) -> None:
    """The photos, the saved model, its own answer to each photo (one at a time, as the checks send them), and
    its CPU time per photo in batches of 32 (as under load) into build.json."""
    import keras

    from examples.image_classifier import handler, photos
    from examples.image_classifier import model as example

    work = Path(folder)
    sizes = photos.make(work / "photos", count)
    example.build().save(work / "classifier.keras")
    model = keras.models.load_model(work / "classifier.keras", compile=False)  # as every server loads it
    expected = []
    for path in sorted((work / "photos").glob("*.jpg")):
        probabilities = keras.ops.convert_to_numpy(model(handler.decode(path.read_bytes())[None], training=False))
        answer = handler.postprocess({"probabilities": probabilities}, {}, {})
        expected.append({"labels": [label.decode() for label in answer["labels"][0]],
                         "scores": answer["scores"][0].tolist()})
    batch = np.stack([handler.decode(path.read_bytes()) for path in sorted((work / "photos").glob("*.jpg"))] * 2)
    cpu = []
    for _ in range(23):
        started = time.process_time()
        model.predict_on_batch(batch[:32])
        cpu.append(time.process_time() - started)
    model_ms = statistics.median(cpu[3:]) / 32 * 1000  # the first calls compile
    (work / "build.json").write_text(json.dumps({"sizes": sizes, "expected": expected, "model_cpu_ms": model_ms}))


def decode_for(jpegs: list[bytes], seconds: float, start: float) -> tuple[int, float]:
    """Photos decoded in turn from `start` (a shared monotonic instant) for `seconds`; (count, CPU seconds)."""
    from examples.image_classifier.handler import decode

    while time.monotonic() < start:
        time.sleep(0.001)  # the processes start together
    cpu, count, end = time.process_time(), 0, start + seconds
    while time.monotonic() < end:
        decode(jpegs[count % len(jpegs)])
        count += 1
    return count, time.process_time() - cpu


def decode_limit(folder: str, seconds: float) -> None:
    """The handler's own decode (Pillow: JPEG decode, RGB, bilinear resize to 224 × 224) over the photos in turn,
    in one process with nothing of this run beside it, then in one process per usable CPU at once; limit.json."""
    from app.ops.runtime import usable_cpus
    from examples.image_classifier.handler import decode

    jpegs = [path.read_bytes() for path in sorted((Path(folder) / "photos").glob("*.jpg"))]
    for jpeg in jpegs:
        decode(jpeg)  # first calls (imports, plug-in registration) out of the clock
    cores = usable_cpus().count
    count, cpu_s = decode_for(jpegs, seconds, time.monotonic())
    start = time.monotonic() + 1.0
    with multiprocessing.get_context("fork").Pool(cores) as pool:
        together = sum(done for done, _ in pool.starmap(decode_for, [(jpegs, seconds, start)] * cores))
    (Path(folder) / "limit.json").write_text(json.dumps({
        "cores": cores, "cpu_ms": cpu_s / count * 1000, "wall_ms": seconds / count * 1000,
        "together_per_s": together / seconds}))


# ---------------------------------------------------------------- one layout


def measure(layout: Layout, server: Server, result: Measured, *, bodies: Path, checks: Sequence[tuple[bytes, dict]],
            expected: Sequence[dict[str, Any]], args: argparse.Namespace, work_dir: Path, tag: str) -> Measured:
    """Start, check every photo's answer, warm, load and stop one server."""
    url = url_of(layout, server)

    def load_it(duration_s: float, log_path: Path | None = None) -> tuple[Any, float]:
        return run_wrk(url, bodies, duration_s=duration_s, threads=args.wrk_threads, connections=args.connections,
                       log_path=log_path, listing=layout.protocol != "b64")
    try:
        server.start(workers=server.config.workers, ready_within_s=args.server_start_timeout)
        result.check_difference = check_answers(layout.protocol, url, checks, expected)
        # LitServe's idle inference workers poll its queue without pause: it is never idle.
        load, _, _ = layouts.closed_loop(server, result, load_it, warmup_s=args.warmup, duration_s=args.duration,
                                         tag=tag, work_dir=work_dir, quiet=layout.peer != "litserve")
        if load.errors:
            raise RuntimeError(f"refused: {load.errors} in {load.requests} requests")
    except Exception as exc:  # one layout failing should not lose the others' numbers
        result.error = common.failure(exc, server)
        log(f"{tag}: {result.error}")
    finally:
        server.stop()
    return result


# ---------------------------------------------------------------- the page


@dataclasses.dataclass(frozen=True)
class Limit:
    cores: int
    cpu_ms: float  # one decode and resize, CPU time, one process alone
    wall_ms: float
    together_per_s: float  # photos a second, one process per core at once
    model_cpu_ms: float  # the model's CPU time per photo at batch 32

    @property
    def per_s(self) -> float:
        return self.cores / self.cpu_ms * 1000


def table(results: Sequence[Measured], chosen: Sequence[Layout], rounds: int, limit: Limit) -> list[str]:
    """The mean of the rounds per layout, with its ratios to LitServe's better layout, PyTriton and the limit;
    then the targets met or missed by this server's best layout, and every round's req/s."""
    def average(name: str, field: str) -> float | None:
        return mean(getattr(r, field) for r in results if r.layout == name and r.error is None)

    rps = {layout.name: average(layout.name, "rps") for layout in chosen}
    litserve = max((value for name, value in rps.items() if value and LAYOUTS_BY_NAME[name].peer == "litserve"),
                   default=None)
    pytriton = rps.get("pytriton")
    rows = [(f"`{layout.name}`: {described(layout)}", fmt(rps[layout.name]),
             common.ratio(rps[layout.name], litserve, 2), common.ratio(rps[layout.name], pytriton, 2),
             f"{rps[layout.name] / limit.per_s:.0%}" if rps[layout.name] else "–",
             fmt(average(layout.name, "p50_ms")), fmt(average(layout.name, "p99_ms")),
             fmt(average(layout.name, "cpu_ms_per_request"), 2), fmt(average(layout.name, "rss_mib"), 0),
             fmt(average(layout.name, "batch_rows"))) for layout in chosen]
    lines = [f"Means of {rounds} round{'s' if rounds > 1 else ''}.", "", *markdown_table(
        ("layout", "req/s", "÷ LitServe best", "÷ PyTriton", "of limit", "p50 ms", "p99 ms", "CPU ms/req", "RSS MiB",
         "batch rows"), rows)]
    ours = {name: value for name, value in rps.items() if value and not LAYOUTS_BY_NAME[name].peer}
    if ours:
        best = max(ours, key=lambda name: ours[name])
        got = [(what, ours[best] / base if base else None, target)
               for (what, target), base in zip(TARGETS, (litserve, pytriton, limit.per_s), strict=True)]
        lines += ["", f"Targets (issue 56), this server's best, `{best}`: " + "; ".join(
            target_text(what, value, target) for what, value, target in got) + "."]
    lines += ["", "Every round's req/s: " + "; ".join(
        f"`{layout.name}` " + ", ".join(fmt(r.rps) if r.error is None else "failed"
                                        for r in results if r.layout == layout.name) for layout in chosen) + "."]
    return lines + [f"- `{r.layout}`, round {r.round}: {r.error}" for r in results if r.error]


def target_text(what: str, value: float | None, target: float) -> str:
    if what == "the limit":
        wanted, reached = f"≥ {target:.0%} of the limit", f"{value or 0:.0%}"
    else:
        wanted, reached = f"≥ {target:g}× {what}", f"{value or 0:.2f}×"
    return f"{wanted}: –" if value is None else f"{wanted}: {reached}, {'met' if value >= target else 'missed'}"


def page_body(results: Sequence[Measured], chosen: Sequence[Layout], args: argparse.Namespace, limit: Limit,
              sizes: Sequence[int]) -> list[str]:
    intro = __doc__.split("\n\n", 1)[1].replace("\n", " ").strip()
    lines = [intro, "", f"wrk: {args.connections} connections, {args.wrk_threads} thread(s), {args.duration:g} s "
             f"after {args.warmup:g} s of warm-up; photos of {min(sizes):,}–{max(sizes):,} bytes (mean "
             f"{sum(sizes) / len(sizes):,.0f}).", "", *table(results, chosen, args.rounds, limit), "",
             f"The limit: {limit.cores} cores ÷ {limit.cpu_ms:.2f} ms of CPU a photo = {limit.per_s:,.0f} req/s "
             f"(wall ÷ CPU {limit.wall_ms / limit.cpu_ms:.2f}; {limit.cores} processes at once: "
             f"{limit.together_per_s:,.0f} photos/s). The model adds {limit.model_cpu_ms:.2f} ms of CPU a photo at "
             f"batch 32: {limit.cores / (limit.cpu_ms + limit.model_cpu_ms) * 1000:,.0f} req/s with it."]
    wrk = [r.wrk_cores for r in results if r.wrk_cores is not None]
    others = [r.other_cores for r in results if r.other_cores is not None]
    if wrk and others:
        lines += [f"wrk used {min(wrk):.2f}–{max(wrk):.2f} of a core; other processes on the machine "
                  f"{min(others):.2f}–{max(others):.2f}."]
    if differences := [r.check_difference for r in results if r.check_difference is not None]:
        lines += [f"Answers checked: largest score difference {max(differences):g} over {len(differences)} servers."]
    return lines + ["", "LitServe and PyTriton run from virtualenvs of their own, .venv-litserve and .venv-pytriton, "
                    "made from requirements-litserve.lock and requirements-pytriton.lock as in "
                    "[peers](peers-benchmark.md#reproduce)."]


# ---------------------------------------------------------------- the scenario


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    default = [layout.name for layout in LAYOUTS if layout.in_full_run]
    add("--duration", type=float, default=30, help="seconds of load per layout (default 30)")
    add("--warmup", type=float, default=3, help="seconds of unmeasured load first (default 3)")
    add("--rounds", type=int, default=2, help="runs of every layout, order alternating (default 2)")
    add("--layouts", type=common.names(list(LAYOUTS_BY_NAME)), default=default,
        help=f"comma-separated, of {', '.join(LAYOUTS_BY_NAME)} (default {','.join(default)})")
    add("--connections", type=int, default=32, help="wrk's connections (default 32)")
    add("--wrk-threads", type=int, default=1, help="wrk's threads (default 1)")
    add("--limit-seconds", type=float, default=10, help="seconds of decoding for the limit, each way (default 10)")
    add("--litserve-python", type=Path, default=LITSERVE_PYTHON, help="the Python of LitServe's own virtualenv")
    add("--pytriton-python", type=Path, default=layouts.PYTRITON_PYTHON, help="the Python of PyTriton's own "
        "virtualenv")
    add("--server-start-timeout", type=float, default=300)
    common.add_page_arguments(parser, PAGE)


def peer_version(python: Path, package: str) -> str:
    done = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                          capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or "not found"


def run(args: argparse.Namespace) -> int:
    for peer, python in (("litserve", args.litserve_python), ("pytriton", args.pytriton_python)):
        if any(LAYOUTS_BY_NAME[name].peer == peer for name in args.layouts) and not python.exists():
            raise SystemExit(f"{python} is missing: make it, or leave the {peer} layouts out of --layouts")
    return common.run_scenario(args, "The image handler beside LitServe and PyTriton",
                               lambda work_dir, machine: measure_all(args, work_dir, machine))


def measure_all(args: argparse.Namespace, work_dir: Path, machine: dict[str, str]) -> tuple[list[str], bool]:
    chosen = [layout for layout in LAYOUTS if layout.name in args.layouts]
    for name in ("OS", "memory", "locust", "flask"):  # a short page: what bears on these figures
        machine.pop(name, None)
    machine["pillow"] = peer_version(Path(sys.executable), "pillow")
    for peer, python, package in (("litserve", args.litserve_python, "litserve"),
                                  ("pytriton", args.pytriton_python, "nvidia-pytriton")):
        if any(layout.peer == peer for layout in chosen):
            machine[package] = peer_version(python, package)
    machine["wrk"] = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split(" Copyright")[0]
    log("building the photos and the image example's model in a child process")
    run_child("scripts.benchmark.handler:build", work_dir / "build.log", folder=str(work_dir), count=PHOTOS)
    built = json.loads((work_dir / "build.json").read_text())
    log(f"the limit: {args.limit_seconds:g} s of decoding alone, then as many processes as cores")
    run_child("scripts.benchmark.handler:decode_limit", work_dir / "limit.log", folder=str(work_dir),
              seconds=args.limit_seconds)
    limit = Limit(**json.loads((work_dir / "limit.json").read_text()), model_cpu_ms=built["model_cpu_ms"])
    log(f"limit {limit.per_s:.0f} req/s ({limit.cpu_ms:.2f} ms CPU a photo, wall ÷ CPU "
        f"{limit.wall_ms / limit.cpu_ms:.2f})")
    jpegs = [path.read_bytes() for path in sorted((work_dir / "photos").glob("*.jpg"))]
    checks, bodies = {}, {}
    for protocol in {layout.protocol for layout in chosen}:
        checks[protocol] = bodies_of(protocol, jpegs)
        if protocol == "b64":  # one JSON body a line, Content-Type JSON: wrk's lines mode
            bodies[protocol] = work_dir / "b64.body"
            bodies[protocol].write_bytes(b"\n".join(body for body, _ in checks[protocol]) + b"\n")
        else:
            bodies[protocol] = write_listing(work_dir / "bodies", protocol, checks[protocol])
    results: list[Measured] = []
    for number in range(1, args.rounds + 1):
        for layout in chosen if number % 2 else chosen[::-1]:
            tag = f"{layout.name}-round{number}"
            server = layout_server(layout, args, str(work_dir / "classifier.keras"), work_dir / f"{tag}.log")
            results.append(measure(layout, server, Measured("image", layout.name, number),
                                   bodies=bodies[layout.protocol], checks=checks[layout.protocol],
                                   expected=built["expected"], args=args, work_dir=work_dir, tag=tag))
            (work_dir / "results.json").write_text(json.dumps([dataclasses.asdict(r) for r in results]))
    return page_body(results, chosen, args, limit, built["sizes"]), any(r.error for r in results)
