"""The matrix product behind every projection, chosen once per device and dtype.

On x86 CPUs in fp32 the weights are reordered once, at load, into oneDNN's blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied with oneDNN's
linear (`torch.ops.mkldnn._linear_pointwise`): the products no longer repack the
weights on every call. Measured on a 2-core AVX2 machine against `F.linear`
(GFLOP/s, fp32): batch 64: 125 vs 110 (576x3072), 129 vs 119 (1536x576),
116 vs 68 (the 576x49152 LM head); batch 2048: on par; batch 1: 25 vs 20.
It is used only where the ops exist and agree with `F.linear` on a probe;
elsewhere weights stay plain tensors and `F.linear` does the work. (Neither keeps a row's
result independent of the other rows: batch-invariant mode multiplies with
`invariant_linear.BatchInvariantLinear` instead.)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 64
"""The row count oneDNN picks the packed layout for (any row count works; decode batches are the target)."""


class Linear:
    """`F.linear` on plain weights: every device and dtype."""

    name = "torch"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """The form of a [out, in] weight that `__call__` takes (here: itself)."""
        return weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, weight, bias)


class PackedOneDnnLinear(Linear):
    """oneDNN's linear on weights reordered once into its blocked layout (opaque `torch._mkldnn` tensors)."""

    name = "onednn-packed"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


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
