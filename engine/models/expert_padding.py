"""Experts whose intermediate width does not split into equal shares among the tensor-parallel ranks, padded with
zero units as vLLM pads them (its MXFP4 MoE method rounds the width up per rank) instead of refused.

    width I, ranks N, unit u       padded width P = the smallest multiple of N * u >= I; each rank's share P / N
    rank r                         units r * P/N .. (r + 1) * P/N - 1 of the padded width: the real ones it
                                   covers, then zeros (only the last ranks' shares hold padding)

The unit is what a share must hold whole: 1 for float weights, 32 for MXFP4 blocks (a block's inputs share one
scale), the group size for int4 groups (quantized at load or an AWQ checkpoint's). A padded unit is exact: its
gate and up rows (and biases) are zero, so gate = up = 0 and every activation served gives 0 there (SiLU(0) * 0;
GPT-OSS's clamped (up + 1) * gate * sigmoid(alpha * gate)), and its down column is zero, so it adds nothing. In the
stored formats the zeros are exact too: an MXFP4 block of code 0 is +0.0 under any scale, an int4 group of zeros
quantizes to codes 0 with zero offset -8 * scale (exactly zero), and a padded AWQ group holds scale 0 and zero 0.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from engine.models.moe_arch import MoeArch
from engine.quantization.int4_groups import Int4Groups
from engine.quantization.mxfp4 import BLOCK_VALUES as MXFP4_BLOCK


def expert_unit(mxfp4: bool, group_size: Optional[int]) -> int:
    """The inputs a rank's share of an expert's width must hold whole: MXFP4 blocks, int4 groups (both: either)."""
    return math.lcm(MXFP4_BLOCK if mxfp4 else 1, group_size or 1)


def expert_share(width: int, ranks: int, unit: int = 1) -> int:
    """One rank's share of an expert's `width`, padded: ceil(width / (ranks * unit)) * unit."""
    return -(-width // (ranks * unit)) * unit


def padding_notes(moe: MoeArch, ranks: int, unit: int, routed: bool = True) -> list[str]:
    """A line for each expert width padded for `ranks` ranks (what start-up logs), none where all divide.
    `routed` False: the routed experts are held whole (expert parallelism), a shared expert's width alone is cut."""
    widths = [("expert width", moe.expert_intermediate_size)] if routed else []
    if moe.shared_intermediate_size is not None:
        widths.append(("shared expert width", moe.shared_intermediate_size))
    notes = []
    for what, width in widths:
        padded = expert_share(width, ranks, unit) * ranks
        if padded != width:
            notes.append(
                f"{what} {width} padded to {padded} for {ranks} ranks: {100 * (padded / width - 1):.1f}% more "
                "expert weights"
            )
    return notes


def padded_slice(tensor: torch.Tensor, dim: int, rank: int, share: int, fill: int = 0) -> torch.Tensor:
    """Rank `rank`'s `share` entries along `dim` of `tensor` padded at its end with `fill` (rows of a column-parallel
    matrix, input columns of a row-parallel one; MXFP4 scales pad with any exponent)."""
    size = tensor.shape[dim]
    start, stop = min(rank * share, size), min((rank + 1) * share, size)
    part = tensor.narrow(dim, start, stop - start)
    missing = share - (stop - start)
    if not missing:
        return part.contiguous()
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([part, tensor.new_full(shape, fill)], dim=dim).contiguous()


def padded_int4_rows(tensor: Int4Groups, rank: int, share: int) -> Int4Groups:
    """An AWQ matrix's output rows of this rank, then zero rows (codes, scales and offsets 0: W = 0)."""
    rows = tensor.out_features
    start, stop = min(rank * share, rows), min((rank + 1) * share, rows)
    part = tensor.take_rows(start, stop)
    missing = share - (stop - start)
    if not missing:
        return part
    zeros = Int4Groups(
        tensor.codes.new_zeros(missing, tensor.padded_in_features),
        tensor.scales.new_zeros(missing, tensor.scales.shape[1]),
        tensor.zeros.new_zeros(missing, tensor.zeros.shape[1]),
        tensor.group_size,
        tensor.in_features,
    )
    return Int4Groups.concat([part, zeros])


def padded_int4_columns(tensor: Int4Groups, rank: int, share: int) -> Int4Groups:
    """An AWQ matrix's input columns of this rank (whole groups: `share` is a multiple of the group size), then
    zero groups. The last real group's own padding becomes logical columns: they meet the padded units'
    activations, which are zero."""
    group, width = tensor.group_size, tensor.in_features
    assert share % group == 0, f"a share of {share} inputs cuts {group}-input groups"  # (expert_unit's)
    start = rank * share
    codes, scales, zeros = tensor.codes[:, :0], tensor.scales[:, :0], tensor.zeros[:, :0]
    if start < width:
        part = tensor.take_columns(start, min(start + share, width))
        codes, scales, zeros = part.codes, part.scales, part.zeros
    missing = share - codes.shape[1]
    return Int4Groups(
        torch.cat([codes, codes.new_zeros(codes.shape[0], missing)], dim=1).contiguous(),
        torch.cat([scales, scales.new_zeros(scales.shape[0], missing // group)], dim=1).contiguous(),
        torch.cat([zeros, zeros.new_zeros(zeros.shape[0], missing // group)], dim=1).contiguous(),
        group,
        share,
    )
