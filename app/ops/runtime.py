"""TensorFlow's process set-up: thread pools and GPU memory, before the first TF op.

GPU memory is capped per worker by GPU_MEMORY_LIMIT_MB, or by GPU_MEMORY_FRACTION of each GPU's
total (TF Serving's --per_process_gpu_memory_fraction, total read from the CUDA driver), as a
logical device of that size; with neither, memory grows as needed.

Gunicorn's post_fork hook calls `configure()` once in each worker, before the app loads its
models, with the worker count, so that N workers share the usable CPUs (`usable_cpus()`: the
affinity, capped by a cgroup CPU quota) instead of each starting pools as wide as the machine.
It returns what it set; the hooks hand that to the app's services (Services.tensorflow).

TensorFlow's C++ libraries write start-up lines (oneDNN, CPU features, absl's "before
InitializeLog" banner) straight to file descriptor 2 while `import tensorflow` runs, in
their own format and whatever TF_CPP_MIN_LOG_LEVEL says. The import runs with descriptor 2
pointed at a temporary file, and what was written there is logged afterwards through
`logging`: known informational lines at DEBUG (so they show with LOG_LEVEL=DEBUG, in
LOG_FORMAT), anything else (an import error, say) at WARNING; a record's later lines at the
level of its first. Python's own log handlers on stderr write past the capture meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import importlib.util
import logging
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from app.ops.settings import Settings

log = logging.getLogger(__name__)

# absl's one-line banner, and its INFO lines ("I1123 12:00:00.000000 123 port.cc:153] ...").
_NATIVE_NOISE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)|I\d{4} )")
# The first line of any absl/glog record; a multi-line message's later lines have no prefix.
_NATIVE_RECORD = re.compile(r"^[IWEF]\d{4} ")


# Usable CPUs per worker. Issue 15's closed-loop runs of a wide model (1,024 floats in,
# 4 x 4,096 hidden) on a 16-core machine (table in docs/scaling.md): 1 worker 469 req/s
# (5.8 cores busy), 2 917, 4 1,142 (the best), 8 979. One worker's request threads share
# one GIL, so it cannot fill a big machine; past 16 / 4 workers they contend for the cores.
CPUS_PER_WORKER = 4


@dataclasses.dataclass(frozen=True)
class UsableCpus:
    """The CPUs this process may use, and what limits them."""

    count: int
    source: str  # "affinity" or "cgroup cpu quota": whichever gives fewer
    affinity: int
    quota: float | None  # CPUs the tightest CFS quota allows (1.5 for "150000 100000"); None: no quota


def usable_cpus(*, root: str = "/", affinity: int | None = None) -> UsableCpus:
    """The fewer of the CPUs in this process's affinity and its cgroup's CPU quota, rounded up.

    In a container with a CPU limit the affinity still lists every core of the node, and
    os.cpu_count() every core of the machine; the quota is what the limit really allows.
    (Python 3.13's os.process_cpu_count() reads the affinity only; joblib's loky reads the
    quota only at the cgroup root.) `root` and `affinity` are for tests.
    """
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except AttributeError:
            affinity = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    if quota is not None and math.ceil(quota) < affinity:
        return UsableCpus(max(1, math.ceil(quota)), "cgroup cpu quota", affinity, quota)
    return UsableCpus(affinity, "affinity", affinity, quota)


def default_workers(cpus: int) -> int:
    return max(1, cpus // CPUS_PER_WORKER)


def cgroup_cpu_quota(root: str = "/") -> float | None:
    """CPUs the tightest CFS quota on this process's cgroup or an ancestor allows; None: none.

    The cgroup comes from /proc/self/cgroup: v2 ("0::/path", cpu.max "200000 100000", or
    "max ..." for no limit) or v1's cpu controller (cpu.cfs_quota_us, -1 for no limit, over
    cpu.cfs_period_us). A parent's quota binds its children too, so every level up to the
    mount is read. Inside a container without its own cgroup namespace the listed path is
    the host's and does not exist under the mount: the levels that do exist still count.
    """
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as own:
            lines = own.read().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if hierarchy == "0" and not controllers:
            mounts, read = ["sys/fs/cgroup"], _cgroup2_quota
        elif "cpu" in controllers.split(","):
            # v1's cpu controller: mounted alone, or with cpuacct and a "cpu" link to it.
            mounts, read = [f"sys/fs/cgroup/{controllers}", "sys/fs/cgroup/cpu"], _cgroup1_quota
        else:
            continue
        for mount in dict.fromkeys(mounts):
            for directory in _levels(os.path.join(root, mount), path):
                quota = read(directory)
                if quota is not None:
                    quotas.append(quota)
    return min(quotas, default=None)


def _levels(mount: str, path: str) -> Iterator[str]:
    parts = [part for part in path.split("/") if part]
    for depth in range(len(parts), -1, -1):
        yield os.path.join(mount, *parts[:depth])


def _cgroup2_quota(directory: str) -> float | None:
    try:
        with open(os.path.join(directory, "cpu.max")) as limits:
            quota, period = limits.read().split()[:2]
        return None if quota == "max" else _cpus(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _cgroup1_quota(directory: str) -> float | None:
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as quota, \
                open(os.path.join(directory, "cpu.cfs_period_us")) as period:
            return _cpus(int(quota.read()), int(period.read()))
    except (OSError, ValueError):
        return None


def _cpus(quota_us: int, period_us: int) -> float | None:
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def gpu_memory_limit_mb(settings: Settings, ordinal: int, *, total_bytes: Callable[[int], int]) -> int:
    """The memory cap of GPU `ordinal` in MiB: GPU_MEMORY_LIMIT_MB, or GPU_MEMORY_FRACTION of the
    GPU's total memory (`total_bytes(ordinal)`), rounded down; 0: no cap (memory grows as needed)."""
    if settings.gpu_memory_limit_mb:
        return settings.gpu_memory_limit_mb
    if settings.gpu_memory_fraction:
        return max(1, int(total_bytes(ordinal) * settings.gpu_memory_fraction) // 2**20)
    return 0


class GpuMemoryError(RuntimeError):
    """The CUDA driver cannot say how much memory a GPU has."""


def cuda_total_memory(ordinal: int, *, library: str = "libcuda.so.1") -> int:
    """Total memory in bytes of CUDA device `ordinal`, from the CUDA driver, as TensorFlow reads it.

    The driver numbers devices as TensorFlow's GPU list does (CUDA_VISIBLE_DEVICES and
    CUDA_DEVICE_ORDER applied); NVML and nvidia-smi number every GPU of the host in PCI order.
    TF Serving's fraction is of this same total (gpu_device.cc). No context is created, so
    TensorFlow's own set-up after this is unaffected.
    """
    try:
        cuda = ctypes.CDLL(library)
    except OSError as exc:
        raise GpuMemoryError(f"GPU_MEMORY_FRACTION: cannot load the CUDA driver ({library}): {exc}") from None
    device, total = ctypes.c_int(), ctypes.c_size_t()
    for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(device), ordinal)),
                       ("cuDeviceTotalMem_v2", (ctypes.byref(total), device))):
        result = getattr(cuda, call)(*args)
        if result != 0:
            raise GpuMemoryError(f"GPU_MEMORY_FRACTION: the CUDA driver's {call} failed for GPU {ordinal} "
                                 f"(CUresult {result})")
    return total.value


