"""Drives a scheduler as a pipeline-parallel engine does: up to N steps in flight, updated oldest first.

The runner executes each step when it is scheduled (the stages take steps in the order
scheduled, so a later step's writes follow an earlier step's reads); its sampled tokens
reach the scheduler only when that step is updated, after up to N - 1 newer steps were
scheduled. With N = 1 this is the plain schedule / execute / update loop.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from scheduler import Scheduler, SchedulerOutput

from tests.scheduler.factories import check_invariants, check_step_output

Runner = Callable[[SchedulerOutput], dict[str, list[int]]]


class PipelineDriver:
    """A FIFO of steps in flight between `schedule` and `update_from_output`, checked after every call."""

    def __init__(
        self,
        scheduler: Scheduler,
        execute: Runner,
        depth: Optional[int] = None,
        complete: Optional[Callable[[int], None]] = None,
    ):
        """`depth`: steps kept in flight (default: the scheduler's max_concurrent_batches; 1 drives a deeper
        scheduler step by step); `complete`: told each step id once its update is taken."""
        self.scheduler = scheduler
        self.execute = execute
        self.complete = complete
        self.depth = scheduler.max_concurrent_batches if depth is None else depth
        self.in_flight: deque[tuple[SchedulerOutput, dict[str, list[int]]]] = deque()
        self.outputs: list[SchedulerOutput] = []  # every step scheduled, empty ones included
        self.num_overlapped = 0  # non-empty steps scheduled while another was in flight

    def schedule(self) -> SchedulerOutput:
        """One step, executed at once, kept in flight unless it is empty."""
        output = self.scheduler.schedule()
        check_step_output(self.scheduler, output)
        busy = {request_id for o, _ in self.in_flight for request_id in o.num_scheduled_tokens}
        assert not busy & set(output.num_scheduled_tokens), "a request scheduled again before its step's update"
        sampled = self.execute(output)
        self.outputs.append(output)
        if not output.is_empty:
            self.num_overlapped += bool(self.in_flight)
            self.in_flight.append((output, sampled))
        check_invariants(self.scheduler)
        assert self.scheduler.num_outstanding_steps == len(self.in_flight)
        return output

    def update_oldest(self) -> None:
        output, sampled = self.in_flight.popleft()
        self.scheduler.update_from_output(output, sampled)
        if self.complete is not None:
            self.complete(output.step_id)
        check_invariants(self.scheduler)

    def step(self) -> None:
        """Fill the pipeline (while steps are not empty), then update the oldest step."""
        while len(self.in_flight) < self.depth:
            if self.schedule().is_empty:
                break
        if self.in_flight:
            self.update_oldest()

    def drive(self, max_steps: int = 5_000, between: Optional[Callable[[], None]] = None) -> None:
        """Steps until nothing is left in the scheduler or in flight (`between`: called after each update)."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests and not self.in_flight:
                return
            self.step()
            if between is not None:
                between()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
