"""ruff over the whole tree with the rules committed in pyproject.toml ([tool.ruff]): an unused import, an
undefined name or a redefinition fails `make test`, so the next reader never meets one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff() -> str:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (it comes with the dev extra: make test installs it)")
    return found


def test_the_tree_passes_ruff():
    result = subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
