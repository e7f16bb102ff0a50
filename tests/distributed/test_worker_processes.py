"""The workers' processes (engine/distributed/worker_processes.py): forks of one fork server per launching process,
each given the launching process's environment of the moment (a fork alone has the server's, from when it
started)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.distributed.worker_processes import run_in_environment, worker_context

VARIABLE = "PAGEDSERVE_TEST_WORKER_ENV"


def report(results) -> None:
    results.put((os.getppid(), os.environ.get(VARIABLE)))


def run(target, *args) -> tuple[int, str | None]:
    context = worker_context()
    results = context.SimpleQueue()
    process = context.Process(target=target, args=(*args, results))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    return results.get()


def test_forks_of_one_server_take_the_environment_of_the_moment(monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    server, value = run(report)  # (starts this process's fork server, if no test here started it before)
    assert server != os.getpid() and value is None
    monkeypatch.setenv(VARIABLE, "set after the server started")
    assert run(run_in_environment, dict(os.environ), report) == (server, "set after the server started")
    assert run(report) == (server, None)  # what run_in_environment is for


LAUNCHER = """
import os, sys, time
from engine.distributed.worker_processes import run_in_environment, worker_context
from tests.distributed.test_worker_processes import headless_worker, served_worker
context = worker_context()
for target in (headless_worker, served_worker):
    context.Process(target=run_in_environment, args=(dict(os.environ), target, sys.argv[1], os.getpid())).start()
time.sleep(120)
"""


def headless_worker(directory: str, parent_pid: int) -> None:
    """A headless node's rank: SIGKILLed when the thread that forked it ends, and nothing else."""
    from engine.tp_workers import _die_with_parent

    _die_with_parent()
    Path(directory, f"{os.getpid()}.headless").touch()
    time.sleep(120)


def served_worker(directory: str, parent_pid: int) -> None:
    """A serving host's rank, idle: it looks for its parent every so often and leaves when it is gone."""
    from engine.tp_workers import _parent_gone

    launcher = os.getppid()
    Path(directory, f"{os.getpid()}.served").touch()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not _parent_gone(parent_pid, launcher):
        time.sleep(0.05)


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_workers_leave_with_their_sigkilled_launcher(tmp_path):
    """The fork server leaves as soon as the launching process ends (not when its last fork does): a headless
    node's rank dies of PR_SET_PDEATHSIG and a served rank sees its parent change, while the killed launcher is
    still a zombie nobody reaped (a pid that answers kill(pid, 0))."""
    root = Path(__file__).resolve().parents[2]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], cwd=root, env=environment)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = [int(path.stem) for path in tmp_path.iterdir()]
            time.sleep(0.05)
        assert len(workers) == 2
        launcher.kill()
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {path.name for path in tmp_path.iterdir() if running(int(path.stem))}
        assert not left, f"workers alive 10 s after their launcher's SIGKILL: {sorted(left)}"
    finally:
        launcher.kill()
        launcher.wait()
        for pid in workers:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


WHICH_CONTEXT = """
import sys
sys.path.insert(0, sys.argv[1])
import engine
from engine.distributed.worker_processes import worker_context
print(engine.__file__, worker_context().get_start_method())
"""


def test_a_process_whose_engine_a_fresh_interpreter_would_not_import_spawns_its_workers(tmp_path):
    """The fork server imports its preloads from its own sys.path: a process running another copy of `engine` (a
    path put first at run time, as a second checkout) spawns its workers instead, so that they run its code."""
    root = Path(__file__).resolve().parents[2]
    copy = tmp_path / "copy"
    shutil.copytree(root / "engine", copy / "engine", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for path, method in ((copy, "spawn"), (root, "forkserver")):
        command = [sys.executable, "-c", WHICH_CONTEXT, str(path)]
        found = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
        assert found.stdout.split() == [str(path / "engine" / "__init__.py"), method]