# cuInit's CUresult on a host whose driver sees no device (CUDA_VISIBLE_DEVICES empty, say).
CUDA_ERROR_NO_DEVICE = 100


def cuda_device_count(*, library: str = "libcuda.so.1") -> int:
    """How many GPUs the CUDA driver shows this process (CUDA_VISIBLE_DEVICES applied); 0 without a driver.

    As cuda_total_memory: no context is created and TensorFlow is not imported, so the model
    processes' supervisor can ask. A driver whose cuInit fails leaves TensorFlow on the CPU too
    ("failed call to cuInit"): 0, with a warning unless the driver simply sees no device.
    """
    try:
        cuda = ctypes.CDLL(library)
    except OSError:
        return 0
    count = ctypes.c_int()
    for call, args in (("cuInit", (0,)), ("cuDeviceGetCount", (ctypes.byref(count),))):
        result = getattr(cuda, call)(*args)
        if result != 0:
            if result != CUDA_ERROR_NO_DEVICE:
                log.warning("the CUDA driver's %s failed (CUresult %d): no GPU is used", call, result)
            return 0
    return count.value


# Keras's own variable: which backend its layers run on, fixed when `keras` is first imported.
BACKEND_VARIABLE = "KERAS_BACKEND"


def keras_backend(environ: Any = os.environ) -> str:
    """The Keras backend this process runs: KERAS_BACKEND, else Keras's default, TensorFlow."""
    return (environ.get(BACKEND_VARIABLE) or "tensorflow").strip().lower()


