"""Each framework patch (app/ops/patches.py, app/http/patches.py) was measured on one version:
a new one must be re-measured."""

from __future__ import annotations

import importlib.metadata
import sys
import threading

import flask
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from app.http.patches import CachedEnsureSync, NoSessions
from app.ops.patches import MEASURED_ON, HistogramCounts, value_of


@pytest.mark.parametrize("package", ["flask", "gunicorn", "prometheus-client"])
def test_patched_package_is_the_version_the_patches_were_measured_on(package):
    installed = importlib.metadata.version(package)
    assert installed == MEASURED_ON[package], (
        f"{package} {installed} is installed; app/ops/patches.py was measured on {MEASURED_ON[package]}: "
        "re-measure each patch of it, then move the pin or drop the patch")


def test_python_is_the_version_the_logging_patch_was_measured_on():
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == MEASURED_ON["python"]


def test_pins_agree_with_the_requirements():
    from tests.conftest import REPO

    pinned = dict(line.split("==", 1) for line in (REPO / "requirements.txt").read_text().splitlines()
                  if "==" in line and not line.startswith("#") and ";" not in line)
    assert all(pinned[package] == MEASURED_ON[package] for package in ("flask", "gunicorn"))


@pytest.mark.parametrize("amount", [0.0, 0.001, 0.0011, 0.0025, 29.9, 30.0, 30.5, float("inf"), -1.0, float("nan")])
def test_histogram_counts_write_what_observe_writes(amount):
    """The bucket a bound itself falls in, past the last bound, and NaN (no bucket) included."""
    registry = CollectorRegistry()
    buckets = (0.001, 0.0025, 0.005, 1.0, 30.0)
    plain = Histogram("plain_seconds", "", ["model"], buckets=buckets, registry=registry)
    direct = Histogram("direct_seconds", "", ["model"], buckets=buckets, registry=registry)
    plain.labels("m").observe(amount)
    HistogramCounts(direct.labels("m")).observe(amount)
    samples = {name: [(sample.name.split("_seconds")[1], sample.labels, repr(sample.value))
                      for sample in metric.samples if not sample.name.endswith("_created")]
               for name, metric in (("plain", plain), ("direct", direct)) for metric in metric.collect()}
    assert samples["direct"] == samples["plain"]


def test_values_written_directly_are_the_metrics_values():
    registry = CollectorRegistry()
    counter = Counter("answers", "", ["status"], registry=registry)
    gauge = Gauge("in_flight", "", registry=registry)
    value_of(counter.labels("200")).inc(3)
    value_of(gauge).inc(2)
    value_of(gauge).inc(-1)
    assert registry.get_sample_value("answers_total", {"status": "200"}) == 3
    assert registry.get_sample_value("in_flight") == 1


def test_no_sessions_gives_every_request_the_same_empty_read_only_session():
    app = CachedEnsureSync("no-sessions")
    app.session_interface = NoSessions()
    seen = []

    @app.get("/")
    def view() -> str:
        seen.append(flask.session._get_current_object())  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match="no secret key"):
            flask.session["user"] = "x"
        return "ok"

    client = app.test_client()
    answers = [client.get("/"), client.get("/")]
    assert [(answer.status_code, answer.headers.get("Set-Cookie")) for answer in answers] == [(200, None)] * 2
    assert seen[0] is seen[1] and dict(seen[0]) == {}


def test_a_request_thread_keeps_one_app_context_and_the_main_thread_gets_one_per_request():
    app, other = CachedEnsureSync("kept-context"), CachedEnsureSync("other")
    seen = []  # (thread, current app, g): each g kept alive, so that two are never one by a reused id

    @app.get("/")
    def view() -> str:
        current = flask.current_app._get_current_object()  # type: ignore[attr-defined]
        seen.append((threading.current_thread().name, current, flask.g._get_current_object()))  # type: ignore[attr-defined]
        return "ok"

    def serve() -> None:
        with other.app_context():  # another app's context on the thread: this app's request gets its own
            assert app.test_client().get("/").status_code == 200
        for _ in range(2):
            assert app.test_client().get("/").status_code == 200

    thread = threading.Thread(target=serve, name="request-thread")
    thread.start()
    thread.join()
    for _ in range(2):
        assert app.test_client().get("/").status_code == 200
    assert [(name, current) for name, current, _ in seen] == [("request-thread", app)] * 3 + [("MainThread", app)] * 2
    threads_g, main_g = [g for _, _, g in seen[1:3]], [g for _, _, g in seen[3:]]
    assert threads_g[0] is threads_g[1]  # the request thread's two requests shared one context
    assert main_g[0] is not main_g[1] and not flask.has_app_context()  # the main thread's: one per request, popped
