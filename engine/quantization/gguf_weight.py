"""A weight matrix kept in a GGUF block format (Q4_0, Q4_1, Q8_0), multiplied by the native kernels.

Products of fewer than `DENSE_MIN_ROWS` activation rows (decode, batched decode) quantize the activations to
int8 per 32-block and take integer dot products with the blocks (csrc/quant_gemm.cpp); longer ones
(prefill chunks) dequantize the matrix to the activations' dtype and use torch's dense product, which
is faster once the dequantization is spread over enough rows (measured, see DENSE_MIN_ROWS).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from engine.kernels.quant import QuantKernels
from engine.quantization.gguf_formats import BlockFormat, PackedBlocks
from engine.quantization.quantized_weight import QuantizedWeight

DENSE_MIN_ROWS = {torch.bfloat16: 16, torch.float32: 64}
"""Per activation dtype, the row count from which dequantize + torch's dense product beats the integer
kernel. Measured per thread on the embedded model's shapes (AVX512-VNNI + AVX512-BF16, Q4_1, ms for 8
layers): bf16 at 16 rows 15.1 (integer) vs 13.7 (dense), at 32 rows 29.3 vs 17.7; fp32 at 32 rows 28.5
vs 30.2, at 64 rows 57.3 vs 57.6. At 1-8 rows the integer kernel is 1.5-7x faster than torch's product
on the same weights already dequantized."""


class GgufWeight(QuantizedWeight):
    """[out_features, in_features] in GGUF blocks, repacked for the kernels (see gguf_formats.py)."""

    def __init__(self, fmt: BlockFormat, packed: PackedBlocks, in_features: int, kernels: QuantKernels):
        self.fmt = fmt
        self.format = fmt.name
        self.packed = packed
        self.kernels = kernels
        self._in_features = in_features

    @property
    def out_features(self) -> int:
        return self.packed.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self._in_features

    @property
    def nbytes(self) -> int:
        p = self.packed
        return sum(t.numel() * t.element_size() for t in (p.qs, p.d, p.m) if t is not None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] f32/bf16 -> [rows, out_features] in x's dtype."""
        if x.shape[-1] != self._in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight takes {self._in_features}")
        if x.shape[0] >= DENSE_MIN_ROWS.get(x.dtype, 0):
            return F.linear(x, self.dequantize(x.dtype))
        p = self.packed
        return self.kernels.linear(x.contiguous(), p.qs, p.d, p.m, self.out_features, p.nbp, self.fmt.code)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [out_features, in_features] (float32/bfloat16 by the kernel, others cast)."""
        p = self.packed
        kernel_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = self.kernels.dequantize(p.qs, p.d, p.m, self._in_features, p.nbp, self.fmt.code, kernel_dtype)
        return out.to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized rows `index` [n] -> [n, in_features] (an embedding lookup)."""
        return self.take_rows(index).dequantize(dtype)

    def take_rows(self, index: torch.Tensor) -> "GgufWeight":
        """The weight made of rows `index` [n], in that order (whole rows of blocks: exact)."""
        p = self.packed
        picked = PackedBlocks(p.qs.index_select(0, index), p.d.index_select(0, index),
                              None if p.m is None else p.m.index_select(0, index), p.nbp)
        return GgufWeight(self.fmt, picked, self._in_features, self.kernels)

    @classmethod
    def concat_rows(cls, weights: Sequence["GgufWeight"]) -> "GgufWeight":
        """[w0; w1; ...] stacked along the output rows (fused q|k|v, gate|up); one format and width."""
        first = weights[0]
        if any(w.fmt != first.fmt or w.in_features != first.in_features for w in weights):
            formats = ", ".join(f"{w.format} [{w.out_features}, {w.in_features}]" for w in weights)
            raise ValueError(f"cannot fuse GGUF weights of different formats or widths: {formats}")
        m: Optional[torch.Tensor] = None
        if first.packed.m is not None:
            m = torch.cat([w.packed.m for w in weights])
        packed = PackedBlocks(torch.cat([w.packed.qs for w in weights]), torch.cat([w.packed.d for w in weights]),
                              m, first.packed.nbp)
        return GgufWeight(first.fmt, packed, first.in_features, first.kernels)

    def __repr__(self) -> str:
        return f"GgufWeight({self.format}, [{self.out_features}, {self.in_features}], {self.nbytes} bytes)"
