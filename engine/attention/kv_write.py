"""Writing a step's new K/V into the paged cache through `slot_mapping`, in plain torch."""

from __future__ import annotations

import torch

from engine.attention.kv_cache import as_stored, to_cache


def write_kv_by_slots(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block_id * block_size + offset
    values: bool = True,
) -> None:
    """Token j's K/V go to slot slot_mapping[j] of the cache viewed as `[num_blocks * block_size, ...]`,
    converted to the cache's dtype. `values` False: the keys alone (a latent cache, whose values are in them)."""
    key, key_cache = as_stored(to_cache(key, key_cache.dtype)), as_stored(key_cache)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    key_cache.view(num_slots, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    if values:
        value, value_cache = as_stored(to_cache(value, value_cache.dtype)), as_stored(value_cache)
        value_cache.view(num_slots, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)
