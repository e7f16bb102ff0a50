"""How a pipeline stage's hidden states reach the next stage, and the last stage's back to stage 0: point-to-point
sends over torch.distributed (gloo on CPU, over loopback on one host or TCP across hosts; NCCL on CUDA).

Both ends know every message's shape from the step message alone (the step's tokens, or the rows stage 0 samples),
so a message is the tensor and nothing else. Sends are asynchronous: a stage goes on to its next step while its
last output travels; `Outbox` keeps each send's tensor alive until the send completed.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from engine.distributed.pipeline_stage import PipelineStage
from engine.distributed.shm_all_reduce import PeerGoneError

MAX_SENDS_IN_FLIGHT = 4
"""Sends a stage leaves in flight before waiting for the oldest (a bound on the memory they hold)."""


class PipelineLink:
    """One rank's ends of the pipeline: from the stage before (or, on stage 0, from the last stage) and to the
    stage after (or, on the last stage, back to stage 0)."""

    def __init__(self, stage: PipelineStage, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.stage = stage
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self._outbox = _Outbox()

    def send_forward(self, hidden: torch.Tensor) -> None:
        """The hidden states this stage computed, to the next stage, or (last stage) back to stage 0."""
        stage = self.stage
        self._outbox.send(hidden, stage.first_rank if stage.is_last else stage.next_rank)

    def receive(self, num_rows: int) -> torch.Tensor:
        """The `num_rows` hidden states this stage takes: from the stage before, or (stage 0) the last stage's."""
        stage = self.stage
        source = stage.last_rank if stage.is_first else stage.previous_rank
        out = torch.empty((num_rows, self.hidden_size), dtype=self.dtype, device=self.device)
        try:
            dist.recv(out, src=source)
        except RuntimeError as exc:  # gloo's DistBackendError ("Connection closed by peer [...]:port"): chained
            raise PeerGoneError(f"pipeline parallel: the stage on rank {source} is gone") from exc
        return out

    def flush(self) -> None:
        """Wait until every send has left (before shutting down)."""
        self._outbox.drain(0)


class _Outbox:
    def __init__(self) -> None:
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()

    def send(self, tensor: torch.Tensor, destination: int) -> None:
        tensor = tensor.contiguous()
        self._sends.append((dist.isend(tensor, dst=destination), tensor))
        self.drain(MAX_SENDS_IN_FLIGHT)

    def drain(self, keep: int) -> None:
        sends = self._sends
        while len(sends) > keep:
            work, _ = sends.popleft()
            try:
                work.wait()
            except RuntimeError as exc:  # as in receive
                raise PeerGoneError("pipeline parallel: the next stage is gone") from exc
        while sends and sends[0][0].is_completed():
            sends.popleft()
