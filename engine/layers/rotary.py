"""Rotary position embeddings: default, linear, llama3, YaRN and LongRoPE frequency scaling, over whole heads or
their first `rotary_dim` dimensions (partial rotary: Phi-4-mini).

LongRoPE has two factor sets, short and long. HF switches a whole forward pass to the long ones once the sequence
passes `original_max_position_embeddings` (and Phi-3's `generate` drops its KV cache to recompute the prefix with
them). A paged server cannot re-rotate cached keys, and rotating a query and its keys with different factors
breaks the relative encoding; so, as vLLM does, one set serves every position: the long one when the server's
`max_model_len` passes the original context, else the short one. That is HF exactly for every sequence when
`max_model_len` stays within the original context, and for every sequence longer than it otherwise; shorter
sequences on a long-context server rotate with the long factors where HF would use the short ones.

A LongRoPE scaling may carry `attention_factors` (short, long): cos and sin are scaled by the one matching the set
served, instead of the factor derived from the context lengths (Phi-3.5-MoE's short_mscale and long_mscale, put
there by models/families.py).
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_type_of(scaling: Optional[dict]) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def check_rope_scaling(scaling: Optional[dict]) -> None:
    """ValueError naming a RoPE scaling type this module does not implement, and those it does."""
    rope_type = rope_type_of(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def inverse_frequencies(
    head_dim: int,
    theta: float,
    scaling: Optional[dict],
    max_position_embeddings: Optional[int] = None,
    long_context: bool = False,
) -> torch.Tensor:
    """[head_dim // 2] float32 rotation speeds, after the model's frequency scaling (LongRoPE: its long factors
    with `long_context`, else its short ones). `head_dim`: the rotated dimensions of a head."""
    check_rope_scaling(scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = rope_type_of(scaling)
    if scaling is None or rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_frequencies(head_dim, theta, scaling, max_position_embeddings)
    return _longrope_frequencies(head_dim, theta, scaling["long_factor" if long_context else "short_factor"])


def uses_long_factors(scaling: Optional[dict], max_model_len: int) -> bool:
    """Whether LongRoPE serves every position with its long factors: when sequences of `max_model_len` tokens
    pass the original context (see the module's docstring)."""
    if rope_type_of(scaling) != "longrope":
        return False
    assert scaling is not None  # its type is longrope
    return max_model_len > scaling["original_max_position_embeddings"]


def check_longrope_factors(scaling: Optional[dict], rotary_dim: int) -> None:
    """ValueError unless LongRoPE's short and long factors give one per rotated pair (`rotary_dim // 2`)."""
    if rope_type_of(scaling) != "longrope":
        return
    assert scaling is not None  # its type is longrope
    for key in ("short_factor", "long_factor"):
        if len(scaling[key]) != rotary_dim // 2:
            raise ValueError(
                f"LongRoPE {key} has {len(scaling[key])} entries; the {rotary_dim} rotated dimensions of a head "
                f"need {rotary_dim // 2}"
            )


def attention_factor(
    scaling: Optional[dict], max_position_embeddings: Optional[int] = None, long_context: bool = False
) -> float:
    """What cos and sin are multiplied by (YaRN's and LongRoPE's attention scaling; 1 otherwise); `long_context`:
    LongRoPE serves its long factors (which of its `attention_factors` applies, where it has them)."""
    rope_type = rope_type_of(scaling)
    if scaling is None or rope_type not in ("yarn", "longrope"):
        return 1.0
    if rope_type == "longrope" and scaling.get("attention_factors") is not None:
        short, long = scaling["attention_factors"]
        return float(long if long_context else short)
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _factor(scaling, max_position_embeddings)
    if rope_type == "longrope":
        original = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _factor(scaling: dict, max_position_embeddings: Optional[int]) -> float:
    factor = scaling.get("factor")
    if factor is None:  # Phi-3 and DeepSeek configs give the ratio of the context lengths instead
        factor = max_position_embeddings / scaling["original_max_position_embeddings"]
    return float(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_frequencies(head_dim: int, theta: float, scaling: dict, max_position_embeddings: Optional[int]):
    """YaRN: interpolated (divided by the factor) where a dimension turns fewer than beta_slow times over the
    original context, extrapolated (unchanged) past beta_fast turns, a linear ramp between."""
    factor = _factor(scaling, max_position_embeddings)
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero in the ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _longrope_frequencies(head_dim: int, theta: float, factors) -> torch.Tensor:
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


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
    """Precomputed cos/sin tables; rotates the two halves of each head's first `rotary_dim` dimensions (HF's
    layout), the rest pass unrotated.

    rotate_half(x) = [-x2, x1] = roll(x, half) * [-1 .. -1, 1 .. 1]
    x' = x * cos + rotate_half(x) * sin = x * cos + roll(x, half) * sin_signed

        head:  | x1 (half) | x2 (half) | passed through (head_dim - rotary_dim) |
               |<------- rotary_dim -------->|
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: Optional[dict],
        dtype: torch.dtype,
        device: torch.device,
        rotary_dim: Optional[int] = None,
        max_model_len: Optional[int] = None,
    ):
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and within the head ({head_dim})")
        check_longrope_factors(scaling, rotary_dim)
        long_context = uses_long_factors(scaling, max_positions if max_model_len is None else max_model_len)
        inv_freq = inverse_frequencies(rotary_dim, theta, scaling, max_positions, long_context)
        # a row per position served: past max_position_embeddings where a RoPE scaling extends the context
        # (engine/loading/rope_context.py), as HF rotates any position
        num_rows = max(max_positions, max_model_len or 0)
        positions = torch.arange(num_rows, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [num_rows, rotary_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        half = rotary_dim // 2
        factor = attention_factor(scaling, max_positions, long_context)
        cos, sin = emb.cos() * factor, emb.sin() * factor
        sin[:, :half] = -sin[:, :half]
        self.half = half
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.long_context = long_context  # LongRoPE: its long factors serve every position
        self.cos = cos.to(dtype=dtype, device=device)  # [num_rows, rotary_dim]
        self.sin_signed = sin.to(dtype=dtype, device=device)  # [num_rows, rotary_dim]

    @property
    def partial(self) -> bool:
        return self.rotary_dim != self.head_dim

    def with_tables(self, cos: torch.Tensor, sin_signed: torch.Tensor) -> "RotaryEmbedding":
        """The same rotation reading other tables [rows, rotary_dim] (M-RoPE: a step's own, engine/layers/mrope.py)."""
        view = copy.copy(self)
        view.cos, view.sin_signed = cos, sin_signed
        return view

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed for the step's positions: [num_tokens, 1, rotary_dim] each."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim] -> rotated copy."""
        if not self.partial:
            return x * cos + torch.roll(x, self.half, dims=-1) * sin_signed
        rot = x[..., : self.rotary_dim]
        return torch.cat([rot * cos + torch.roll(rot, self.half, dims=-1) * sin_signed, x[..., self.rotary_dim :]], -1)
