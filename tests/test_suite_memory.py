"""The suite reports its peak memory at the end of a run (tests/conftest.py)."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_run_ends_with_its_peak_rss():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_cli.py::test_child_servers_share_the_tests_cache_dir",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(
        r"^peak RSS: (\d+) MiB in the test process(; a child process reached \d+ MiB)?$", result.stdout, re.M
    )
    assert match, result.stdout
    assert 10 < int(match[1]) < 100_000  # torch alone takes more than 10 MiB
