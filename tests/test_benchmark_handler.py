"""The handler scenario's parts: which servers it runs and how, the bodies it sends, the check of every
answer, LitServe's stop, and the page from given results. The scenario itself (TensorFlow servers,
LitServe and PyTriton from virtualenvs of their own, minutes of load) is not run here; the wrk
listing it loads v2 binary bodies with is tested in tests/test_process_bench.py.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import types
from pathlib import Path

import psutil
import pytest

from app.ops.runtime import default_workers, usable_cpus
from scripts.benchmark import common, handler, layouts
from scripts.benchmark.__main__ import parse_args
from tests.test_process_bench import local_server, reply

JPEG = b"\xff\xd8\xff\xe0 not really a photo \n\x00\xff\xd9"
TOP = {"labels": ["milk", "egg", "apple", "bread", "onion"], "scores": [0.5, 0.2, 0.125, 0.1, 0.075]}


def test_the_scenario_runs_this_server_two_ways_and_three_layouts_beside_litserve_and_pytriton():
    args = parse_args(["handler"])
    assert args.layouts == ["default-b64", "default-bytes", "procs-2w-b64", "procs-2w-bytes", "default-2w-bytes",
                            "litserve-1", "litserve-2", "pytriton"]
    assert (args.out, args.litserve_python, args.pytriton_python) == (
        common.DOCS / "handler-benchmark.md", common.REPO / ".venv-litserve/bin/python", layouts.PYTRITON_PYTHON)
    # The page's command names no local folder.
    assert common.without_flags(["handler", "--litserve-python", "/x/py", "--rounds", "1"]) == ["handler", "--rounds",
                                                                                                 "1"]


def test_this_server_serves_the_example_handler_with_its_defaults_but_workers_and_model_processes(tmp_path):
    args = parse_args(["handler"])
    default = handler.layout_server(handler.LAYOUTS_BY_NAME["default-bytes"], args, "c.keras", tmp_path / "d.log")
    assert default.config.workers == default_workers(usable_cpus().count)
    assert (default.env["MODEL_HANDLER"], default.env["MODEL_PATH"], default.env["GRPC_BIND"]) == (
        "examples.image_classifier.handler", "c.keras", "")
    assert "MODEL_PROCESSES" not in default.env and default.config.app == ("wsgi:app",)
    procs = handler.layout_server(handler.LAYOUTS_BY_NAME["procs-2w-b64"], args, "c.keras", tmp_path / "p.log")
    assert (procs.config.workers, procs.env["MODEL_PROCESSES"]) == (2, "1")
    assert handler.url_of(handler.LAYOUTS_BY_NAME["procs-2w-b64"], procs) == procs.url + "/v1/models/default:predict"
    assert handler.url_of(handler.LAYOUTS_BY_NAME["default-bytes"], default) == default.url + "/v2/models/default/infer"


def test_litserve_runs_its_inference_workers_in_a_group_of_its_own_and_pytriton_decodes_photos(tmp_path):
    args = parse_args(["handler", "--litserve-python", "ls/py", "--pytriton-python", "pt/py"])
    litserve = handler.layout_server(handler.LAYOUTS_BY_NAME["litserve-2"], args, "c.keras", tmp_path / "l.log")
    command = litserve.command(workers=litserve.config.workers)
    assert command[:2] == ["ls/py", str(handler.LITSERVE_SCRIPT)]
    assert dict(zip(command[2::2], command[3::2], strict=True)) == {
        "--model-path": "c.keras", "--port": str(litserve.port), "--workers": "2", "--max-batch-size": "32"}
    assert litserve.own_group and litserve.ready_path == "/health" and litserve.metrics() is None
    assert handler.url_of(handler.LAYOUTS_BY_NAME["litserve-2"], litserve) == litserve.url + "/predict"
    triton = handler.layout_server(handler.LAYOUTS_BY_NAME["pytriton"], args, "c.keras", tmp_path / "t.log")
    assert triton.command()[:2] == ["pt/py", str(layouts.PYTRITON_SCRIPT)] and triton.command()[-1] == "--photos"
    assert not triton.own_group and triton.ready_path == "/v2/models/default/ready"


def test_the_bodies_carry_the_photo_as_b64_and_as_one_v2_bytes_element():
    (b64, b64_headers), = handler.bodies_of("b64", [JPEG])
    assert base64.b64decode(json.loads(b64)["instances"][0]["b64"]) == JPEG and b"\n" not in b64
    assert b64_headers == {"Content-Type": "application/json"}
    for protocol, shape in (("bytes", [1]), ("bytes-triton", [1, 1])):
        (body, headers), = handler.bodies_of(protocol, [JPEG])
        length = int(headers["Inference-Header-Content-Length"])
        (tensor,) = json.loads(body[:length])["inputs"]
        assert (tensor["name"], tensor["shape"], tensor["datatype"]) == ("image_bytes", shape, "BYTES")
        assert tensor["parameters"]["binary_data_size"] == len(body) - length == 4 + len(JPEG)
        assert body[length:] == len(JPEG).to_bytes(4, "little") + JPEG
        assert headers["Content-Type"] == "application/octet-stream"


def v2_answer(labels: list, scores: list) -> dict:
    return {"outputs": [{"name": "scores", "datatype": "FP32", "shape": [1, 5], "data": scores},
                        {"name": "labels", "datatype": "BYTES", "shape": [1, 5], "data": labels}]}


def test_an_answer_is_the_models_own_top_5_whatever_the_door():
    tfs = {"predictions": [{"labels": [{"b64": base64.b64encode(b"milk").decode()}, *TOP["labels"][1:]],
                            "scores": [0.5, 0.2, 0.125, 0.1, 0.0750001]}]}
    assert handler.difference("b64", tfs, TOP) == pytest.approx(1e-7, abs=2e-8)
    assert handler.difference("bytes", v2_answer(TOP["labels"], TOP["scores"]), TOP) == 0.0
    assert handler.difference("bytes-triton", v2_answer([TOP["labels"]], [TOP["scores"]]), TOP) == 0.0
    swapped = [TOP["labels"][1], TOP["labels"][0], *TOP["labels"][2:]]
    with pytest.raises(RuntimeError, match="the model's own"):
        handler.difference("bytes", v2_answer(swapped, TOP["scores"]), TOP)
    with pytest.raises(RuntimeError, match="the model's own"):
        handler.difference("bytes", v2_answer(TOP["labels"], TOP["scores"][:4]), TOP)


def test_every_photo_is_sent_as_the_load_sends_it_and_a_score_off_by_more_than_1e_6_is_refused():
    bodies = handler.bodies_of("bytes", [JPEG, JPEG[::-1]])
    good = json.dumps(v2_answer(TOP["labels"], TOP["scores"])).encode()
    with local_server(reply(200, good)) as (url, received):
        assert handler.check_answers("bytes", url, bodies, [TOP, TOP]) == 0.0
        assert received == [body for body, _ in bodies]
    off = json.dumps(v2_answer(TOP["labels"], [0.5, 0.2, 0.125, 0.1, 0.0751])).encode()
    with local_server(reply(200, off)) as (url, _), pytest.raises(RuntimeError, match="differ from the model's"):
        handler.check_answers("bytes", url, bodies, [TOP, TOP])
    with local_server(reply(400, b'{"error": "no"}')) as (url, _), pytest.raises(RuntimeError, match="400"):
        handler.check_answers("bytes", url, bodies, [TOP, TOP])


# A master that leaves on SIGTERM, with a child that stops on it and says so, and a child that ignores it (what
# LitServe's tree did); each child writes its pid first, in one write: with PYTHONUNBUFFERED, print's text and
# newline are two, and the two children's lines could interleave.
GRACEFUL = "import os, signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(print('graceful', " \
           "flush=True))); os.write(1, b'%d\\n' % os.getpid()); time.sleep(120)"
STUBBORN = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "os.write(1, b'%d\\n' % os.getpid()); time.sleep(120)"
MASTER = "import subprocess, sys; children = [subprocess.Popen([sys.executable, '-c', code]) for code in " \
         f"({GRACEFUL!r}, {STUBBORN!r})]; [child.wait() for child in children]"


def test_litserve_is_stopped_by_sigterm_to_its_whole_group_then_sigkill(tmp_path):
    server = handler.LitServeServer(python=Path(sys.executable), model_path="c.keras", log_path=tmp_path / "l.log",
                                    name="litserve-1", workers=1)
    server.proc = subprocess.Popen([sys.executable, "-c", MASTER], stdout=subprocess.PIPE, text=True,
                                   start_new_session=True)
    children = [psutil.Process(int(server.proc.stdout.readline())) for _ in range(2)]
    assert server.stop(within_s=0.5) == -15  # the master, by SIGTERM
    assert server.proc.stdout.read() == "graceful\n"  # the child got SIGTERM too, not only the SIGKILL
    assert not any(handler.alive(child) for child in children)  # the one that ignored it: SIGKILLed after 0.5 s
    server.proc.stdout.close()


def measured(layout: str, round_number: int, rps: float | None, error: str | None = None) -> layouts.Measured:
    return layouts.Measured("image", layout, round_number, requests=int(rps or 0), rps=rps, p50_ms=rps and 50.0,
                            p99_ms=rps and 90.0, cpu_ms_per_request=rps and 1000 / rps, rss_mib=rps and 600.0,
                            batch_rows=rps and 8.0 if not layout.startswith(("litserve", "pytriton")) else None,
                            wrk_cores=0.1, other_cores=0.05, check_difference=0.0, error=error)


LIMIT = handler.Limit(cores=2, cpu_ms=4.0, wall_ms=4.4, together_per_s=480.0, model_cpu_ms=0.5)


def test_the_table_divides_by_litserves_better_layout_pytriton_and_the_limit_and_names_the_targets():
    chosen = [handler.LAYOUTS_BY_NAME[name] for name in ("default-bytes", "procs-2w-b64", "litserve-1", "litserve-2",
                                                          "pytriton")]
    results = [measured("default-bytes", 1, 440.0), measured("default-bytes", 2, 460.0),
               measured("procs-2w-b64", 1, 400.0), measured("procs-2w-b64", 2, None, error="refused: 3 ..."),
               measured("litserve-1", 1, 300.0), measured("litserve-2", 1, 375.0), measured("pytriton", 1, 500.0)]
    lines = handler.table(results, chosen, 2, LIMIT)
    workers = default_workers(usable_cpus().count)
    assert lines[:2] == ["Means of 2 rounds.", ""]
    assert lines[4:9] == [
        f"| `default-bytes`: default ({workers} worker{'s' if workers > 1 else ''}) | 450 | 1.20× | 0.90× | 90% | "
        "50.0 | 90.0 | 2.22 | 600 | 8.0 |",
        "| `procs-2w-b64`: MODEL_PROCESSES=1, 2 workers | 400 | 1.07× | 0.80× | 80% | 50.0 | 90.0 | 2.50 | 600 | 8.0 |",
        "| `litserve-1`: LitServe, 1 worker | 300 | 0.80× | 0.60× | 60% | 50.0 | 90.0 | 3.33 | 600 | – |",
        "| `litserve-2`: LitServe, 2 workers | 375 | 1.00× | 0.75× | 75% | 50.0 | 90.0 | 2.67 | 600 | – |",
        "| `pytriton`: PyTriton | 500 | 1.33× | 1.00× | 100% | 50.0 | 90.0 | 2.00 | 600 | – |"]
    # 450 ÷ 375 = 1.2 meets its target exactly; 450 ÷ 500 does not; 450 ÷ 500 of the limit is 90 %.
    assert lines[10] == ("Targets (issue 56), this server's best, `default-bytes`: ≥ 1.2× LitServe's better layout: "
                        "1.20×, met; ≥ 1× PyTriton: 0.90×, missed; ≥ 80% of the limit: 90%, met.")
    assert lines[12:] == ["Every round's req/s: `default-bytes` 440, 460; `procs-2w-b64` 400, failed; `litserve-1` "
                          "300; `litserve-2` 375; `pytriton` 500.", "- `procs-2w-b64`, round 2: refused: 3 ..."]


def test_the_page_states_the_limit_the_photos_and_the_machines_other_load():
    args = types.SimpleNamespace(connections=32, wrk_threads=1, duration=30.0, warmup=3.0, rounds=1)
    chosen = [handler.LAYOUTS_BY_NAME["default-bytes"]]
    lines = handler.page_body([measured("default-bytes", 1, 450.0)], chosen, args, LIMIT, [43_265, 45_647, 44_000])
    assert lines[2] == "wrk: 32 connections, 1 thread(s), 30 s after 3 s of warm-up; photos of 43,265–45,647 bytes " \
        "(mean 44,304)."
    assert ("The limit: 2 cores ÷ 4.00 ms of CPU a photo = 500 req/s (wall ÷ CPU 1.10; 2 processes at once: 480 "
            "photos/s). The model adds 0.50 ms of CPU a photo at batch 32: 444 req/s with it.") in lines
    assert "wrk used 0.10–0.10 of a core; other processes on the machine 0.05–0.05." in lines
    assert "Answers checked: largest score difference 0 over 1 servers." in lines
    assert lines[-1].startswith("LitServe and PyTriton run from virtualenvs of their own")
