"""call_in_child_process: the result, the exception, the log records and the output of a child."""

from __future__ import annotations

import logging
import os

import pytest

from engine.loading.child_process import call_in_child_process

logger = logging.getLogger("tests.engine.child")


def _logs_prints_and_returns(value: int) -> dict:
    logger.info("working on %d", value)
    logger.debug("details")
    print("printed by the child")  # goes to stderr: the channel stays readable
    return {"value": value, "pid": os.getpid()}


def _raises() -> None:
    raise ValueError("bad input, said the child")


def _dies() -> None:
    os._exit(3)


def test_the_result_comes_back_and_the_records_reach_this_process(caplog, capfd):
    with caplog.at_level(logging.INFO, logger="tests.engine.child"):
        result = call_in_child_process(_logs_prints_and_returns, 7)
    assert result["value"] == 7 and result["pid"] != os.getpid()
    ours = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.name == "tests.engine.child"]
    assert ours == [("tests.engine.child", logging.INFO, "working on 7")]  # DEBUG is not enabled here
    assert "printed by the child" in capfd.readouterr().err


def test_an_exception_is_raised_here_and_a_dead_child_is_named():
    with pytest.raises(ValueError, match="bad input, said the child"):
        call_in_child_process(_raises)
    with pytest.raises(ChildProcessError, match="_dies exited with status 3"):
        call_in_child_process(_dies)
