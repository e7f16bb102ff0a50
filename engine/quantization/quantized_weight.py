"""The contract of a weight matrix stored quantized: what `Linear` multiplies when a weight is not a tensor.

A projection's weight is either a plain `[out, in]` tensor (or the packed form `Linear.prepare` made of one)
or a `QuantizedWeight`: its own storage (GGUF blocks, int8 per channel, int4 groups, ...) and its own
product. `Linear.__call__` hands a quantized weight the activations and adds the bias; everything else
(the model, the runner, the memory floor) sees only the interface below.
"""

from __future__ import annotations

import torch


class QuantizedWeight:
    """A `[out_features, in_features]` matrix in a quantized storage format."""

    format: str = "unknown"  # e.g. "q4_1", "q8_0", "int8", "int4-g128"

    @property
    def out_features(self) -> int:
        raise NotImplementedError

    @property
    def in_features(self) -> int:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes a product reads from memory (the packed data with its scales and zeros)."""
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] -> x @ W.T [rows, out_features], in x's dtype."""
        raise NotImplementedError

    def matmul_float32(self, x: torch.Tensor) -> torch.Tensor:
        """`matmul` in float32 (logits): formats whose kernel can write float32 outright override it."""
        return self.matmul(x).float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix it stands for, [out_features, in_features] (references, tests, fallbacks)."""
        raise NotImplementedError

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized rows `index` [n] -> [n, in_features] (an embedding lookup; formats that can
        dequantize rows alone override this)."""
        return self.dequantize(dtype).index_select(0, index)

    def for_products(self) -> "QuantizedWeight":
        """The form the model multiplies, once its matrices are final (rows fused): by default itself; a
        format may re-lay its data for its product (GGUF blocks: 16 rows interleaved)."""
        return self

    def take_columns(self, start: int, stop: int) -> "QuantizedWeight":
        """Input columns `start` .. `stop - 1` (a row-parallel shard's), when the format can cut there exactly."""
        raise NotImplementedError(f"{type(self).__name__} cannot be cut by input columns")

    @classmethod
    def concat_rows(cls, weights) -> "QuantizedWeight":
        """The weights stacked along the output rows (fused q|k|v, gate|up), when the format allows."""
        raise NotImplementedError(f"{cls.__name__} cannot be fused")
