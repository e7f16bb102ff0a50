"""Part: every test of tests/gpu, run by pytest in this process, each test's outcome saved as it ends.

Per test: passed, failed, error (its setup or teardown failed), skipped (with the reason) or
xfailed/xpassed, its duration, the failure's text and what the test printed (the flash tests
print their errors). The test that is running is saved before it starts (`running`), so a test
that kills the process (a CUDA fault) or hangs past the part's deadline is named in the results.
A test that would start too close to the deadline is skipped with that reason; pytest-timeout
(when installed) bounds each test that hangs in Python.
"""

from __future__ import annotations

import importlib.util
import time

from gpucheck.common import PartContext, logger

TESTS = "tests/gpu"
PER_TEST_TIMEOUT_S = 90  # the longest tests build and capture a few tiny engines
STARTING_LEFT_S = 5  # a test needs at least this much of the part's time to start


class Recorder:
    """A pytest plugin that writes each test's outcome into the part's result as it ends."""

    def __init__(self, ctx: PartContext):
        self.ctx = ctx
        self.tests: dict[str, dict] = ctx.result.setdefault("tests", {})
        self.collection_errors: list[dict] = ctx.result.setdefault("collection_errors", [])

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.collection_errors.append({"nodeid": report.nodeid, "error": report.longreprtext[-3000:]})
            self.ctx.save()

    def pytest_runtest_setup(self, item) -> None:
        import pytest

        if self.ctx.remaining() < STARTING_LEFT_S:
            pytest.skip(f"the check's deadline for this part was near ({self.ctx.remaining():.0f} s left)")

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self.ctx.result["running"] = nodeid
        self.ctx.save()

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
        self.ctx.result.pop("running", None)
        self.ctx.save()


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


def run(ctx: PartContext) -> None:
    import pytest

    args = [TESTS, "-v", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        args.append(f"--timeout={PER_TEST_TIMEOUT_S}")
    result = ctx.result
    result.update(pytest=pytest.__version__, args=list(args))
    ctx.save()
    recorder = Recorder(ctx)
    started = time.perf_counter()
    exit_code = pytest.main(args, plugins=[recorder])  # -v prints each test's outcome into the log
    tests = recorder.tests
    counts: dict[str, int] = {}
    for entry in tests.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    result.update(exit_code=int(exit_code), counts=counts, pytest_s=round(time.perf_counter() - started, 1))
    bad = counts.get("failed", 0) + counts.get("error", 0) + len(recorder.collection_errors)
    result["status"] = "ok" if not bad and int(exit_code) in (0, 5) else "failed"
    logger.info("tests/gpu: %s, pytest exit code %d", counts, int(exit_code))
