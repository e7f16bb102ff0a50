"""The physical paged KV cache: one K and one V tensor per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of one layer's cache block."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


class KVCache:
    """Per layer, K and V of shape `[num_blocks + 1, block_size, num_kv_heads, head_dim]`
    (the layout flash-attn's paged kernels read). The scheduler's KVCacheManager
    decides which of blocks 0 .. num_blocks - 1 belong to whom; this class only holds
    the memory. The last block, `pad_block`, is never handed out: the padding rows of a
    CUDA-graph step write and read it (engine/runner/cuda_graphs.py)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        shape = (num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.spec = spec
        self.num_blocks = num_blocks
        self.pad_block = num_blocks
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
            for _ in range(spec.num_layers)
        ]

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block
