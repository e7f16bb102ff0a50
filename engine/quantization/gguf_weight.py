"""A weight matrix kept in a GGUF block format (Q4_0, Q4_1, Q8_0), multiplied by the native kernels.

Few activation rows (decode) are quantized to int8 per 32-block and take integer dot products with the
blocks (csrc/quant_gemm.cpp). More rows take bf16 products with tiles of the weight dequantized once per
call (csrc/quant_dense_bf16.cpp, AVX512-BF16); float32 prefill (and bf16 without AVX512-BF16) dequantizes
the whole matrix and uses torch's dense product. The thresholds are measured (below).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from engine.kernels.quant import QuantKernels
from engine.quantization.gguf_formats import BlockFormat, PackedBlocks
from engine.quantization.quantized_weight import QuantizedWeight

TILE_MIN_ROWS = 6
"""Activations of at least this many rows take the bf16 tile product (a tile of the weight dequantized once
per call, csrc/quant_dense_bf16.cpp; float32 activations rounded to bf16) where the build has AVX512-BF16.
Measured per thread on 8 layers of the embedded model's Q4_1 shapes (ms), integer vs tiles vs oneDNN on the
float weights: 4 rows 4.2 / 4.6 / 8.4; 8 rows 8.7 / 6.0 / 9.1; 16 rows 15.9 / 8.6 / 11.4; 64 rows 62.3 /
25.2 / 25.2."""

NO_TILES = 1 << 62

DENSE_MIN_ROWS = {torch.float32: 64, torch.bfloat16: 16}
"""From this many rows the weight is dequantized whole and multiplied by torch's product: float32 prefill
(exact float32 products, as the float weights give), and bf16 where the build has no bf16 tiles.
Measured per thread (ms, 8 layers, Q4_1): fp32 at 32 rows 28.5 (integer) vs 30.2 (dense), at 64 rows 57.3
vs 57.6; bf16 (without tiles) at 16 rows 15.1 vs 13.7, at 32 rows 29.3 vs 17.7."""


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
        p = self.packed
        tiles = self.kernels.bf16_tiles
        if x.shape[0] >= DENSE_MIN_ROWS.get(x.dtype, 0) and not (tiles and x.dtype == torch.bfloat16):
            return F.linear(x, self.dequantize(x.dtype))
        return self.kernels.linear(x.contiguous(), p.qs, p.d, p.m, self.out_features, p.nbp, self.fmt.code,
                                   TILE_MIN_ROWS if tiles else NO_TILES)

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
