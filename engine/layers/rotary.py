"""Rotary position embeddings: default, linear and llama3 frequency scaling."""

from __future__ import annotations

import math
from typing import Optional

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    """[head_dim // 2] float32 rotation speeds, after the model's frequency scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, scaling)
    raise ValueError(f"RoPE scaling {rope_type!r} is not supported (supported: default, linear, llama3)")


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables; rotates the two halves of each head (HF's layout).

        rotate_half(x) = [-x2, x1] = roll(x, half) * [-1 .. -1, 1 .. 1]
        x' = x * cos + rotate_half(x) * sin = x * cos + roll(x, half) * sin_signed
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[dict],
                 dtype: torch.dtype, device: torch.device):
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        half = head_dim // 2
        sin = emb.sin()
        sin[:, :half] = -sin[:, :half]
        self.half = half
        self.cos = emb.cos().to(dtype=dtype, device=device)  # [max_positions, head_dim]
        self.sin_signed = sin.to(dtype=dtype, device=device)  # [max_positions, head_dim]

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed for the step's positions: [num_tokens, 1, head_dim] each."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim] -> rotated copy."""
        return x * cos + torch.roll(x, self.half, dims=-1) * sin_signed
