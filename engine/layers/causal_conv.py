"""A causal depthwise convolution over a step's requests, each continuing from the window of its last inputs that
its recurrent state keeps (layers/recurrent_state.py): Mamba-2's over x, B and C, LFM2's short convolution.

    window  = [state (kernel - 1 inputs) | this step's inputs]      out_t = sum_k w[k] window[t + k] + b
    state   = the window's last kernel - 1 inputs
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def conv_prefill(
    x: torch.Tensor,  # [n, channels]: one request's inputs
    weight: torch.Tensor,  # [channels, kernel]
    bias: Optional[torch.Tensor],  # [channels]
    windows: torch.Tensor,  # [rows, channels, kernel - 1]: the layer's states
    row: int,
) -> torch.Tensor:
    """The request's n outputs [n, channels] (in the windows' dtype), its window moved on by n inputs."""
    n = x.shape[0]
    window = torch.cat([windows[row], x.t().to(windows.dtype)], dim=1)  # [channels, kernel - 1 + n]
    windows[row] = window[:, n:]
    return F.conv1d(window[None], weight[:, None, :], bias, groups=window.shape[0])[0].t()


def conv_decode(
    x: torch.Tensor,  # [d, channels]: one input per request
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    windows: torch.Tensor,
    rows: torch.Tensor,  # [d]
) -> torch.Tensor:
    """d requests' next outputs [d, channels] (summed in float32, in x's dtype), their windows moved on by one."""
    window = torch.cat([windows[rows], x[:, :, None].to(windows.dtype)], dim=2)  # [d, channels, kernel]
    windows[rows] = window[:, :, 1:]
    out = (window.float() * weight.float()).sum(dim=2)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
