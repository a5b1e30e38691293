"""The machine and the package versions a run was made with, for the report's first tables."""

from __future__ import annotations

import os
import platform
from importlib import metadata as package_metadata
from pathlib import Path

import psutil


def machine_facts() -> dict[str, str]:
    cpu_model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = psutil.virtual_memory().total / 2**30
    return {
        "CPU": cpu_model,
        "cores": f"{psutil.cpu_count(logical=True)} logical, {psutil.cpu_count(logical=False)} physical",
        "memory": f"{memory_gib:.1f} GiB",
        "OS": platform.platform(),
        "GPU": "none used (TensorFlow CPU build)",
        "load average at start (1, 5, 15 min)": ", ".join(f"{value:.2f}" for value in os.getloadavg()),
    }


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    distributions = {"tensorflow": ("tensorflow-cpu", "tensorflow"), "keras": ("keras",), "gunicorn": ("gunicorn",),
                     "locust": ("locust",), "flask": ("flask",), "numpy": ("numpy",)}
    for label, names in distributions.items():
        found[label] = "not installed"
        for name in names:
            try:
                version = package_metadata.version(name)
            except package_metadata.PackageNotFoundError:
                continue
            found[label] = version if name == label else f"{version} ({name})"
            break
    return found
