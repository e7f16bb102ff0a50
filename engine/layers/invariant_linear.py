"""The column-block product (csrc/column_blocks.h): each output row summed in one fixed order, whatever else is
in the batch, and on AVX512-BF16 the fastest bf16 product at every row count (on AMX CPUs, on the tiles).

oneDNN (behind `F.linear` and the packed fp32 product) chooses its kernel by the shape of
the product, so a row computed alone can round differently from the same row among others,
enough to flip greedy tokens in bfloat16. The native kernel sums every element in float32
with k ascending, threads split columns, never the sum; weights are packed once, at load,
into its column-block layout.

    BatchInvariantLinear   batch-invariant mode's product (float32 and bfloat16)
    ColumnBlockLinear      the cpu backend's bf16 product where the kernel runs on vdpbf16ps, and its float32
                           product on AVX2 and AVX-512 builds: faster than oneDNN or about even at every row
                           count there (and than the plain-layout kernel of csrc/gemv.h, but at 2 float32 rows
                           on AVX2, about even). On AMX CPUs it runs on the tile unit (`amx`)

Measured in docs/performance.md ("Products on CPU").
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from engine.kernels.column_block_weight import PackedWeight, pack_invariant_weight
from engine.kernels.cpu import CpuKernels
from engine.layers.linear import Linear, Weight, quantized_product
from engine.quantization.quantized_weight import QuantizedWeight


class BatchInvariantLinear(Linear):
    """`F.linear` whose every output row is bitwise the same whatever the other rows (CPU, fp32 / bf16)."""

    name = "batch-invariant"

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels

    def prepare(self, weight: Weight) -> Any:
        if isinstance(weight, QuantizedWeight):
            raise ValueError(
                "the batch-invariant product multiplies float weights (quantization is refused with "
                "batch invariance at build)"
            )
        return pack_invariant_weight(weight.contiguous())

    def __call__(self, x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return self.kernels.invariant_linear(x.contiguous(), weight.data, bias, weight.out_features)


ONEDNN_MIN_ROWS = 1536
"""On AMX, `ColumnBlockLinear` hands products of at least this many rows (prefill chunks) to oneDNN on the weight
unpacked for the call: oneDNN's large bf16 products on the tiles outrun our tile path, which pays for the
unpack (a transposing copy of the weight) from about this many rows on (the embedded model's four products of
a layer, one thread, CPU time, load ~10: 1024 rows 15.4 vs 17.4 ms; 2048 rows 30.8 vs ~25 ms; docs/performance.md,
"Long prompts")."""

FUSED_MAX_ROWS = 256
"""The decode batches `ColumnBlockLinear`'s model runs through the fused decode (engine/layers/fused_decode.py):
its product is the same kernel at every row count, so the fused path takes any decode-only step up to this."""


class ColumnBlockLinear(BatchInvariantLinear):
    """The cpu backend's product where the column-block kernel outruns oneDNN: bf16 on vdpbf16ps (AVX512-BF16),
    float32 on AVX2 and AVX-512 builds. Every row count (decode and prefill) through it, on weights packed
    once at load; quantized weights go to their own product."""

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
        if self.amx and x.shape[0] >= ONEDNN_MIN_ROWS:
            return F.linear(x, weight.unpack(), bias)
        return self.kernels.invariant_linear(x.contiguous(), weight.data, bias, weight.out_features, amx=self.amx)
