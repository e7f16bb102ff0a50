"""Running one function in a fresh Python process, its log records relayed to this process's loggers.

    parent                                        child: python -m engine.loading.child_process
      stdin   -- pickle (function, args, level) -->
      stdout  <-- pickles: ("log", record fields) ... then ("result", value) or ("error", exception)
      stderr      shared (what the child prints, its progress bars)

A plain subprocess rather than multiprocessing: multiprocessing's spawn re-imports the parent's main
script, which breaks (or re-runs) a user's script that has no `if __name__ == "__main__"` guard.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, BinaryIO, Callable, TypeVar

T = TypeVar("T")


def call_in_child_process(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` in a fresh Python process: its result, or its exception re-raised here
    (ChildProcessError when the child ended without either). The child's log records go to this
    process's loggers of the same names (those that enable them), so they reach this process's handlers.

    For work whose imports or memory should not stay in this process; `function` must be importable by
    name (a module-level function) and its arguments and result picklable."""
    # INFO at least, whatever the root's level: a logger here may be more verbose than the root
    level = min(logging.getLogger().getEffectiveLevel(), logging.INFO)
    command = [sys.executable, "-m", __name__]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_child_environment()) as child:
        assert child.stdin is not None and child.stdout is not None  # both opened as PIPE
        pickle.dump((function, args, level), child.stdin)
        child.stdin.close()
        outcome = None
        while outcome is None:
            try:
                kind, value = pickle.load(child.stdout)
            except EOFError:
                break
            if kind == "log":
                _relay(logging.makeLogRecord(value))
            else:
                outcome = (kind, value)
    if outcome is None:
        raise ChildProcessError(
            f"the child process running {function.__name__} exited with status {child.returncode} and no result"
        )
    kind, value = outcome
    if kind == "error":
        raise value
    return value


def _child_environment() -> dict[str, str]:
    """This environment, with the folder that holds this package first on PYTHONPATH: the child imports
    this copy even where this process found it through its own sys.path (a test runner's, a script's)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _relay(record: logging.LogRecord) -> None:
    logger = logging.getLogger(record.name)
    if logger.isEnabledFor(record.levelno):
        logger.handle(record)


class _ChannelHandler(logging.Handler):
    """In the child: every record, its message already formatted, down the channel to the parent."""

    def __init__(self, channel: BinaryIO):
        super().__init__()
        self._channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = dict(record.__dict__, msg=record.getMessage(), args=None, exc_info=None, exc_text=None)
            if record.exc_info:
                fields["msg"] += "\n" + logging.Formatter().formatException(record.exc_info)
            _send(self._channel, ("log", fields))
        except Exception:  # noqa: BLE001 - logging's own convention: report, never raise
            self.handleError(record)


def _send(channel: BinaryIO, message: tuple[str, Any]) -> None:
    data = pickle.dumps(message)  # whole before any byte is written: a failure leaves the stream intact
    channel.write(data)
    channel.flush()


def _child_main() -> None:
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what the function prints goes to stderr, not the channel
    function, args, level = pickle.load(sys.stdin.buffer)
    root = logging.getLogger()
    root.handlers[:] = [_ChannelHandler(channel)]
    root.setLevel(level)
    try:
        message = ("result", function(*args))
    except BaseException as error:  # noqa: BLE001 - handed to the parent as is
        message = ("error", error)
    try:
        _send(channel, message)
    except (pickle.PicklingError, TypeError, AttributeError):
        _send(channel, ("error", ChildProcessError(f"{type(message[1]).__name__}: {message[1]}")))


if __name__ == "__main__":
    _child_main()
