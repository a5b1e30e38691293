"""The manual runs as written: every shell and Python block of README.md and docs/*.md, in page
order, from the repository's root, against live servers; what a block shows it prints is what it
prints. Sybil finds the blocks and the markers around them; the evaluators are here.

How a page's blocks are read (the conventions a page follows):

- ```bash (or ```sh) runs with `bash -e`: every command must succeed. `.venv/bin/...` is the
  project's venv as the README installs it; the README's install itself (its set-up command up to
  the server) is what made the environment this test runs in.
- A comment line right below a command shows what it prints. The block is cut there (and at
  each blank line); the part above runs and its standard output must match: `...` stands for
  any text, a space for any whitespace, a number for one within 1e-4 of it (TensorFlow's float
  sums differ in their last bits between CPUs). curl's HTTP errors exit 22 (a .curlrc asks it
  to fail, with the body); that is allowed where the body is shown.
- `<!-- server -->` before a block: it ends in a command that keeps running until Ctrl-C. The
  test runs it in the background and waits until /readyz answers 200 on port 8000 (or the port
  the marker names, `<!-- server: 8501 -->`) and every port the block names takes connections;
  lines it shows below the command must then be in the server's output. The page's later blocks
  talk to it; before a page's first server block, to the README's. One server per command, kept
  while a later block needs it.
- Ports: for each server, the manual's ports (8000, 8080, 8500, 8501, 8510) are free ports of
  this machine, in the blocks that talk to it and in the files a block hands a server
  (deploy/nginx/nginx.conf); gRPC and REST listen on loopback only.
- ```python runs as a script of the project's venv; the comment lines right below statements
  are all it prints, in order.
- Every Python process a block starts finds only what the README's install (requirements.txt,
  requirements-nodeps.txt, a venv's pip and setuptools) and the page's `pip install -r` lines so
  far put in the venv: any other module is missing, as it is for a reader.
- ```json follows `<!-- file: examples/models/NAME -->`: that file, which examples/make_models.py
  writes and the server reads as MODEL_CONFIG.
- `<!-- skip: next "REASON" -->` (Sybil's skip) marks a block that CI cannot run; REASON is one
  of SKIP_REASONS. Blocks of another language (```text) are not commands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer

from tests.conftest import REPO, free_ports
from tests.test_docs import SET_UP_COMMANDS

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The README's set-up command is its install, then the server: the install made this environment.
INSTALL = SET_UP_COMMANDS[0][:SET_UP_COMMANDS[0].index(".venv/bin/gunicorn")]
SHELL, PYTHON, JSON = ("bash", "sh"), "python", "json"
# Why a block may be left out of CI: the page says which with `<!-- skip: next "..." -->`.
SKIP_REASONS = {
    "docker": "needs a Docker engine (the images are built and run by .ci/images)",
    "kubectl": "needs a Kubernetes cluster (tests/test_deploy.py checks the manifests)",
    "GPU": "needs a GPU",
    "CI itself": ".ci/run is what runs this test",
    "installs .venv-jax": "makes the venv .ci/run makes, beside tests that use it meanwhile",
    "a benchmark": "minutes of load; tests/test_benchmark.py runs each scenario small",
}
MANUAL_PORTS = (8000, 8080, 8500, 8501, 8510)
PORT = re.compile(r"(?<=[:= ])(8000|8080|8500|8501|8510)\b")
# Files a block hands a server that name the manual's ports: the test hands it a copy on its ports.
FILES_WITH_PORTS = ("deploy/nginx/nginx.conf",)
FILE_PORT = re.compile(r"\b(8000|8080|8500|8501|8510)\b")
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
READY_WITHIN_S = 240
README_SERVER = SET_UP_COMMANDS[0][len(INSTALL):]


# -- the pages, parsed ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Marker:
    kind: str  # "server" or "file"
    argument: str


@dataclasses.dataclass
class Block:
    """One fenced block of a page, with the markers before it."""

    page: str
    line: int
    language: str
    source: str
    example: Example
    server_port: int | None = None  # a server block: the port /readyz answers on
    file: str | None = None  # a json block: the file it shows
    skip: str | None = None
    index: int = 0
    talks_to: str | None = None  # the server command its page started last, or the README's

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


class MarkerParser:
    """`<!-- server -->`, `<!-- server: 8501 -->` and `<!-- file: PATH -->`, for the block after them."""

    def __init__(self) -> None:
        self.lexer = DirectiveInHTMLCommentLexer(directive="server|file", arguments=r"[^\s>]*")

    def __call__(self, document: Document) -> Iterator[Region]:
        for region in self.lexer(document):
            lexemes = region.lexemes
            yield Region(region.start, region.end, Marker(lexemes["directive"], lexemes["arguments"] or ""))


def evaluate_block(example: Example) -> None:
    example.namespace["manual"].run(example.namespace["blocks"][example.start])


MANUAL = Sybil(parsers=[SkipParser(), MarkerParser(),
                        *(CodeBlockParser(language, evaluate_block) for language in (*SHELL, PYTHON, JSON))])


def parse_pages() -> list[Block]:
    blocks: list[Block] = []
    for page in PAGES:
        document = MANUAL.parse(page)
        document.namespace["blocks"] = {}
        pending: list = []
        marker_end = 0
        talks_to = README_SERVER
        for example in document.examples():
            parsed = example.parsed
            if isinstance(parsed, Marker) or isinstance(parsed, tuple):  # a marker, or Sybil's skip
                pending.append(parsed)
                marker_end = example.end
                continue
            language = example.region.lexemes["arguments"]
            block = Block(str(page.relative_to(REPO)), example.line, language, str(parsed), example,
                          index=len(blocks))
            assert not pending or re.fullmatch(r"\s*(--+>)?\s*", document.text[marker_end:example.start]), \
                f"{block.id}: a marker stands right above the block it is for"
            for marker in pending:
                if isinstance(marker, tuple):
                    action, reason = marker
                    assert action == "next", f"{block.id}: only `skip: next` is used, not {action!r}"
                    block.skip = eval(reason, {})  # Sybil's skip reasons are Python expressions
                elif marker.kind == "server":
                    block.server_port = int(marker.argument or 8000)
                else:
                    block.file = marker.argument
            pending = []
            if block.server_port and not block.skip:
                talks_to = server_command(block.source)
            block.talks_to = talks_to
            document.namespace["blocks"][example.start] = block
            blocks.append(block)
    return blocks


def server_command(source: str) -> str:
    """What a server block runs: its commands, without the README's install and without the output it shows."""
    commands, _ = split_output(source.replace(INSTALL, ""))[0]
    return commands.strip()


