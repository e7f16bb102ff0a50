"""The code runs on the oldest Python that pyproject's `requires-python` promises.

No interpreter that old can be installed here, so vermin checks the source
statically: stdlib modules and members, syntax and annotations newer than the floor.
"""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "engine", "scheduler", "tests")


def python_floor() -> str:
    """`requires-python = ">=3.X"` from pyproject.toml, as "3.X" (no tomllib: it is 3.11+)."""
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(r'^requires-python\s*=\s*">=\s*(\d+\.\d+)"', text, re.MULTILINE)
    assert match, "pyproject.toml: requires-python is not of the form >=X.Y"
    return match.group(1)


def test_the_source_needs_nothing_newer_than_the_floor():
    floor = python_floor()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from vermin import main; sys.exit(main())",
            f"--target={floor}-",
            "--eval-annotations",
            "--no-tips",
            "--violations",
            "-q",
            *PACKAGES,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, f"features newer than Python {floor}:\n{result.stdout}{result.stderr}"
