"""The workers' processes (engine/distributed/worker_processes.py): forks of one fork server per launching process,
each given the launching process's environment of the moment (a fork alone has the server's, from when it
started)."""

from __future__ import annotations

import os

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
