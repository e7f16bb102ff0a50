"""Blocks of the paged KV cache as bytes and back: what a block file's payload holds.

A block's payload is, for each layer this rank holds (in order) its K then its V (a latent cache: its one
tensor of entries), each `[block_size, num_kv_heads, head_dim]` in the cache's dtype, as raw bytes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.attention.kv_cache import KVCache, values_in_keys


def cache_tensors(kv_cache: KVCache) -> list[torch.Tensor]:
    """Every tensor a block's payload covers, in payload order, viewed as bytes (`[num_blocks + 1, block_size,
    num_kv_heads, head_dim * element_size]`: one view covers every dtype, fp8 and bfloat16 included)."""
    tensors = []
    for keys, values in kv_cache.layers:
        tensors.append(keys.view(torch.uint8))
        if not values_in_keys(keys, values):
            tensors.append(values.view(torch.uint8))
    return tensors


def payload_bytes(kv_cache: KVCache) -> int:
    """One block's payload size on this rank."""
    return sum(t[0].numel() for t in cache_tensors(kv_cache))


def gather_blocks(kv_cache: KVCache, block_ids: Sequence[int]) -> torch.Tensor:
    """The blocks' payloads, `[len(block_ids), payload_bytes]` uint8 on the cache's device (a copy: later
    steps may overwrite the blocks)."""
    tensors = cache_tensors(kv_cache)
    index = torch.tensor(block_ids, dtype=torch.int64, device=tensors[0].device)
    # [n, num_tensors, block_size, num_kv_heads, head_dim * element_size]
    stacked = torch.stack([t.index_select(0, index) for t in tensors], dim=1)
    return stacked.view(len(block_ids), -1)


def scatter_blocks(kv_cache: KVCache, block_ids: Sequence[int], payloads: Sequence[bytearray]) -> None:
    """Write the payloads (each `payload_bytes` long) into the blocks."""
    tensors = cache_tensors(kv_cache)
    device = tensors[0].device
    index = torch.tensor(block_ids, dtype=torch.int64, device=device)
    host = torch.stack([torch.frombuffer(p, dtype=torch.uint8) for p in payloads])
    data = host.to(device).view(len(block_ids), len(tensors), *tensors[0].shape[1:])
    for j, tensor in enumerate(tensors):
        tensor.index_copy_(0, index, data[:, j])