def split_output(source: str) -> list[tuple[str, str | None]]:
    """The block cut below each output it shows, and at each blank line: [(commands, shown output
    or None)]. A comment line right below a command, and each comment line right below that one,
    shows its output; a comment after a blank line, or first, is a comment."""
    chunks: list[tuple[str, str | None]] = []
    commands: list[str] = []
    shown: list[str] = []
    after_command = False
    for line in source.splitlines():
        if line.startswith("#") and (after_command or shown):
            shown.append(line[1:].strip())
            after_command = False
            continue
        if shown or not line.strip():
            chunks.append(("\n".join(commands), "\n".join(shown) if shown else None))
            commands, shown = [], []
        commands.append(line)
        after_command = bool(line.strip()) and not line.startswith("#")
    chunks.append(("\n".join(commands), "\n".join(shown) if shown else None))
    return [(code, output) for code, output in chunks if code.strip() or output is not None]


BLOCKS = parse_pages()


# -- output ----------------------------------------------------------------------------------------


NUMBER = re.compile(r"-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+[eE][-+]?\d+")


def output_pattern(shown: str) -> tuple[re.Pattern, list[float]]:
    """A regular expression for what a block shows: `...` any text, whitespace any whitespace,
    each number with a fraction or an exponent captured, to compare within a tolerance."""
    parts, numbers = [], []
    for piece in re.split(r"(\.\.\.|\s+|" + NUMBER.pattern + ")", shown):
        if not piece:
            continue
        if piece == "...":
            parts.append(".*?")
        elif piece.isspace():
            parts.append(r"\s*")
        elif NUMBER.fullmatch(piece):
            parts.append(r"(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")
            numbers.append(float(piece))
        else:
            parts.append(r"\s*".join(re.escape(word) for word in piece.split()))
    return re.compile("".join(parts), re.DOTALL), numbers


