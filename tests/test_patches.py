"""Each framework patch (app/patches.py) was measured on one version: a new one must be re-measured."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from app.patches import MEASURED_ON


@pytest.mark.parametrize("package", ["flask", "gunicorn"])
def test_patched_package_is_the_version_the_patches_were_measured_on(package):
    installed = importlib.metadata.version(package)
    assert installed == MEASURED_ON[package], (
        f"{package} {installed} is installed; app/patches.py was measured on {MEASURED_ON[package]}: "
        "re-measure each patch of it, then move the pin or drop the patch")


def test_python_is_the_version_the_logging_patch_was_measured_on():
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == MEASURED_ON["python"]


def test_pins_agree_with_the_requirements():
    from tests.conftest import REPO

    pinned = dict(line.split("==", 1) for line in (REPO / "requirements.txt").read_text().splitlines()
                  if "==" in line and not line.startswith("#") and ";" not in line)
    assert pinned["flask"] == MEASURED_ON["flask"] and pinned["gunicorn"] == MEASURED_ON["gunicorn"]
