"""The per-token operations between a layer's matrix products: plain torch, or fused native CPU kernels.

Both implement the same contract (results agree to float32 rounding):

    rms_norm(x, w, eps)               -> x / sqrt(mean(x^2) + eps) * w
    add_rms_norm(x, residual, w, eps) -> (rms_norm(residual + x), residual + x); the native one
                                         updates `residual` in place
    layer_norm(x, w, b, eps)          -> (x - mean(x)) / sqrt(var(x) + eps) * w (+ b), in float32 (torch's
                                         in both: no family that needs it fuses its steps)
    silu_and_mul(gate_up)             -> silu(gate) * up, gate_up = [gate | up] on the last dim
    gelu_tanh_and_mul(gate_up)        -> gelu(gate, approximate="tanh") * up (GeGLU)
    rotary(x, angles, rope)           -> x rotated by RoPE; `angles = rotary_angles(positions, rope)`,
                                         once per forward pass; the native one rotates in place

The native ones make each a single pass over memory (torch: 3-6 operator calls each);
what that saves a decode step is measured in docs/performance.md.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from engine.kernels.cpu import CpuKernels
from engine.layers.rotary import RotaryEmbedding


class TorchLayerOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return F.rms_norm(residual, (residual.shape[-1],), weight, eps), residual

    def layer_norm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float
    ) -> torch.Tensor:
        """Over x's last dimension; `weight` and `bias` broadcast over x's trailing dimensions ([width], or
        [heads, head_dim] for a weight per head: Cohere's q/k norms). Computed in float32 and rounded once to x's
        dtype, as Cohere's LayerNorm (and nn.LayerNorm on float32) computes it."""
        y = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps) * weight.float()
        return (y if bias is None else y + bias.float()).to(x.dtype)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rotary_angles(self, positions: torch.Tensor, rope: RotaryEmbedding):
        return rope.tables(positions)  # cos, sin_signed rows of the step's positions

    def rotary(self, x: torch.Tensor, angles, rope: RotaryEmbedding) -> torch.Tensor:
        cos, sin_signed = angles
        return rope.apply(x, cos, sin_signed)


class NativeLayerOps(TorchLayerOps):
    """The fused kernels of csrc/layer_ops.cpp (float32 / bfloat16 on CPU)."""

    name = "cpu"

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x.contiguous(), weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.add_rms_norm(x.contiguous(), residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(gate_up.contiguous())

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.gelu_tanh_and_mul(gate_up.contiguous())

    def rotary_angles(self, positions: torch.Tensor, rope: RotaryEmbedding):
        return positions  # the kernel reads the full tables at each row's position

    def rotary(self, x: torch.Tensor, angles, rope: RotaryEmbedding) -> torch.Tensor:
        return self.kernels.rotary_(x, angles, rope.cos, rope.sin_signed)
