"""The shape of app/: one package per layer, imports point down only (docs/design.md), and no
function runs past MAX_FUNCTION_LINES; read from the source as written.

Every import counts, a function's own import too: a lazy import hides a circle from Python's
start-up, not from the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app"


def _module_name(path: Path) -> str:
    parts = path.relative_to(APP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The app modules `path` imports (`from app import x` names module app.x where there is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules and name != "app"}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in APP.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, modules) - {name} for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in sorted(graph[name]):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == name:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_circles_finds_a_circle_of_two_and_of_three():
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_package_imports():
    graph = import_graph()
    assert "app.core.model_types" in graph["app.core.jax_model"]
    assert "app.core.batching" in graph["app.core.registry"]
    assert "app.ops.tracing" in graph["app.core.loading"]  # imported inside steps(), only with tracing on


def test_app_has_no_import_circle():
    assert circles(import_graph()) == []


def test_loading_a_model_reaches_no_front_door_and_no_tracing():
    graph = import_graph()
    reached, todo = set(), ["app.core.registry"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name])
    doors = {"app.http.tfs", "app.grpc.server", "app.grpc.tfs", "app.http.v2", "app.grpc.v2", "app.ops.tracing",
             "app.wire.warmup", "app.core.serving"}
    assert reached & doors == set()


# The packages of app/, lowest first: a module imports from its own package and from those below
# it, never from one beside it (HTTP and gRPC are two transports) or above it.
LAYERS = [("app.ops",), ("app.core",), ("app.wire",), ("app.http", "app.grpc"), ("app.model_process",)]
# The only modules at app/'s top: the app factory and the entry points (`python -m app.entrypoint`,
# `python -m app.tfs_flags`, Gunicorn's worker class), which may import any package.
ENTRY_POINTS = {"app", "app.entrypoint", "app.tfs_flags", "app.worker"}


def package(module: str) -> str:
    """The layer package a module of app/ belongs to, or the module itself at app/'s top."""
    return ".".join(module.split(".")[:2]) if module.count(".") >= 1 and module not in ENTRY_POINTS else module


def rank(module: str) -> int:
    found = package(module)
    return next((index for index, layer in enumerate(LAYERS) if found in layer), len(LAYERS))


def arrows_not_down(graph: dict[str, set[str]]) -> list[str]:
    """Every import from one package to another that is not below it (an entry point may import any)."""
    return sorted(f"{source} -> {target}" for source, targets in graph.items() for target in targets
                  if source not in ENTRY_POINTS and package(source) != package(target) and rank(source) <= rank(target))


def test_arrows_not_down_finds_an_arrow_up_and_one_beside():
    assert arrows_not_down({"app.core.a": {"app.ops.b"}, "app.ops.b": set()}) == []
    assert arrows_not_down({"app.ops.b": {"app.core.a"}, "app.core.a": set()}) == ["app.ops.b -> app.core.a"]
    assert arrows_not_down({"app.http.a": {"app.grpc.b"}, "app.grpc.b": set()}) == ["app.http.a -> app.grpc.b"]
    assert arrows_not_down({"app": {"app.http.a"}, "app.core.b": {"app.core.c"}}) == []


def test_every_module_sits_in_a_layer_package_but_the_factory_and_the_entry_points():
    graph = import_graph()
    layered = {name for layer in LAYERS for name in layer}
    assert sorted(name for name in graph if package(name) not in layered | ENTRY_POINTS) == []
    assert {name for name in graph if name.count(".") <= 1} - layered == ENTRY_POINTS


def test_a_package_imports_only_from_the_packages_below_it():
    assert arrows_not_down(import_graph()) == []


def _imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_flask_is_imported_only_under_the_http_package_and_by_the_factory():
    flask_users = sorted(_module_name(path) for path in APP.rglob("*.py") if _imports_of(path) & {"flask", "werkzeug"})
    assert flask_users and [name for name in flask_users if package(name) not in ("app.http", "app")] == []


MAX_FUNCTION_LINES = 60


def test_no_function_in_app_runs_past_the_line_limit():
    long = [f"{path.relative_to(APP.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted(APP.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (node.end_lineno or node.lineno) - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []
