"""Deployment files agree with the app and with each other, checked offline in seconds.

The Dockerfile passes hadolint; the Kubernetes manifests pass the Kubernetes API schemas
(kubernetes-validate, strict); docker-compose.yml passes Compose's own validation; the
alert rules pass `promtool check rules` and their unit tests (`promtool test rules`); the
prometheus-adapter queries and the dashboard's are valid PromQL (promtool). Then the
cross-checks no linter does: probes and HEALTHCHECK hit GET routes the app really has (its
url_map, built without TensorFlow or a model), ports agree with gunicorn.conf.py's default
bind and GRPC_BIND, the image runs the very command the integration tests run, grace periods
cover the drain, worker counts fit the CPUs and the GPU they are given, the HPAs ask for
the metric the adapter serves, every setting reaches the compose container with its
default, rules and panels name only metrics the app exports, and the locks pin the whole
tree the requirements name. nginx's own config is run for real in tests/test_nginx.py.
"""

from __future__ import annotations

import ast
import copy
import fnmatch
import importlib.metadata
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from flask import Flask

from tests.conftest import REPO, SERVER_COMMAND, free_port

KUBERNETES_VERSION = "1.33.0"
MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
DEPLOYMENTS = ["deployment.yaml", "deployment-gpu.yaml"]
# Each deployment's autoscaler: the same name, so one replaces the other.
HPAS = {"deployment.yaml": "hpa.yaml", "deployment-gpu.yaml": "hpa-gpu.yaml"}
MONITORING = REPO / "deploy" / "kubernetes" / "monitoring"
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


def container(deployment: dict, name: str = "model-server") -> dict:
    [found] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def env_of(container_spec: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container_spec.get("env", [])}


def cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def nginx_listen_port() -> int:
    [port] = re.findall(r"^\s*listen (\d+);", (REPO / "deploy" / "nginx" / "nginx.conf").read_text(), re.MULTILINE)
    return int(port)


def nginx_grpc_listen_port() -> int:
    """The port of nginx's gRPC front."""
    [port] = re.findall(r"^\s*listen (\d+) http2;", (REPO / "deploy" / "nginx" / "nginx.conf").read_text(),
                        re.MULTILINE)
    return int(port)


def nginx_grpc_upstream() -> str:
    """host:port nginx's gRPC front passes to: the workers' GRPC_BIND where nginx is in front."""
    [address] = re.findall(r"upstream model_server_grpc \{\s*server ([\d.]+:\d+);",
                           (REPO / "deploy" / "nginx" / "nginx.conf").read_text())
    return address


def grpc_port() -> int:
    from app.ops.settings import Settings

    return int(Settings().grpc_bind.rpartition(":")[2])


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
    from types import SimpleNamespace

    from app.http import routes, tfs
    from app.ops.settings import Settings

    probe_app = Flask("probe")
    routes.init_app(probe_app)
    routes.register(probe_app, SimpleNamespace(settings=Settings()), "tfs", tfs.ROUTES)
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
    # 8501: REST under TF Serving's image conventions (app/entrypoint.py).
    assert exposed == {default_port, grpc_port(), 8501}


@pytest.mark.parametrize("target", SERVER_TARGETS)
def test_server_runs_as_numeric_non_root_user(stages, target):
    user, _, group = last(stages[target], "USER").partition(":")
    assert user.isdigit() and int(user) != 0
    assert group.isdigit() and int(group) != 0


@pytest.mark.parametrize("target", SERVER_TARGETS)
def test_healthcheck_gets_a_liveness_route_on_the_bind_port(stages, target, get_routes, gunicorn_defaults):
    healthcheck = last(stages[target], "HEALTHCHECK")
    # buildah/podman 4 and Docker before 25 stop at --start-interval.
    assert "--start-interval" not in healthcheck
    assert re.findall(r"'(/[\w/.-]*)'", healthcheck) == ["/healthz"]
    assert "/healthz" in get_routes
    # It reads the port from BIND as gunicorn.conf.py does, with the same default.
    assert f"'BIND', '{gunicorn_defaults['bind']}'" in healthcheck


