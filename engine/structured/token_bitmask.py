"""Applying a batch's allowed-token bitmask to its logits, on the logits' device."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenBitmask(NamedTuple):
    """Bit j of word i of row r allows token 32 * i + j for logits row rows[k] where r = rows[k].

    bitmask: [num_rows, ceil(vocab / 32)] int32 on the logits' device (rows not in `rows` are ignored).
    """

    bitmask: torch.Tensor
    rows: list[int]


def apply_token_bitmask(x: torch.Tensor, mask: TokenBitmask) -> None:
    """Disallowed tokens of the masked rows of x ([num_rows, vocab], float32) become -inf, in place.

    xgrammar's kernel (CUDA/Triton on a GPU, a native loop on the CPU): no wait for the device.
    """
    import xgrammar as xgr

    indices = None if len(mask.rows) == x.shape[0] else mask.rows
    xgr.apply_token_bitmask_inplace(x, mask.bitmask, vocab_size=x.shape[1], indices=indices)
