"""The runner's persistent block table: one row per request, written only when its blocks change."""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    """A host-side `[rows, width]` int64 table (a torch tensor and a numpy view of the same memory).

    A request takes a row when it is added and gives it back when it ends; the
    scheduler's new block ids are appended to the row as they arrive, so a step
    never rebuilds tables from Python lists: decode tables are one `index_select`
    of the rows in the batch, and a prefill chunk's table is a view of its row.
    Rows and width grow by doubling when needed (rare), which reallocates.
    """

    def __init__(self, rows: int = 64, width: int = 64):
        self._tensor = torch.zeros((rows, width), dtype=torch.int64)
        self._array = self._tensor.numpy()
        self._free = list(range(rows - 1, -1, -1))
        self._lengths = np.zeros(rows, dtype=np.int64)

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    def acquire(self) -> int:
        if not self._free:
            self._resize(self._tensor.shape[0] * 2, self._tensor.shape[1])
        row = self._free.pop()
        self._lengths[row] = 0
        return row

    def release(self, row: int) -> None:
        self._lengths[row] = 0
        self._free.append(row)

    def set(self, row: int, block_ids: list[int]) -> None:
        """Replace the row's blocks (a request admitted, or resumed after preemption)."""
        self._lengths[row] = 0
        self.append(row, block_ids)

    def append(self, row: int, block_ids: list[int]) -> None:
        start = int(self._lengths[row])
        end = start + len(block_ids)
        if end > self._tensor.shape[1]:
            width = self._tensor.shape[1]
            while width < end:
                width *= 2
            self._resize(self._tensor.shape[0], width)
        self._array[row, start:end] = block_ids
        self._lengths[row] = end

    def row(self, row: int, num_blocks: int) -> torch.Tensor:
        """The first `num_blocks` block ids of a row (a view: valid until the table next changes)."""
        return self._tensor[row, :num_blocks]

    def gather(self, rows: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """`[len(rows), num_blocks]` copy of those rows' first blocks (entries past a row's end are stale)."""
        return self._tensor[:, :num_blocks].index_select(0, rows)

    def _resize(self, rows: int, width: int) -> None:
        old_rows, old_width = self._tensor.shape
        tensor = torch.zeros((rows, width), dtype=torch.int64)
        tensor[:old_rows, :old_width] = self._tensor
        self._tensor, self._array = tensor, tensor.numpy()
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free
        lengths = np.zeros(rows, dtype=np.int64)
        lengths[:old_rows] = self._lengths
        self._lengths = lengths