@pytest.mark.parametrize("bind", ["0.0.0.0:{port}", "127.0.0.1:{port}", " 127.0.0.1:{port} , 0.0.0.0:{other}"])
def test_healthcheck_command_asks_the_first_address_in_bind(stages, bind):
    """The image's HEALTHCHECK command run here, against a /healthz on the port BIND names."""
    import http.server
    import threading

    class Healthz(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    command = json.loads(last(stages["cpu"], "HEALTHCHECK").partition("CMD")[2])
    assert command[0] == "python"
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthz) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port, other = server.server_address[1], free_port()
        environ = {**os.environ, "BIND": bind.format(port=port, other=other)}
        passed = subprocess.run([sys.executable, *command[1:]], env=environ, capture_output=True, timeout=30)
        server.shutdown()
    assert passed.returncode == 0, passed.stderr
    environ["BIND"] = f"0.0.0.0:{other},127.0.0.1:{port}"
    failed = subprocess.run([sys.executable, *command[1:]], env=environ, capture_output=True, timeout=30)
    assert failed.returncode != 0


@pytest.mark.parametrize("target", SERVER_TARGETS)
def test_requirements_install_before_the_code_is_copied(stages, target):
    steps = stages[target]
    install = next(i for i, (key, args) in enumerate(steps) if key == "RUN" and "pip install" in args)
    copy_code = next(i for i, (key, args) in enumerate(steps) if key == "COPY" and args.startswith("app/"))
    assert install < copy_code
    copied_before = [args for key, args in steps[:install] if key == "COPY"]
    assert copied_before == [f"requirements-{target}.lock requirements-nodeps.txt ./"]
    # The lock, then TF Serving's stubs without their `tensorflow` dependency.
    # libclang (61 MB) goes in the same layer, or it would still be in the image.
    assert " ".join(steps[install][1].split()) == (f"pip install --no-cache-dir -r requirements-{target}.lock "
                                 "&& pip install --no-cache-dir --no-deps -r requirements-nodeps.txt "
                                 "&& pip uninstall --yes libclang")


def test_dockerignore_passes_what_the_image_copies_and_nothing_else():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    # COPY --from takes from another stage, not from the context.
    sources = {source.rstrip("/") for key, args in dockerfile_instructions((REPO / "Dockerfile").read_text())
               if key == "COPY" and not args.startswith("--from") for source in args.split()[:-1]}
    assert sources >= {"requirements-cpu.lock", "requirements-gpu.lock", "requirements-loadtest.lock",
                       "requirements-nodeps.txt", "wsgi.py", "gunicorn.conf.py", "app"}
    for source in sources:
        assert not dockerignored(source, patterns), source
        assert (REPO / source).exists(), source
    assert not dockerignored("app/http/tfs.py", patterns)
    for kept_out in (".venv/bin/python", ".git/HEAD", "tests/test_deploy.py", ".pytest_cache/v",
                     "docs/deployment.md", "app/__pycache__/api.cpython-311.pyc", "models/my.keras"):
        assert dockerignored(kept_out, patterns), kept_out


# ---------------------------------------------------------------------------- Kubernetes


def test_every_manifest_is_checked():
    assert {path.name for path in MANIFESTS} == {*DEPLOYMENTS, *HPAS.values(), "service.yaml", "pdb.yaml",
                                                 "nginx-configmap.yaml"}


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
    # gRPC is bound to the pod's loopback, where nginx's gRPC front passes calls: no container port.
    assert [p["containerPort"] for p in server["ports"]] == [default_port]
    assert env_of(server)["GRPC_BIND"] == nginx_grpc_upstream()
    assert nginx_grpc_upstream().startswith("127.0.0.1:")


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
    service, hpa, pdb = manifest("service.yaml"), manifest(HPAS[name]), manifest("pdb.yaml")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    assert set(ports) == {"http", "grpc"}
    # HTTP and gRPC both go to the nginx sidecar; gRPC clients keep TF Serving's port.
    nginx = container(deployment, "nginx")
    assert port_number(nginx, ports["http"]["targetPort"]) == nginx_listen_port()
    assert port_number(nginx, ports["grpc"]["targetPort"]) == ports["grpc"]["port"] == nginx_grpc_listen_port()
    assert nginx_grpc_listen_port() == grpc_port()


