"""The linters over the tree, with the settings committed in pyproject.toml: ruff ([tool.ruff]: an unused
import, an undefined name or a redefinition; and its formatter's layout) and mypy ([tool.mypy], over server,
engine and scheduler).
Each fails `make test`, so the next reader never meets what they catch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: it comes with the dev extra (make test installs it)")
    return found


def test_the_tree_passes_ruff():
    result = subprocess.run(
        [tool("ruff"), "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tree_is_formatted_by_ruff():
    result = subprocess.run(
        [tool("ruff"), "format", "--check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout[-4000:] + result.stderr


def test_server_engine_and_scheduler_pass_mypy():
    # its incremental cache lives outside the tree, so a clean checkout checks from scratch
    result = subprocess.run(
        [tool("mypy"), "--cache-dir", "/dev/null"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
