"""Weight-only int8, symmetric per output channel: W[o, :] = scale[o] * q[o, :], q in [-127, 127].

The product reads the int8 matrix (a quarter of fp32's bytes, half of bf16's) and scales the outputs:
`x @ W.T = (x @ q.T) * scale`, either through torch's weight-only kernel `aten._weight_int8pack_mm`
(where this build has it for the device and dtype, checked once per `Int8KernelCheck` against the
reference product: a model's int8 matrices share their quantizer's) or by converting the int8 matrix
to the activations' dtype and calling `F.linear`; `uses_kernel` says which, per row count and dtype,
from measurements.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from engine.quantization.quantized_weight import QuantizedWeight

INT8_MAX = 127
CPU_KERNEL_MAX_ROWS = 8
KERNEL_IN_MULTIPLE = 16
"""torch 2.13's CPU `_weight_int8pack_mm` reads in_features in steps of 16: other widths give wrong sums or
crash (measured), so those matrices take the dequantizing product."""


class Int8KernelCheck:
    """Whether `aten._weight_int8pack_mm` runs for a dtype and device type and matches the reference,
    probed the first time it is asked and remembered for its owner's lifetime (a `WeightQuantizer` passes
    one to all of a model's int8 matrices; a weight made without one gets its own)."""

    __slots__ = ("_answers",)

    def __init__(self) -> None:
        self._answers: dict[tuple[torch.dtype, str], bool] = {}

    def __call__(self, dtype: torch.dtype, device: torch.device) -> bool:
        key = (dtype, device.type)
        answer = self._answers.get(key)
        if answer is None:
            answer = self._answers[key] = _probe(dtype, device)
        return answer


class Int8Weight(QuantizedWeight):
    """`qweight` int8 [out, in] and `scales` [out] (float32, with a copy per activation dtype); `kernel_check`
    says whether torch's int8 kernel can serve its products."""

    format = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, kernel_check: Optional[Int8KernelCheck] = None):
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scales.shape != (qweight.shape[0],):
            raise ValueError(
                f"int8 weight wants int8 [out, in] and scales [out], got {qweight.dtype} "
                f"{tuple(qweight.shape)} and {tuple(scales.shape)}"
            )
        self.qweight = qweight.contiguous()
        self.scales = scales.float().contiguous()
        self._scales_as: dict[torch.dtype, torch.Tensor] = {}
        self._kernel_ok: dict[torch.dtype, bool] = {}
        self.kernel_check = Int8KernelCheck() if kernel_check is None else kernel_check

    @classmethod
    def quantize(cls, weight: torch.Tensor, kernel_check: Optional[Int8KernelCheck] = None) -> "Int8Weight":
        """Round a float [out, in] matrix to int8 with one scale per row (its absolute maximum / 127)."""
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
        q = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return cls(q, scales, kernel_check)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scales[:, None]).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_kernel(x.shape[0], x.dtype, x.device):
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self._scales_for(x.dtype))
        return self.matmul_dequantized(x)

    def uses_kernel(self, rows: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a product of `rows` rows runs torch's int8 kernel (else the dequantizing product).

        On CPU only 16-bit activations at up to CPU_KERNEL_MAX_ROWS rows take it: there it beats bf16's own
        product, while at 16 rows it loses to dequantize + `F.linear`, and with fp32 activations it is far
        slower than dequantizing (no vectorized fp32 path). Measured in docs/performance.md."""
        if device.type == "cpu" and (dtype == torch.float32 or rows > CPU_KERNEL_MAX_ROWS):
            return False
        if self._kernel_ok.get(dtype) is None:
            fits = self.in_features % KERNEL_IN_MULTIPLE == 0
            self._kernel_ok[dtype] = fits and self.kernel_check(dtype, device)
        return self._kernel_ok[dtype]

    def matmul_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """The fallback (and the measured alternative): convert the int8 matrix, multiply, scale."""
        return F.linear(x, self.qweight.to(x.dtype)) * self._scales_for(x.dtype)

    def _scales_for(self, dtype: torch.dtype) -> torch.Tensor:
        scales = self._scales_as.get(dtype)
        if scales is None:
            scales = self._scales_as[dtype] = self.scales.to(dtype)
        return scales

    def take_columns(self, start: int, stop: int) -> "Int8Weight":
        """Input columns `start` .. `stop - 1` with the whole rows' scales: a row-parallel shard whose partial
        products, summed over the ranks, are the whole matrix's (each rank quantizing its own columns would pick
        other scales: the maximum over its slice of a row, not over the row)."""
        return Int8Weight(self.qweight[:, start:stop], self.scales, self.kernel_check)

    def to(self, device: torch.device) -> "Int8Weight":
        return Int8Weight(self.qweight.to(device), self.scales.to(device), self.kernel_check)


def _probe(dtype: torch.dtype, device: torch.device) -> bool:
    """One small product through `aten._weight_int8pack_mm` against a float64 reference."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(-INT8_MAX, INT8_MAX + 1, (48, 64), dtype=torch.int8, generator=generator)
    scales = torch.rand(48, generator=generator) / 64
    x = torch.randn(5, 64, generator=generator)
    reference = (x.double() @ q.double().t()) * scales.double()
    try:
        out = torch.ops.aten._weight_int8pack_mm(x.to(device, dtype), q.to(device), scales.to(device, dtype))
    except (RuntimeError, NotImplementedError):
        return False
    tolerance = 1e-3 if dtype == torch.float32 else 3e-2
    return bool(torch.allclose(out.double().cpu(), reference, rtol=tolerance, atol=tolerance))
