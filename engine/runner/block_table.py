"""The runner's persistent block tables: one row per request in each KV-cache layer group, written only when
its blocks change."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class BlockTable:
    """A host-side `[groups, rows, width]` int32 table (a torch tensor and a numpy view of the same memory).

    A request takes a row (the same in every group) when it is added and gives it back when it ends; the
    scheduler's new block ids are appended to the row, group by group, as they arrive, so a step
    never rebuilds tables from Python lists: a group's table for the step is one gather of the rows
    in the batch (`gather_into`), and slots (block_id * block_size +
    offset) are read from the rows. A model with one kind of attention has one group; one that mixes
    sliding-window and full layers has a group per kind (scheduler/kv_cache_manager.py), whose rows hold
    different blocks for the same positions.
    Rows and width grow by doubling when needed (rare), which reallocates.
    """

    def __init__(self, block_size: int, rows: int = 64, width: int = 64, num_groups: int = 1):
        self.block_size = block_size
        self.num_groups = num_groups
        self._tensor = torch.zeros((num_groups, rows, width), dtype=torch.int32)
        self._array = self._tensor.numpy()
        self._free = list(range(rows - 1, -1, -1))
        self._lengths = np.zeros((num_groups, rows), dtype=np.int64)

    @property
    def num_rows_in_use(self) -> int:
        return self._tensor.shape[1] - len(self._free)

    def acquire(self) -> int:
        if not self._free:
            self._resize(self._tensor.shape[1] * 2, self._tensor.shape[2])
        row = self._free.pop()
        self._lengths[:, row] = 0
        return row

    def release(self, row: int) -> None:
        self._lengths[:, row] = 0
        self._free.append(row)

    def set(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        """Replace the row's blocks, per group (a request admitted, or resumed after preemption)."""
        self._lengths[:, row] = 0
        self.append(row, block_ids)

    def append(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        """Append blocks to the row, per group."""
        if len(block_ids) != self.num_groups:
            raise ValueError(f"block ids for {len(block_ids)} groups, the table has {self.num_groups}")
        for group, ids in enumerate(block_ids):
            if not ids:
                continue
            start = int(self._lengths[group, row])
            end = start + len(ids)
            if end > self._tensor.shape[2]:
                width = self._tensor.shape[2]
                while width < end:
                    width *= 2
                self._resize(self._tensor.shape[1], width)
            self._array[group, row, start:end] = ids
            self._lengths[group, row] = end

    def slots(self, row: int, start: int, end: int) -> np.ndarray:
        """`[groups, end - start]`: where the tokens at positions start .. end - 1 of the row's request live in
        each group's cache."""
        positions = np.arange(start, end)
        return (
            self._array[:, row, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )

    def slots_at(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """`[groups, n]`: the slot of one position per row (decodes): rows and positions int64 arrays of one
        length n."""
        return (
            self._array[:, rows, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )

    def blocks(self, row: int, num_tokens: int, group: int = 0) -> torch.Tensor:
        """The block ids holding the row's first `num_tokens` tokens in `group` (a view: valid until the table
        changes)."""
        return self._tensor[group, row, : -(-num_tokens // self.block_size)]

    def gather_into(self, rows: np.ndarray, out: np.ndarray, group: int = 0) -> None:
        """out[i] = the first out.shape[1] block ids of row rows[i] in `group` (entries past a row's blocks are
        stale but valid block ids). Numpy's indexing, which reads the chosen rows alone (`np.take` copies a
        non-contiguous source whole first); torch's index_select costs several times more per step."""
        out[...] = self._array[group][rows, : out.shape[1]]

    def _resize(self, rows: int, width: int) -> None:
        groups, old_rows, old_width = self._tensor.shape
        tensor = torch.zeros((groups, rows, width), dtype=torch.int32)
        tensor[:, :old_rows, :old_width] = self._tensor
        self._tensor, self._array = tensor, tensor.numpy()
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free
        lengths = np.zeros((groups, rows), dtype=np.int64)
        lengths[:, :old_rows] = self._lengths
        self._lengths = lengths
