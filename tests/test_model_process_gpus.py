"""MODEL_PROCESSES on GPUs: one model process per visible GPU, each seeing that GPU alone.

No GPU on the test machines. The plan (which CUDA_VISIBLE_DEVICES each model process gets) is
checked for 0, 1, 2 and 4 GPUs; the real supervisor is checked against a stand-in CUDA driver,
a `libcuda.so.1` compiled here that shows two GPUs of 16 and 24 GiB and reads
CUDA_VISIBLE_DEVICES (indices) as the driver does. tensorflow-cpu never loads libcuda, so
TensorFlow in the model processes runs on the CPU as ever and answers exactly.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import requests

from app.model_process import supervisor
from app.model_process.supervisor import PlacementError, gpu_placements
from app.ops import runtime
from tests.conftest import Server, integer_rows, wait_for
from tests.test_grpc import access_line
from tests.test_model_processes import workers

STAND_IN_DRIVER = r"""
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* STAND_IN_GPUS devices (2 unless set); device d has (16 + 8 d) GiB. */
static int physical[64];

static int visible(void) {
    const char *set = getenv("STAND_IN_GPUS");
    int gpus = set ? atoi(set) : 2;
    const char *named = getenv("CUDA_VISIBLE_DEVICES");
    if (!named) {
        for (int d = 0; d < gpus && d < 64; d++) physical[d] = d;
        return gpus;
    }
    /* As the driver: the listed devices in order, up to the first that is not one. */
    char copy[256];
    strncpy(copy, named, sizeof copy - 1);
    copy[sizeof copy - 1] = 0;
    int count = 0;
    for (char *entry = strtok(copy, ","); entry && count < 64; entry = strtok(NULL, ",")) {
        char *end;
        long d = strtol(entry, &end, 10);
        if (end == entry || d < 0 || d >= gpus) break;
        physical[count++] = (int)d;
    }
    return count;
}

int cuInit(unsigned int flags) {
    const char *result = getenv("STAND_IN_CUINIT_RESULT");
    if (result) return atoi(result);
    return visible() ? 0 : 100; /* CUDA_ERROR_NO_DEVICE */
}

int cuDeviceGetCount(int *count) { *count = visible(); return 0; }

int cuDeviceGet(int *device, int ordinal) {
    if (ordinal < 0 || ordinal >= visible()) return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *device = physical[ordinal];
    return 0;
}

