"""A weight matrix kept in a GGUF block format (Q4_0, Q4_1, Q8_0), multiplied by the native kernels.

Few activation rows (decode) are quantized to int8 per 32-block and take integer dot products with the
blocks (csrc/quant_gemm.cpp). More rows take bf16 products with tiles of the weight dequantized once per
call (csrc/quant_dense_bf16.cpp, AVX512-BF16); float32 prefill (and bf16 without AVX512-BF16) dequantizes
the whole matrix and uses torch's dense product. The thresholds are measured (docs/performance.md, "GGUF
block products").
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from engine.kernels.quant import QuantKernels
from engine.quantization.gguf_formats import (
    BLOCK,
    GROUP,
    ROWS,
    X16,
    BlockFormat,
    PackedBlocks,
    block_columns,
    interleave16,
    rows_of_x16,
)
from engine.quantization.quantized_weight import QuantizedWeight

TILE_MIN_ROWS = 6
"""Activations of at least this many rows take the bf16 tile product (a tile of the weight dequantized once
per call, csrc/quant_dense_bf16.cpp; float32 activations rounded to bf16) where the build has AVX512-BF16:
on the row layout the tiles overtake the integer product between 4 and 8 rows (measured in
docs/performance.md)."""

X16_TILE_MIN_ROWS = 65
"""bf16 activations on X16 weights (gguf_formats.py) take the integer product below this many rows and the
bf16 tiles from it on. The integer product is the faster at every row count, but its int8 activations
cost prompt scoring accuracy: perplexity rises over three times as much as through the tiles (measured in
docs/performance.md and docs/quantization.md). So decode batches (up to 64 rows, the default server's
max_num_seqs) take the integer product and prefill chunks the tiles."""

AMX_DENSE_MIN_ROWS = 96
"""On AMX CPUs, bf16 activations of at least this many rows take the weight dequantized to bf16 and torch's
product (oneDNN on the tile unit) instead of the vdpbf16ps tiles: the embedded model's four products of a
layer, one thread, CPU time: 128 rows 10.8 -> 7.4 ms, 256 rows 21.2 -> 7.9 ms, 2048 rows ~12x faster
(docs/performance.md, "Long prompts"). The dequantized weight is bf16 as the tiles' is, the sums float32:
the same accuracy."""

BF16_DENSE_MIN_ROWS = 256
"""On AVX512-BF16 CPUs without AMX (AMD Zen 4 and newer), bf16 activations of at least this many rows go dense
as on AMX CPUs: oneDNN's bf16 product runs on the same vdpbf16ps instructions as our tiles but faster at these
sizes, the dequantization each call adds included (`python -m benchmarks.gguf_kernels`; docs/performance.md,
"Long prompts", on the AMD EPYC)."""


def bf16_dense_min_rows(kernels: QuantKernels) -> Optional[int]:
    """From how many bf16 activation rows a GGUF product dequantizes its weight for torch's (None: never, where
    the build has no bf16 tiles DENSE_MIN_ROWS decides)."""
    if not kernels.bf16_tiles:
        return None
    return AMX_DENSE_MIN_ROWS if kernels.amx_dense else BF16_DENSE_MIN_ROWS


NO_TILES = 1 << 62

DENSE_MIN_ROWS = {torch.float32: 65, torch.bfloat16: 16}
"""From this many rows the weight is dequantized whole and multiplied by torch's product: float32 prefill
(exact float32 products, as the float weights give), and bf16 where the build has no bf16 tiles: where
the dense product catches up with the integer one (measured in docs/performance.md). float32 decode batches
(up to 64 rows, the default server's max_num_seqs) keep the integer product, as bf16's on X16 weights
(X16_TILE_MIN_ROWS): dequantizing every matrix for each step of 64 rows made those steps 2-3x as long on AVX2."""


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
        return self.packed.out_features

    @property
    def in_features(self) -> int:
        return self._in_features

    @property
    def nbytes(self) -> int:
        p = self.packed
        parts = (p.qs,) if p.layout == X16 else (p.qs, p.d, p.m)  # X16: the scales are views into qs
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def product(self, rows: int, dtype: torch.dtype) -> str:
        """Which product `matmul` runs for `rows` activation rows of `dtype`: "integer" (int8 activations),
        "tiles" (bf16 tiles, AVX512-BF16 builds) or "dense" (dequantized, torch's product). On the X16 layout
        with bf16 activations the integer product is used up to X16_TILE_MIN_ROWS - 1 rows (decode batches),
        the tiles beyond (prefill chunks); bf16 prefill chunks go dense (bf16_dense_min_rows)."""
        tiles = self.kernels.bf16_tiles
        dense_rows = bf16_dense_min_rows(self.kernels)
        if dtype == torch.bfloat16 and dense_rows is not None and rows >= dense_rows:
            return "dense"
        if dtype == torch.bfloat16 and tiles:
            threshold = X16_TILE_MIN_ROWS if self.packed.layout == X16 else TILE_MIN_ROWS
            return "tiles" if rows >= threshold else "integer"
        if rows >= DENSE_MIN_ROWS.get(dtype, 0):
            return "dense"
        return "tiles" if tiles and rows >= TILE_MIN_ROWS and self.packed.layout == ROWS else "integer"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] f32/bf16 -> [rows, out_features] in x's dtype."""
        return self._matmul(x, float32_out=False)

    def matmul_float32(self, x: torch.Tensor) -> torch.Tensor:
        """`matmul` in float32: the integer product writes it outright (a decode step's logits)."""
        return self._matmul(x, float32_out=True)

    def _matmul(self, x: torch.Tensor, float32_out: bool) -> torch.Tensor:
        if x.shape[-1] != self._in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight takes {self._in_features}")
        product = self.product(x.shape[0], x.dtype)
        if product == "dense":
            out = F.linear(x, self.dequantize(x.dtype))
        else:
            p = self.packed
            out = self.kernels.linear(
                x.contiguous(),
                p.qs,
                p.d,
                p.m,
                self.out_features,
                p.nbp,
                self.fmt.code,
                p.layout,
                0 if product == "tiles" else NO_TILES,
                float32_out=float32_out and product == "integer",
            )
        return out.float() if float32_out else out  # (a no-op where the kernel wrote float32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [out_features, in_features] (float32/bfloat16 by the kernel, others cast)."""
        p = self.packed
        kernel_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = self.kernels.dequantize(
            p.qs, p.d, p.m, self.out_features, self._in_features, p.nbp, self.fmt.code, p.layout, kernel_dtype
        )
        return out.to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized rows `index` [n] -> [n, in_features] (an embedding lookup)."""
        p = self.packed
        kernel_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = self.kernels.dequantize_rows(
            p.qs,
            p.d,
            p.m,
            index.to(torch.int64).contiguous(),
            self.out_features,
            self._in_features,
            p.nbp,
            self.fmt.code,
            p.layout,
            kernel_dtype,
        )
        return out.to(dtype)

    def take_rows(self, index: torch.Tensor) -> "GgufWeight":
        """The weight made of rows `index` [n], in that order (whole rows of blocks: exact), row layout."""
        p = self.packed
        if p.layout == X16:
            return GgufWeight(
                self.fmt, rows_of_x16(self.fmt, p, index, self._in_features), self._in_features, self.kernels
            )
        picked = PackedBlocks(
            p.qs.index_select(0, index),
            p.d.index_select(0, index),
            None if p.m is None else p.m.index_select(0, index),
            p.nbp,
        )
        return GgufWeight(self.fmt, picked, self._in_features, self.kernels)

    def take_columns(self, start: int, stop: int) -> "GgufWeight":
        """Input columns `start` .. `stop - 1` of a row-layout weight (a row-parallel shard): whole blocks only,
        since each block's scale covers 32 inputs (ValueError naming the split otherwise); exact."""
        if start % BLOCK or stop % BLOCK:
            raise ValueError(
                f"{self.format} columns {start} .. {stop - 1} do not fall on its {BLOCK}-input block boundaries"
            )
        packed = block_columns(self.fmt, self.packed, self._in_features, start // BLOCK, (stop - start) // BLOCK)
        return GgufWeight(self.fmt, packed, stop - start, self.kernels)

    def zero_rows(self, count: int) -> "GgufWeight":
        """`count` rows of zeros in this weight's format and width, row layout (a vocabulary's padding rows):
        every scale (and Q4_1 minimum) zero."""
        p = self.packed
        if p.layout != ROWS:
            raise ValueError("zero rows are made beside a row-layout weight")
        m = None if p.m is None else p.m.new_zeros(count, p.m.shape[1])
        packed = PackedBlocks(p.qs.new_zeros(count, p.qs.shape[1]), p.d.new_zeros(count, p.d.shape[1]), m, p.nbp)
        return GgufWeight(self.fmt, packed, self._in_features, self.kernels)

    @classmethod
    def concat_rows(cls, weights: Sequence["GgufWeight"]) -> "GgufWeight":
        """[w0; w1; ...] stacked along the output rows (fused q|k|v, gate|up); one format and width."""
        first = weights[0]
        if any(w.packed.layout != ROWS for w in weights):
            raise ValueError("GGUF weights are fused by rows before they are interleaved")
        if any(w.fmt != first.fmt or w.in_features != first.in_features for w in weights):
            formats = ", ".join(f"{w.format} [{w.out_features}, {w.in_features}]" for w in weights)
            raise ValueError(f"cannot fuse GGUF weights of different formats or widths: {formats}")
        m: Optional[torch.Tensor] = None
        if first.packed.m is not None:
            mins = [w.packed.m for w in weights if w.packed.m is not None]
            assert len(mins) == len(weights)  # one format (checked above): all of them have mins
            m = torch.cat(mins)
        packed = PackedBlocks(
            torch.cat([w.packed.qs for w in weights]), torch.cat([w.packed.d for w in weights]), m, first.packed.nbp
        )
        return GgufWeight(first.fmt, packed, first.in_features, first.kernels)

    def for_products(self) -> "GgufWeight":
        return self.interleaved()

    def interleaved(self) -> "GgufWeight":
        """The same weight in the X16 layout (gguf_formats.py), which the integer decode kernel reads several
        times faster; itself where it has a row count that is not a multiple of 16 or is X16 already."""
        if self.packed.layout != ROWS or self.out_features % GROUP:
            return self
        return GgufWeight(
            self.fmt, interleave16(self.fmt, self.packed, self._in_features), self._in_features, self.kernels
        )

    def __repr__(self) -> str:
        return f"GgufWeight({self.format}, [{self.out_features}, {self.in_features}], {self.nbytes} bytes)"
