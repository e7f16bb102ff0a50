"""The torch-family backends' per-step attention metadata, built from the step's StepMetadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.attention.step_metadata import StepMetadata


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """A run of query tokens of one request, attending to its cache causally.

    Queries are tokens `[query_start, query_start + query_len)` of the flat batch,
    at positions `[context_len - query_len, context_len)` of the sequence. `bidirectional`: ranges [first, end)
    of the chunk's own queries (0 is its first) that also see each other's keys ahead (StepMetadata.bidirectional).
    """

    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # [>= num_blocks_of_request] int32: the request's row of the step's table
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """The metadata of the torch-family backends (torch, cpu, cpu-batch-invariant), built from the
    step's `StepMetadata` by `decode_and_chunks`:

        tokens  [d0 d1 ... d(D-1) | p0 p0 p0 p0 | p1 p1 ...]
                 one per request    prefill chunks, one run per request

    Decodes are read through `decode_block_tables` (views of the step's one int32 table);
    each prefill chunk carries its request's row.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    num_decodes: int
    decode_block_tables: Optional[torch.Tensor]  # [num_decodes, max_blocks] int32
    decode_context_lens: Optional[torch.Tensor]  # [num_decodes] int32
    prefills: tuple[PrefillChunk, ...]
    decode_bias: Optional[torch.Tensor] = None  # [num_decodes, 1, 1, max_blocks * block_size]: 0 or -inf,
    # added by the torch backend (the padding mask of its gathered decode K/V)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def decodes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables, context lengths) of the step's decodes: for a step that has some."""
        if self.decode_block_tables is None or self.decode_context_lens is None:
            raise RuntimeError("this step has no decodes")
        return self.decode_block_tables, self.decode_context_lens


def decode_and_chunks(step: StepMetadata, block_size: int) -> AttentionMetadata:
    """Split the step into its decodes (tables as wide as the longest decode needs, contiguous) and
    one PrefillChunk per other request (read from the host copies: no device sync)."""
    num_decodes = step.num_decodes
    tables = lens = None
    seq_lens = step.seq_lens_cpu.tolist()
    if num_decodes:
        width = -(-max(seq_lens[:num_decodes]) // block_size)
        tables = step.block_table[:num_decodes, :width].contiguous()
        lens = step.seq_lens[:num_decodes]
    starts = step.query_start_loc_cpu.tolist()
    prefills = tuple(
        PrefillChunk(
            query_start=starts[i],
            query_len=starts[i + 1] - starts[i],
            context_len=seq_lens[i],
            block_table=step.block_table[i],
            bidirectional=_within(step.bidirectional, starts[i], starts[i + 1]),
        )
        for i in range(num_decodes, step.num_reqs)
    )
    return AttentionMetadata(step.slot_mapping, num_decodes, tables, lens, prefills)


def _within(ranges: tuple[tuple[int, int], ...], first: int, end: int) -> tuple[tuple[int, int], ...]:
    """The row ranges inside the rows [first, end), counted from `first`."""
    if not ranges:
        return ()
    return tuple((lo - first, hi - first) for lo, hi in ranges if first <= lo and hi <= end)
