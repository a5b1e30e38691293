"""Numbers and tables as the reports write them (the benchmark's and scripts/profile_worker.py's)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .configs import CLOSED_LOOP_LABEL


def fmt(value: float | None, digits: int = 1) -> str:
    """A figure for a table: – where unknown, thousands without decimals."""
    if value is None:
        return "–"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def load_name(label: str) -> str:
    if label == CLOSED_LOOP_LABEL:
        return "the closed loop"
    return f"{label} user" if label == "1" else f"{label} users"


def ratio(numerator: float | None, denominator: float | None) -> str:
    if not numerator or not denominator:
        return "–"
    return f"{numerator / denominator:.1f}×" if numerator / denominator < 100 else f"{numerator / denominator:,.0f}×"
