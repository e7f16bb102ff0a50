"""Blocks of the paged KV cache as bytes and back: what a block file's payload holds.

A block's payload is, for each layer this rank holds (in order) its K then its V (a latent cache: its one
tensor of entries), each `[block_size, num_kv_heads, head_dim]` in the cache's dtype, as raw bytes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from engine.attention.kv_cache import KVCache, values_in_keys


def cache_tensors(kv_cache: KVCache) -> list[torch.Tensor]:
    """Every tensor a block's payload covers, in payload order, viewed as raw words (`[num_blocks + 1,
    block_size, num_kv_heads, head_dim * element_size / word]`: one view covers every dtype, fp8 and bfloat16
    included; the widest word that divides a row, since index_copy_ and index_select move a word per element)."""
    tensors = []
    for keys, values in kv_cache.layers:
        tensors.append(_as_words(keys))
        if not values_in_keys(keys, values):
            tensors.append(_as_words(values))
    return tensors


def _as_words(tensor: torch.Tensor) -> torch.Tensor:
    raw = tensor.view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        if raw.shape[-1] % word.itemsize == 0:
            return raw.view(word)
    return raw


def payload_bytes(kv_cache: KVCache) -> int:
    """One block's payload size on this rank."""
    return sum(t[0].numel() * t.element_size() for t in cache_tensors(kv_cache))


def gather_blocks(kv_cache: KVCache, block_ids: Sequence[int]) -> torch.Tensor:
    """The blocks' payloads, `[len(block_ids), payload_bytes]` uint8 (a copy: later steps may overwrite the
    blocks), on the cache's device. All of a cache's tensors share one shape and dtype."""
    tensors = cache_tensors(kv_cache)
    if tensors[0].device.type == "cpu":  # numpy's fancy indexing: a memcpy per block row, no per-element loop
        index = np.asarray(block_ids, dtype=np.int64)
        out = np.empty((len(block_ids), len(tensors), *tensors[0].shape[1:]), dtype=tensors[0].numpy().dtype)
        for j, tensor in enumerate(tensors):
            out[:, j] = tensor.numpy()[index]
        return torch.from_numpy(out).view(len(block_ids), -1).view(torch.uint8)
    index_tensor = torch.tensor(block_ids, dtype=torch.int64, device=tensors[0].device)
    # [n, num_tensors, block_size, num_kv_heads, head_dim * element_size / word]
    stacked = torch.stack([t.index_select(0, index_tensor) for t in tensors], dim=1)
    return stacked.view(len(block_ids), -1).view(torch.uint8)


def scatter_blocks(kv_cache: KVCache, block_ids: Sequence[int], payloads: np.ndarray) -> None:
    """Write the payloads, `[len(block_ids), payload_bytes]` uint8 on the host, into the blocks."""
    tensors = cache_tensors(kv_cache)
    shape = (len(block_ids), len(tensors), *tensors[0].shape[1:])
    if tensors[0].device.type == "cpu":
        index = np.asarray(block_ids, dtype=np.int64)
        rows = payloads.view(tensors[0].numpy().dtype).reshape(shape)
        for j, tensor in enumerate(tensors):
            tensor.numpy()[index] = rows[:, j]
        return
    scatter_device_blocks(kv_cache, block_ids, torch.from_numpy(payloads).to(tensors[0].device))


def scatter_device_blocks(kv_cache: KVCache, block_ids: Sequence[int], payloads: torch.Tensor) -> None:
    """Write the payloads, `[len(block_ids), payload_bytes]` uint8 on the cache's device, into the blocks (on
    the current stream)."""
    tensors = cache_tensors(kv_cache)
    shape = (len(block_ids), len(tensors), *tensors[0].shape[1:])
    index_tensor = torch.tensor(block_ids, dtype=torch.int64).to(tensors[0].device, non_blocking=True)
    data = payloads.view(tensors[0].dtype).view(shape)
    for j, tensor in enumerate(tensors):
        tensor.index_copy_(0, index_tensor, data[:, j])


def _row_view(kv_cache: KVCache, rows: np.ndarray) -> tuple[list[torch.Tensor], np.ndarray]:
    """The cache's tensors, and `rows` ([num_rows, payload_bytes] uint8) as `[num_rows, num_tensors,
    block_size, num_kv_heads, words]` in their word type."""
    tensors = cache_tensors(kv_cache)
    view = rows.view(tensors[0].numpy().dtype).reshape(rows.shape[0], len(tensors), *tensors[0].shape[1:])
    return tensors, view


def copy_blocks_to_rows(kv_cache: KVCache, block_ids: Sequence[int], rows: np.ndarray, row_ids: Sequence[int]) -> None:
    """A CPU cache's blocks into rows of `rows` ([num_rows, payload_bytes] uint8), with no staging copy."""
    tensors, view = _row_view(kv_cache, rows)
    blocks, targets = np.asarray(block_ids, dtype=np.int64), np.asarray(row_ids, dtype=np.int64)
    for j, tensor in enumerate(tensors):
        view[targets, j] = tensor.numpy()[blocks]


def copy_rows_to_blocks(kv_cache: KVCache, rows: np.ndarray, row_ids: Sequence[int], block_ids: Sequence[int]) -> None:
    """`copy_blocks_to_rows`' inverse."""
    tensors, view = _row_view(kv_cache, rows)
    blocks, sources = np.asarray(block_ids, dtype=np.int64), np.asarray(row_ids, dtype=np.int64)
    for j, tensor in enumerate(tensors):
        tensor.numpy()[blocks] = view[sources, j]
