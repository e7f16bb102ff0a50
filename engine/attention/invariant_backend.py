"""The batch-invariant CPU backend: every query token, prompt or decode, through the paged decode kernel.

A query's attention must not depend on what else is in the step. The default backends
run a prompt chunk through SDPA, whose blocking (and so its reduction order) depends on
the chunk's length and on whether it continues a cached prefix, both of which depend on
the other requests (chunked prefill splits a prompt by the budget the others leave;
prefix-cache hits depend on what ran before). Here every query token is a row of its
own: the kernel of csrc/paged_decode.cpp reads the request's K/V from the paged cache in
place, block by block in a fixed order, up to and including the token's own position.

    tokens   [d0 d1 | p0 p0 p0 | p1 p1]          (decodes first, then prefill chunks)
    rows     [d0 d1 | p0@s p0@s+1 p0@s+2 | ...]   one row each, context = its position + 1

The cost: prompt attention re-reads the cached K/V once per query token instead of once
per query tile (the kernel is the decode one); decodes cost what they cost with `cpu`.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.runner.kv_cache import KVCacheSpec


class BatchInvariantCpuBackend(CpuAttentionBackend):
    """`cpu` with prompt chunks turned into single-query rows in `prepare` (once per step)."""

    name = "cpu-batch-invariant"

    def prepare(self, metadata: AttentionMetadata, spec: KVCacheSpec) -> AttentionMetadata:
        if not metadata.prefills:
            return metadata
        block_size = spec.block_size
        num_tokens = metadata.num_tokens
        width = max(-(-chunk.context_len // block_size) for chunk in metadata.prefills)
        if metadata.num_decodes:
            width = max(width, metadata.decode_block_tables.shape[1])
        device = metadata.slot_mapping.device
        tables = torch.zeros((num_tokens, width), dtype=torch.int64, device=device)  # [num_tokens, width]
        lens = torch.empty(num_tokens, dtype=torch.int64, device=device)  # [num_tokens]
        if metadata.num_decodes:
            decodes = metadata.num_decodes
            tables[:decodes, : metadata.decode_block_tables.shape[1]] = metadata.decode_block_tables
            lens[:decodes] = metadata.decode_context_lens
        for chunk in metadata.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            num_blocks = -(-chunk.context_len // block_size)
            tables[rows, :num_blocks] = chunk.block_table[:num_blocks]
            first = chunk.context_len - chunk.query_len + 1
            lens[rows] = torch.arange(first, chunk.context_len + 1, device=device)
        return dataclasses.replace(metadata, num_decodes=num_tokens, decode_block_tables=tables,
                                   decode_context_lens=lens, prefills=())
