"""LFM2's short convolution, a gated depthwise causal convolution over a step's requests:

    B | C | x = in_proj(h)        y = C * conv(B * x)        out = out_proj(y)

its state per request the last `kernel - 1` gated inputs B * x (layers/causal_conv.py, layers/recurrent_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from engine.layers.causal_conv import conv_decode, conv_prefill
from engine.layers.recurrent_state import RecurrentStep, StateShape, lone_sequence


@dataclass(slots=True)
class ShortConvWeights:
    in_proj: Any  # [3 * width, hidden]: B, C, x; as the model's Linear prepared it
    conv_weight: torch.Tensor  # [width, kernel]
    conv_bias: Optional[torch.Tensor]
    out_proj: Any  # [hidden, width]
    in_proj_bias: Optional[torch.Tensor] = None
    out_proj_bias: Optional[torch.Tensor] = None


def short_conv_mix(
    x: torch.Tensor,  # [T, hidden], normed
    weights: ShortConvWeights,
    linear: Callable[..., torch.Tensor],
    step: Optional[RecurrentStep],
    layer: int,  # the layer's index among the model's recurrent layers
) -> torch.Tensor:
    """The layer's output [T, hidden] (with several ranks: this rank's channels' partial sum); `step` None: the rows
    are one sequence from an empty window, kept nowhere (a profiling pass)."""
    B, C, values = linear(x, weights.in_proj, weights.in_proj_bias).chunk(3, dim=-1)
    gated = B * values
    if step is None:
        shape = StateShape(gated.shape[1], weights.conv_weight.shape[1])
        step, layer = lone_sequence(shape, x.shape[0], x.dtype, x.device), 0
    windows, weight, bias = step.states.conv[layer], weights.conv_weight, weights.conv_bias
    convolved = torch.empty_like(gated)
    for first, end, rows in step.decode_slices():
        convolved[first:end] = conv_decode(gated[first:end], weight, bias, windows, rows)
    for first, end, row in step.prefills(layer):
        convolved[first:end] = conv_prefill(gated[first:end], weight, bias, windows, row)
    return linear((C * convolved).to(x.dtype), weights.out_proj, weights.out_proj_bias)
