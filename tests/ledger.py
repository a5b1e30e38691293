"""What a live server logged and counted, held against what its clients got, and the checks around an attack.

A `Door` says which requests a ledger reads (gRPC calls, or HTTP requests less the probes the
access log leaves out) and the key it counts them by. `Ledger` reads, since it was opened, the
access lines of those requests and the change in model_server_requests_total, each as a count
per key. `Watch` is what every attack test asserts once the attack is over (the siege helpers
of tests/grpc_ledger.py and tests/http_ledger.py make one around an attack):

- the worker's pid is unchanged: no client made it exit;
- a normal predict was answered, with the model's own values, while the attack held;
- the worker's resident memory (VmRSS) after the attack is at most RSS_GROWTH (a quarter)
  above what it was before: what an attack makes the server hold is bounded;
- every request the attack's clients made has exactly one access line and one count, each
  with the status its client got (`expected`), and nothing else was logged or counted.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import psutil
import requests

from tests.conftest import Server, wait_for

# Growth of the worker's resident memory an attack may leave, as a share of where it started.
# A loaded worker holds about 550 MiB; glibc and grpc-core keep freed memory for reuse, and
# the first 50,000-stream reset storm leaves 64-90 MiB more, later storms 0-28 MiB each
# (docs/reliability.md); a leak of a few KiB a request would pass 138 MiB within a storm or two.
RSS_GROWTH = 0.25
_TEXT_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')
# The HTTP paths the access log leaves out by default (app/ops/logs.py's PROBE_PATHS); the
# ledger's own reads of /readyz and /metrics are among them.
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})

Counts = collections.Counter[tuple[str, str]]
Key = Callable[[dict[str, str]], "tuple[str, str] | None"]


@dataclass(frozen=True)
class Door:
    """Which requests a ledger reads: the key of an access line and of a metrics sample's
    labels, or None for one it leaves out."""

    line_key: Key
    sample_key: Key


def _grpc_key(fields: dict[str, str], where: str) -> tuple[str, str] | None:
    return (fields[where], fields["status"]) if fields.get("method") == "GRPC" else None


def _http_key(fields: dict[str, str], where: str) -> tuple[str, str] | None:
    # An HTTP request's line holds its path, its count the URL rule it matched: both sides
    # are keyed by method and status.
    if fields.get("method") == "GRPC" or fields[where] in PROBES:
        return None
    return fields["method"], fields["status"]


# gRPC calls by method path and status; HTTP requests by method and status.
GRPC = Door(line_key=lambda line: _grpc_key(line, "path"), sample_key=lambda labels: _grpc_key(labels, "route"))
HTTP = Door(line_key=lambda line: _http_key(line, "path"), sample_key=lambda labels: _http_key(labels, "route"))


def access_lines(text: str) -> list[dict[str, str]]:
    """The access lines in a server's log text, JSON or text format, as fields."""
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("logger") != "app.access":
                continue
        elif " app.access: access " in line:
            entry = {key: value.strip('"') for key, value in _TEXT_FIELD.findall(line.split(" app.access: ", 1)[1])}
        else:
            continue
        found.append({key: str(value) for key, value in entry.items()})
    return found


def request_counts(server: Server, door: Door) -> Counts:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.url + "/metrics", timeout=30).text
    counts: Counts = collections.Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = door.sample_key(sample.labels) if sample.name == "model_server_requests_total" else None
            if key is not None:
                counts[key] += int(sample.value)
    return counts


class Ledger:
    def __init__(self, server: Server, door: Door) -> None:
        self.server = server
        self.door = door
        self._counts = request_counts(server, door)
        self._log_at = len(server.log())

    def lines(self) -> list[dict[str, str]]:
        return [line for line in access_lines(self.server.log()[self._log_at:]) if self.door.line_key(line)]

    def logged(self) -> Counts:
        return collections.Counter(self.door.line_key(line) for line in self.lines())  # type: ignore[misc]

    def counted(self) -> Counts:
        now = request_counts(self.server, self.door)
        return collections.Counter({key: now[key] - self._counts[key] for key in now if now[key] != self._counts[key]})

    def settle(self, expected: Counts, *, within_s: float = 30) -> None:
        """Wait until the log and the counts reach `expected` (lines are written off the request's
        thread, after its end), then assert both equal it."""
        expected = +expected
        try:
            wait_for(lambda: self.logged() == expected and self.counted() == expected, within_s=within_s)
        except TimeoutError:
            pass  # the assertion says how they differ
        logged, counted = self.logged(), self.counted()
        assert logged == counted == expected, f"logged {dict(logged)}, counted {dict(counted)}, " \
                                              f"expected {dict(expected)}"


def worker_pid(server: Server) -> int:
    shown = requests.get(server.url + "/readyz", timeout=10).json().get("pid")
    if shown is not None:
        return shown
    # Without READYZ_DETAIL /readyz shows no pid: a one-worker server's worker is the master's one child.
    [worker] = [process for process in server.processes()[1:] if process.status() != psutil.STATUS_ZOMBIE]
    return worker.pid


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        [line] = [line for line in status if line.startswith("VmRSS:")]
    return int(line.split()[1]) * 1024


class Watch:
    """The worker's pid, memory and ledger, taken before an attack and checked after it."""

    def __init__(self, server: Server, door: Door, *, ledger: bool) -> None:
        self.server = server
        self.pid = worker_pid(server)
        self.rss_before = rss_bytes(self.pid)
        self.ledger = Ledger(server, door) if ledger else None
        self.expected: Counts = collections.Counter()
        self.predicted = 0

    def close(self) -> None:
        """Let go of the watch's own connections."""

    def check(self) -> None:
        self.close()
        assert self.predicted, "no predict was answered while the attack held"
        rss_after = rss_bytes(self.pid)
        assert rss_after <= self.rss_before * (1 + RSS_GROWTH), f"VmRSS {self.rss_before} -> {rss_after} bytes"
        assert worker_pid(self.server) == self.pid, "the worker was replaced"
        if self.ledger is not None:
            self.ledger.settle(self.expected)


W = TypeVar("W", bound=Watch)


@contextmanager
def watching(watch: W) -> Iterator[W]:
    """Yield `watch`; on a clean exit, make every check of the module docstring."""
    try:
        yield watch
    except BaseException:
        watch.close()
        raise
    watch.check()
