"""Elementwise torch ops whose value for a row does not depend on how many rows share the batch.

torch's CPU kernels run their vector loop over whole runs of two vectors only (16 floats on AVX2, 32 on AVX-512)
and scalar code, which rounds differently, over the rest: over a [tokens, n] tensor, which of a row's elements
take which code depends on the rows before it. A lone token's shared-expert gate differed from the same token's
among 24 in the last bit on AVX2. Padding each row to a multiple of 32 elements gives every row whole runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_RUN = 32  # floats in two AVX-512 vectors: a multiple of every ISA's run


def rowwise_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid of [rows, n], each row computed as it would be alone."""
    width = x.shape[-1]
    padded = F.pad(x, (0, -width % _RUN))
    return torch.sigmoid(padded)[..., :width]
