"""The images, built from the Dockerfile as committed, and run: the CPU server and Locust.

Run by .ci/images, which installs buildah and makes the stand-in base image first
(.ci/standin_base.sh); elsewhere it is skipped: set IMAGE_TESTS=1 with buildah installed
and run as root. Builds use the layer cache, so a rerun after a code change takes seconds.

Containers run as uid 10001 with `buildah run --isolation chroot`, in the host's network: the
server binds free loopback ports through BIND and GRPC_BIND, as an orchestrator would set them,
and the image's own HEALTHCHECK command must follow. A stop is what `docker stop` does: SIGTERM
to the container's first process, Gunicorn's master.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.conftest import REPO, SERVER_COMMAND, free_port, free_ports, integer_rows, wait_for

BUILDAH = shutil.which("buildah")
pytestmark = [
    pytest.mark.skipif(os.environ.get("IMAGE_TESTS") != "1" or not BUILDAH,
                       reason="image tests run in CI (.ci/images): IMAGE_TESTS=1 and buildah"),
    # A cold build downloads and installs TensorFlow: minutes, not the suite's usual bound.
    pytest.mark.timeout(1200),
]
STORAGE = ["--storage-driver", os.environ.get("STORAGE_DRIVER", "overlay")]
# Where HTTPS goes through an intercepting proxy, pip in the build needs the host's CA bundle:
# mounted for RUN steps only, it leaves nothing in the image.
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
UID = 10001


def buildah(*args: str, timeout: float = 120) -> str:
    done = subprocess.run([BUILDAH, *STORAGE, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"buildah {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


def report(line: str) -> None:
    # CI's log is where the sizes and build times are read.
    print(f"[image] {line}", file=sys.stderr, flush=True)


class Image:
    def __init__(self, target: str, log_dir: Path) -> None:
        self.target = target
        self.tag = f"localhost/model-server-{target}:ci"
        self.log_path = log_dir / f"build-{target}.log"

    def build(self) -> Image:
        command = [BUILDAH, *STORAGE, "bud", "--isolation", "chroot", "--format", "docker", "--pull=never",
                   "--layers", "--target", self.target, "--tag", self.tag]
        if Path(CA_BUNDLE).is_file():
            command += ["--volume", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"]
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            done = subprocess.run([*command, str(REPO)], stdout=log, stderr=subprocess.STDOUT, timeout=1100)
        seconds = time.monotonic() - started
        assert done.returncode == 0, self.log_path.read_text(errors="replace")[-6000:]
        [image] = json.loads(buildah("images", "--json", self.tag))
        report(f"{self.target}: built in {seconds:.0f} s, {image['size']}")
        self.config = json.loads(buildah("inspect", "--type", "image", self.tag))["Docker"]["config"]
        return self


class Container:
    """A working container of an image, its processes run as uid 10001 in the host's network."""

    def __init__(self, image: Image, log_dir: Path, *, env: dict[str, str] | None = None,
                 volumes: tuple[str, ...] = ()) -> None:
        self.name = buildah("from", "--pull=never", image.tag).strip()
        self.env = env or {}
        self.volumes = volumes
        self.log_path = log_dir / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None

    def command(self, args: list[str], env: dict[str, str] | None = None) -> list[str]:
        options = ["--isolation", "chroot", "--user", f"{UID}:{UID}"]
        for name, value in {**self.env, **(env or {})}.items():
            options += ["--env", f"{name}={value}"]
        for volume in self.volumes:
            options += ["--volume", volume]
        return [BUILDAH, *STORAGE, "run", *options, self.name, "--", *args]

    def start(self, args: list[str]) -> Container:
        self._log = open(self.log_path, "wb")
        # A session of its own: buildah's helpers and the container's processes share its group.
        self.proc = subprocess.Popen(self.command(args), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def run(self, args: list[str], *, env: dict[str, str] | None = None, timeout: float = 120):
        return subprocess.run(self.command(args, env), capture_output=True, text=True, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def remove(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # Killing `buildah run` alone would leave the container's processes running.
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc is not None:
            self._log.close()
        buildah("rm", self.name)


class ImageServer(Container):
    """The CPU image's own CMD, one worker, on free loopback ports."""

    def __init__(self, image: Image, log_dir: Path, env: dict[str, str] | None = None, **kwargs) -> None:
        self.port, grpc_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_target = f"127.0.0.1:{grpc_port}"
        # READYZ_DETAIL: /readyz then names the worker's pid, which leads to the master.
        super().__init__(image, log_dir, env={"BIND": f"127.0.0.1:{self.port}", "GRPC_BIND": self.grpc_target,
                                              "WORKERS": "1", "READYZ_DETAIL": "true", **(env or {})}, **kwargs)
        # What `docker run IMAGE` runs: `buildah run` takes a command and applies no ENTRYPOINT.
        self.cmd = [*(image.config.get("Entrypoint") or []), *image.config["Cmd"]]

    def start_ready(self, *, within_s: float = 240) -> ImageServer:
        self.start(self.cmd)
        started = time.monotonic()

        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the container exited with {self.proc.returncode}:\n{self.log()}")
            try:
                answer = requests.get(self.url + "/readyz", timeout=10, headers={"Connection": "close"})
            except (requests.ConnectionError, requests.Timeout):
                return None
            return answer.json() if answer.status_code == 200 else None

        self.readyz = wait_for(ready, within_s=within_s, what=f"the image's server ready\n{self.log_path}")
        report(f"{self.name}: ready in {time.monotonic() - started:.1f} s")
        return self

    def master_pid(self) -> int:
        worker = self.readyz["pid"]
        return int(Path(f"/proc/{worker}/stat").read_text().rpartition(")")[2].split()[1])

    def stop(self, *, within_s: float = 60) -> int:
        os.kill(self.master_pid(), signal.SIGTERM)
        return self.proc.wait(within_s)

    def remove(self) -> None:
        # Gracefully where it came up, so that a test's end is not a crash in the log.
        if self.proc is not None and self.proc.poll() is None and hasattr(self, "readyz"):
            self.stop()
        super().remove()

    def predict(self, rows: np.ndarray) -> np.ndarray:
        answer = requests.post(self.url + "/predict", json={"instances": rows.tolist()}, timeout=60)
        assert answer.status_code == 200, answer.text
        return np.asarray(answer.json()["predictions"], dtype=np.float32)

    def predict_grpc(self, rows: np.ndarray, model: str) -> np.ndarray:
        import grpc
        import tensorflow as tf
        from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

        request = predict_pb2.PredictRequest()
        request.model_spec.name = model
        request.inputs["features"].CopyFrom(tf.make_tensor_proto(rows))
        with grpc.insecure_channel(self.grpc_target) as channel:
            response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=60)
        [output] = response.outputs.values()
        return tf.make_ndarray(output)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("image-logs")


@pytest.fixture(scope="module")
def cpu_image(log_dir) -> Image:
    return Image("cpu", log_dir).build()


@pytest.fixture(scope="module")
def loadtest_image(log_dir) -> Image:
    return Image("loadtest", log_dir).build()


@pytest.fixture(scope="module")
def default_server(cpu_image, log_dir):
    server = ImageServer(cpu_image, log_dir).start_ready()
    yield server
    server.remove()


@pytest.fixture(scope="module")
def mounted_models(tmp_path_factory, exact_model) -> Path:
    """TensorFlow Serving's layout, BASE/VERSION/, readable by the image's uid."""
    folder = tmp_path_factory.mktemp("mounted")
    exact_model.export(str(folder / "exact" / "1"), format="tf_saved_model", verbose=False)
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


# ---------------------------------------------------------------------------- the CPU image


def test_cpu_image_keeps_its_healthcheck_user_and_command(cpu_image):
    config = cpu_image.config
    assert config["Cmd"] == list(SERVER_COMMAND)
    assert config["User"] == f"{UID}:{UID}"
    # The docker format keeps HEALTHCHECK (the OCI format would drop it), without --start-interval.
    health = config["Healthcheck"]
    assert health["Test"][0] == "CMD" and "/healthz" in health["Test"][-1]
    assert (health["Interval"], health["StartPeriod"], health["Retries"]) == (30e9, 300e9, 3)
    assert "StartInterval" not in health


def test_default_model_is_ready_as_the_unprivileged_user(default_server):
    assert default_server.readyz["ready"] is True
    assert default_server.readyz["models"]["default"]["source"] == "built-in default model"
    status = Path(f"/proc/{default_server.readyz['pid']}/status").read_text()
    [uids] = [line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")]
    assert set(uids) == {str(UID)}


def test_healthcheck_command_follows_bind(default_server, cpu_image):
    command = cpu_image.config["Healthcheck"]["Test"][1:]
    passed = default_server.run(command)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    # The same command where nothing listens fails: it does ask the server.
    failed = default_server.run(command, env={"BIND": f"0.0.0.0:{free_port()}"})
    assert failed.returncode != 0


def test_default_model_answers_rest_and_grpc_as_the_model_itself(default_server):
    from app.core.models import build_default_model

    rows = integer_rows(5)
    served = default_server.predict(rows)
    # The same rows the same way over both APIs, bit for bit.
    assert np.array_equal(default_server.predict_grpc(rows, "default"), served)
    # Its float weights are summed in another order by another thread pool than here: equal
    # to float32's rounding (the mounted integer model below is compared exactly).
    expected = np.asarray(build_default_model()(rows))
    assert served.shape == expected.shape == (5, 3)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)


def test_mounted_model_folder_is_served_row_for_row(cpu_image, log_dir, mounted_models, exact_model):
    server = ImageServer(cpu_image, log_dir, env={"MODEL_PATH": "/models/exact", "MODEL_NAME": "exact"},
                         volumes=(f"{mounted_models}:/models:ro",))
    try:
        server.start_ready()
        assert server.readyz["models"]["exact"]["version"] == 1
        rows = integer_rows(7)
        expected = np.asarray(exact_model(rows))
        assert np.array_equal(server.predict(rows), expected)
        assert np.array_equal(server.predict_grpc(rows, "exact"), expected)
        # docker stop: SIGTERM to the first process; Gunicorn drains and exits 0.
        started = time.monotonic()
        assert server.stop() == 0, server.log()
        report(f"stopped in {time.monotonic() - started:.1f} s")
        assert not Path(f"/proc/{server.readyz['pid']}").exists()
        assert "Shutting down: Master" in server.log()
    finally:
        server.remove()


def test_tf_serving_conventions_serve_models_slash_model_name(cpu_image, log_dir, mounted_models, exact_model):
    """As `docker run -e MODEL_NAME=exact -v ...:/models IMAGE --port=... --rest_api_port=...`:
    the entrypoint serves /models/exact on the flags' ports, and REST on BIND for the HEALTHCHECK."""
    rest_port = free_port()
    server = ImageServer(cpu_image, log_dir, env={"MODEL_NAME": "exact", "TFS_LISTEN_HOST": "127.0.0.1"},
                         volumes=(f"{mounted_models}:/models:ro",))
    server.cmd = [*cpu_image.config["Entrypoint"], f"--port={server.grpc_target.rpartition(':')[2]}",
                  f"--rest_api_port={rest_port}"]
    try:
        server.start_ready()
        assert server.readyz["models"]["exact"]["version"] == 1
        rows = integer_rows(6)
        expected = np.asarray(exact_model(rows))
        answer = requests.post(f"http://127.0.0.1:{rest_port}/v1/models/exact:predict",
                               json={"instances": rows.tolist()}, timeout=60)
        assert np.array_equal(np.asarray(answer.json()["predictions"], dtype=np.float32), expected)
        assert np.array_equal(server.predict_grpc(rows, "exact"), expected)
    finally:
        server.remove()


def test_cpu_image_entrypoint_is_the_tf_serving_translator(cpu_image):
    assert cpu_image.config["Entrypoint"] == ["python", "-m", "app.entrypoint"]


# ---------------------------------------------------------------------------- the loadtest image


def test_loadtest_image_has_everything_locustfile_imports(loadtest_image, log_dir):
    from tests.test_deploy import locustfile_imports

    container = Container(loadtest_image, log_dir)
    try:
        # Its import statements in its own order (locust first: it monkey-patches the standard
        # library), the gRPC user's too.
        done = container.run(["python", "-c", "\n".join(locustfile_imports())])
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        container.remove()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_loadtest_image_runs_headless_against_the_server(loadtest_image, default_server, log_dir, tmp_path,
                                                         protocol):
    host = default_server.url if protocol == "http" else f"grpc://{default_server.grpc_target}"
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    command = loadtest_image.config["Cmd"]
    assert command[-2] == "--host"
    container = Container(loadtest_image, log_dir, env={"LOCUST_PROTOCOL": protocol},
                          volumes=(f"{out}:/out",))
    try:
        done = container.run([*command[:-1], host, "--headless", "--users", "4", "--spawn-rate", "4",
                              "--run-time", "5s", "--csv", "/out/run"], timeout=180)
        # Locust exits 1 when any request failed.
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        container.remove()
    with open(out / "run_stats.csv", newline="") as stats:
        [total] = [row for row in csv.DictReader(stats) if row["Name"] == "Aggregated"]
    report(f"locust over {protocol}: {total['Request Count']} requests, {total['Failure Count']} failures")
    assert int(total["Request Count"]) > 0
    assert int(total["Failure Count"]) == 0
