"""Locate Prometheus' `promtool` (installed by `make test` at .venv/bin/promtool) and lint with it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

INSTALL_HINT = (
    "promtool not found: `make test` (or `make promtool`) installs it at .venv/bin/promtool "
    "from Debian's `prometheus` package"
)


def find_promtool() -> str | None:
    """`promtool` next to the running interpreter (the virtualenv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "promtool"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("promtool")


def require_promtool() -> str:
    """The promtool path; fails the calling test (never skips) when it is missing."""
    path = find_promtool()
    if path is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    return path


def check_metrics(exposition: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """`promtool check metrics` over the exposition text on stdin."""
    return subprocess.run(
        [require_promtool(), "check", "metrics"],
        input=exposition,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
