"""Progress lines of a run, with the time of day: a run takes minutes."""

from __future__ import annotations

import datetime


def log(message: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)