def shows(shown: str, actual: str, *, anywhere: bool = False) -> bool:
    """Whether `actual` is what `shown` shows (anywhere in it, for a server's output)."""
    pattern, numbers = output_pattern(shown)
    matches = pattern.finditer(actual) if anywhere else [pattern.fullmatch(actual.strip())]
    for match in matches:
        if match and all(math.isclose(float(got), want, rel_tol=1e-4, abs_tol=1e-6)
                         for got, want in zip(match.groups(), numbers, strict=True)):
            return True
    return False


def test_shown_output_reads_ellipses_whitespace_and_numbers():
    assert shows('{"predictions":[[...]]}', '{"predictions":[[1.5,2.5]]}')
    assert shows('{"a": [0.1234, ...]}', '{"a":[0.12341,7]}')
    assert not shows('{"a": [0.1234, ...]}', '{"a":[0.1237,7]}')
    assert not shows('{"error":"a b"}', '{"error":"a c"}')
    assert shows("[[-0.00627266 -0.00103179  0.00044744]]", "[[-0.00627266 -0.00103179  0.00044744]]\n")
    assert shows("model 'default' v1 runs", "x\nmodel 'default' v1 runs on\n", anywhere=True)
    assert split_output("a\n# 1\nb \\\n  c\n# 2\n# 3\n\n# prose\nd\n\ne\n# 4") == [
        ("a", "1"), ("b \\\n  c", "2\n3"), ("\n# prose\nd", None), ("\ne", "4")]


# -- which packages the README's install brings ------------------------------------------------------


def requirement_names(file: Path) -> set[str]:
    names = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*==", file.read_text(), re.MULTILINE)
    return {normalized(name) for name in names}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_by(requirements: str) -> set[str]:
    """What `pip install -r FILE` brings: its lock where there is one (the whole closure, as
    scripts/lock.sh writes it), else its pins."""
    lock = "requirements-cpu.lock" if requirements == "requirements.txt" else requirements.replace(".txt", ".lock")
    return requirement_names(REPO / lock if (REPO / lock).exists() else REPO / requirements)


# `python3 -m venv` puts pip and setuptools (whose .pth imports its _distutils_hack at every start) in a venv.
README_INSTALL = installed_by("requirements.txt") | installed_by("requirements-nodeps.txt") | {"pip", "setuptools"}
PIP_INSTALL = re.compile(r"\.venv[\w-]*/bin/pip install [^\n#]*?-r (requirements[\w-]*\.txt)")


def page_installs(block: Block) -> frozenset[str]:
    """The README's install and every requirements file the page installs up to this block."""
    names = set(README_INSTALL)
    for earlier in BLOCKS[:block.index + 1]:
        if earlier.page == block.page:
            for requirements in PIP_INSTALL.findall(earlier.source):
                names |= installed_by(requirements)
    return frozenset(names)


@functools.cache
def not_installed(installed: frozenset[str]) -> frozenset[str]:
    """The top-level modules of this environment that no installed distribution of `installed` holds."""
    owners = importlib.metadata.packages_distributions()
    return frozenset(top for top, distributions in owners.items()
                     if not any(normalized(distribution) in installed for distribution in distributions))


# Every Python process a block starts imports this first (PYTHONPATH): a module that the page's
# installs would not have put in the venv is missing, as it is for a reader, and an optional
# import falls back as it does for them.
SITECUSTOMIZE = """\
import importlib.abc, os, sys


class NotInstalled(importlib.abc.MetaPathFinder):
    names = frozenset(os.environ.get("MANUAL_NOT_INSTALLED", "").split(","))

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
"""


