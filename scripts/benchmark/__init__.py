"""The benchmark: the model alone, then real servers under real Locust load; a report and a plot.

    python -m scripts.benchmark --help

Modules, in the order of a run: `options` (the command line), `configs` (what is run),
`model_alone` (part 1, in a child process), `server`, `locust` and `measure` (part 2),
`metrics` (a server's own batching figures), `report`, `report_sections` and `plot` (part 3),
`cli` (the run from end to end). Results are the dataclasses of `results`.
scripts/profile_worker.py uses the names below.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The repository root, so that `app` and `scripts` import however this package was reached.
_REPO = str(Path(__file__).resolve().parent.parent.parent)
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from .configs import (  # noqa: E402
    CLOSED_LOOP_LABEL,
    CONFIGS,
    CONFIGS_BY_NAME,
    REFERENCE,
    Config,
    Load,
    baseline_config,
    baseline_tree,
)
from .locust import locust_command, run_locust, spawning  # noqa: E402
from .machine import machine_facts  # noqa: E402
from .measure import run_config, run_rounds  # noqa: E402
from .metrics import batch_delta, ceiling_figures, metric_snapshot  # noqa: E402
from .model_alone import build_wide_model  # noqa: E402
from .options import Options, parse_args, without_flags  # noqa: E402
from .report_sections import round_lines  # noqa: E402
from .results import (  # noqa: E402
    AfterIdle,
    BatchDelta,
    BatchTiming,
    CallTiming,
    Ceiling,
    ConfigResult,
    LoadStats,
    ModelAlone,
    ProtocolResult,
)
from .runlog import log  # noqa: E402
from .server import Server  # noqa: E402
from .text import fmt, markdown_table  # noqa: E402

REPO = Path(_REPO)

__all__ = [
    "CLOSED_LOOP_LABEL", "CONFIGS", "CONFIGS_BY_NAME", "REFERENCE", "REPO", "AfterIdle", "BatchDelta", "BatchTiming",
    "CallTiming", "Ceiling", "Config", "ConfigResult", "Load", "LoadStats", "ModelAlone", "Options", "ProtocolResult",
    "Server", "baseline_config", "baseline_tree", "batch_delta", "build_wide_model", "ceiling_figures", "fmt", "log",
    "locust_command", "machine_facts", "markdown_table", "metric_snapshot", "parse_args", "round_lines", "run_config",
    "run_locust", "run_rounds", "spawning", "without_flags"]
