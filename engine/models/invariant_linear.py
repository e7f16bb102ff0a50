"""The batch-invariant matrix product: each output row summed in one fixed order, whatever else is in the batch.

oneDNN (behind `F.linear` and the packed fp32 product) chooses its kernel by the shape of
the product: measured on an AVX-512 machine in bfloat16, a row of the down projection
(576 x 1536) computed alone rounds differently from the same row among others (any batch
of 2 or more), enough to flip a greedy token within 30-odd tokens of the embedded model.
`BatchInvariantLinear` multiplies with the native kernel of csrc/invariant_linear.cpp
instead: float32 accumulation with k ascending for every element, threads split columns,
never the sum. Weights are packed once, at load, into its column-block layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from engine.kernels.cpu import CpuKernels
from engine.models.linear import Linear

BLOCK_N = 64
"""Output columns per packed block (csrc/invariant_linear.cpp's kBlockN)."""


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A [out_features, in_features] weight in the kernel's layout (see `pack_invariant_weight`)."""

    data: torch.Tensor
    out_features: int
    in_features: int

    def unpack(self) -> torch.Tensor:
        """The plain [out_features, in_features] weight (for references and the bandwidth floor)."""
        if self.data.dtype == torch.bfloat16:
            blocks, pairs = self.data.shape[:2]
            plain = self.data.permute(0, 2, 1, 3).reshape(blocks * BLOCK_N, pairs * 2)
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


class BatchInvariantLinear(Linear):
    """`F.linear` whose every output row is bitwise the same whatever the other rows (CPU, fp32 / bf16)."""

    name = "batch-invariant"

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels

    def prepare(self, weight: torch.Tensor) -> PackedWeight:
        return pack_invariant_weight(weight.contiguous())

    def __call__(self, x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return self.kernels.invariant_linear(x.contiguous(), weight.data, bias, weight.out_features)
