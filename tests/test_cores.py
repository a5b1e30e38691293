"""Usable CPUs (affinity, cgroup CPU quota) and the defaults derived from them.

The cgroup readers run against fake trees: a root folder holding proc/self/cgroup and
sys/fs/cgroup/..., laid out as the kernel lays them out (cgroup v2: cpu.max; v1's cpu
controller: cpu.cfs_quota_us and cpu.cfs_period_us).
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from app.core import shared_config
from app.ops.runtime import CPUS_PER_WORKER, UsableCpus, cgroup_cpu_quota, default_workers, usable_cpus
from tests.conftest import REPO, SERVER_COMMAND, Server


def fake_tree(root: Path, own_cgroup: str, files: dict[str, str]) -> str:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(own_cgroup)
    for path, content in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(content)
    return str(root)


V1_HYBRID = "12:memory:/job\n4:cpu,cpuacct:/job/task\n1:name=systemd:/job\n0::/job\n"


@pytest.mark.parametrize("own_cgroup,files,quota", [
    # v2, no limit anywhere
    ("0::/\n", {"sys/fs/cgroup/cpu.max": "max 100000\n"}, None),
    # v2, the process's own cgroup: 2 CPUs
    ("0::/app.slice/server.service\n", {"sys/fs/cgroup/app.slice/server.service/cpu.max": "200000 100000\n"}, 2.0),
    # v2, a parent's quota binds the child that has none of its own
    ("0::/kubepods/pod1/ctr\n", {"sys/fs/cgroup/kubepods/pod1/cpu.max": "150000 100000\n",
                                 "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000\n"}, 1.5),
    # v2, the tightest level wins, wherever it is
    ("0::/a/b\n", {"sys/fs/cgroup/a/cpu.max": "300000 100000", "sys/fs/cgroup/a/b/cpu.max": "800000 100000"}, 3.0),
    # v2 in a container without its own cgroup namespace: the host's path is not under the
    # mount, whose root is the container's cgroup
    ("0::/system.slice/docker-1234.scope\n", {"sys/fs/cgroup/cpu.max": "50000 100000\n"}, 0.5),
    # v1, cpu and cpuacct mounted together
    (V1_HYBRID, {"sys/fs/cgroup/cpu,cpuacct/job/task/cpu.cfs_quota_us": "250000\n",
                 "sys/fs/cgroup/cpu,cpuacct/job/task/cpu.cfs_period_us": "100000\n"}, 2.5),
    # v1, mounted alone as "cpu"; -1 is no limit at that level, the parent's counts
    ("3:cpu:/job/task\n", {"sys/fs/cgroup/cpu/job/task/cpu.cfs_quota_us": "-1\n",
                           "sys/fs/cgroup/cpu/job/task/cpu.cfs_period_us": "100000\n",
                           "sys/fs/cgroup/cpu/job/cpu.cfs_quota_us": "400000\n",
                           "sys/fs/cgroup/cpu/job/cpu.cfs_period_us": "100000\n"}, 4.0),
    # v1, no limit
    ("3:cpu:/\n", {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"},
     None),
    # another controller's hierarchy is not read, even one whose name starts with "cpu"
    ("5:cpuset:/x\n", {"sys/fs/cgroup/cpuset/x/cpu.cfs_quota_us": "100000\n",
                       "sys/fs/cgroup/cpuset/x/cpu.cfs_period_us": "100000\n"}, None),
    # files that cannot be read, or read as garbage, are no limit
    ("0::/\n", {"sys/fs/cgroup/cpu.max": "lots\n"}, None),
    ("0::/\n", {}, None),
    ("not a cgroup line\n", {"sys/fs/cgroup/cpu.max": "100000 100000\n"}, None),
])
def test_cgroup_cpu_quota_reads_the_tightest_level_of_the_own_cgroup(tmp_path, own_cgroup, files, quota):
    assert cgroup_cpu_quota(fake_tree(tmp_path, own_cgroup, files)) == quota


def test_without_proc_self_cgroup_there_is_no_quota(tmp_path):
    assert cgroup_cpu_quota(str(tmp_path)) is None


@pytest.mark.parametrize("cpu_max,affinity,expected", [
    ("150000 100000", 8, UsableCpus(2, "cgroup cpu quota", 8, 1.5)),  # a fraction rounds up
    ("50000 100000", 8, UsableCpus(1, "cgroup cpu quota", 8, 0.5)),
    ("800000 100000", 2, UsableCpus(2, "affinity", 2, 8.0)),  # taskset to 2 inside an 8-CPU limit
    ("200000 100000", 2, UsableCpus(2, "affinity", 2, 2.0)),
    ("max 100000", 16, UsableCpus(16, "affinity", 16, None)),
])
def test_usable_cpus_are_the_fewer_of_affinity_and_quota(tmp_path, cpu_max, affinity, expected):
    root = fake_tree(tmp_path, "0::/\n", {"sys/fs/cgroup/cpu.max": cpu_max})
    assert usable_cpus(root=root, affinity=affinity) == expected


def test_missing_cgroup_files_leave_the_affinity(tmp_path):
    assert usable_cpus(root=str(tmp_path)) == UsableCpus(len(os.sched_getaffinity(0)), "affinity",
                                                         len(os.sched_getaffinity(0)), None)


@pytest.mark.parametrize("cpus,workers", [(1, 1), (2, 1), (3, 1), (4, 1), (7, 1), (8, 2), (16, 4), (64, 16)])
def test_one_worker_per_four_usable_cpus(cpus, workers):
    assert CPUS_PER_WORKER == 4
    assert default_workers(cpus) == workers


def _gunicorn_config(monkeypatch, environ: dict[str, str], cpus: int) -> dict:
    """gunicorn.conf.py's knobs with `cpus` usable CPUs (its import only reads)."""
    from app.ops import runtime

    monkeypatch.setattr(runtime, "usable_cpus", lambda **_: runtime.UsableCpus(cpus, "affinity", cpus, None))
    for name in ("WORKERS", "THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    config = runpy.run_path(str(REPO / "gunicorn.conf.py"))
    return {name: config[name] for name in ("workers", "threads")}


def test_gunicorn_derives_workers_from_usable_cpus_unless_workers_is_set(monkeypatch):
    assert _gunicorn_config(monkeypatch, {}, cpus=16) == {"workers": 4, "threads": 128 + 2 * 32}
    assert _gunicorn_config(monkeypatch, {"WORKERS": "3"}, cpus=16)["workers"] == 3
    assert _gunicorn_config(monkeypatch, {"WORKERS": ""}, cpus=2)["workers"] == 1


class _PinnedServer(Server):
    """The server on CPU 0 only, with no --workers flag: every count is derived."""

    def start(self, *, workers: int = 1, ready_within_s: float = 180) -> Server:
        self.env.pop("WORKERS", None)
        self.env.pop("TF_INTRA_OP_THREADS", None)
        self.env.pop("TF_INTER_OP_THREADS", None)
        command = ["taskset", "--cpu-list", "0", sys.executable, "-m", *SERVER_COMMAND]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_ready(workers=workers, within_s=ready_within_s)
        return self


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is not installed")
def test_one_usable_cpu_reaches_tensorflow_through_gunicorn(tmp_path, exact_model_path):
    # The small model: the default one takes far longer to build on one CPU, and is not what this checks.
    server = _PinnedServer(tmp_path, {"MODEL_PATH": str(exact_model_path)})
    try:
        server.start()
        readyz = requests.get(server.url + "/readyz", timeout=60).json()
        tensorflow = readyz["tensorflow"]
    finally:
        server.stop()
    # The worker froze what loading left (gunicorn.conf.py's post_worker_init): TensorFlow alone
    # leaves far more than this many objects.
    assert readyz["gc_frozen_objects"] > 10_000
    # No cgroup quota on a CI machine is below one CPU: the affinity is what limits here.
    assert tensorflow == {
        "intra_op_threads": 1, "inter_op_threads": 1, "gpus": 0, "gpu_memory_limit_mb": None,
        "workers": 1, "usable_cpus": 1, "usable_cpus_from": "affinity"}
    assert "'usable_cpus': 1, 'usable_cpus_from': 'affinity'" in server.log()


def test_importing_gunicorn_conf_changes_nothing_and_on_starting_does_the_work(monkeypatch, tmp_path):
    # setenv first, so that monkeypatch records the variable's state before the test and puts
    # it back: on_starting sets it in os.environ itself, and a later delenv alone would restore
    # the folder on_exit removed, for every test after this one.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    monkeypatch.setenv("BATCH_TIMEOUT_MS", "40000")
    monkeypatch.setenv("GRACEFUL_TIMEOUT", "30")
    before = dict(os.environ)
    config = runpy.run_path(str(REPO / "gunicorn.conf.py"))  # neither exits nor writes
    assert dict(os.environ) == before

    class Master:
        cfg = type("Cfg", (), {"graceful_timeout": 30})()

    with pytest.raises(SystemExit, match="BATCH_TIMEOUT_MS=40000 must stay below GRACEFUL_TIMEOUT=30"):
        config["on_starting"](Master())
    monkeypatch.setenv("BATCH_TIMEOUT_MS", "5")
    config = runpy.run_path(str(REPO / "gunicorn.conf.py"))
    master = Master()
    config["on_starting"](master)
    made = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    assert master.own_metrics_dir == made and os.path.isdir(made) and not os.listdir(made)
    # Where the workers share a reloaded model config (app/core/shared_config.py): the server's own.
    run_dir = os.environ[shared_config.RUN_DIR_ENV]
    assert master.run_dir == run_dir and os.path.isdir(run_dir) and not os.listdir(run_dir)
    config["on_exit"](master)
    assert not os.path.exists(made)
    assert not os.path.exists(run_dir) and shared_config.RUN_DIR_ENV not in os.environ
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")

    # A folder the operator names is kept, emptied of an earlier run's values.
    (tmp_path / "counter_1.db").write_bytes(b"old")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    config["on_starting"](master)
    assert master.own_metrics_dir is None and os.listdir(tmp_path) == []
    config["on_exit"](master)
    assert tmp_path.is_dir()
