"""What rank 0's runner hands the other tensor-parallel ranks each step: the step message, and the tokens it
sampled in the step before (a peer samples nothing, yet feeds those tokens back as rank 0 does)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

from scheduler import SchedulerOutput


class PeerStep(NamedTuple):
    scheduler_output: SchedulerOutput
    sampled_token_ids: dict[str, list[int]]  # by request: the last step's tokens (accepted drafts, then one)


class FinishStep(NamedTuple):
    """Pipeline parallelism: stage 0 samples the oldest step it launched (its tensor-parallel peers gather their
    slices of the same logits; the other stages ignore it)."""

    step_id: int


class StepPeers(Protocol):
    """The other ranks, reached by a broadcast (engine/tp_workers.py)."""

    def send(self, step: "PeerStep | FinishStep") -> None: ...

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback` when another rank fails outside a step."""
        ...

    def fail(self, error: BaseException) -> None:
        """A step failed on this rank after the others took it: the ranks are out of step, every later `send`
        raises (the engine cannot run another step)."""
        ...

    def stop(self) -> None:
        """The engine shuts down: the other ranks leave."""
        ...