def test_scaling_guide_states_what_the_autoscalers_do():
    text = (REPO / "docs" / "scaling.md").read_text()
    assert "deploy/prometheus-adapter/config.yaml" in text
    for name in HPAS.values():
        spec = manifest(name)["spec"]
        pods_metric, cpu = spec["metrics"]
        assert f"deploy/kubernetes/{name}" in text
        assert f"{spec['minReplicas']} to {spec['maxReplicas']}" in text, name
        assert f"{pods_metric['pods']['target']['averageValue']} rows a pod" in text, name
        assert f"at {cpu['resource']['target']['averageUtilization']} %" in text, name


# ---------------------------------------------------------------------------- Compose


def compose_command() -> list[str]:
    """Compose v2 (`docker compose`) where the plugin is there, else Debian's docker-compose."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return [tool("docker-compose")]


def compose_config(**environ: str) -> dict:
    """`config` reads, interpolates and validates the file against Compose's schema: no daemon needed."""
    clean = {k: v for k, v in os.environ.items() if k not in {name for name, _ in compose_settings()}}
    result = subprocess.run([*compose_command(), "-f", "docker-compose.yml", "config"], cwd=REPO,
                            capture_output=True, text=True, timeout=60,
                            env={**clean, "GRAFANA_ADMIN_PASSWORD": "test-only", **environ})
    assert result.returncode == 0, result.stdout + result.stderr
    return yaml.safe_load(result.stdout)


def compose_settings() -> list[tuple[str, object]]:
    """(variable, default) of every server setting: app/ops/settings.py's and gunicorn.conf.py's."""
    from app.ops.settings import documented

    return [(name, default) for name, default, _ in documented()] + [
        ("BIND", "0.0.0.0:8000"), ("WORKERS", None), ("THREADS", None), ("TIMEOUT", 120),
        ("GRACEFUL_TIMEOUT", 30), ("KEEPALIVE", 5), ("PROMETHEUS_MULTIPROC_DIR", None)]


def test_compose_file_passes_compose_validation():
    assert compose_config()["services"]


def test_compose_needs_a_grafana_password():
    clean = {k: v for k, v in os.environ.items() if k != "GRAFANA_ADMIN_PASSWORD"}
    result = subprocess.run([*compose_command(), "-f", "docker-compose.yml", "config", "--quiet"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, env=clean)
    assert result.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in result.stdout + result.stderr


def test_compose_services_build_the_dockerfile_targets(stages, default_port):
    services = yaml_file("docker-compose.yml")["services"]
    assert set(services) == {"api", "nginx", "api-gpu", "locust", "prometheus", "grafana"}
    assert services["api"]["build"]["target"] == "cpu"
    assert services["api-gpu"]["build"]["target"] == "gpu"
    # Gunicorn on loopback only: nginx's 8080 and gRPC front are the public doors (docs/reliability.md);
    # the workers' gRPC is on the container's loopback, so it is not published at all.
    expected_ports = {f"127.0.0.1:8000:{default_port}", f"{grpc_port()}:{nginx_grpc_listen_port()}",
                      f"8080:{nginx_listen_port()}"}
    assert set(services["api"]["ports"]) == expected_ports
    assert services["locust"]["build"]["target"] == "loadtest"
    # Load goes through nginx, as clients' would.
    assert services["locust"]["command"][-2:] == ["--host", f"http://api:{nginx_listen_port()}"]
    assert "-f" in services["locust"]["command"] and "127.0.0.1:8089:8089" in services["locust"]["ports"]
    assert json.loads(last(stages["loadtest"], "CMD")) == services["locust"]["command"]


def test_compose_asks_the_images_healthcheck_every_5_seconds():
    services = yaml_file("docker-compose.yml")["services"]
    health = services["api"]["healthcheck"]
    # No test: the image's own command, which follows BIND. No start_interval: Compose before
    # 2.20 rejects it (test_compose_file_passes_compose_validation runs Debian's 1.29).
    assert health == {"interval": "5s", "timeout": "5s", "start_period": "300s", "retries": 3}
    assert services["locust"]["depends_on"]["api"] == {"condition": "service_healthy"}


def test_compose_passes_every_setting_with_the_servers_default(monkeypatch):
    from app.ops.settings import Settings

    config = compose_config()
    for service in ("api", "api-gpu"):
        environment = config["services"][service]["environment"]
        assert sorted(environment) == sorted(name for name, _ in compose_settings()), service
    # api's workers serve gRPC on loopback behind nginx's front; otherwise both get the same list.
    api = dict(config["services"]["api"]["environment"])
    assert api.pop("GRPC_BIND") == nginx_grpc_upstream()
    environment = config["services"]["api-gpu"]["environment"]
    assert api == {name: value for name, value in environment.items() if name != "GRPC_BIND"}
    # The container gets exactly the server's defaults: settings and gunicorn.conf.py read them so.
    for name, value in environment.items():
        monkeypatch.setenv(name, str(value))
    assert Settings.from_env() == Settings()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(REPO / ".pytest_cache" / "compose-metrics"))
    values = runpy.run_path(str(REPO / "gunicorn.conf.py"))
    settings = Settings()
    derived_threads = settings.max_queue_rows + 2 * settings.max_batch_size
    assert (values["bind"], values["workers"], values["threads"], values["timeout"], values["graceful_timeout"],
            values["keepalive"]) == ("0.0.0.0:8000", 1, derived_threads, 120, 30, 5)