def uses_jax(environ: Any = os.environ) -> bool:
    return keras_backend(environ) == "jax"


# JAX's GPU allocator reads these when its GPU client starts (the first JAX op in the process).
JAX_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
JAX_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def jax_allocator_env(settings: Settings, *, gpus: int, total_bytes: Callable[[int], int],
                      environ: Any = os.environ) -> dict[str, str]:
    """JAX's allocator settings for this process's GPU memory cap, as TensorFlow's are set.

    JAX caps its pool at a fraction of each GPU's memory, never at a size: GPU_MEMORY_FRACTION
    is that fraction; GPU_MEMORY_LIMIT_MB becomes the fraction it is of the smallest GPU the
    process sees (rounded down), so no GPU gives it more. With a cap the pool is taken at
    start, as TensorFlow takes a capped logical device; without one memory grows as needed
    (TensorFlow's memory growth), unless the environment already says otherwise.
    """
    fraction = settings.gpu_memory_fraction
    if settings.gpu_memory_limit_mb and gpus:
        smallest = min(total_bytes(ordinal) for ordinal in range(gpus))
        fraction = min(1.0, settings.gpu_memory_limit_mb * 2**20 / smallest)
    if fraction:
        return {JAX_MEM_FRACTION: f"{math.floor(fraction * 10**4) / 10**4:g}", JAX_PREALLOCATE: "true"}
    return {JAX_PREALLOCATE: environ.get(JAX_PREALLOCATE, "false")}


