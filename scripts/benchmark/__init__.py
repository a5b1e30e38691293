"""The benchmark tool: `python -m scripts.benchmark <scenario> [options]`, one results page per scenario.

Scenarios (each a module here): experiment, floor (experiment.py), peers, model-processes,
variable-length, profile. `common` holds what they share (the measured server, the page, the
machine); `load` the load generators (Locust, wrk).
"""

from __future__ import annotations

import sys
from pathlib import Path

# The repository root, so that `app` and `scripts` import however this package was reached.
_REPO = str(Path(__file__).resolve().parent.parent.parent)
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