def test_compose_settings_follow_the_shell():
    config = compose_config(WORKERS="3", THREADS="40", GRPC_BIND="", LOG_FORMAT="json")
    environment = config["services"]["api"]["environment"]
    assert (environment["WORKERS"], environment["THREADS"], environment["GRPC_BIND"], environment["LOG_FORMAT"]) == (
        "3", "40", "", "json")


def test_compose_gpu_profile_reserves_a_gpu_and_other_ports(default_port):
    services = yaml_file("docker-compose.yml")["services"]
    gpu = services["api-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert set(gpu["ports"]) == {f"127.0.0.1:8001:{default_port}", f"127.0.0.1:8501:{grpc_port()}"}
    assert "profiles" not in services["api"]


def test_compose_nginx_fronts_the_api_with_the_shipped_config():
    services = yaml_file("docker-compose.yml")["services"]
    nginx = services["nginx"]
    # In api's network namespace, as the sidecar is in the pod: Gunicorn is 127.0.0.1:8000 for both.
    assert nginx["network_mode"] == "service:api"
    assert nginx["volumes"] == ["./deploy/nginx/nginx.conf:/etc/nginx/nginx.conf:ro"]
    pod = manifest("deployment.yaml")
    assert nginx["image"] == container(pod, "nginx")["image"]


def test_compose_binds_tools_to_loopback_and_grafana_has_no_anonymous_access():
    services = yaml_file("docker-compose.yml")["services"]
    for name in ("locust", "prometheus", "grafana"):
        assert all(port.startswith("127.0.0.1:") for port in services[name]["ports"]), name
    assert services["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


def test_compose_mounts_exist():
    services = yaml_file("docker-compose.yml")["services"]
    mounts = [volume.split(":") for service in services.values() for volume in service.get("volumes", [])]
    assert mounts, "prometheus and grafana mount their configuration"
    for host, container_path, *_ in mounts:
        relative = Path(host).as_posix().removeprefix("./")
        assert (REPO / relative).exists(), f"{host} (mounted at {container_path})"


def test_prometheus_scrapes_the_api_metrics_every_5_seconds(default_port):
    config = yaml_file("deploy/prometheus/prometheus.yml")
    [job] = config["scrape_configs"]
    assert job["job_name"] == "model-server"
    assert job["metrics_path"] == "/metrics"
    assert job["scrape_interval"] == "5s"
    assert job["static_configs"] == [{"targets": [f"api:{default_port}", f"api-gpu:{default_port}"]}]
    assert config["rule_files"] == ["alerts.yml"]
    services = yaml_file("docker-compose.yml")["services"]
    assert services["prometheus"]["volumes"] == ["./deploy/prometheus:/etc/prometheus:ro"]


def test_grafana_provisioning_points_at_prometheus_and_the_mounted_dashboards():
    services = yaml_file("docker-compose.yml")["services"]
    mounts = dict(volume.split(":")[:2] for volume in services["grafana"]["volumes"])
    [source] = yaml_file("deploy/grafana/provisioning/datasources/prometheus.yml")["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in services["prometheus"]["ports"]
    [provider] = yaml_file("deploy/grafana/provisioning/dashboards/dashboards.yml")["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == mounts["./deploy/grafana/dashboards"] == "/var/lib/grafana/dashboards"
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


# ---------------------------------------------------------------------------- docs


def test_settings_reference_names_every_setting():
    from app.ops.settings import documented

    gunicorn_variables = re.findall(r"""_env\("([A-Z_]+)"|environ\.get\("([A-Z_]+)\"""",
                                    (REPO / "gunicorn.conf.py").read_text())
    names = {name for name, _, _ in documented()} | {a or b for a, b in gunicorn_variables}
    assert {"BIND", "WORKERS", "THREADS", "GRACEFUL_TIMEOUT"} <= names
    guide = (REPO / "docs" / "settings.md").read_text()
    assert sorted(name for name in names if f"`{name}`" not in guide) == []


# ---------------------------------------------------------------------------- Kubernetes: scaling, nginx, monitoring


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_replicas_are_left_to_the_autoscaler_and_the_image_is_versioned(name):
    deployment = manifest(name)
    assert "replicas" not in deployment["spec"]
    for spec in deployment["spec"]["template"]["spec"]["containers"]:
        image, _, tag = spec["image"].rpartition(":")
        assert image and tag and tag != "latest", spec["image"]


def test_images_agree_between_compose_and_kubernetes():
    services = yaml_file("docker-compose.yml")["services"]
    assert container(manifest("deployment.yaml"))["image"] == services["api"]["image"]
    assert container(manifest("deployment-gpu.yaml"))["image"] == services["api-gpu"]["image"]


def adapter_rules() -> list[dict]:
    return yaml_file("deploy/prometheus-adapter/config.yaml")["rules"]


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_hpa_scales_on_queue_rows_per_pod_with_cpu_as_fallback(name):
    hpa = manifest(HPAS[name])
    server_env = env_of(container(manifest(name)))
    pods_metric, cpu = hpa["spec"]["metrics"]
    assert pods_metric["type"] == "Pods" and cpu["type"] == "Resource"
    served = {rule["name"]["as"] for rule in adapter_rules()}
    assert pods_metric["pods"]["metric"]["name"] in served
    # About one full batch waiting per worker (docs/scaling.md).
    target = int(pods_metric["pods"]["target"]["averageValue"])
    assert target == int(server_env["WORKERS"]) * int(server_env["MAX_BATCH_SIZE"])
    assert cpu["resource"]["name"] == "cpu" and cpu["resource"]["target"]["averageUtilization"] >= 80


def test_gpu_hpa_starts_at_one_gpu_pod():
    gpu, cpu = manifest("hpa-gpu.yaml"), manifest("hpa.yaml")
    assert gpu["spec"]["minReplicas"] == 1
    assert gpu["spec"]["maxReplicas"] < cpu["spec"]["maxReplicas"]
    assert gpu["metadata"]["name"] == cpu["metadata"]["name"]  # one replaces the other


def test_adapter_rules_serve_a_per_pod_metric_the_app_exports(tmp_path, app_metric_names):
    for rule in adapter_rules():
        series = re.match(r"^(\w+)\{", rule["seriesQuery"]).group(1)
        assert series in app_metric_names
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert re.fullmatch(rule["name"]["matches"], series)
    # The adapter fills its Go template in; the result must be PromQL that promtool accepts.
    rendered = [rule["metricsQuery"].replace("<<.Series>>", series)
                .replace("<<.LabelMatchers>>", 'namespace="default",pod=~"model-server-.*"')
                .replace("<<.GroupBy>>", "pod") for rule in adapter_rules()]
    assert_promql_valid(tmp_path, rendered)


def test_nginx_sidecar_runs_the_shipped_config(default_port):
    deployment = manifest("deployment.yaml")
    nginx = container(deployment, "nginx")
    [configmap] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "nginx-conf"]
    assert configmap["configMap"]["name"] == manifest("nginx-configmap.yaml")["metadata"]["name"]
    shipped = (REPO / "deploy" / "nginx" / "nginx.conf").read_text()
    assert manifest("nginx-configmap.yaml")["data"]["nginx.conf"] == shipped
    assert {"mountPath": "/etc/nginx/nginx.conf", "subPath": "nginx.conf", "name": "nginx-conf",
            "readOnly": True} in nginx["volumeMounts"]
    assert [p["containerPort"] for p in nginx["ports"]] == [nginx_listen_port(), nginx_grpc_listen_port()]
    # nginx reaches Gunicorn over the pod's loopback, at gunicorn.conf.py's port.
    assert f"server 127.0.0.1:{default_port};" in shipped
    assert nginx["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "nginx-tmp", "mountPath": "/tmp"} in nginx["volumeMounts"]
    assert manifest("deployment-gpu.yaml")["spec"]["template"]["spec"]["containers"][1] == nginx


def test_pod_monitor_scrapes_gunicorn_past_nginx(get_routes):
    [monitor] = [d for d in yaml.safe_load_all((MONITORING / "podmonitor.yaml").read_text()) if d]
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    pod_labels = manifest("deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for name in DEPLOYMENTS:
        assert port_number(container(manifest(name)), endpoint["port"]) == 8000


def test_prometheus_rule_carries_the_tested_alert_groups():
    [rule] = [d for d in yaml.safe_load_all((MONITORING / "prometheus-rule.yaml").read_text()) if d]
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == yaml_file("deploy/prometheus/alerts.yml")["groups"]


# ---------------------------------------------------------------------------- Prometheus rules, Grafana


@pytest.fixture(scope="module")
def app_metric_names() -> set[str]:
    """Every series name the app exports (a counter as its _total), histograms with their parts."""
    from prometheus_client import CollectorRegistry

    from app.ops.metrics import Metrics

    registry = CollectorRegistry()
    Metrics(registry).observer("m")
    names = set()
    for family in registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "histogram":
            names.update(f"{family.name}_{part}" for part in ("bucket", "sum", "count"))
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return names


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is needed (.ci/run installs Debian's prometheus package)"
    return found


def assert_promql_valid(tmp_path: Path, expressions: list[str]) -> None:
    """promtool parses each expression as a recording rule's."""
    rules = {"groups": [{"name": "check", "rules": [{"record": f"check:expr{i}", "expr": expr}
                                                      for i, expr in enumerate(expressions)]}]}
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def metric_names_in(expression: str) -> set[str]:
    without_strings = re.sub(r'"[^"]*"', '""', expression)
    without_labels = re.sub(r"\{[^}]*\}", "", without_strings)
    words = set(re.findall(r"\b(model_server_\w+)\b", without_labels))
    return words


def test_promtool_checks_the_alert_rules_and_the_scrape_config():
    folder = REPO / "deploy" / "prometheus"
    for command in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"]):
        result = subprocess.run([promtool(), *command], cwd=folder, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_of_the_alert_rules_pass():
    result = subprocess.run([promtool(), "test", "rules", "alerts.test.yml"], cwd=REPO / "deploy" / "prometheus",
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_unit_tests_fail_when_an_alert_is_broken(tmp_path):
    folder = REPO / "deploy" / "prometheus"
    rules = (folder / "alerts.yml").read_text().replace('reason=~"queue_full|deadline"', 'reason=~".+"')
    (tmp_path / "alerts.yml").write_text(rules)
    shutil.copy(folder / "alerts.test.yml", tmp_path)
    result = subprocess.run([promtool(), "test", "rules", "alerts.test.yml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "ModelServerRejecting" in result.stdout + result.stderr


def test_alerts_cover_the_promised_cases_with_metrics_the_app_exports(app_metric_names):
    rules = yaml_file("deploy/prometheus/alerts.yml")["groups"][0]["rules"]
    assert [rule["alert"] for rule in rules] == ["ModelServerQueueNearFull", "ModelServerRejecting",
                                                 "ModelServerLatencyP99High", "ModelServerBatchThreadDead",
                                                 "ModelServerWorkerRestarted"]
    tested = yaml_file("deploy/prometheus/alerts.test.yml")
    alerts_tested = {case["alertname"] for test in tested["tests"] for case in test["alert_rule_test"]
                     if case.get("exp_alerts")}
    assert alerts_tested == {rule["alert"] for rule in rules}
    for rule in rules:
        assert metric_names_in(rule["expr"]) <= app_metric_names, rule["alert"]


DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "model-server.json"


def dashboard_panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def test_dashboard_imports_into_any_grafana():
    dashboard = json.loads(DASHBOARD.read_text())
    [source_input] = dashboard["__inputs"]
    assert (source_input["type"], source_input["pluginId"]) == ("datasource", "prometheus")
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "pod", "model"}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == "${" + source_input["name"] + "}"
    assert variables["pod"]["includeAll"] and variables["model"]["includeAll"]
    # No data source uid but the variable, anywhere in the file.
    uids = re.findall(r'"uid": "([^"]*)"', DASHBOARD.read_text())
    assert set(uids) == {"model-server", "${datasource}"}


def test_every_panel_shows_one_quantity_filtered_by_pod_and_model(app_metric_names):
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    from app.ops.metrics import Metrics

    collectors = [c for c in vars(Metrics(CollectorRegistry())).values() if isinstance(c, MetricWrapperBase)]
    model_labelled = {}
    for collector in collectors:
        name = collector._name + ("_total" if collector._type == "counter" else "")
        model_labelled[name] = collector._labelnames
    for panel in dashboard_panels():
        exprs = [target["expr"] for target in panel["targets"]]
        families = {re.sub(r"_(bucket|sum|count)$", "", name) for expr in exprs for name in metric_names_in(expr)}
        assert len(families) == 1, (panel["title"], families)
        assert {name for expr in exprs for name in metric_names_in(expr)} <= app_metric_names, panel["title"]
        [family] = families
        for expr in exprs:
            assert 'instance=~"$pod"' in expr, panel["title"]
            assert ('model=~"$model"' in expr) == ("model" in model_labelled[family]), panel["title"]


def test_dashboard_queries_are_valid_promql(tmp_path):
    exprs = [target["expr"] for panel in dashboard_panels() for target in panel["targets"]]
    concrete = [expr.replace("$__rate_interval", "1m").replace("$pod", ".*").replace("$model", ".*") for expr in exprs]
    assert_promql_valid(tmp_path, concrete)


def test_rejection_series_exist_at_zero_for_every_reason_the_engine_uses():
    from prometheus_client import CollectorRegistry

    from app.ops.metrics import Metrics

    # Each reason appears in the engine as hooks.rejected("queue_full") or observer.rejected(...).
    engine = "".join(path.read_text() for path in sorted((REPO / "app" / "core" / "batching").glob("*.py")))
    reasons = set(re.findall(r'rejected(?:\(|",\s*)"(\w+)"', engine))
    assert reasons == {"queue_full", "shutting_down", "deadline", "client_gone"}
    registry = CollectorRegistry()
    Metrics(registry).observer("m")
    for reason in reasons:
        assert registry.get_sample_value("model_server_rejections_total", {"model": "m", "reason": reason}) == 0.0


# ---------------------------------------------------------------------------- locks


LOCKS = {"cpu": ["requirements.txt"], "dev": ["requirements.txt", "requirements-dev.txt"],
         "loadtest": ["requirements-loadtest.txt"], "gpu": ["requirements.txt"]}


def pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line (comments, -r lines and markers aside)."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            requirement = line.split(";")[0].strip()
            assert "==" in requirement, f"{path.name}: {line!r} is not pinned"
            name, version = requirement.split("==")
            found[re.sub(r"[-_.]+", "-", re.sub(r"\[.*\]", "", name)).lower()] = version
    return found


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_lock_pins_every_package_and_every_top_level_requirement(lock):
    locked = pins(REPO / f"requirements-{lock}.lock")
    assert len(locked) > 20
    for source in LOCKS[lock]:
        for name, version in pins(REPO / source).items():
            if lock == "gpu" and name == "tensorflow-cpu":
                name = "tensorflow"
            if name == "tensorflow" and lock != "gpu":
                continue  # the non-x86_64 branch of requirements.txt; the locks are for x86_64
            assert locked.get(name) == version, f"requirements-{lock}.lock: {name}=={version} (run scripts/lock.sh)"


def test_gpu_lock_has_cuda_tensorflow_and_cpu_locks_do_not():
    gpu, cpu = pins(REPO / "requirements-gpu.lock"), pins(REPO / "requirements-cpu.lock")
    assert gpu["tensorflow"] == cpu["tensorflow-cpu"] and "tensorflow-cpu" not in gpu
    assert any(name.startswith("nvidia-") for name in gpu)
    assert not any(name.startswith("nvidia-") or name == "tensorflow" for name in cpu)
    # Same pins for everything both hold, TensorFlow's own dependencies included.
    assert {name: v for name, v in gpu.items() if name in cpu} == {name: v for name, v in cpu.items() if name in gpu}


def test_loadtest_lock_is_slim_and_the_image_takes_tensorflows_protos_from_the_pinned_wheel(stages):
    loadtest = pins(REPO / "requirements-loadtest.lock")
    assert not {"tensorflow", "tensorflow-cpu", "keras", "gunicorn"} & set(loadtest)
    assert {"locust", "grpcio", "protobuf", "numpy", "requests"} <= set(loadtest)
    assert loadtest["protobuf"] == pins(REPO / "requirements-cpu.lock")["protobuf"]
    # The wheel's version is the CPU lock's, not a second pin; the protos land in whatever
    # site-packages the base has (the stage mirrors it under /protos).
    protos = stages["tf-protos"]
    assert not [args for key, args in protos if key == "ARG"]
    assert ("COPY", "requirements-cpu.lock ./") in protos
    download = last(protos, "RUN")
    assert "--constraint requirements-cpu.lock tensorflow-cpu " in " ".join(download.split())
    assert "sysconfig.get_path('purelib')" in download and "site-packages" not in download
    copies = [args for key, args in stages["loadtest"] if key == "COPY"]
    assert "--from=tf-protos /protos/ /" in copies
    assert "locustfile.py ./" in copies and not any(args.startswith("app/") for args in copies)


def locustfile_imports() -> list[str]:
    """locustfile.py's import statements in source order, the gRPC user's included."""
    tree = ast.parse((REPO / "locustfile.py").read_text())
    nodes = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             and getattr(node, "module", None) != "__future__"]
    return [ast.unparse(node) for node in sorted(nodes, key=lambda node: node.lineno)]


def test_loadtest_lock_holds_every_package_locustfile_imports():
    pinned = set(pins(REPO / "requirements-loadtest.lock")) | set(pins(REPO / "requirements-nodeps.txt"))
    distributions = importlib.metadata.packages_distributions()
    modules = {statement.split()[1].split(".")[0] for statement in locustfile_imports()}
    third_party = sorted(modules - set(sys.stdlib_module_names))
    assert {"locust", "orjson", "ml_dtypes", "grpc", "tensorflow_serving", "tensorflow"} <= set(third_party)
    for module in third_party:
        if module == "tensorflow":
            continue  # only its generated *_pb2 modules, from the tf-protos stage
        names = {re.sub(r"[-_.]+", "-", name).lower() for name in distributions[module]}
        assert names & pinned, f"locustfile.py imports {module}: pin {sorted(names)} in requirements-loadtest.txt"


def test_lock_script_writes_every_lock_and_ci_installs_the_dev_lock():
    script = (REPO / "scripts" / "lock.sh").read_text()
    for lock in LOCKS:
        assert f"requirements-{lock}.lock" in script
    assert "uv==" in (REPO / "requirements-dev.txt").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    # With .pyc written at install: where PYTHONDONTWRITEBYTECODE is set, nothing writes them later.
    assert '"$uv" pip install -q --compile-bytecode --python .venv/bin/python -r requirements-dev.lock' in ci
    assert ('"$uv" pip install -q --compile-bytecode --python .venv/bin/python --no-deps '
            '-r requirements-nodeps.txt') in ci
    assert "nginx" in ci and "promtool" in ci
