"""The test functions of a tree with the asserts each holds, for a before/after check that a
change to the tests kept every check (issue: the project's weight).

    python .ci/inventory.py [ROOT] > after.txt
    git worktree add /tmp/before <rev> && python .ci/inventory.py /tmp/before > before.txt

One line per test function, `file::name asserts`, where asserts counts `assert` statements and
`pytest.raises`/`pytest.fail` calls in the function and the functions nested in it. Parametrized
cases are one function; a file's module-level helpers are counted on a line of their own
(`file::<helpers>`), since a check moved into a helper is still a check.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CHECKS = {"raises", "fail"}


def checks(node: ast.AST) -> int:
    count = 0
    for child in ast.walk(node):
        if isinstance(child, ast.Assert):
            count += 1
        elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
              and child.func.attr in CHECKS and isinstance(child.func.value, ast.Name)
              and child.func.value.id == "pytest"):
            count += 1
    return count


def inventory(root: Path) -> list[str]:
    lines = []
    for path in sorted((root / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text())
        name = path.relative_to(root).as_posix()
        helpers = 0
        for node in tree.body:
            functions = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else (
                [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if isinstance(node, ast.ClassDef) else [])
            for function in functions:
                if function.name.startswith("test_"):
                    lines.append(f"{name}::{function.name} {checks(function)}")
                else:
                    helpers += checks(function)
        if helpers:
            lines.append(f"{name}::<helpers> {helpers}")
    return lines


if __name__ == "__main__":
    print("\n".join(inventory(Path(sys.argv[1] if len(sys.argv) > 1 else "."))))
