"""GPU_MEMORY_FRACTION (TF Serving's --per_process_gpu_memory_fraction) beside GPU_MEMORY_LIMIT_MB.

No GPU on the test machines: the cap's computation is checked with each GPU's total memory
given, and the CUDA driver's reader with a library that is not there.
"""

from __future__ import annotations

import pytest

from app.ops import runtime
from app.ops.settings import Settings, SettingsError

GIB = 2**30
H100_BYTES = 85_032_697_856  # what cuDeviceTotalMem reports for an 80 GB H100 (79.19 GiB)


@pytest.mark.parametrize("environ, totals, limits", [
    ({}, [H100_BYTES], [0]),
    ({"GPU_MEMORY_LIMIT_MB": "2048"}, [H100_BYTES, 16 * GIB], [2048, 2048]),
    ({"GPU_MEMORY_FRACTION": "0.25"}, [16 * GIB, 40 * GIB], [4096, 10240]),
    ({"GPU_MEMORY_FRACTION": "0.5"}, [H100_BYTES], [40546]),  # rounded down to whole MiB
    ({"GPU_MEMORY_FRACTION": "1"}, [16 * GIB], [16384]),
    ({"GPU_MEMORY_FRACTION": "1e-9"}, [16 * GIB], [1]),  # never 0, which would mean no cap
])
def test_the_cap_is_the_limit_or_the_fraction_of_each_gpus_total(environ, totals, limits):
    settings = Settings.from_env(environ)
    asked: list[int] = []

    def total_bytes(ordinal: int) -> int:
        asked.append(ordinal)
        return totals[ordinal]

    assert [runtime.gpu_memory_limit_mb(settings, ordinal, total_bytes=total_bytes)
            for ordinal in range(len(totals))] == limits
    # The total is read only for a fraction, once per GPU.
    assert asked == (list(range(len(totals))) if "GPU_MEMORY_FRACTION" in environ else [])


def test_a_fraction_and_a_limit_together_stop_start_up():
    with pytest.raises(SettingsError, match=r"^GPU_MEMORY_LIMIT_MB=1024 and GPU_MEMORY_FRACTION=0.5 both cap "
                                            r"GPU memory: set one of them$"):
        Settings.from_env({"GPU_MEMORY_LIMIT_MB": "1024", "GPU_MEMORY_FRACTION": "0.5"})


@pytest.mark.parametrize("text", ["1.5", "-0.1", "nan", "half"])
def test_a_fraction_outside_0_to_1_is_refused(text):
    with pytest.raises(SettingsError, match=rf"^GPU_MEMORY_FRACTION='{text}' is not valid: expected a number "
                                            r"from 0 to 1$"):
        Settings.from_env({"GPU_MEMORY_FRACTION": text})


def test_without_the_cuda_driver_the_fraction_stops_the_worker_with_a_message():
    with pytest.raises(runtime.GpuMemoryError, match=r"^GPU_MEMORY_FRACTION: cannot load the CUDA driver "
                                                     r"\(libcuda-absent\.so\.1\): "):
        runtime.cuda_total_memory(0, library="libcuda-absent.so.1")
