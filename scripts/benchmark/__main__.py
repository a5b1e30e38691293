"""`python -m scripts.benchmark` (from the repository root) or `python scripts/benchmark`."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a folder (`python scripts/benchmark`): import the package by its full name, and not
    # its modules as top-level ones (its locust.py would hide the locust package).
    sys.path[0] = str(Path(__file__).resolve().parent.parent.parent)

from scripts.benchmark.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