int cuDeviceTotalMem_v2(size_t *bytes, int device) { *bytes = (size_t)(16 + 8 * device) << 30; return 0; }
"""


@pytest.fixture(scope="module")
def driver_dir(tmp_path_factory) -> Path:
    assert shutil.which("gcc"), "gcc is needed to build the stand-in driver (.ci/run installs it)"
    folder = tmp_path_factory.mktemp("stand-in-cuda")
    source = folder / "cuda.c"
    source.write_text(STAND_IN_DRIVER)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(folder / "libcuda.so.1"), str(source)], check=True)
    return folder


@pytest.mark.parametrize("count, gpus, environ, placed", [
    (1, 0, {}, []),  # no GPU: a share of the CPUs each, as before
    (3, 0, {"CUDA_VISIBLE_DEVICES": ""}, []),
    (1, 1, {}, ["0"]),
    (2, 1, {}, ["0", "0"]),  # two on the one GPU, each with the cap
    (2, 2, {}, ["0", "1"]),
    (4, 2, {}, ["0", "1", "0", "1"]),
    (4, 4, {}, ["0", "1", "2", "3"]),
    (8, 4, {}, ["0", "1", "2", "3", "0", "1", "2", "3"]),
    (2, 2, {"CUDA_VISIBLE_DEVICES": "3,1"}, ["3", "1"]),  # the user's choice and order, kept
    (2, 2, {"CUDA_VISIBLE_DEVICES": "GPU-8a5e, GPU-f00d"}, ["GPU-8a5e", "GPU-f00d"]),  # UUIDs, as written
    (2, 2, {"CUDA_VISIBLE_DEVICES": "2,5,9"}, ["2", "5"]),  # the driver stopped at 9, which is no GPU
    (1, 1, {"CUDA_VISIBLE_DEVICES": "MIG-4f1c"}, ["MIG-4f1c"]),
    (4, 2, {"GPU_MEMORY_FRACTION": "ignored here"}, ["0", "1", "0", "1"]),
])
def test_each_model_process_gets_one_visible_gpu(count, gpus, environ, placed):
    assert gpu_placements(count, gpus, environ) == placed


@pytest.mark.parametrize("count, gpus, environ, message", [
    (1, 2, {}, "MODEL_PROCESSES=1 with 2 visible GPUs: set it to a multiple of 2 (2 for one model process per "
               "GPU), or name the GPUs to use in CUDA_VISIBLE_DEVICES"),
    (3, 2, {"CUDA_VISIBLE_DEVICES": "0,1"}, "MODEL_PROCESSES=3 with 2 visible GPUs (CUDA_VISIBLE_DEVICES=0,1): set "
                                            "it to a multiple of 2 (2 for one model process per GPU), or name the "
                                            "GPUs to use in CUDA_VISIBLE_DEVICES"),
    (2, 4, {}, "MODEL_PROCESSES=2 with 4 visible GPUs: set it to a multiple of 4 (4 for one model process per GPU), "
               "or name the GPUs to use in CUDA_VISIBLE_DEVICES"),
])
def test_a_count_that_does_not_fit_the_gpus_stops_start_up(count, gpus, environ, message):
    with pytest.raises(PlacementError, match=f"^{re.escape(message)}$"):
        gpu_placements(count, gpus, environ)


def test_memory_fractions_that_add_up_past_a_gpu_stop_start_up():
    assert gpu_placements(4, 2, {}, memory_fraction=0.5) == ["0", "1", "0", "1"]  # two halves fit
    assert gpu_placements(2, 2, {}, memory_fraction=1.0) == ["0", "1"]
    message = ("GPU_MEMORY_FRACTION=0.6 for each of the 2 model processes on a GPU (MODEL_PROCESSES=4, 2 visible "
               "GPUs) is more than the GPU: at most 0.5")
    with pytest.raises(PlacementError, match=f"^{re.escape(message)}$"):
        gpu_placements(4, 2, {}, memory_fraction=0.6)


def test_the_device_count_comes_from_the_driver_and_is_0_without_one(driver_dir, monkeypatch, caplog):
    library = str(driver_dir / "libcuda.so.1")
    assert runtime.cuda_device_count(library="libcuda-absent.so.1") == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert runtime.cuda_device_count(library=library) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert runtime.cuda_device_count(library=library) == 1
    assert runtime.cuda_total_memory(0, library=library) == 24 * 2**30  # the one visible GPU is device 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with caplog.at_level("WARNING", logger="app.ops.runtime"):
        assert runtime.cuda_device_count(library=library) == 0  # cuInit: CUDA_ERROR_NO_DEVICE, no warning
    assert caplog.messages == []


def test_a_failing_cuinit_means_no_gpu_and_says_why(driver_dir, monkeypatch, caplog):
    monkeypatch.setenv("STAND_IN_CUINIT_RESULT", "999")
    with caplog.at_level("WARNING", logger="app.ops.runtime"):
        assert runtime.cuda_device_count(library=str(driver_dir / "libcuda.so.1")) == 0
    assert caplog.messages == ["the CUDA driver's cuInit failed (CUresult 999): no GPU is used"]


def test_the_supervisor_logs_each_model_processs_gpu_and_cap(monkeypatch, caplog):
    """Two per GPU: each cap is the fraction of its own GPU's total, read by its ordinal here."""
    totals = {0: 16 * 2**30, 1: 24 * 2**30}
    monkeypatch.setattr(runtime, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(runtime, "cuda_total_memory", totals.__getitem__)
    monkeypatch.setenv("GPU_MEMORY_FRACTION", "0.25")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b")
    with caplog.at_level("INFO", logger="app.model_process.supervisor"):
        assert supervisor.place(4) == ["GPU-a", "GPU-b", "GPU-a", "GPU-b"]
    assert caplog.messages == [
        "model process 0: GPU 0 of 2 (CUDA_VISIBLE_DEVICES=GPU-a), memory capped at 4096 MiB",
        "model process 1: GPU 1 of 2 (CUDA_VISIBLE_DEVICES=GPU-b), memory capped at 6144 MiB",
        "model process 2: GPU 0 of 2 (CUDA_VISIBLE_DEVICES=GPU-a), memory capped at 4096 MiB",
        "model process 3: GPU 1 of 2 (CUDA_VISIBLE_DEVICES=GPU-b), memory capped at 6144 MiB",
    ]
    monkeypatch.delenv("GPU_MEMORY_FRACTION")
    caplog.clear()
    with caplog.at_level("INFO", logger="app.model_process.supervisor"):
        supervisor.place(2)
    assert caplog.messages[0] == "model process 0: GPU 0 of 2 (CUDA_VISIBLE_DEVICES=GPU-a), memory grows as needed"
    monkeypatch.setattr(runtime, "cuda_device_count", lambda: 0)
    caplog.clear()
    with caplog.at_level("INFO", logger="app.model_process.supervisor"):
        assert supervisor.place(3) == []
    assert caplog.messages == ["no GPU visible: each of the 3 model processes takes a share of the CPUs"]


def model_processes(server: Server) -> dict[int, psutil.Process]:
    """The live model processes by index (the socket each listens on: model-<index>.sock)."""
    found = {}
    for process in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            command = process.cmdline()
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
        if "app.model_process.server" in command:
            found[int(re.search(r"model-(\d+)\.sock$", command[command.index("--socket") + 1]).group(1))] = process
    return found


def environ_of(process: psutil.Process) -> dict[str, str]:
    entries = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if entry)


