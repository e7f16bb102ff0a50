"""How this host's worker processes start: forked by multiprocessing's fork server, which imported the worker's
modules once, instead of spawned as fresh interpreters that each import torch and the engine again.

A spawned rank spends seconds importing before it does any work, and every engine a process builds pays it again
(a script or a test suite building several, the ranks of each). The fork server is one clean process (no threads,
no CUDA context, no OpenMP pool: it only imported `PRELOAD`), started the first time this process launches
workers and kept until it exits; each rank is a fork of it. Rank 0's changes to its own process since (CPU
affinity, threads) never reach the ranks, as with spawn.

What a fork of the server does not take from the launching process, it is given: the environment of the moment
(`run_in_environment`). Settings a library reads once when it is loaded (libgomp's `OMP_*`, torch's) are the fork
server's, which inherited the launching process's environment when it started: the CLI sets those before any
engine exists.

The fork server imports its preloads from its own `sys.path` (a fresh `python -c` in this directory's), not the
launching process's (multiprocessing applies that to each fork only, after the preloads). Where a fresh
interpreter here would import another `engine` than this process's (a copy found through a `sys.path` entry
added at run time, a second checkout beside an installed one), the workers are spawned instead, so that every
rank runs the same code (`_fork_server_imports_this_engine`, asked once before the server starts).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from multiprocessing import forkserver, spawn, util
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, Callable, Sequence

PRELOAD = ("engine.tp_workers",)
"""The modules a worker runs (and everything they import), imported once by the fork server."""


def semaphore_context() -> BaseContext:
    """The context of the semaphores handed to workers: spawn's, whose named semaphores a worker reopens by name
    whether it was forked by the fork server or spawned (a fork context's cannot be handed over), without asking
    which of the two `worker_context` will choose."""
    return multiprocessing.get_context("spawn")


def worker_context(preload: Sequence[str] = ()) -> BaseContext:
    """The multiprocessing context worker processes are made in. `preload`:
    modules the workers' arguments need besides `PRELOAD` (the model config's class: unpickling a transformers
    config imports its module, which imports most of transformers), imported by the fork server if this call
    starts it. Spawn where a fork server would import another `engine` (see the module docstring)."""
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is None and not _fork_server_imports_this_engine():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*PRELOAD, *preload])  # (read when the server starts; later calls change nothing)
    return context


def _fork_server_imports_this_engine() -> bool:
    """Whether an interpreter started as multiprocessing starts the fork server (this executable and interpreter
    flags, `-c`, this directory and environment) finds this process's `engine` package."""
    this_engine = Path(__file__).resolve().parents[1] / "__init__.py"  # (this module's own package)
    probe = "import importlib.util as u; s = u.find_spec('engine'); print(s.origin if s and s.origin else '')"
    command = [spawn.get_executable(), *util._args_from_interpreter_flags(), "-c", probe]  # type: ignore[attr-defined]
    try:
        found = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
        return bool(found) and os.path.samefile(found, this_engine)
    except (OSError, subprocess.SubprocessError):
        return False


def run_in_environment(environ: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    """A worker process's entry: the launching process's environment (`dict(os.environ)` when it launched),
    then `target(*args)`. The worker lets go of the fork server first (`_let_go_of_the_fork_server`)."""
    _let_go_of_the_fork_server()
    os.environ.clear()
    os.environ.update(environ)
    return target(*args)


def _let_go_of_the_fork_server() -> None:
    """Close this fork's copy of the fork server's "alive" pipe, which multiprocessing hands every fork (for forks
    that start processes of their own). The server leaves when every copy is closed: kept here, it would outlive
    the launching process as long as this worker lives, so the worker's parent never changes and a headless node's
    ranks (PR_SET_PDEATHSIG on the fork server's thread) outlive their SIGKILLed node. Let go, the server leaves as
    soon as the launching process ends, and the worker sees it gone."""
    server = forkserver._forkserver  # (multiprocessing's own; no public way to this pipe)
    inherited = getattr(server, "_forkserver_alive_fd", None)
    if inherited is not None and getattr(server, "_forkserver_pid", None) is None:  # (not a server this one started)
        os.close(inherited)
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]
