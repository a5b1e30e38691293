"""The shape of app/: imports point down only (docs/design.md), and no function runs past
MAX_FUNCTION_LINES; read from the source as written.

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
    doors = {"app.http.tfs", "app.grpc.server", "app.http.v2", "app.grpc.v2", "app.ops.tracing", "app.wire.warmup",
             "app.core.serving"}
    assert reached & doors == set()


MAX_FUNCTION_LINES = 60


def test_no_function_in_app_runs_past_the_line_limit():
    long = [f"{path.relative_to(APP.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted(APP.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (node.end_lineno or node.lineno) - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []
