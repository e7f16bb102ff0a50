"""The step's input tensors, allocated once at start-up and reused by every step."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


class StepBuffer:
    """One input of the step: a host tensor (pinned when the device is CUDA) with a numpy view of the
    same memory, and its device twin (the host tensor itself on CPU).

    A step writes a prefix through `array` and `upload`s it: one non-blocking copy on CUDA, nothing
    on CPU. The returned views stay valid until the next step writes the buffer again.
    """

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device):
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(capacity, dtype=dtype, pin_memory=on_cuda)
        self.array = self.host.numpy()
        self.device = torch.zeros(capacity, dtype=dtype, device=device) if on_cuda else self.host

    def upload(self, count: int) -> torch.Tensor:
        """The device view of the first `count` entries, copied up (asynchronously) from the host."""
        if self.device is not self.host:
            self.device[:count].copy_(self.host[:count], non_blocking=True)
        return self.device[:count]


class StepBuffers:
    """Every per-step input the runner hands the model and the attention backend.

        input_ids, positions                 [max_num_tokens]                int64
        slot_mappings[g]                     [max_num_tokens]                int64, one per KV layer group
        query_start_loc                      [max_num_reqs + 1]               int32
        seq_lens                             [max_num_reqs]                   int32
        block_tables[g]                      [max_num_reqs * max_blocks]      int32, viewed [num_reqs, width]
        sample_rows                          [max_num_reqs]                   int64

    Sized from the scheduler's limits (`max_num_batched_tokens`, `max_num_seqs`,
    `max_model_len`), so no step allocates, and a CUDA graph can read them in place.
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        device: torch.device,
        num_groups: int = 1,
    ):
        # The host side of a non-blocking copy is read when the copy runs on the stream, not when it is
        # queued: a step must not rewrite the host buffers before the last step's copies have run (a step
        # that samples nothing never waits on the device).
        self._copies_done: Optional[torch.cuda.Event] = None
        self._on_cuda = device.type == "cuda"
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.input_ids = StepBuffer(max_num_tokens, torch.int64, device)
        self.positions = StepBuffer(max_num_tokens, torch.int64, device)
        self.slot_mappings = [StepBuffer(max_num_tokens, torch.int64, device) for _ in range(num_groups)]
        self.query_start_loc = StepBuffer(max_num_reqs + 1, torch.int32, device)
        self.seq_lens = StepBuffer(max_num_reqs, torch.int32, device)
        self.block_tables = [
            StepBuffer(max_num_reqs * max_blocks_per_req, torch.int32, device) for _ in range(num_groups)
        ]
        self.sample_rows = StepBuffer(max_num_reqs, torch.int64, device)

    def begin_step(self) -> None:
        """Before writing the host buffers: wait until the previous step's copies up have run."""
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None

    def end_step(self) -> None:
        """After the step's last upload: mark where its copies end on the stream."""
        if self._on_cuda:
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()

    def check_fits(self, num_tokens: int, num_reqs: int, width: int) -> None:
        if num_tokens > self.max_num_tokens or num_reqs > self.max_num_reqs or width > self.max_blocks_per_req:
            raise ValueError(
                f"a step of {num_tokens} tokens, {num_reqs} requests and {width} blocks per request exceeds the "
                f"runner's buffers ({self.max_num_tokens}, {self.max_num_reqs}, {self.max_blocks_per_req})"
            )

    def block_table_view(self, num_reqs: int, width: int, group: int = 0) -> np.ndarray:
        """The host `[num_reqs, width]` block table of a group in this step (contiguous), as numpy's view."""
        return self.block_tables[group].array[: num_reqs * width].reshape(num_reqs, width)

    def upload_all(self, num_reqs: int, width: int) -> None:
        """Copy up the first `num_reqs` rows of every input of a decode step (one token per request)
        whose block table is `width` wide (a CUDA-graph step, which reads the device buffers in place)."""
        for buffer in (self.input_ids, self.positions, *self.slot_mappings, self.seq_lens):
            buffer.upload(num_reqs)
        self.query_start_loc.upload(num_reqs + 1)
        for table in self.block_tables:
            table.upload(num_reqs * width)

    def upload_block_table(self, num_reqs: int, width: int, group: int = 0) -> torch.Tensor:
        return self.block_tables[group].upload(num_reqs * width).view(num_reqs, width)
