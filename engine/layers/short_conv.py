"""LFM2's short convolution, a gated depthwise causal convolution over a step's requests:

    B | C | x = in_proj(h)        y = C * conv(B * x)        out = out_proj(y)

its state per request the last `kernel - 1` gated inputs B * x (layers/causal_conv.py, layers/recurrent_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from engine.layers.causal_conv import conv_decode, conv_prefill
from engine.layers.recurrent_state import RecurrentStep


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
    width, kernel = gated.shape[1], weights.conv_weight.shape[1]
    if step is None:
        windows = torch.zeros((1, width, kernel - 1), dtype=x.dtype, device=x.device)
        convolved = conv_prefill(gated, weights.conv_weight, weights.conv_bias, windows, 0)
    else:
        windows, starts, decodes = step.states.conv[layer], step.query_start_loc_cpu, step.num_decodes
        convolved = torch.empty_like(gated)
        if decodes:
            convolved[:decodes] = conv_decode(
                gated[:decodes], weights.conv_weight, weights.conv_bias, windows, step.rows[:decodes]
            )
        for i in range(decodes, step.num_reqs):
            first, end = starts[i], starts[i + 1]
            rows = gated[first:end]
            convolved[first:end] = conv_prefill(rows, weights.conv_weight, weights.conv_bias, windows, step.rows_cpu[i])
    return linear((C * convolved).to(x.dtype), weights.out_proj, weights.out_proj_bias)
