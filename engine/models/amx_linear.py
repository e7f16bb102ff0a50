"""The bf16 product on CPUs with AMX tiles whose native kernels were built without their tile path (an older
compiler; with it, the column-block product runs on the tiles itself: models/invariant_linear.py, faster and
without a second copy of the weights): small batches streamed by the native kernel, larger ones on oneDNN's AMX.

oneDNN runs bf16 products on AMX tiles there, but `F.linear` on a plain weight reorders the weight into
the tiles' layout on every call; reordered once, at load (`torch.ops.mkldnn._reorder_linear_weight`), the
same product takes half the time. Measured on a 2-core Xeon with AMX, 2 threads (us, 3072 x 576 /
576 x 1536 / the 49152 x 576 LM head):

    rows   native (csrc/gemv.h)     F.linear              oneDNN, packed once (for 1 row)
    1      66 / 24 / 1139           122 / 64 / 2056       59 / 28 / 1185
    4      116 / 53 / 1598          129 / 64 / 2035       58 / 29 / 1184
    16     134* / 66* / 2121*       132 / 67 / 2089       64 / 34 / 1267
    64     229* / 129* / 3764*      221 / 123 / 3663      129 / 77 / 2218      (* past 8 rows: F.linear)

Per call they are on par at 1 row and the packed product takes half the time at 4, but only the native
kernel's steps run fused (one native call per decode step, models/fused_decode.py), which saves ~5 ms of
per-op overhead per step of the embedded model: bench offline --num-prompts 4 (decode steps of 4 rows) made
157-158 tok/s with the native kernel at 1 row only, 167-168 up to 2, 208-211 up to 4; with 8 prompts, up to
4 or up to 8 rows measured the same (282-290). So each matrix is kept twice, plain for the native kernel (and the fused path) up to `max_rows` rows,
packed for oneDNN beyond, for twice the bf16 weights' memory. bench offline --num-prompts 16: 446-465 tok/s,
against 393-397 with `F.linear` beyond 4 rows and 277-285 with the column-block kernel at every row count
(which on AVX512-BF16 CPUs without AMX is the fastest); the packed copy alone, unfused: ~490, but a
single-stream step of 20 ms against 15. The packing is laid out for PACK_BATCH_HINT rows (64): the model's
121 products from memory at 64 rows took 20.3 ms packed for 64 rows, 23.1 for 1 (at 16 rows, 15.6 either
way: 17 GB/s, against a streaming read of ~30); end to end, 16 and 64 prompts, within noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from engine.models.linear import PACK_BATCH_HINT, GemvLinear, bucketed, quantized_product
from engine.quantization.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from engine.kernels.cpu import CpuKernels

AMX_NATIVE_MAX_ROWS = 4
"""Rows up to which the native kernel multiplies (and decode steps run fused); oneDNN's AMX product beyond."""



def amx_product_ok() -> bool:
    """oneDNN's bf16 product on a weight packed for it, against `F.linear` (1, 5 and 17 rows, a bias): the
    load-time check before the engine relies on it (False on an error or a mismatch)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 72, generator=generator).bfloat16()
    bias = torch.randn(40, generator=generator).bfloat16()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        for rows in (1, 5, 17):
            x = torch.randn(rows, 72, generator=generator).bfloat16()
            got = AmxLinear._packed_product(x, packed, bias)
            if not torch.allclose(got.float(), F.linear(x, weight, bias).float(), atol=5e-2, rtol=2e-2):
                return False
    except (RuntimeError, AttributeError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class DualWeight:
    """A [out_features, in_features] bf16 weight twice: `data` plain (the native kernel, the fused decode
    path, embedding lookups), `packed` in oneDNN's AMX layout (an opaque tensor)."""

    data: torch.Tensor
    packed: torch.Tensor

    @property
    def extra_bytes(self) -> int:
        """The memory of the second copy (the step reads one of the two)."""
        return self.data.numel() * self.data.element_size()


class AmxLinear(GemvLinear):
    """bf16 on CPUs with AMX: up to `max_rows` rows through the native weight-streaming kernel on the plain
    copy, larger batches through oneDNN on the copy packed for AMX; quantized weights to their own product."""

    name = "cpu-gemv-amx"

    def __init__(self, kernels: "CpuKernels", max_rows: int = AMX_NATIVE_MAX_ROWS):
        super().__init__(kernels, max_rows)

    def prepare(self, weight):
        if isinstance(weight, QuantizedWeight):
            return weight.for_products()
        plain = weight.contiguous()
        return DualWeight(plain, torch.ops.mkldnn._reorder_linear_weight(plain, PACK_BATCH_HINT))

    def __call__(self, x: torch.Tensor, weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return quantized_product(x, weight, bias)
        if x.dtype != weight.data.dtype:
            raise ValueError(f"the AMX product of {x.dtype} rows by a {weight.data.dtype} weight")
        if x.dim() == 2 and x.shape[0] <= self.max_rows:
            return self.kernels.gemv(x.contiguous(), weight.data, bias)
        return bucketed(self._packed_product, x, weight.packed, bias)

    @staticmethod
    def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
