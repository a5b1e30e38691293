"""Deployment files agree with the app and with each other, checked offline in seconds.

The Dockerfile passes hadolint; the Kubernetes manifests pass the Kubernetes API schemas
(kubernetes-validate, strict); docker-compose.yml passes Compose's own validation. Then
the cross-checks no linter does: probes and HEALTHCHECK hit GET routes the app really has
(its url_map, built without TensorFlow or a model), ports agree with gunicorn.conf.py's
default bind, the image runs the very command the integration tests run, grace periods
cover the drain, and worker counts fit the CPUs and the GPU they are given.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import runpy
import shutil
import subprocess
import sysconfig
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from flask import Flask

from tests.conftest import REPO, SERVER_COMMAND

KUBERNETES_VERSION = "1.33.0"
MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
DEPLOYMENTS = ["deployment.yaml", "deployment-gpu.yaml"]
SERVER_TARGETS = ["cpu", "gpu"]
# MiB of CUDA context and kernels each worker process holds outside TensorFlow's limit.
CUDA_CONTEXT_MIB = 512


# ---------------------------------------------------------------------------- helpers


def tool(name: str) -> str:
    """A command-line tool from this interpreter's environment (pip-installed), else PATH."""
    found = shutil.which(name, path=sysconfig.get_path("scripts")) or shutil.which(name)
    assert found, f"{name} is not installed: see requirements-dev.txt"
    return found


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, arguments = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def dockerfile_stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """Each named stage's instructions, its parent stages' first: what the target builds."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for keyword, arguments in dockerfile_instructions(text):
        if keyword == "FROM":
            parts = re.split(r"\s+as\s+", arguments, flags=re.IGNORECASE)
            image, name = parts[0], parts[1] if len(parts) > 1 else None
            current = list(stages.get(image, [("FROM", image)]))
            stages[name or f"#{len(stages)}"] = current
        else:
            current.append((keyword, arguments))
    return stages


def last(instructions: list[tuple[str, str]], keyword: str) -> str:
    values = [arguments for key, arguments in instructions if key == keyword]
    assert values, f"no {keyword}"
    return values[-1]


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        candidates = [pattern] + ([pattern[3:]] if pattern.startswith("**/") else [])
        if any(fnmatch.fnmatchcase(prefix, p) for prefix in prefixes for p in candidates):
            ignored = not negated
    return ignored


def yaml_file(relative: str):
    return yaml.safe_load((REPO / relative).read_text())


def manifest(name: str) -> dict:
    [document] = [d for d in yaml.safe_load_all((REPO / "deploy" / "kubernetes" / name).read_text()) if d]
    return document


def container(deployment: dict) -> dict:
    [only] = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env_of(container_spec: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container_spec.get("env", [])}


def cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def port_number(container_spec: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container_spec["ports"] if p.get("name") == port]
    return number


@pytest.fixture(scope="module")
def stages() -> dict[str, list[tuple[str, str]]]:
    return dockerfile_stages((REPO / "Dockerfile").read_text())


@pytest.fixture(scope="module")
def get_routes() -> set[str]:
    """Paths the app answers to GET, from its url_map: no model and no TensorFlow needed."""
    from app import api

    probe_app = Flask("probe")
    api.init_app(probe_app)
    return {rule.rule for rule in probe_app.url_map.iter_rules() if "GET" in rule.methods}


@pytest.fixture
def gunicorn_defaults(monkeypatch) -> dict:
    """gunicorn.conf.py's own values with none of its variables set."""
    for name in re.findall(r"""["']([A-Z][A-Z0-9_]+)["']""", (REPO / "gunicorn.conf.py").read_text()):
        # Set, then delete: monkeypatch then restores the variable's first state, even where
        # the file itself sets it (it creates PROMETHEUS_MULTIPROC_DIR).
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    values = runpy.run_path(str(REPO / "gunicorn.conf.py"))
    shutil.rmtree(os.environ.get("PROMETHEUS_MULTIPROC_DIR", ""), ignore_errors=True)
    return values


@pytest.fixture
def default_port(gunicorn_defaults) -> int:
    return int(gunicorn_defaults["bind"].rpartition(":")[2])


# ---------------------------------------------------------------------------- Dockerfile


