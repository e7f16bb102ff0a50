"""Per-step attention inputs, built once by the model runner and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """A run of query tokens of one request, attending to its cache causally.

    Queries are tokens `[query_start, query_start + query_len)` of the flat batch,
    at positions `[context_len - query_len, context_len)` of the sequence.
    """

    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks_of_request] int64


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where the new tokens' K/V go and what each query attends to.

    The flat batch puts single-token queries (decodes) first:

        tokens  [d0 d1 ... d(D-1) | p0 p0 p0 p0 | p1 p1 ...]
                 one per request    prefill chunks, one run per request

    Every layer writes all new K/V through `slot_mapping` before any query of
    that layer reads the cache, so a request may read blocks that another
    request fills in the same step (prefix-cache hits admitted together).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    num_decodes: int
    decode_block_tables: Optional[torch.Tensor]  # [num_decodes, max_blocks] int64
    decode_context_lens: Optional[torch.Tensor]  # [num_decodes] int64
    prefills: tuple[PrefillChunk, ...]
    decode_bias: Optional[torch.Tensor] = None  # [num_decodes, 1, 1, max_blocks * block_size]: 0 or -inf,
    # added by the torch backend's `prepare` (the padding mask of its gathered decode K/V)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