def test_two_gpus_two_model_processes_each_on_its_own_gpu_with_its_own_cap(
        tmp_path, driver_dir, exact_model_path, exact_model):
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": [{"name": "exact", "path": str(exact_model_path)}]}))
    # The user names both GPUs, the second first: model process 0 gets device 1 (24 GiB).
    server = Server(tmp_path, {"MODEL_CONFIG": str(config), "MODEL_PROCESSES": "2", "LOG_FORMAT": "json",
                               "GPU_MEMORY_FRACTION": "0.5", "CUDA_VISIBLE_DEVICES": "1,0",
                               "LD_LIBRARY_PATH": str(driver_dir)})
    server.start(workers=2)
    try:
        processes = model_processes(server)
        assert sorted(processes) == [0, 1]
        assert {index: environ_of(process)["CUDA_VISIBLE_DEVICES"] for index, process in processes.items()} == \
            {0: "1", 1: "0"}
        log = server.log()
        assert "model process 0: GPU 0 of 2 (CUDA_VISIBLE_DEVICES=1), memory capped at 12288 MiB" in log
        assert "model process 1: GPU 1 of 2 (CUDA_VISIBLE_DEVICES=0), memory capped at 8192 MiB" in log
        # Each model process's TensorFlow start-up line names its GPU (TF itself sees none here).
        for process in processes.values():
            line = next(json.loads(line)["message"] for line in log.splitlines()
                        if f"tensorflow configured in pid {process.pid}:" in line)
            configured = ast.literal_eval(line.split(": ", 1)[1])
            assert configured["cuda_visible_devices"] == environ_of(process)["CUDA_VISIBLE_DEVICES"]
        readyz = requests.get(server.url + "/readyz", timeout=30).json()
        assert readyz["tensorflow"] == {"model_processes": 2, "model_process_gpus": ["1", "0"]}

        # A worker talks to model process pid % 2: until the two workers' pids differ in parity,
        # one is replaced, so that both model processes serve.
        def workers_reach_both() -> bool:
            live = workers(server)
            if len(live) == 2 and len({worker.pid % 2 for worker in live}) == 2:
                return True
            if len(live) == 2:
                live[0].send_signal(signal.SIGKILL)
            return False

        wait_for(workers_reach_both, within_s=120, what="two workers of either parity")
        server.wait_ready(workers=2)
        served: set[int] = set()

        def both_answer_exactly() -> bool:
            rows = integer_rows(3, seed=len(served))
            answer = server.predict(rows, path="/v1/models/exact:predict", headers={"Connection": "close"})
            assert answer.status_code == 200, answer.text
            assert answer.json() == {"predictions": exact_model(rows).numpy().tolist()}
            served.add(access_line(server, answer.headers["X-Request-ID"])["pid"] % 2)
            return served == {0, 1}

        wait_for(both_answer_exactly, within_s=120, what="answers through both model processes")
    finally:
        server.stop()


def test_a_count_that_does_not_fit_stops_the_server_with_the_message(tmp_path, driver_dir, exact_model_path):
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": [{"name": "exact", "path": str(exact_model_path)}]}))
    server = Server(tmp_path, {"MODEL_CONFIG": str(config), "MODEL_PROCESSES": "3",
                               "LD_LIBRARY_PATH": str(driver_dir)})
    done = subprocess.run(server.command(workers=1), cwd=server.cwd, env=server.env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert ("MODEL_PROCESSES=3 with 2 visible GPUs: set it to a multiple of 2 (2 for one model process per GPU), "
            "or name the GPUs to use in CUDA_VISIBLE_DEVICES") in done.stderr
