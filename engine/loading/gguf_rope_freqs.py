"""llama.cpp's `rope_freqs.weight` read back into the llama3 RoPE scaling it was made from.

llama.cpp's converter does not write a Llama 3.1/3.2/3.3 checkpoint's `rope_scaling` (llama3) into the GGUF's
metadata: it bakes it into a tensor of per-pair frequency divisors, which llama.cpp divides each pair's
frequency by. transformers' GGUF loader reads neither, so the converted config rotated with plain RoPE (every
token after the first few differed from the original checkpoint's). The divisors, per rotary pair i of
wavelength w_i = 2 pi / (theta^(-2i/d)):

    1                                    w_i < original / high_freq_factor             (high frequencies)
    factor                               w_i > original / low_freq_factor              (low frequencies)
    1 / ((1 - s_i) / factor + s_i)       between, s_i = (original / w_i - low) / (high - low)

`factor` is the lowest frequency's divisor; s_i of the pairs between is linear in 1 / w_i, whose slope and offset
fix original / (high - low) and low / (high - low). Any (original, low, high) with those two ratios gives the
same frequencies; low = 1 (every release's) picks one. The scaling found is checked by recomputing the divisors:
a tensor that is not a llama3 scaling is refused, never served approximately.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

ROPE_FREQS = "rope_freqs.weight"
"""llama.cpp's tensor of per-pair RoPE frequency divisors."""
RELATIVE_TOLERANCE = 1e-4
"""How close the recomputed divisors must be to the stored ones (float32, rounded by the converter)."""


def llama3_divisors(scaling: dict, theta: float, rotary_dim: int) -> list[float]:
    """The divisors llama.cpp's converter writes for a llama3 `scaling` (HF's keys)."""
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    divisors = []
    for wavelen in _wavelengths(theta, rotary_dim):
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return divisors


def llama3_scaling(divisors: Sequence[float], theta: float, rotary_dim: int) -> Optional[dict]:
    """The llama3 scaling (HF's `rope_parameters` keys, without rope_theta) whose divisors these are; None when
    they are all 1 (no scaling). ValueError when no llama3 scaling gives them."""
    divisors = [float(d) for d in divisors]
    if len(divisors) != rotary_dim // 2:
        raise ValueError(f"rope_freqs.weight has {len(divisors)} entries; {rotary_dim // 2} rotary pairs need one each")
    if all(math.isclose(d, 1.0, rel_tol=RELATIVE_TOLERANCE) for d in divisors):
        return None
    for found in _candidates(divisors, theta, rotary_dim):
        # the original context as an integer (as configs give it) where that gives the divisors too
        for original in (round(found["original_max_position_embeddings"]), found["original_max_position_embeddings"]):
            scaling = {**found, "original_max_position_embeddings": original}
            recomputed = llama3_divisors(scaling, theta, rotary_dim)
            if all(math.isclose(a, b, rel_tol=RELATIVE_TOLERANCE) for a, b in zip(recomputed, divisors)):
                return scaling
    raise ValueError(
        "the GGUF's rope_freqs.weight (per-pair RoPE frequency divisors) is not a llama3 RoPE scaling, the only "
        f"one served from it: {[round(d, 4) for d in divisors]}"
    )


def _wavelengths(theta: float, rotary_dim: int) -> list[float]:
    return [2 * math.pi * theta ** (i / rotary_dim) for i in range(0, rotary_dim, 2)]


def _candidates(divisors: list[float], theta: float, rotary_dim: int):
    """llama3 scalings that may give `divisors` (each checked by the caller): the pairs between the high and low
    frequencies fitted by least squares; with fewer than two of them, the boundaries of every release
    (low 1, high 4) around what the pairs allow."""
    factor = divisors[-1]
    if factor <= 1.0:
        return
    wavelens = _wavelengths(theta, rotary_dim)
    tol = RELATIVE_TOLERANCE
    between = [
        (1 / w, (1 / d - 1 / factor) / (1 - 1 / factor))
        for w, d in zip(wavelens, divisors)
        if not math.isclose(d, 1.0, rel_tol=tol) and not math.isclose(d, factor, rel_tol=tol)
    ]
    if len(between) >= 2:  # smooth = slope / w - offset
        n = len(between)
        mean_x, mean_s = sum(x for x, _ in between) / n, sum(s for _, s in between) / n
        slope = sum((x - mean_x) * (s - mean_s) for x, s in between) / sum((x - mean_x) ** 2 for x, _ in between)
        offset = slope * mean_x - mean_s
        if offset > 0:  # low = 1: offset = 1 / (high - 1), slope = original / (high - 1)
            yield _scaling(factor, 1.0, round(1 + 1 / offset, 6), slope / offset)
        return
    high = 4.0
    if between:  # smooth = (original / w - 1) / 3
        x, smooth = between[0]
        yield _scaling(factor, 1.0, high, (3 * smooth + 1) / x)
        return
    unscaled = [w for w, d in zip(wavelens, divisors) if math.isclose(d, 1.0, rel_tol=tol)]
    scaled = [w for w, d in zip(wavelens, divisors) if math.isclose(d, factor, rel_tol=tol)]
    if unscaled and scaled:  # original in (high * longest unscaled, shortest scaled): their geometric mean
        yield _scaling(factor, 1.0, high, math.sqrt(high * max(unscaled) * min(scaled)))


def _scaling(factor: float, low: float, high: float, original: float) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
