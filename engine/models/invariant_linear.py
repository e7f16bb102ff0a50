"""The column-block product (csrc/column_blocks.h): each output row summed in one fixed order, whatever else is
in the batch, and on AVX512-BF16 the fastest bf16 product at every row count (on AMX CPUs, on the tiles).

oneDNN (behind `F.linear` and the packed fp32 product) chooses its kernel by the shape of
the product: measured on an AVX-512 machine in bfloat16, a row of the down projection
(576 x 1536) computed alone rounds differently from the same row among others (any batch
of 2 or more), enough to flip a greedy token within 30-odd tokens of the embedded model.
The native kernel sums every element in float32 with k ascending, threads split columns,
never the sum; weights are packed once, at load, into its column-block layout.

    BatchInvariantLinear   batch-invariant mode's product (float32 and bfloat16)
    ColumnBlockLinear      the cpu backend's bf16 product where the kernel runs on vdpbf16ps: one thread,
                           2-core AVX512-BF16 machine, against torch's bf16 `F.linear` (oneDNN) and the
                           plain-layout kernel of csrc/gemv.h (G MAC/s, 3072 x 576 / LM head 49152 x 576):
                           1 row 34 / 17 vs 13 / 5 and 32 / 14; 4 rows 92 / 57 vs 42 / 17 and 45 / 25;
                           16 rows 108 / 86 vs 80 / 45 and 57 / 40; 64 rows 112 / 96 vs 104 / 82. On AMX
                           CPUs it runs on the tile unit (`amx`; csrc/column_blocks.h has the figures)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from engine.kernels.cpu import CpuKernels
from engine.models.linear import Linear, quantized_product
from engine.quantization.quantized_weight import QuantizedWeight

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


FUSED_MAX_ROWS = 256
"""The decode batches `ColumnBlockLinear`'s model runs through the fused decode (engine/models/fused_decode.py):
its product is the same kernel at every row count, so the fused path takes any decode-only step up to this."""


class ColumnBlockLinear(BatchInvariantLinear):
    """The cpu backend's bf16 product on builds where the column-block kernel runs on vdpbf16ps: every row count
    (decode and prefill) through it, on weights packed once at load; quantized weights go to their own product."""

    name = "cpu-column-blocks"
    max_rows = FUSED_MAX_ROWS

    def __init__(self, kernels: CpuKernels, amx: Optional[bool] = None):
        super().__init__(kernels)
        self.amx = kernels.amx_tiles if amx is None else amx  # on AMX tiles (the fused decode too)

    def prepare(self, weight):
        if isinstance(weight, QuantizedWeight):
            return weight.for_products()
        return super().prepare(weight)

    def __call__(self, x: torch.Tensor, weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return quantized_product(x, weight, bias)
        if x.dtype != weight.data.dtype:
            raise ValueError(f"the column-block product of {x.dtype} rows by a {weight.data.dtype} weight")
        return self.kernels.invariant_linear(x.contiguous(), weight.data, bias, weight.out_features, amx=self.amx)
