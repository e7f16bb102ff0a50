"""The runner's persistent block table: one row per request, written only when its blocks change."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class BlockTable:
    """A host-side `[rows, width]` int32 table (a torch tensor and a numpy view of the same memory).

    A request takes a row when it is added and gives it back when it ends; the
    scheduler's new block ids are appended to the row as they arrive, so a step
    never rebuilds tables from Python lists: the step's table is one `index_select`
    of the rows in the batch (`gather_into`), and slots (block_id * block_size +
    offset) are read from the rows.
    Rows and width grow by doubling when needed (rare), which reallocates.
    """

    def __init__(self, block_size: int, rows: int = 64, width: int = 64):
        self.block_size = block_size
        self._tensor = torch.zeros((rows, width), dtype=torch.int32)
        self._array = self._tensor.numpy()
        self._free = list(range(rows - 1, -1, -1))
        self._lengths = np.zeros(rows, dtype=np.int64)

    @property
    def num_rows_in_use(self) -> int:
        return self._tensor.shape[0] - len(self._free)

    def acquire(self) -> int:
        if not self._free:
            self._resize(self._tensor.shape[0] * 2, self._tensor.shape[1])
        row = self._free.pop()
        self._lengths[row] = 0
        return row

    def release(self, row: int) -> None:
        self._lengths[row] = 0
        self._free.append(row)

    def set(self, row: int, block_ids: Sequence[int]) -> None:
        """Replace the row's blocks (a request admitted, or resumed after preemption)."""
        self._lengths[row] = 0
        self.append(row, block_ids)

    def append(self, row: int, block_ids: Sequence[int]) -> None:
        start = int(self._lengths[row])
        end = start + len(block_ids)
        if end > self._tensor.shape[1]:
            width = self._tensor.shape[1]
            while width < end:
                width *= 2
            self._resize(self._tensor.shape[0], width)
        self._array[row, start:end] = block_ids
        self._lengths[row] = end

    def slots(self, row: int, start: int, end: int) -> np.ndarray:
        """Where the tokens at positions start .. end - 1 of the row's request live in the cache."""
        positions = np.arange(start, end)
        return (
            self._array[row, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )

    def slots_at(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """`slot` of one position per row (decodes): rows and positions int64 arrays of one length."""
        return (
            self._array[rows, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )

    def blocks(self, row: int, num_tokens: int) -> torch.Tensor:
        """The block ids holding the row's first `num_tokens` tokens (a view: valid until the table changes)."""
        return self._tensor[row, : -(-num_tokens // self.block_size)]

    def gather_into(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """out[i] = the first out.shape[1] block ids of row rows[i] (entries past a row's blocks are stale
        but valid block ids)."""
        torch.index_select(self._tensor[:, : out.shape[1]], 0, rows, out=out)

    def _resize(self, rows: int, width: int) -> None:
        old_rows, old_width = self._tensor.shape
        tensor = torch.zeros((rows, width), dtype=torch.int32)
        tensor[:old_rows, :old_width] = self._tensor
        self._tensor, self._array = tensor, tensor.numpy()
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free
        lengths = np.zeros(rows, dtype=np.int64)
        lengths[:old_rows] = self._lengths
        self._lengths = lengths
