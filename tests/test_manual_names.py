"""The manual and the server name the same things: every variable the code reads is on the
settings page, every metric a page names is one /metrics shows, and /v2 lists the extensions
the Open Inference Protocol page does. Read from the server's behaviour (its settings, an
in-process /metrics and /v2) where it shows them, and from its source where only the source can:
the environment it reads."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from app.ops.settings import SERVER_KNOBS, documented
from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SETTINGS_PAGE = REPO / "docs" / "settings.md"

# Variables the server reads that are not its settings: another program's, each named on the page
# that says what the server does with it, or the server's own, set for the processes it starts.
OTHER_PROGRAMS = {
    "KERAS_BACKEND": "jax.md",  # Keras's
    "CUDA_VISIBLE_DEVICES": "scaling.md",  # CUDA's
    "XLA_PYTHON_CLIENT_PREALLOCATE": "jax.md",  # JAX's allocator
    "XLA_PYTHON_CLIENT_MEM_FRACTION": "jax.md",
    "TF_CPP_MIN_LOG_LEVEL": None,  # TensorFlow's: the server sets it (unless set) before importing TensorFlow
}
SET_FOR_ITS_OWN_PROCESSES = {"MODEL_SERVER_RUN_DIR", "MODEL_PROCESS_FOLDER"}
# The WSGI environ is an `environ` too: its keys are not environment variables.
WSGI_KEY = re.compile(r"HTTP_\w+|wsgi\..*|werkzeug\..*|REQUEST_METHOD|PATH_INFO|QUERY_STRING|CONTENT_(TYPE|LENGTH)"
                      r"|RAW_URI|REMOTE_\w+|SERVER_\w+|SCRIPT_NAME")


def server_sources() -> list[Path]:
    """The server's code wherever its modules live under app/, and Gunicorn's config and entry point."""
    return [*sorted((REPO / "app").rglob("*.py")), REPO / "gunicorn.conf.py", REPO / "wsgi.py"]


def environment_reads(source: str) -> set[str]:
    """Names read from an environment mapping: `os.environ[...]`, `.get`, `.setdefault`, `in`,
    `os.getenv`, through a parameter named environ, or through a module constant naming the variable."""
    tree = ast.parse(source)
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}

    def name_of(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    def is_environment(node: ast.AST) -> bool:
        return ast.unparse(node).split(".")[-1] in ("environ", "env", "environment")

    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environment(node.value):
            names.add(name_of(node.slice))
        elif isinstance(node, ast.Call) and node.args:
            function = node.func
            if isinstance(function, ast.Attribute) and function.attr in ("get", "setdefault", "pop") \
                    and is_environment(function.value) or ast.unparse(function) == "os.getenv":
                names.add(name_of(node.args[0]))
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In) and is_environment(node.comparators[0]):
            names.add(name_of(node.left))
    return {name for name in names if name and re.fullmatch(r"[A-Z][A-Z0-9_]+", name) and not WSGI_KEY.fullmatch(name)}


def settings_page_variables() -> set[str]:
    return set(re.findall(r"^\| `([A-Z_]+)` \|", SETTINGS_PAGE.read_text(), flags=re.MULTILINE))


def test_every_variable_the_server_reads_is_on_the_settings_page_or_another_programs():
    read = set().union(*(environment_reads(path.read_text()) for path in server_sources()))
    assert "TFS_LISTEN_HOST" in read and "KERAS_BACKEND" in read, "the scan finds what the server reads"
    unlisted = read - settings_page_variables() - set(OTHER_PROGRAMS) - SET_FOR_ITS_OWN_PROCESSES
    assert sorted(unlisted) == [], "add each to app/ops/settings.py (Settings or SERVER_KNOBS), then the page"
    for variable, page in OTHER_PROGRAMS.items():
        assert page is None or variable in (REPO / "docs" / page).read_text(), f"{page} names {variable}"


def test_the_settings_page_lists_the_settings_and_the_variables_read_beside_them():
    assert settings_page_variables() == {name for name, _, _ in documented()} | {knob.env for knob in SERVER_KNOBS}


def test_the_scan_sees_each_way_of_reading_the_environment():
    source = '''
import os
FOLDER = "A_FOLDER"
os.environ.get("A_GET", "x"); os.environ["A_ITEM"]; os.getenv("A_GETENV"); os.environ.setdefault("A_DEFAULT", "1")
env = {}
env["A_SET"] = "1"
def f(environ=os.environ):
    return environ.get("A_PARAMETER"), "A_IN" in environ, environ[FOLDER], environ.get("HTTP_X_REQUEST_ID")
'''
    assert environment_reads(source) == {"A_GET", "A_ITEM", "A_GETENV", "A_DEFAULT", "A_PARAMETER", "A_IN", "A_FOLDER"}


# -- metrics ---------------------------------------------------------------------------------------


METRIC_NAME = re.compile(r"(?<![\w.])model_server_[a-z0-9_]+\*?")


def shown_metric_names(text: str) -> set[str]:
    """Every name a /metrics page shows: its families (counters as `..._total`, as the text format
    writes them) and a histogram's `_bucket`, `_count` and `_sum` series."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE):
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    return names


def test_every_metric_a_page_names_is_one_metrics_shows(in_process_app, exact_model_path):
    app = in_process_app(model_path=str(exact_model_path))
    shown = shown_metric_names(app.test_client().get("/metrics").get_data(as_text=True))
    assert "model_server_requests_total" in shown
    unknown = []
    for page in PAGES:
        for name in set(METRIC_NAME.findall(page.read_text())):
            known = any(metric.startswith(name[:-1]) for metric in shown) if name.endswith("*") else name in shown
            if not known:
                unknown.append(f"{page.relative_to(REPO)}: {name}")
    assert sorted(unknown) == []


def test_a_counter_is_named_as_metrics_shows_it():
    text = "# TYPE model_server_a_total counter\n# TYPE model_server_b histogram\n"
    assert shown_metric_names(text) == {"model_server_a_total", "model_server_b", "model_server_b_bucket",
                                        "model_server_b_count", "model_server_b_sum"}
    assert METRIC_NAME.findall("`model_server_a`, `model_server_stats_*`, tensorflow_model_server_test") == [
        "model_server_a", "model_server_stats_*"]


# -- the Open Inference Protocol's extensions ------------------------------------------------------------


def test_v2_lists_the_extensions_api_v2_lists(in_process_app, exact_model_path):
    row = next(line for line in (REPO / "docs" / "api-v2.md").read_text().splitlines()
               if line.startswith("| `GET /v2` |"))
    listed = json.loads(re.search(r"\| `(\{.*\})` \|", row)[1])
    served = in_process_app(model_path=str(exact_model_path)).test_client().get("/v2").get_json()
    assert served == listed
