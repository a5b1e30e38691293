"""MODEL_PROCESSES' GPU placement against a real NVIDIA driver (skipped where there is none).

tests/test_model_process_gpus.py checks the placement against a stand-in `libcuda.so.1`; this
module checks what that stand-in assumes, on a machine with a GPU: that `runtime`'s ctypes
calls read the driver's count and totals as nvidia-smi reports them, without creating a
context; and that a process started with the CUDA_VISIBLE_DEVICES the supervisor gives a model
process sees that GPU alone, as its device 0, whether the user named GPUs by index or by UUID.

Each check runs in a child process: the driver reads CUDA_VISIBLE_DEVICES once, at cuInit.
TensorFlow is not needed (nor imported): it reads the same variable through the same driver.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.model_process.supervisor import gpu_placements

pytestmark = pytest.mark.skipif(shutil.which("nvidia-smi") is None,
                                reason="no NVIDIA driver here: runs on a machine with a GPU")

ROOT = Path(__file__).resolve().parent.parent

# What the driver shows a process started with the given environment: our runtime's count and
# totals, each device's UUID (as nvidia-smi prints it), whether any context is current or any
# primary context active after the count (none may be: TensorFlow sets up its own), and the
# supervisor's log lines for `place` (PLACE model processes).
CHILD = r"""
import ctypes, json, logging, os, sys
from app.ops import runtime
from app.model_process import supervisor

count = runtime.cuda_device_count()
cuda = ctypes.CDLL("libcuda.so.1")
context = ctypes.c_void_p()
assert cuda.cuCtxGetCurrent(ctypes.byref(context)) == 0 or count == 0  # no cuInit without a device
devices = []
for ordinal in range(count):
    device, uuid = ctypes.c_int(), (ctypes.c_ubyte * 16)()
    flags, active = ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(device), ordinal) == 0
    assert cuda.cuDeviceGetUuid_v2(uuid, device) == 0
    assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
    text = bytes(uuid).hex()
    devices.append({"uuid": f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}",
                    "total": runtime.cuda_total_memory(ordinal), "active": active.value})
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(f"{record.levelname} {record.getMessage()}")
logging.getLogger().addHandler(handler)
logging.getLogger().setLevel(logging.INFO)
placed = supervisor.place(int(os.environ["PLACE"])) if os.environ.get("PLACE") else None
print(json.dumps({"count": count, "context": context.value, "devices": devices, "placed": placed,
                  "log": lines}))
"""


def nvidia_smi() -> list[dict[str, object]]:
    """Every GPU of the host, in PCI order: uuid and total memory in MiB."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid,memory.total", "--format=csv,noheader,nounits"],
                         check=True, capture_output=True, text=True).stdout
    return [{"uuid": uuid.strip(), "mib": int(mib)} for uuid, mib in
            (line.split(",") for line in out.strip().splitlines())]


def python_path() -> str:
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def driver(**environ: str) -> dict:
    """CHILD's report in a process with the PCI order (nvidia-smi's) and `environ` set."""
    env = {key: value for key, value in os.environ.items()
           if key not in {"CUDA_VISIBLE_DEVICES", "GPU_MEMORY_FRACTION", "GPU_MEMORY_LIMIT_MB", "PLACE"}}
    env.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", PYTHONPATH=python_path(), **environ)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_driver_shows_what_nvidia_smi_shows_and_no_context_is_made():
    gpus = nvidia_smi()
    seen = driver()
    assert seen["count"] == len(gpus) > 0
    assert [device["uuid"] for device in seen["devices"]] == [gpu["uuid"] for gpu in gpus]
    # The CUDA total, which TensorFlow's GPU_MEMORY_FRACTION is of, leaves out what the driver
    # reserves: less than nvidia-smi's (143,155 against 143,771 MiB on an H200). PyTorch reads it
    # through the runtime API, where it is there.
    assert all(device["total"] // 2**20 <= gpu["mib"] for device, gpu in zip(seen["devices"], gpus, strict=True))
    pytest.importorskip("torch")
    read = "[torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]"
    torch = subprocess.run([sys.executable, "-c", f"import json, torch; print(json.dumps({read}))"],
                           env={**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, check=True, capture_output=True,
                           text=True, timeout=120)
    assert [device["total"] for device in seen["devices"]] == json.loads(torch.stdout)
    assert seen["context"] is None
    assert [device["active"] for device in seen["devices"]] == [0] * len(gpus)


def test_each_model_process_sees_its_own_gpu_alone_with_the_logged_cap():
    gpus = nvidia_smi()
    count = 2 * len(gpus)  # two model processes per GPU, half of it each
    seen = driver(PLACE=str(count), GPU_MEMORY_FRACTION="0.5")
    placed = seen["placed"]
    assert placed == gpu_placements(count, len(gpus), {}, memory_fraction=0.5) == \
        [str(index % len(gpus)) for index in range(count)]
    for index, device in enumerate(placed):
        gpu = seen["devices"][index % len(gpus)]
        assert f"INFO model process {index}: GPU {index % len(gpus)} of {len(gpus)} (CUDA_VISIBLE_DEVICES={device}), " \
               f"memory capped at {int(gpu['total'] * 0.5) // 2**20} MiB" in seen["log"]
        inside = driver(CUDA_VISIBLE_DEVICES=device)
        assert inside["count"] == 1
        assert inside["devices"][0]["uuid"] == gpu["uuid"]


def test_gpus_named_by_uuid_are_passed_on_as_written():
    gpus = nvidia_smi()
    named = gpus[-1]["uuid"]
    seen = driver(CUDA_VISIBLE_DEVICES=named, PLACE="2", GPU_MEMORY_LIMIT_MB="1024")
    assert seen["count"] == 1
    assert seen["placed"] == [named, named]
    assert f"INFO model process 1: GPU 0 of 1 (CUDA_VISIBLE_DEVICES={named}), memory capped at 1024 MiB" \
        in seen["log"]
    inside = driver(CUDA_VISIBLE_DEVICES=named)
    assert [device["uuid"] for device in inside["devices"]] == [named]


@pytest.mark.parametrize("hidden", ["", "-1"])
def test_no_visible_gpu_means_the_cpus_and_no_warning(hidden):
    seen = driver(CUDA_VISIBLE_DEVICES=hidden, PLACE="3")
    assert seen["count"] == 0
    assert seen["placed"] == []
    assert seen["log"] == ["INFO no GPU visible: each of the 3 model processes takes a share of the CPUs"]


def test_more_model_processes_than_fit_stop_with_the_message():
    gpus = nvidia_smi()
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHONPATH=python_path(), GPU_MEMORY_FRACTION="0.6")
    done = subprocess.run([sys.executable, "-c", "from app.model_process import supervisor; "
                           f"supervisor.place({2 * len(gpus)})"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"app.model_process.supervisor.PlacementError: GPU_MEMORY_FRACTION=0.6 for each of the 2 model processes "
        f"on a GPU (MODEL_PROCESSES={2 * len(gpus)}, {len(gpus)} visible GPUs) is more than the GPU: at most 0.5")
