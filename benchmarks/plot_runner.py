"""Drawing a results folder's plots (benchmarks/plots.py) with a Python that has matplotlib: this one when
it does, else a small venv of its own under .bench-peers/ (made once)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.servers import PLOTS_VENV, REPO, ensure_venv

WORK_DIR = REPO / ".bench-peers"


def make_plots(out_dir: Path, module: str = "benchmarks.plots") -> list[str]:
    """The plots' file names, drawn by `module` from out_dir/results.json (none, with the reason printed, on
    failure)."""
    python = Path(sys.executable)
    if importlib.util.find_spec("matplotlib") is None:
        (WORK_DIR / "venvs").mkdir(parents=True, exist_ok=True)  # a fresh clone has no .bench-peers/ yet
        python = ensure_venv(WORK_DIR / "venvs", PLOTS_VENV, WORK_DIR / "pip-plots.log")
    result = subprocess.run(
        [str(python), "-m", module, str(out_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if result.returncode != 0:
        print(f"plots failed:\n{result.stderr[-2000:]}", flush=True)
        return []
    return result.stdout.split()