def test_dockerfile_passes_hadolint():
    result = subprocess.run([tool("hadolint"), "--failure-threshold", "warning", "Dockerfile"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_gate_fails_on_a_warning(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install flask\n")
    result = subprocess.run([tool("hadolint"), "--failure-threshold", "warning", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "DL3006" in result.stdout  # untagged base image


def test_default_target_is_the_cpu_server(stages):
    assert list(stages)[-1] == "cpu"


@pytest.mark.parametrize("target", SERVER_TARGETS)
def test_server_runs_the_integration_tests_command(stages, target):
    assert json.loads(last(stages[target], "CMD")) == list(SERVER_COMMAND)


@pytest.mark.parametrize("target", SERVER_TARGETS)
def test_server_exposes_gunicorn_default_port(stages, target, default_port):
    exposed = {int(port.split("/")[0]) for key, ports in stages[target] if key == "EXPOSE" for port in ports.split()}
    assert exposed == {default_port}


@pytest.mark.parametrize("target", SERVER_TARGETS)
def test_server_runs_as_numeric_non_root_user(stages, target):
    user, _, group = last(stages[target], "USER").partition(":")
    assert user.isdigit() and int(user) != 0
    assert group.isdigit() and int(group) != 0


@pytest.mark.parametrize("target", SERVER_TARGETS)
def test_healthcheck_gets_a_liveness_route_on_the_bind_port(stages, target, get_routes, gunicorn_defaults):
    healthcheck = last(stages[target], "HEALTHCHECK")
    assert re.findall(r"'(/[\w/.-]*)'", healthcheck) == ["/healthz"]
    assert "/healthz" in get_routes
    # It reads the port from BIND as gunicorn.conf.py does, with the same default.
    assert f"'BIND', '{gunicorn_defaults['bind']}'" in healthcheck


@pytest.mark.parametrize("target", SERVER_TARGETS)
def test_requirements_install_before_the_code_is_copied(stages, target):
    steps = stages[target]
    install = next(i for i, (key, args) in enumerate(steps) if key == "RUN" and "pip install" in args)
    copy_code = next(i for i, (key, args) in enumerate(steps) if key == "COPY" and args.startswith("app/"))
    assert install < copy_code
    copied_before = [args for key, args in steps[:install] if key == "COPY"]
    assert copied_before == ["requirements.txt ./"]


def test_gpu_target_installs_the_cuda_build_of_the_pinned_tensorflow(stages):
    [cpu_pin] = re.findall(r"^tensorflow-cpu==([\w.]+)", (REPO / "requirements.txt").read_text(), re.MULTILINE)
    installs = " ".join(args for key, args in stages["gpu"] if key == "RUN")
    assert f'"tensorflow[and-cuda]=={cpu_pin}"' in installs
    assert "grep -v '^tensorflow' requirements.txt" in installs
    cpu_installs = " ".join(args for key, args in stages["cpu"] if key == "RUN")
    assert "and-cuda" not in cpu_installs


def test_dockerignore_passes_what_the_image_copies_and_nothing_else():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = {source.rstrip("/") for key, args in dockerfile_instructions((REPO / "Dockerfile").read_text())
               if key == "COPY" for source in args.split()[:-1] if not source.startswith("--")}
    assert sources >= {"requirements.txt", "wsgi.py", "gunicorn.conf.py", "app"}
    for source in sources:
        assert not dockerignored(source, patterns), source
        assert (REPO / source).exists(), source
    assert not dockerignored("app/api.py", patterns)
    for kept_out in (".venv/bin/python", ".git/HEAD", "tests/test_deploy.py", ".pytest_cache/v",
                     "docs/deployment.md", "app/__pycache__/api.cpython-311.pyc", "models/my.keras"):
        assert dockerignored(kept_out, patterns), kept_out


# ---------------------------------------------------------------------------- Kubernetes


def test_every_manifest_is_checked():
    assert {path.name for path in MANIFESTS} == {*DEPLOYMENTS, "service.yaml", "hpa.yaml", "pdb.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_manifest_is_valid_kubernetes(path):
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert documents
    for document in documents:
        # Raises on a schema violation, an unknown field (strict) or an unknown kind.
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_validation_rejects_a_misspelt_field():
    deployment = copy.deepcopy(manifest("deployment.yaml"))
    container(deployment)["readinesProbe"] = container(deployment).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_probes_get_routes_of_the_app_on_the_gunicorn_port(name, get_routes, default_port):
    server = container(manifest(name))
    expected = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in expected.items():
        http_get = server[probe]["httpGet"]
        assert http_get["path"] == path
        assert path in get_routes
        assert port_number(server, http_get["port"]) == default_port
    assert [p["containerPort"] for p in server["ports"]] == [default_port]


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_grace_period_covers_prestop_and_gunicorn_drain(name, gunicorn_defaults):
    pod = manifest(name)["spec"]["template"]["spec"]
    server = container(manifest(name))
    command = server["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    drain_s = int(env_of(server).get("GRACEFUL_TIMEOUT", gunicorn_defaults["graceful_timeout"]))
    assert pod["terminationGracePeriodSeconds"] > int(command[1]) + drain_s


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_tensorflow_threads_fit_the_cpu_limit(name):
    server = container(manifest(name))
    env = env_of(server)
    workers = int(env["WORKERS"])
    assert workers * int(env["TF_INTRA_OP_THREADS"]) <= cpus(server["resources"]["limits"]["cpu"])
    assert int(env.get("THREADS", 2 * int(env["MAX_BATCH_SIZE"]))) >= int(env["MAX_BATCH_SIZE"])


def test_gpu_workers_fit_the_card():
    deployment = manifest("deployment-gpu.yaml")
    server = container(deployment)
    env = env_of(server)
    card_mib = int(deployment["metadata"]["annotations"]["model-server/gpu-card-memory-mib"])
    assert int(env["GPU_MEMORY_LIMIT_MB"]) > 0
    assert int(env["WORKERS"]) * (int(env["GPU_MEMORY_LIMIT_MB"]) + CUDA_CONTEXT_MIB) <= card_mib
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_pod_user_is_the_image_user(name, stages):
    pod_security = manifest(name)["spec"]["template"]["spec"]["securityContext"]
    user, _, group = last(stages["cpu"], "USER").partition(":")
    assert pod_security["runAsNonRoot"] is True
    assert (pod_security["runAsUser"], pod_security["runAsGroup"]) == (int(user), int(group))


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_service_hpa_and_pdb_select_the_deployment(name):
    deployment = manifest(name)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    service, hpa, pdb = manifest("service.yaml"), manifest("hpa.yaml"), manifest("pdb.yaml")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    [service_port] = service["spec"]["ports"]
    assert port_number(container(deployment), service_port["targetPort"]) == service_port["port"]


def test_manifests_in_the_scaling_guide_are_valid_kubernetes():
    text = (REPO / "docs" / "scaling.md").read_text()
    blocks = [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)]
    documents = [block for block in blocks if isinstance(block, dict) and "apiVersion" in block]
    assert any(d["kind"] == "HorizontalPodAutoscaler" for d in documents)
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


# ---------------------------------------------------------------------------- Compose


def compose_command() -> list[str]:
    """Compose v2 (`docker compose`) where the plugin is there, else Debian's docker-compose."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return [tool("docker-compose")]


def test_compose_file_passes_compose_validation():
    # `config` reads, interpolates and validates the file against Compose's schema: no daemon needed.
    result = subprocess.run([*compose_command(), "-f", "docker-compose.yml", "config", "--quiet"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_services_build_the_dockerfile_targets(stages, default_port):
    services = yaml_file("docker-compose.yml")["services"]
    assert set(services) == {"api", "locust", "prometheus", "grafana"}
    assert services["api"]["build"]["target"] == "cpu"
    assert f"8000:{default_port}" in services["api"]["ports"]
    assert services["locust"]["build"]["target"] in stages
    assert services["locust"]["command"][-2:] == ["--host", f"http://api:{default_port}"]
    assert "-f" in services["locust"]["command"] and "8089:8089" in services["locust"]["ports"]


def test_compose_mounts_exist():
    services = yaml_file("docker-compose.yml")["services"]
    mounts = [volume.split(":") for service in services.values() for volume in service.get("volumes", [])]
    assert mounts, "prometheus and grafana mount their configuration"
    for host, container_path, *_ in mounts:
        relative = Path(host).as_posix().removeprefix("./")
        assert (REPO / relative).exists(), f"{host} (mounted at {container_path})"


def test_prometheus_scrapes_the_api_metrics_every_5_seconds(default_port):
    [job] = yaml_file("deploy/prometheus/prometheus.yml")["scrape_configs"]
    assert job["job_name"] == "model-server"
    assert job["metrics_path"] == "/metrics"
    assert job["scrape_interval"] == "5s"
    assert job["static_configs"] == [{"targets": [f"api:{default_port}"]}]


def test_grafana_provisioning_points_at_prometheus_and_the_mounted_dashboards():
    services = yaml_file("docker-compose.yml")["services"]
    mounts = dict(volume.split(":")[:2] for volume in services["grafana"]["volumes"])
    [source] = yaml_file("deploy/grafana/provisioning/datasources/prometheus.yml")["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert "9090:9090" in services["prometheus"]["ports"]
    [provider] = yaml_file("deploy/grafana/provisioning/dashboards/dashboards.yml")["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == mounts["./deploy/grafana/dashboards"] == "/var/lib/grafana/dashboards"
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


# ---------------------------------------------------------------------------- docs


def test_deployment_guide_names_every_setting():
    from app.settings import documented

    gunicorn_variables = re.findall(r"""_env\("([A-Z_]+)"|environ\.get\("([A-Z_]+)\"""",
                                    (REPO / "gunicorn.conf.py").read_text())
    names = {name for name, _, _ in documented()} | {a or b for a, b in gunicorn_variables}
    assert {"BIND", "WORKERS", "THREADS", "GRACEFUL_TIMEOUT"} <= names
    guide = (REPO / "docs" / "deployment.md").read_text()
    assert sorted(name for name in names if f"`{name}`" not in guide) == []
