"""Weights in the column-block layout that the native column-block product reads (csrc/column_blocks.h):
packed once, at load, by whoever multiplies with them (engine/layers/invariant_linear.py) and by the
kernels' own load-time self-checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK_N = 64
"""Output columns per packed block (csrc/column_blocks.h's kBlockN)."""


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A [out_features, in_features] weight in the kernel's layout (see `pack_invariant_weight`)."""

    data: torch.Tensor
    out_features: int
    in_features: int

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the plain weight -> [T, in_features] (a tied embedding looked up in its LM head's
        packing: row n is lane n % 64 of block n // 64)."""
        if self.data.dtype == torch.bfloat16:
            picked = self.data[ids // BLOCK_N, :, ids % BLOCK_N, :]  # [T, K/2, 2]
        else:
            picked = self.data[ids // BLOCK_N, :, ids % BLOCK_N]  # [T, K]
        return picked.reshape(ids.shape[0], -1)[:, : self.in_features]

    def unpack(self) -> torch.Tensor:
        """The plain [out_features, in_features] weight (for references and the bandwidth floor)."""
        if self.data.dtype == torch.bfloat16:
            # each k pair as one int32: a transpose of 4-byte elements copies ~1.4x faster than of 2-byte pairs
            # (it runs per prefill chunk on AMX: ColumnBlockLinear)
            blocks, pairs = self.data.shape[:2]
            as_pairs = self.data.view(torch.int32).view(blocks, pairs, BLOCK_N)
            plain = as_pairs.transpose(1, 2).contiguous().view(torch.bfloat16).view(blocks * BLOCK_N, pairs * 2)
        else:
            blocks = self.data.shape[0]
            plain = self.data.permute(0, 2, 1).reshape(blocks * BLOCK_N, self.in_features)
        return plain[: self.out_features, : self.in_features].contiguous()


def pack_invariant_weight(weight: torch.Tensor) -> PackedWeight:
    """weight [N, K] -> blocks of 64 columns, N padded with zero columns:

    float32   [N/64, K, 64]          packed[b, k, j]     = weight[64 b + j, k]
    bfloat16  [N/64, K/2, 64, 2]     packed[b, p, j, i]  = weight[64 b + j, 2 p + i]   (K padded to even)
    """
    out_features, in_features = weight.shape
    pad_n = -out_features % BLOCK_N
    if weight.dtype == torch.bfloat16:
        padded = F.pad(weight, (0, in_features % 2, 0, pad_n))
        blocks, pairs = padded.shape[0] // BLOCK_N, padded.shape[1] // 2
        data = padded.view(blocks, BLOCK_N, pairs, 2).permute(0, 2, 1, 3)
    elif weight.dtype == torch.float32:
        padded = F.pad(weight, (0, 0, 0, pad_n))
        data = padded.view(padded.shape[0] // BLOCK_N, BLOCK_N, in_features).permute(0, 2, 1)
    else:
        raise ValueError(f"the batch-invariant product takes float32 or bfloat16 weights, not {weight.dtype}")
    return PackedWeight(data.contiguous(), out_features, in_features)
