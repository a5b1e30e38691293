"""The checks of tests/ledger.py around an attack on a live server's HTTP port, directly or through nginx.

`siege` is the one set of assertions every HTTP attack test makes, around the attack:

- the worker's pid is unchanged: no client made it exit;
- `/healthz` answers 200 and a normal POST predict answers the model's own values while the
  attack holds (the test calls `serving()` at that point), on a session whose connection was
  made before the attack (the front's, where `url` names nginx);
- the worker's resident memory (VmRSS) after the attack is at most RSS_GROWTH (a quarter)
  above what it was before;
- every request the attack's clients made has exactly one access line and one count, each
  with the status its client got (`got`), and nothing else was logged or counted (the probes,
  which the access log leaves out, are left out of both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import requests

from tests import ledger
from tests.conftest import Server, integer_rows
from tests.ledger import HTTP, watching

Model = Callable[[np.ndarray], object]
Rows = Callable[[int], np.ndarray]


def exact_rows(seed: int) -> np.ndarray:
    return integer_rows(3, seed=seed)


class Siege(ledger.Watch):
    """One attack's watch over HTTP: what its clients got, and the server serving while it holds."""

    def __init__(self, server: Server, model: Model, *, url: str, path: str, rows: Rows, ledger: bool) -> None:
        self.model = model
        self.url = url
        self.path = path
        self.rows = rows
        self.session = requests.Session()
        self._check_health()  # opens the session's connection before the attack
        super().__init__(server, HTTP, ledger=ledger)

    def got(self, method: str, status: int, count: int = 1) -> None:
        """`count` requests with `method` whose clients got `status`."""
        self.expected[method, str(status)] += count

    def _check_health(self) -> None:
        answer = self.session.get(self.url + "/healthz", timeout=10)
        assert answer.status_code == 200, answer.text

    def serving(self) -> None:
        """/healthz answers 200 and a normal predict the model's own values, now."""
        self._check_health()
        rows = self.rows(100 + self.predicted)
        answer = self.session.post(self.url + self.path, json={"instances": rows.tolist()}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["predictions"] == np.asarray(self.model(rows)).tolist()
        self.got("POST", 200)
        self.predicted += 1

    def close(self) -> None:
        self.session.close()


@contextmanager
def siege(server: Server, model: Model, *, url: str | None = None, path: str = "/predict",
          rows: Rows = exact_rows, ledger: bool = True) -> Iterator[Siege]:
    """Watch an attack on `server` (reached at `url`, by default its own); on a clean exit,
    make every assertion of the module docstring. `model` gives the values a predict of
    `rows(seed)` at `path` must answer."""
    with watching(Siege(server, model, url=url or server.url, path=path, rows=rows, ledger=ledger)) as watch:
        yield watch
