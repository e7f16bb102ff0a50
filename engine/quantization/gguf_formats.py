"""GGUF's block formats (Q4_0, Q4_1, Q8_0) and their repacking into the layout csrc/quant_gemm.cpp reads.

A GGUF block covers 32 consecutive inputs of one output row:

    Q4_0  18 bytes: d fp16 | 16 bytes, byte j = element j (low nibble), element j + 16 (high)   w = d (u - 8)
    Q4_1  20 bytes: d fp16 | m fp16 | 16 bytes, nibbles as Q4_0                                  w = d u + m
    Q8_0  34 bytes: d fp16 | 32 int8                                                             w = d q

Repacked (nb blocks per row, padded to an even nbp with zero blocks):

    qs  4-bit  uint8 [N, nbp / 2 * 32]  pair p, byte j: block 2p's element j (low nibble), block 2p+1's (high)
        8-bit  uint8 [N, nbp * 32]      q + 128
    d   fp16 [N, nbp]; m fp16 [N, nbp] (Q4_1 only)

Scales stay fp16 (the kernel converts them; fp32 would add 10-20% to the bytes a product reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

BLOCK = 32


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """One GGUF block format: its name, its code in quant_gemm.cpp, bytes per GGUF block, bits per quant."""

    name: str
    code: int
    block_bytes: int
    bits: int

    @property
    def has_min(self) -> bool:
        return self.name == "q4_1"

    def qs_bytes_per_block(self) -> int:
        return BLOCK * self.bits // 8


FORMATS = {
    "q4_0": BlockFormat("q4_0", 0, 18, 4),
    "q4_1": BlockFormat("q4_1", 1, 20, 4),
    "q8_0": BlockFormat("q8_0", 2, 34, 8),
}
"""The formats kept quantized, by GGUF's lower-case type name (`GGMLQuantizationType.Q4_1.name.lower()`)."""


@dataclass(frozen=True, slots=True)
class PackedBlocks:
    """A repacked [N, K] weight: the three tensors the kernel reads."""

    qs: torch.Tensor  # uint8 [N, nbp * 32 * bits / 8]
    d: torch.Tensor  # float16 [N, nbp]
    m: Optional[torch.Tensor]  # float16 [N, nbp] (Q4_1) or None
    nbp: int


def padded_blocks(in_features: int) -> int:
    """Blocks per repacked row: in_features / 32 rounded up to even (the kernel reads blocks in pairs)."""
    if in_features % BLOCK:
        raise ValueError(f"GGUF block formats need in_features a multiple of {BLOCK}, got {in_features}")
    blocks = in_features // BLOCK
    return blocks + blocks % 2


def repack(fmt: BlockFormat, raw: np.ndarray, in_features: int) -> PackedBlocks:
    """raw uint8 [N, nb * block_bytes] (GGUF's rows of blocks) -> the kernel's layout."""
    rows = raw.shape[0]
    nb, nbp = in_features // BLOCK, padded_blocks(in_features)
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, fmt.block_bytes)
    d = np.zeros((rows, nbp), dtype=np.float16)
    d[:, :nb] = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    m = None
    if fmt.has_min:
        m = np.zeros((rows, nbp), dtype=np.float16)
        m[:, :nb] = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
    payload = blocks[:, :, 4 if fmt.has_min else 2:]
    if fmt.bits == 8:
        qs = np.zeros((rows, nbp, BLOCK), dtype=np.uint8)
        qs[:, :nb] = payload ^ np.uint8(0x80)  # int8 q -> q + 128
    else:
        quants = np.zeros((rows, nbp, BLOCK), dtype=np.uint8)  # [N, nbp, 32] in element order
        quants[:, :nb, :16] = payload & 0x0F
        quants[:, :nb, 16:] = payload >> 4
        qs = quants[:, 0::2] | (quants[:, 1::2] << 4)  # [N, nbp / 2, 32]
    return PackedBlocks(
        qs=torch.from_numpy(np.ascontiguousarray(qs).reshape(rows, -1)),
        d=torch.from_numpy(d),
        m=None if m is None else torch.from_numpy(m),
        nbp=nbp,
    )
