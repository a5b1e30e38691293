"""deploy/kubernetes/kserve: the KServe ServingRuntime and InferenceService, checked offline.

KServe's own kinds have no schema in kubernetes-validate, so their containers are checked as
what KServe makes of them, a Pod's containers (strict: an unknown or misspelt field fails),
and the KServe fields against each other and against the server: the runtime speaks the
protocol the InferenceService asks for, the model is served under the name KServe puts in
its URLs, from where KServe's storage initializer puts it, on the port and routes the server
answers, with settings the server accepts.
"""

from __future__ import annotations

from types import SimpleNamespace

import kubernetes_validate
import pytest
import yaml
from flask import Flask

from app.http import routes
from app.http import v2 as v2_rest
from app.ops.settings import Settings
from tests.conftest import REPO

KUBERNETES_VERSION = "1.33.0"
KSERVE = REPO / "deploy" / "kubernetes" / "kserve"
STORAGE_MOUNT = "/mnt/models"  # where KServe's storage initializer puts storageUri


def document(name: str) -> dict:
    [found] = [d for d in yaml.safe_load_all((KSERVE / name).read_text()) if d]
    return found


@pytest.fixture(scope="module")
def runtime() -> dict:
    return document("servingruntime.yaml")


@pytest.fixture(scope="module")
def service() -> dict:
    return document("inferenceservice.yaml")


def env(container: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", [])}


def as_pod(containers: list[dict]) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": {"containers": containers}}


def test_every_kserve_manifest_is_checked():
    assert {path.name for path in KSERVE.glob("*.yaml")} == {"servingruntime.yaml", "inferenceservice.yaml"}


def test_kinds_and_api_versions(runtime, service):
    assert (runtime["apiVersion"], runtime["kind"]) == ("serving.kserve.io/v1alpha1", "ServingRuntime")
    assert (service["apiVersion"], service["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")


def test_containers_are_valid_kubernetes(runtime, service):
    kubernetes_validate.validate(as_pod(runtime["spec"]["containers"]), KUBERNETES_VERSION, strict=True)
    model = service["spec"]["predictor"]["model"]
    # The model's env is merged into the runtime's container: it must be a container's env.
    kubernetes_validate.validate(as_pod([{"name": "model", "image": "x", "env": model["env"]}]),
                                 KUBERNETES_VERSION, strict=True)


def test_container_check_rejects_a_misspelt_field(runtime):
    container = dict(runtime["spec"]["containers"][0])
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(as_pod([container]), KUBERNETES_VERSION, strict=True)


def test_the_service_asks_the_runtime_for_what_it_serves(runtime, service):
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] == "v2" and "v2" in runtime["spec"]["protocolVersions"]
    assert model["modelFormat"]["name"] in {fmt["name"] for fmt in runtime["spec"]["supportedModelFormats"]}


def test_the_model_is_served_under_the_name_kserve_routes_to(runtime, service):
    model = service["spec"]["predictor"]["model"]
    settings = Settings.from_env({**env(runtime["spec"]["containers"][0]), **env(model)})
    assert settings.model_name == service["metadata"]["name"]
    assert settings.model_path == STORAGE_MOUNT


def test_port_probe_and_grpc_agree_with_the_server(runtime):
    (container,) = runtime["spec"]["containers"]
    settings = Settings.from_env(env(container))
    port = int(env(container)["BIND"].rsplit(":", 1)[1])  # Gunicorn's bind (gunicorn.conf.py)
    assert [p["containerPort"] for p in container["ports"]] == [port]
    assert container["readinessProbe"]["httpGet"]["port"] == port
    # One routed port (Knative): gRPC is off rather than listening where nothing reaches it.
    assert settings.grpc_bind == ""
    app = Flask(__name__)
    routes.init_app(app)
    routes.register(app, SimpleNamespace(settings=settings), "v2", v2_rest.ROUTES)
    assert container["readinessProbe"]["httpGet"]["path"] in {rule.rule for rule in app.url_map.iter_rules()}
