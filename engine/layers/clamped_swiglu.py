"""GPT-OSS's expert activation: SwiGLU with both halves clamped, a sigmoid gain, and `up + 1`.

    gate = min(gate, limit)
    up   = clamp(up, -limit, limit)
    out  = (up + 1) * gate * sigmoid(alpha * gate)

The experts' gate|up rows arrive here as [gate | up] halves (the checkpoint interleaves them: gate in the even
columns, up in the odd; they are split into halves once, at load).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    alpha: float  # the sigmoid's gain (config swiglu_alpha)
    limit: float  # the clamp (config swiglu_limit)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 * width] = [gate | up] -> [rows, width]."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