# -- servers -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Server:
    command: str
    ports: dict[int, int]
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM to the block's whole process group (bash, Gunicorn and its workers, nginx), as
        Ctrl-C reaches them all; SIGKILL to what is left after a minute."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while group_alive(self.proc.pid):
            self.proc.poll()  # reap bash, so that its pid reads as gone
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                raise AssertionError(f"`{self.command}` did not stop within 60 s of SIGTERM:\n{self.log()[-3000:]}")
            time.sleep(0.1)  # a process group gives no event when its last member exits
        self.proc.wait()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Manual:
    """Runs blocks: the servers they start (one per command, kept while a later block needs it)
    and the environment every command sees."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.servers: dict[str, Server] = {}
        curl_home = folder / "curl"
        curl_home.mkdir()
        # Every curl fails on an HTTP error (exit 22) and still prints the body; no progress meter.
        (curl_home / ".curlrc").write_text("fail-with-body\nsilent\nshow-error\n")
        self.base_env = {key: value for key, value in os.environ.items() if key != "PROMETHEUS_MULTIPROC_DIR"}
        self.base_env.update({"CURL_HOME": str(curl_home), "TFS_LISTEN_HOST": "127.0.0.1"})
        self.sitecustomize = folder / "installed"
        self.sitecustomize.mkdir()
        (self.sitecustomize / "sitecustomize.py").write_text(SITECUSTOMIZE)

    # -- running one block

    def run(self, block: Block) -> None:
        if ".venv-jax/" in block.source and not (REPO / ".venv-jax" / "bin" / "python").exists():
            pytest.skip("no .venv-jax here (.ci/run makes it, as tests/test_jax.py needs)")
        if "examples/models" in block.source and not (REPO / "examples" / "models").exists():
            # A page run alone: the README's block that makes them has not run.
            subprocess.run([str(VENV_PYTHON), "examples/make_models.py"], cwd=REPO, check=True)
        self.stop_servers_done_before(block)
        if block.language == JSON:
            self.check_file(block)
        elif block.server_port:
            self.start(block)
        else:
            server = self.server_for(block)
            if block.language == PYTHON:
                self.run_python(block, server)
            else:
                self.run_shell(block, server)

    def env(self, ports: dict[int, int], block: Block) -> dict[str, str]:
        """What every command of `block` sees: the server's ports, and only what the page installed."""
        path = os.pathsep.join(filter(None, [str(self.sitecustomize), os.environ.get("PYTHONPATH")]))
        return {**self.base_env, "BIND": f"127.0.0.1:{ports[8000]}", "GRPC_BIND": f"127.0.0.1:{ports[8500]}",
                "PYTHONPATH": path, "MANUAL_NOT_INSTALLED": ",".join(sorted(not_installed(page_installs(block))))}

    def on_ports(self, source: str, ports: dict[int, int]) -> str:
        """The block on the server's ports; the files it names that hold the manual's ports, copies on them."""
        for name in FILES_WITH_PORTS:
            if name in source:
                copy = self.folder / f"{ports[8000]}-{Path(name).name}"
                copy.write_text(FILE_PORT.sub(lambda match: str(ports[int(match[1])]), (REPO / name).read_text()))
                source = source.replace(name, str(copy))
        return PORT.sub(lambda match: str(ports[int(match[1])]), source)

    def run_shell(self, block: Block, server: Server) -> None:
        for commands, shown in split_output(self.on_ports(block.source, server.ports)):
            done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", commands], cwd=REPO,
                                  env=self.env(server.ports, block), capture_output=True, text=True, timeout=600)
            failed = done.returncode != 0 and not (done.returncode == 22 and shown is not None)
            assert not failed, f"{block.id}: exit {done.returncode} from\n{commands}\n{done.stdout}\n{done.stderr}"
            if shown is not None:
                assert shows(shown, done.stdout), f"{block.id}: shows\n{shown}\nprinted\n{done.stdout}{done.stderr}"

    def run_python(self, block: Block, server: Server) -> None:
        chunks = split_output(block.source)
        script = self.on_ports("\n".join(code for code, _ in chunks), server.ports)
        done = subprocess.run([str(VENV_PYTHON), "-c", script], cwd=REPO, env=self.env(server.ports, block),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{block.id}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        shown = "\n".join(output for _, output in chunks if output is not None)
        assert shows(shown, done.stdout), f"{block.id}: shows\n{shown}\nprinted\n{done.stdout}"

    def check_file(self, block: Block) -> None:
        from app.ops.settings import Settings, model_configs

        assert block.file, f"{block.id}: a JSON block names the file it shows (<!-- file: ... -->)"
        path = REPO / block.file
        assert json.loads(block.source) == json.loads(path.read_text()), f"{block.id} is not {block.file}"
        # The server reads it: every model it names is there.
        for config in model_configs(Settings(model_config=str(path))):
            assert config.path is None or (REPO / config.path).exists(), f"{block.file}: no {config.path}"

    # -- servers

    def server_for(self, block: Block) -> Server:
        assert block.talks_to is not None
        if block.talks_to not in self.servers:
            server_block = next(other for other in BLOCKS if other.server_port and not other.skip
                                and server_command(other.source) == block.talks_to)
            self.start(server_block)
        return self.servers[block.talks_to]

    def start(self, block: Block) -> None:
        command = server_command(block.source)
        if command in self.servers:
            return
        ports = dict(zip(MANUAL_PORTS, free_ports(len(MANUAL_PORTS)), strict=True))
        log_path = self.folder / f"server-{ports[8000]}.log"
        with open(log_path, "wb") as log:
            # A session of its own: its process group is what Ctrl-C would reach.
            proc = subprocess.Popen(["bash", "-e", "-c", self.on_ports(command, ports)], cwd=REPO,
                                    env=self.env(ports, block), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        server = Server(command, ports, proc, log_path)
        self.servers[command] = server
        self.wait_ready(block, server)
        shown = [output for _, output in split_output(block.source) if output is not None]
        for lines in shown:
            assert shows(lines, server.log(), anywhere=True), f"{block.id}: its output lacks\n{lines}\n{server.log()}"

    def wait_ready(self, block: Block, server: Server) -> None:
        named = {server.ports[int(port)] for port in PORT.findall(block.source)}
        for name in FILES_WITH_PORTS:
            if name in block.source:
                named |= {server.ports[int(port)] for port in FILE_PORT.findall((REPO / name).read_text())}
        url = f"http://127.0.0.1:{server.ports[block.server_port or 8000]}/readyz"
        deadline = time.monotonic() + READY_WITHIN_S
        while True:
            assert server.proc.poll() is None, f"{block.id} exited with {server.proc.returncode}:\n{server.log()}"
            assert time.monotonic() < deadline, f"{block.id} not ready within {READY_WITHIN_S} s:\n{server.log()}"
            with contextlib.suppress(requests.RequestException):
                if requests.get(url, timeout=10).status_code == 200 and all(accepts(port) for port in named):
                    return
            time.sleep(0.2)  # nothing listens yet: there is no event to wait on

    def stop_servers_done_before(self, block: Block) -> None:
        """Stop each server no block from this one on talks to."""
        needed = {other.talks_to for other in BLOCKS[block.index:] if not other.skip}
        needed |= {server_command(other.source) for other in BLOCKS[block.index:]
                   if other.server_port and not other.skip}
        for command in [command for command in self.servers if command not in needed]:
            self.servers.pop(command).stop()

    def stop_all(self) -> None:
        while self.servers:
            self.servers.popitem()[1].stop()


@pytest.fixture(scope="module")
def manual(tmp_path_factory) -> Iterator[Manual]:
    runner = Manual(tmp_path_factory.mktemp("manual"))
    yield runner
    runner.stop_all()


@pytest.mark.server
@pytest.mark.parametrize("block", [
    pytest.param(block, marks=pytest.mark.skip(reason=f"{block.skip}: {SKIP_REASONS.get(block.skip, '?')}"))
    if block.skip else block for block in BLOCKS], ids=lambda block: block.id)
def test_block_runs_as_the_page_shows(block, manual):
    block.example.namespace["manual"] = manual
    block.example.evaluate()


def test_every_skip_gives_a_known_reason():
    assert sorted({block.skip for block in BLOCKS if block.skip} - set(SKIP_REASONS)) == []