def configure_jax(settings: Settings, *, workers: int, gpu_total_bytes: Callable[[int], int] = cuda_total_memory,
                  gpu_count: Callable[[], int] = cuda_device_count) -> dict[str, Any]:
    """KERAS_BACKEND=jax: JAX's allocator capped as GPU_MEMORY_* say, before JAX starts on the GPU.

    JAX has no per-process thread setting to match TensorFlow's pools: on a GPU its host threads
    only launch work, and XLA's CPU client sizes its pool to the machine (see the manual's JAX
    page). TensorFlow, where installed, still serves SavedModels beside it, on the CPU only: one
    allocator per GPU keeps the cap what it says.
    """
    gpus = gpu_count()
    allocator = jax_allocator_env(settings, gpus=gpus, total_bytes=gpu_total_bytes)
    os.environ.update(allocator)
    cpus = usable_cpus()
    configured: dict[str, Any] = {"keras_backend": "jax", "jax_allocator": allocator, "gpus": gpus,
                                  "workers": workers, "usable_cpus": cpus.count, "usable_cpus_from": cpus.source}
    tf = import_tensorflow(settings)
    if tf is not None:
        share = max(1, cpus.count // max(1, workers))
        configured["intra_op_threads"] = settings.tf_intra_op_threads or share
        configured["inter_op_threads"] = settings.tf_inter_op_threads or share
        tf.config.threading.set_intra_op_parallelism_threads(configured["intra_op_threads"])
        tf.config.threading.set_inter_op_parallelism_threads(configured["inter_op_threads"])
        with native_stderr_logged():
            tf.config.set_visible_devices([], "GPU")
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        configured["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    log.info("keras backend jax configured in pid %d: %s", os.getpid(), configured)
    return configured


def configure(settings: Settings, *, workers: int,
              gpu_total_bytes: Callable[[int], int] = cuda_total_memory) -> dict[str, Any]:
    """Size TF's pools to usable CPUs / workers and cap GPU memory: once, before any TF op runs.
    `gpu_total_bytes(ordinal)`: a GPU's total memory, for GPU_MEMORY_FRACTION. With
    KERAS_BACKEND=jax, JAX's allocator instead (configure_jax)."""
    if uses_jax():
        return configure_jax(settings, workers=workers, gpu_total_bytes=gpu_total_bytes)
    tf = import_tensorflow(settings)
    cpus = usable_cpus()
    # Each worker's pools get its share of the usable CPUs: N workers with pools as wide
    # as the machine would oversubscribe it N times. Inter-op threads run independent ops
    # of one graph side by side; a served model's graph is mostly a chain, so the same
    # share costs it nothing and keeps N workers from each starting one per core.
    share = max(1, cpus.count // max(1, workers))
    intra = settings.tf_intra_op_threads or share
    inter = settings.tf_inter_op_threads or share
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    # The first look for devices loads CUDA in TensorFlow's CUDA build, which prints
    # straight to descriptor 2 (on a host without a GPU: "failed call to cuInit").
    with native_stderr_logged():
        gpus = tf.config.list_physical_devices("GPU")
    limits = [gpu_memory_limit_mb(settings, ordinal, total_bytes=gpu_total_bytes) for ordinal in range(len(gpus))]
    for gpu, limit in zip(gpus, limits, strict=True):
        if limit:
            tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit)])
        else:
            tf.config.experimental.set_memory_growth(gpu, True)
    configured = {
        "intra_op_threads": intra,
        "inter_op_threads": inter,
        "gpus": len(gpus),
        "gpu_memory_limit_mb": max(limits, default=0) or None,  # the largest, where GPUs differ
        "workers": workers,
        "usable_cpus": cpus.count,
        "usable_cpus_from": cpus.source,
    }
    if "CUDA_VISIBLE_DEVICES" in os.environ:  # a model process's own GPU (app/model_process/supervisor.py)
        configured["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    log.info("tensorflow configured in pid %d: %s", os.getpid(), configured)
    return configured


def import_tensorflow(settings: Settings) -> Any:
    """`import tensorflow`, its native start-up lines logged (at DEBUG), not printed.

    None with KERAS_BACKEND=jax where TensorFlow is not installed (a host with JAX's CUDA build
    alone): `.keras` models need no TensorFlow there, and a SavedModel fails its own load.
    """
    if uses_jax() and "tensorflow" not in sys.modules and importlib.util.find_spec("tensorflow") is None:
        return None
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
    # Python's own log records made meanwhile (the import logs through h5py, matplotlib, ...)
    # go out as they are, on the real descriptor 2, not into the capture to come back as
    # "tensorflow: ..." warnings that wrap a whole formatted line.
    python_stderr = open(os.dup(saved), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    handlers = _stderr_handlers()
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            swapped = [(handler, handler.setStream(python_stderr)) for handler in handlers]
            try:
                yield
            finally:
                for handler, stream in swapped:
                    handler.setStream(stream)
                sys.stderr.flush()
                os.dup2(saved, 2)
                captured.seek(0)
                log_native_lines(captured.read().decode(errors="replace"))
    finally:
        python_stderr.close()
        os.close(saved)


def _stderr_handlers() -> list[logging.StreamHandler[Any]]:
    loggers = [logging.getLogger(), *(logger for logger in list(logging.Logger.manager.loggerDict.values())
                                      if isinstance(logger, logging.Logger))]
    return [handler for logger in loggers for handler in logger.handlers
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr]


def log_native_lines(text: str) -> None:
    # A line without a record prefix continues the record before it and takes its level
    # (TensorFlow's CPU-features INFO is two lines); one before any record is a WARNING.
    continued = logging.WARNING
    for line in text.splitlines():
        if not line.strip():
            continue
        if _NATIVE_RECORD.match(line):
            level = continued = logging.DEBUG if _NATIVE_NOISE.match(line) else logging.WARNING
        elif _NATIVE_NOISE.match(line):  # absl's banner: one line of its own
            level, continued = logging.DEBUG, logging.WARNING
        else:
            level = continued
        log.log(level, "tensorflow: %s", line.rstrip())


def freeze_heap() -> int:
    """Put every object that start-up made out of the cyclic garbage collector's reach.

    Loading TensorFlow, Keras and a model leaves hundreds of thousands of long-lived objects,
    and each full collection walks them all: a stop-the-world pause (216 ms measured on the
    2-core machine with the wide model) that held every request in flight and set the p99 at
    light load. Frozen, they stay alive as before (nothing loaded is ever freed anyway), and
    a full collection only walks what came after. Called once a worker has loaded its models.
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d objects left by start-up (pid %d)", frozen, os.getpid())
    return frozen


def refreeze_heap() -> None:
    """After a model version is unloaded: collect what the freeze kept of it, freeze the rest again.

    The collector never looks at frozen objects, so a retired version's objects that sit in
    reference cycles (Keras layers and TensorFlow functions hold many) would stay in memory for
    good. One full collection per unload (a pause like the one the freeze saves, once) frees
    them. Nothing to do where the heap was never frozen (an app outside Gunicorn).
    """
    if gc.get_freeze_count():
        gc.unfreeze()
        freeze_heap()
