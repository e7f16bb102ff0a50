"""Part: every test of tests/gpu, run by pytest, each test's outcome saved as it ends.

Per test: passed, failed, error (its setup or teardown failed), skipped (with the reason),
xfailed/xpassed, or crashed (the process died in it), its duration, the failure's text and what
the test printed (the flash tests print their errors). pytest runs in a child process that saves
into this part's file as it goes, the running test included, so that a test that kills the
process (a CUDA fault) or hangs past the deadline is named. A CUDA error leaves the process's
CUDA context unusable, so pytest stops at the first one, and, as after a crash, a fresh process
runs the tests not yet run: one broken kernel does not fail every test after it. A test that would
start too close to the deadline is skipped with that reason; pytest-timeout (when installed)
bounds each test that hangs in Python.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from gpucheck.results import read_json, write_json

if TYPE_CHECKING:  # the pytest process imports this module too, and needs no torch of its own
    from gpucheck.common import PartContext

logger = logging.getLogger("gpu_check")

TESTS = "tests/gpu"
PER_TEST_TIMEOUT_S = 90  # the longest tests build and capture a few tiny engines
STARTING_LEFT_S = 5  # a test needs at least this much of the part's time to start
MAX_RUNS = 6  # pytest processes: the first, and one after each crash or CUDA error
CUDA_ERROR_MARKERS = ("CUDA error", "CUDA_ERROR", "cudaError", "CUBLAS_STATUS", "CUDNN_STATUS")


def run(ctx: PartContext) -> None:
    result = ctx.result
    result.update(tests={}, collection_errors=[], runs=[])
    ctx.save()
    for _ in range(MAX_RUNS):
        if ctx.remaining() < STARTING_LEFT_S:
            break
        returncode, tail = run_pytest(ctx, deselect=list(result["tests"]))
        result.clear()
        result.update(read_json(ctx.path) or {})  # what the pytest process saved
        stop = result.pop("stopped_by_cuda_error", None)
        running = result.pop("running", None)  # the test the process died in, or was killed in
        result["runs"].append(
            {
                "returncode": returncode,
                **({"stopped_after": stop} if stop else {}),
                **({"ended_in": running} if running else {}),
            }
        )
        if running:
            outcome = "crashed" if returncode is not None else "timeout"
            result["tests"][running] = {"outcome": outcome, "returncode": returncode, "failure": crash_text(tail)}
        ctx.save()
        if not (stop or running and returncode is not None):
            break
        logger.info(
            "tests/gpu: %s; the tests not yet run go on in a fresh process",
            f"CUDA error in {stop}" if stop else f"crashed in {running}",
        )
    counts: dict[str, int] = {}
    for entry in result["tests"].values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    result["counts"] = counts
    bad = sum(counts.get(k, 0) for k in ("failed", "error", "crashed", "timeout")) + len(result["collection_errors"])
    last = result["runs"][-1]["returncode"] if result["runs"] else None
    result["status"] = "ok" if not bad and last in (0, 5) else "failed"  # 5: pytest collected nothing
    logger.info("tests/gpu: %s", counts)


def run_pytest(ctx: PartContext, deselect: list[str]) -> tuple[int | None, list[str]]:
    """One pytest process over tests/gpu less `deselect`, saving into the part's file: (its exit status,
    None if it was killed at the deadline; the last lines it printed)."""
    args = [
        ctx.options.get("tests", TESTS),
        "-v",
        "-p",
        "no:cacheprovider",
        *(f"--deselect={node}" for node in deselect),
    ]
    if importlib.util.find_spec("pytest_timeout") is not None:
        args.append(f"--timeout={PER_TEST_TIMEOUT_S}")
    scripts = Path(__file__).resolve().parents[1]
    command = [
        sys.executable,
        "-u",
        "-c",
        f"import sys; sys.path.insert(0, {str(scripts)!r}); "
        "from gpucheck.tests_gpu import pytest_main; sys.exit(pytest_main())",
        str(ctx.path),
        repr(ctx.deadline),
        *args,
    ]
    child = subprocess.Popen(
        command, cwd=scripts.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    tail: deque[str] = deque(maxlen=300)
    for line in child.stdout:  # the part's stdout is the check's log
        sys.stdout.write(line)
        tail.append(line)
        if time.time() > ctx.deadline + 2:  # a hung test that stopped printing is the parent's to kill
            break
    try:
        return child.wait(timeout=max(ctx.deadline + 2 - time.time(), 1)), list(tail)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return None, list(tail)


def crash_text(tail: list[str]) -> str:
    """What the process printed last: from faulthandler's "Fatal Python error" line when there is one (its
    stacks follow), else the last lines."""
    text = "".join(tail)
    start = text.rfind("Fatal Python error")  # pytest -v may have printed the test's id on the same line
    return text[start : start + 3000] if start >= 0 else text[-3000:]


# ---------------------------------------------------------------------- the pytest process


def pytest_main() -> int:
    """In the pytest process: argv is (the part's file, the deadline, pytest's arguments)."""
    import pytest

    path, deadline, args = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    result = read_json(path) or {}
    result.setdefault("tests", {})
    result.setdefault("collection_errors", [])
    result["pytest"] = {"version": pytest.__version__, "args": list(args)}
    return int(pytest.main(args, plugins=[Recorder(result, path, deadline)]))


class Recorder:
    """A pytest plugin that writes each test's outcome into the part's result as it ends."""

    def __init__(self, result: dict, path: Path, deadline: float):
        self.result, self.path, self.deadline = result, path, deadline
        self.tests: dict[str, dict] = result["tests"]

    def save(self) -> None:
        write_json(self.path, self.result)

    def pytest_collectreport(self, report) -> None:
        known = {error["nodeid"] for error in self.result["collection_errors"]}  # a rerun collects again
        if report.failed and report.nodeid not in known:
            self.result["collection_errors"].append({"nodeid": report.nodeid, "error": report.longreprtext[-3000:]})
            self.save()

    def pytest_runtest_setup(self, item) -> None:
        import pytest

        left = self.deadline - time.time()
        if left < STARTING_LEFT_S:
            pytest.skip(f"the check's deadline for tests/gpu was near ({left:.0f} s left)")

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self.result["running"] = nodeid
        self.save()

    def pytest_runtest_logreport(self, report) -> None:
        entry = self.tests.setdefault(report.nodeid, {"outcome": None, "duration_s": 0.0})
        entry["duration_s"] = round(entry["duration_s"] + report.duration, 3)
        outcome = phase_outcome(report)
        if outcome is not None and entry["outcome"] in (None, "passed"):
            entry["outcome"] = outcome
            if outcome == "skipped":
                entry["reason"] = skip_reason(report)
            elif outcome in ("failed", "error"):
                entry["failure"] = report.longreprtext[-3000:]
                entry["phase"] = report.when
        if report.when == "call" and report.capstdout:
            entry["stdout"] = report.capstdout[-2000:]

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        self.result.pop("running", None)
        self.save()

    def pytest_runtest_makereport(self, item, call) -> None:
        if call.excinfo is not None and any(marker in str(call.excinfo.value) for marker in CUDA_ERROR_MARKERS):
            # the CUDA context is unusable from here: every later test would fail for this one's sake
            item.session.shouldstop = f"CUDA error in {item.nodeid}"
            self.result["stopped_by_cuda_error"] = item.nodeid


def phase_outcome(report) -> str | None:
    """The test's outcome as far as this phase (setup, call, teardown) tells: None when it says nothing."""
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.skipped:
        return "skipped"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return "passed" if report.when == "call" else None


def skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")
