"""TensorFlow's process set-up: thread pools and GPU memory, before the first TF op.

Gunicorn's post_fork hook calls `configure()` in each worker with the worker count, so
that N workers share the cores instead of each starting pools as wide as the machine.
`create_app()` calls it again; the second call changes nothing.

TensorFlow's C++ libraries write start-up lines (oneDNN, CPU features, absl's "before
InitializeLog" banner) straight to file descriptor 2 while `import tensorflow` runs, in
their own format and whatever TF_CPP_MIN_LOG_LEVEL says. The import runs with descriptor 2
pointed at a temporary file, and what was written there is logged afterwards through
`logging`: known informational lines at DEBUG (so they show with LOG_LEVEL=DEBUG, in
LOG_FORMAT), anything else (an import error, say) at WARNING.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from app.settings import Settings

log = logging.getLogger(__name__)

_lock = threading.Lock()
_configured: dict[str, Any] | None = None

# absl's one-line banner, and its INFO lines ("I1123 12:00:00.000000 123 port.cc:153] ...").
_NATIVE_NOISE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)|I\d{4} )")


def available_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota.

    In a container with a CPU limit the affinity still lists every core of the node;
    the quota (cpu.max) is what the limit really allows.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cores, quota)) if quota else cores


def cgroup_cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    try:
        with open(path) as limits:
            quota, period = limits.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def configure(settings: Settings, *, workers: int = 1) -> dict[str, Any]:
    """Size TF's pools to cores / workers and cap GPU memory; idempotent per process."""
    global _configured
    with _lock:
        if _configured is not None:
            return _configured
        tf = import_tensorflow(settings)
        share = max(1, available_cores() // max(1, workers))
        intra = settings.tf_intra_op_threads or share
        inter = settings.tf_inter_op_threads or share
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
        gpus = tf.config.list_physical_devices("GPU")
        for gpu in gpus:
            if settings.gpu_memory_limit_mb:
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=settings.gpu_memory_limit_mb)]
                )
            else:
                tf.config.experimental.set_memory_growth(gpu, True)
        _configured = {
            "intra_op_threads": intra,
            "inter_op_threads": inter,
            "gpus": len(gpus),
            "gpu_memory_limit_mb": settings.gpu_memory_limit_mb or None,
        }
        log.info("tensorflow configured in pid %d: %s", os.getpid(), _configured)
        return _configured


def import_tensorflow(settings: Settings) -> Any:
    """`import tensorflow`, its native start-up lines logged (at DEBUG), not printed."""
    if "tensorflow" not in sys.modules:
        if settings.log_level != "DEBUG":
            # Read by TensorFlow's own C++ logging when it loads; an explicit value is kept.
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        with native_stderr_logged():
            import tensorflow  # noqa: F401
    return sys.modules["tensorflow"]


@contextlib.contextmanager
def native_stderr_logged() -> Iterator[None]:
    """Descriptor 2 goes to a temporary file meanwhile; what lands there is logged after.

    For imports of native libraries that print before any logging of theirs can be set up.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            log_native_lines(captured.read().decode(errors="replace"))


def log_native_lines(text: str) -> None:
    for line in text.splitlines():
        if line.strip():
            level = logging.DEBUG if _NATIVE_NOISE.match(line) else logging.WARNING
            log.log(level, "tensorflow: %s", line.rstrip())


def configured() -> dict[str, Any]:
    return dict(_configured or {})
