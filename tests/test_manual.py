"""The manual in docs/ as a whole: within its size, every page in the menu, and nothing named in it
that the repository does not hold (a file, or a test that reliability.md says guards a limit)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

DOCS = REPO / "docs"
MAX_DOCS_BYTES = 150_000
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
# A path into the repository as the pages write it: app/..., tests/..., scripts/..., deploy/...,
# .ci/..., or a requirements file; not a URL's path or a container's (/models/m), which a slash or
# a letter precedes.
REPO_PATH = re.compile(r"(?<![\w/.-])((?:app|tests|scripts|deploy|\.ci)/[\w./-]*[\w/]"
                       r"|requirements[\w-]*\.(?:txt|lock))")
# `test_x.py::name` names a test; `::name` alone is in the test file named last before it.
TEST_REFERENCE = re.compile(r"`(?:tests/)?(test_\w+\.py)?::(\w+)`|`(?:tests/)?(test_\w+\.py)`")


def test_docs_markdown_is_within_its_cap():
    size = sum(len(page.read_bytes()) for page in DOCS.rglob("*.md"))
    assert size <= MAX_DOCS_BYTES, f"docs/ holds {size} bytes of Markdown; tighten a page or link to another"


def nav_pages(entries: list) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_menu_and_every_menu_entry_is_a_page():
    nav = nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    on_disk = sorted(str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md"))
    assert sorted(nav) == on_disk
    assert len(set(nav)) == len(nav)


def named_paths(text: str) -> set[str]:
    return {match.group(1) for match in REPO_PATH.finditer(text)}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_repository_path_a_page_names_exists(page):
    assert sorted(path for path in named_paths(page.read_text()) if not (REPO / path).exists()) == []


def named_tests(text: str) -> list[tuple[str, str]]:
    """(file, test) for every test the text names, `::name` resolved against the file named before."""
    found, current = [], None
    for match in TEST_REFERENCE.finditer(text):
        current = match.group(1) or match.group(3) or current
        if match.group(2):
            assert current is not None, f"::{match.group(2)} comes before any test file is named"
            found.append((current, match.group(2)))
    return found


def defined_names(test_file: Path) -> set[str]:
    tree = ast.parse(test_file.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_every_test_reliability_names_exists():
    named = named_tests((DOCS / "reliability.md").read_text())
    assert len(named) > 50, "reliability.md names the test behind each limit and attack"
    missing = [f"{file}::{name}" for file, name in named
               if not (REPO / "tests" / file).exists() or name not in defined_names(REPO / "tests" / file)]
    assert missing == []


def test_the_checks_see_a_missing_path_and_a_missing_test():
    assert named_paths("see app/limits.py, /models/app/x, app/gone.py and requirements-gone.lock") == {
        "app/limits.py", "app/gone.py", "requirements-gone.lock"}
    text = "`test_hostile.py::test_a`, `::test_b`; `test_batching.py` unless named: `::test_c`"
    assert named_tests(text) == [("test_hostile.py", "test_a"), ("test_hostile.py", "test_b"),
                                 ("test_batching.py", "test_c")]


# What a fenced block holds: commands that tests/test_manual_runs.py runs (bash, sh, python), a
# file it compares (json), or neither (text: a diagram, a file's shape).
BLOCK_LANGUAGES = {"bash", "sh", "python", "json", "text"}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_block_says_what_it_holds(page):
    languages = re.findall(r"^```(\S*)\n.*?^```$", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    assert sorted(set(languages) - BLOCK_LANGUAGES) == []
