"""The docs: a short README that starts with the set-up commands, a settings page generated from
the code and never stale, and relative links that lead somewhere."""

from __future__ import annotations

import ast
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from app.ops.settings import GUNICORN_SECTION, SERVER_KNOBS, documented, settings_markdown
from tests.conftest import REPO

README = REPO / "README.md"
SETTINGS_PAGE = REPO / "docs" / "settings.md"
# The manual's prose pages; docs/*/ holds benchmark output (data), written by scripts/benchmark/.
PAGES = [README, REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]

SET_UP_COMMANDS = [
    "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && .venv/bin/pip install --no-deps "
    "-r requirements-nodeps.txt && .venv/bin/gunicorn -c gunicorn.conf.py wsgi:app --workers=2",
    "bash .ci/run",
]


def test_readme_is_a_landing_page_of_at_most_10_kb():
    size = len(README.read_bytes())
    assert size <= 10 * 1024, f"README.md is {size} bytes; the manual's pages in docs/ take the detail"


def test_readme_starts_with_the_two_set_up_commands_each_in_its_own_block():
    lines = README.read_text().splitlines()
    block_start = lines.index("```bash")
    # Only the title and a sentence or two of what it is come first: no code before the commands.
    before = lines[:block_start]
    assert before[0].startswith("# ") and len("\n".join(before)) <= 300
    assert not any(line.startswith("```") or line.startswith("    ") for line in before)
    # Each alone in its block, so that each can be pasted alone: the server never returns.
    assert lines[block_start + 1:block_start + 3] == [SET_UP_COMMANDS[0], "```"]
    second = lines.index("```bash", block_start + 1)
    assert lines[second + 1:second + 3] == [SET_UP_COMMANDS[1], "```"]
    between = " ".join(lines[block_start + 3:second])
    assert "until Ctrl-C" in between, "the serving command says that it keeps running"


def test_readme_has_no_dated_narrative():
    text = README.read_text()
    assert "Where it stands" not in text
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b", text) == []


def test_settings_page_matches_the_code():
    assert SETTINGS_PAGE.read_text() == settings_markdown(), "stale: run python scripts/settings_doc.py"


def test_settings_doc_script_writes_the_page_and_catches_a_stale_one(tmp_path):
    script = [sys.executable, str(REPO / "scripts" / "settings_doc.py")]
    page = tmp_path / "settings.md"
    subprocess.run([*script, "--page", str(page)], check=True)
    assert page.read_text() == SETTINGS_PAGE.read_text()
    assert subprocess.run([*script, "--check", "--page", str(page)]).returncode == 0
    page.write_text(page.read_text().replace("| `MAX_BATCH_SIZE` | `32` |", "| `MAX_BATCH_SIZE` | `64` |"))
    stale = subprocess.run([*script, "--check", "--page", str(page)], capture_output=True, text=True)
    assert stale.returncode == 1 and "is stale" in stale.stderr


def setting_rows(text: str) -> set[str]:
    return set(re.findall(r"^\| `([A-Z_]+)` \|", text, flags=re.MULTILINE))


def test_settings_page_lists_every_variable_the_server_reads():
    conf = ast.parse((REPO / "gunicorn.conf.py").read_text())
    # Every upper-case string constant there names an environment variable it reads.
    read_by_gunicorn = {node.value for node in ast.walk(conf)
                        if isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and re.fullmatch(r"[A-Z][A-Z0-9_]+", node.value)}
    listed = setting_rows(SETTINGS_PAGE.read_text())
    assert sorted(read_by_gunicorn - listed) == []
    assert {name for name, _, _ in documented()} | {knob.env for knob in SERVER_KNOBS} == listed


def test_settings_page_shows_the_defaults_gunicorn_conf_gives(monkeypatch, tmp_path):
    for name, _, _ in documented():
        monkeypatch.delenv(name, raising=False)
    for knob in SERVER_KNOBS:
        monkeypatch.delenv(knob.env, raising=False)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    values = runpy.run_path(str(REPO / "gunicorn.conf.py"))
    # Knobs whose default is a literal; WORKERS and THREADS are derived and described in words.
    literal = {knob.env: knob.default for knob in SERVER_KNOBS
               if knob.default is not None and knob.section == GUNICORN_SECTION}
    assert set(literal) == {"BIND", "TIMEOUT", "GRACEFUL_TIMEOUT", "KEEPALIVE"}
    assert {env: values[env.lower()] for env in literal} == literal


def test_readme_settings_are_real_settings():
    known = {name for name, _, _ in documented()} | {knob.env for knob in SERVER_KNOBS}
    in_readme = setting_rows(README.read_text())
    assert in_readme, "the README shows the most-used settings"
    assert sorted(in_readme - known) == []


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose(path: Path) -> str:
    """The page without its fenced code blocks, where brackets are code, not links."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(path), flags=re.MULTILINE):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(path))  # inline code: brackets there are code too
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [target for target in targets if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_relative_links_lead_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        destination = (page.parent / file_part).resolve() if file_part else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == []


def test_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n[ok](#a-page) [gone](missing.md) `[code](x.md)`\n")
    assert relative_links(page) == ["#a-page", "missing.md"]
    assert anchors(page) == {"a-page"}
    assert slug("Differences from `TF Serving` (REST)") == "differences-from-tf-serving-rest"
