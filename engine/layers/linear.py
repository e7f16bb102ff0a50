"""The matrix product behind every projection, chosen once per device and dtype.

On x86 CPUs in fp32 the weights are reordered once, at load, into oneDNN's blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied with oneDNN's
linear (`torch.ops.mkldnn._linear_pointwise`): the products no longer repack the
weights on every call (faster than `F.linear` up to mid-sized batches, on par
at large ones: measured in docs/performance.md). It is used only where the ops
exist and agree with `F.linear` on a probe; elsewhere weights stay plain tensors
and `F.linear` does the work. With the cpu attention
backend in bfloat16, `invariant_linear.ColumnBlockLinear` multiplies every row count natively
on AVX512-BF16 builds (weights packed in column blocks: faster than oneDNN at every row count there, and
batch invariant; on AMX CPUs on the tile unit, whose sums are grouped otherwise); on other builds
`GemvLinear` multiplies batches of up to 8 rows (4 on AMX CPUs, where `F.linear` runs on the tiles)
natively (a weight-streaming kernel), larger ones with `F.linear`. In fp32 on AVX2 and AVX-512 builds
`ColumnBlockLinear` multiplies every row count (its tiles outrun oneDNN there or run about even, and the fused
decode step reads its packing). (Neither oneDNN nor
`GemvLinear` keeps a row's result independent of the other rows: batch-invariant mode
multiplies with `invariant_linear.BatchInvariantLinear` instead.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.nn.functional as F

from engine.quantization.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from engine.kernels.cpu import CpuKernels

Weight = Union[torch.Tensor, QuantizedWeight]
"""A projection's weight as loaded: a float [out, in] matrix or a quantized one. Each Linear's `prepare` turns it
into the form its own `__call__` takes (a tensor, a oneDNN-packed tensor, column blocks, a quantized weight's
product form), typed Any here since only that Linear knows it."""

PACK_BATCH_HINT = 64
"""The row count oneDNN picks the packed layout for (any row count works; decode batches are the target)."""

EXACT_ROWS = 16
ROW_BUCKET = 32


def padded_rows(rows: int) -> int:
    """The row count a CPU product runs at: up to EXACT_ROWS as is, beyond rounded up to a multiple of
    ROW_BUCKET.

    oneDNN (behind torch's CPU products) builds and caches a JIT-compiled primitive per shape, about half
    a MiB each: with prefill chunks of every length up to max_num_batched_tokens, a server's memory grew
    by ~1 MiB per request for its first thousands of requests (measured in docs/performance.md). Bucketing
    bounds the shapes per weight to 16 + max_num_batched_tokens / 32, for at most 31 padding rows (compute
    that decode-sized products, bound by reading the weights, barely notice)."""
    return rows if rows <= EXACT_ROWS else -(-rows // ROW_BUCKET) * ROW_BUCKET


def _bucketed(product, x: torch.Tensor, weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    rows = x.shape[0]
    padded = padded_rows(rows) if x.dim() == 2 else rows
    if padded == rows:
        return product(x, weight, bias)
    return product(F.pad(x, (0, 0, 0, padded - rows)), weight, bias)[:rows]


def quantized_product(x: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [rows, in] times a quantized [out, in] weight, plus the bias."""
    out = weight.matmul(x)
    return out if bias is None else out + bias


class Linear:
    """`F.linear` on plain weights: every device and dtype (on CPU at bucketed row counts, `padded_rows`)."""

    name = "torch"

    def prepare(self, weight: Weight) -> Any:
        """The form of a [out, in] weight that `__call__` takes (here: itself; a quantized weight's own)."""
        return weight.for_products() if isinstance(weight, QuantizedWeight) else weight

    def __call__(self, x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return quantized_product(x, weight, bias)
        if x.device.type == "cpu":
            return _bucketed(F.linear, x, weight, bias)
        return F.linear(x, weight, bias)


class PackedOneDnnLinear(Linear):
    """oneDNN's linear on weights reordered once into its blocked layout (opaque `torch._mkldnn` tensors)."""

    name = "onednn-packed"

    def prepare(self, weight: Weight) -> Any:
        if isinstance(weight, QuantizedWeight):
            return weight.for_products()
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return quantized_product(x, weight, bias)
        return _bucketed(self._product, x, weight, bias)

    @staticmethod
    def _product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


GEMV_MAX_ROWS = 8
"""The largest batch `GemvLinear` multiplies natively (beyond, the weight-reading kernel loses to oneDNN's
blocked products, which reuse each weight tile across many rows)."""


class GemvLinear(Linear):
    """CPU bfloat16 on builds where the column-block product has no vdpbf16ps (AVX2, AVX512F without BF16) or,
    on AMX CPUs, no tile path: up to `max_rows` rows through the native small-batch product (csrc/gemv.cpp),
    which streams the plain [out, in] weight at memory speed; larger batches through `F.linear` (bucketed) on the
    same tensor. Quantized weights go to their own product.

    At batch 1 it reads the weights near the machine's streaming bandwidth, several times faster than
    torch's product; the lead shrinks by 8 rows (measured in docs/performance.md)."""

    name = "cpu-gemv"

    def __init__(self, kernels: "CpuKernels", max_rows: int = GEMV_MAX_ROWS):
        self.kernels = kernels
        self.max_rows = max_rows

    def prepare(self, weight: Weight) -> Any:
        return weight.for_products() if isinstance(weight, QuantizedWeight) else weight.contiguous()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return quantized_product(x, weight, bias)
        if x.dim() == 2 and x.shape[0] <= self.max_rows and x.dtype == weight.dtype:
            return self.kernels.gemv(x.contiguous(), weight, bias)
        return _bucketed(F.linear, x, weight, bias)


def select_linear(device: torch.device, dtype: torch.dtype) -> Linear:
    """Packed oneDNN on CPU in fp32 when available and correct here, else `F.linear`."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return Linear()
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return Linear()
    packed = PackedOneDnnLinear()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 48, generator=generator)
    bias = torch.randn(40, generator=generator)
    try:
        prepared = packed.prepare(weight)
        agrees = all(
            torch.allclose(packed(x, prepared, bias), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
            for x in (torch.randn(rows, 48, generator=generator) for rows in (1, 5, 70))
        )
    except RuntimeError:
        return Linear()
    return packed if agrees else Linear()
