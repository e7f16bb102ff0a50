"""Weight-only int4, group-wise (`Int4Groups`), packed once for the device's kernel.

    CPU   aten._weight_int4pack_mm_for_cpu on `_convert_weight_to_int4pack_for_cpu`'s layout
          (float32, bfloat16, float16 activations; out_features a multiple of 16)
    CUDA  aten._weight_int4pack_mm on `_convert_weight_to_int4pack`'s layout (bfloat16 activations:
          others are converted around it; out_features a multiple of 8, in a multiple of 32)
    else  the nibbles stay as they are and every product dequantizes them first (`F.linear` on the
          float matrix): correct anywhere, but it reads the float matrix it builds.

Scales and zeros are kept in float32 and converted once per activation dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from engine.quantization.int4_groups import CODE_OFFSET, Int4Groups
from engine.quantization.quantized_weight import QuantizedWeight

CPU_KERNEL_GROUP_SIZES = (32, 64, 128, 256)


class Int4Weight(QuantizedWeight):
    """An `Int4Groups` matrix on `device`, in the layout of the kernel that multiplies it there."""

    def __init__(self, groups: Int4Groups, device: torch.device, *, use_kernel: bool = True):
        self.format = f"int4-g{groups.group_size}"
        self.group_size = groups.group_size
        self._out, self._in, self._padded_in = groups.out_features, groups.in_features, groups.padded_in_features
        self.kernel = _kernel_for(groups, device) if use_kernel else "dequantize"
        sz = groups.scales_and_zeros()  # [groups, out, 2]
        self._sz = {torch.float32: sz.to(device)}
        if self.kernel == "cpu":
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.codes.to(torch.int32), 1)
        elif self.kernel == "cuda":
            inner_k_tiles = next(t for t in (8, 4, 2) if self._padded_in % (t * 16) == 0)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(groups.nibbles().to(device), inner_k_tiles)
            self._sz[torch.bfloat16] = sz.to(device, torch.bfloat16)
        else:
            self.packed = groups.nibbles().to(device)  # [out, padded_in / 2]

    @property
    def out_features(self) -> int:
        return self._out

    @property
    def in_features(self) -> int:
        return self._in

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self._sz[torch.float32].numel() * 4

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "dequantize":
            return self.matmul_dequantized(x)
        if self._padded_in != self._in:
            x = F.pad(x, (0, self._padded_in - self._in))
        if self.kernel == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.contiguous(), self.packed, self.group_size, self._scales_and_zeros(x.dtype)
            )
        out = torch.ops.aten._weight_int4pack_mm(
            x.to(torch.bfloat16).contiguous(), self.packed, self.group_size, self._sz[torch.bfloat16]
        )
        return out.to(x.dtype)

    def matmul_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize the whole matrix, then `F.linear` (the fallback, and the measured alternative)."""
        if self.kernel != "dequantize":
            return F.linear(x, self.dequantize(x.dtype))
        return F.linear(x, self._dequantize_nibbles(x.dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.kernel == "dequantize":
            return self._dequantize_nibbles(dtype)
        # the kernel's own view of the matrix: the identity times W.T (exact in float32 on CPU)
        probe_dtype = torch.float32 if self.kernel == "cpu" else torch.bfloat16
        eye = torch.eye(self._in, dtype=probe_dtype, device=self.packed.device)
        return self.matmul(eye).t().to(dtype).contiguous()

    def _dequantize_nibbles(self, dtype: torch.dtype) -> torch.Tensor:
        codes = torch.stack([self.packed >> 4, self.packed & 15], dim=-1).view(self._out, -1, self.group_size)
        sz = self._sz[torch.float32]  # [groups, out, 2]
        w = (codes.to(dtype) - CODE_OFFSET) * sz[..., 0].t().to(dtype)[..., None] + sz[..., 1].t().to(dtype)[..., None]
        return w.view(self._out, self._padded_in)[:, : self._in]

    def _scales_and_zeros(self, dtype: torch.dtype) -> torch.Tensor:
        sz = self._sz.get(dtype)
        if sz is None:
            sz = self._sz[dtype] = self._sz[torch.float32].to(dtype)
        return sz


def _kernel_for(groups: Int4Groups, device: torch.device) -> str:
    """ "cpu", "cuda" or "dequantize": which product this matrix can take on `device`."""
    out_features, padded_in = groups.codes.shape
    if device.type == "cpu":
        ok = (
            hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and out_features % 16 == 0
            and groups.group_size in CPU_KERNEL_GROUP_SIZES
        )
        return "cpu" if ok else "dequantize"
    if device.type == "cuda":
        ok = (
            hasattr(torch.ops.aten, "_weight_int4pack_mm")
            and out_features % 8 == 0
            and padded_in % 32 == 0
            and _cuda_int4_supported(device)
        )
        return "cuda" if ok else "dequantize"
    return "dequantize"


def _cuda_int4_supported(device: torch.device) -> bool:
    """torch's CUDA int4 kernel needs compute capability 8.0 or newer (bf16 tensor cores)."""
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def int4_weight(weight: torch.Tensor, group_size: int, device: Optional[torch.device] = None) -> Int4Weight:
    """Quantize a float [out, in] matrix and pack it for `device` (default: the matrix's)."""
    return Int4Weight(Int4Groups.quantize(weight, group_size), device or weight.device)
