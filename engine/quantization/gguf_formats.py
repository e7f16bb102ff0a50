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

Once the model's matrices are final (rows un-permuted, q|k|v and gate|up fused), those with a multiple of
16 rows are interleaved by 16 (`interleave16`, csrc/quant_blocks.h's kX16): group g of 16 rows is nb
block records in a row; record b holds the quants (4-bit: 4 x 64 bytes P_q, byte 4c + j = u[c][4q + j] |
u[c][16 + 4q + j] << 4; 8-bit: 8 x 64 bytes, byte 4c + j = u[c][4q + j]), then the 16 columns' fp16 scales,
then (Q4_1) their fp16 minimums; no padding block. The integer kernel then keeps 16 output columns in one
vector's lanes: no horizontal sums and no per-block scale shuffles (several times faster than on the row
layout), and reads one stream per group (measured in docs/performance.md).
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


ROWS = 0
X16 = 1
"""Layout codes (csrc/quant_blocks.h's Layout)."""

GROUP = 16


@dataclass(frozen=True, slots=True)
class PackedBlocks:
    """A repacked [N, K] weight in one of the two layouts: ROWS, three tensors the kernel reads; X16, one (the
    records in `qs`), with `d` and `m` views of the scales inside them."""

    qs: torch.Tensor  # ROWS: uint8 [N, nbp * 32 * bits / 8]; X16: uint8 [N / 16, nb * record bytes]
    d: torch.Tensor  # float16 ROWS: [N, nbp]; X16: [N / 16, nb, 16], a view of the records in qs
    m: Optional[torch.Tensor]  # float16, as d (Q4_1) or None
    nbp: int  # blocks per row as stored (X16: nb, no padding)
    layout: int = ROWS

    @property
    def out_features(self) -> int:
        return self.qs.shape[0] * (GROUP if self.layout == X16 else 1)


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
    payload = blocks[:, :, 4 if fmt.has_min else 2 :]
    if fmt.bits == 8:
        qs: np.ndarray = np.zeros((rows, nbp, BLOCK), dtype=np.uint8)
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


def _quants(fmt: BlockFormat, packed: PackedBlocks, nb: int) -> torch.Tensor:
    """The unsigned quants of a ROWS weight in element order, uint8 [N, nb, 32]."""
    rows = packed.qs.shape[0]
    if fmt.bits == 8:
        return packed.qs.view(rows, packed.nbp, BLOCK)[:, :nb]
    pairs = packed.qs.view(rows, packed.nbp // 2, 1, BLOCK)
    quants = torch.cat([pairs & 0x0F, pairs >> 4], dim=2)  # [N, nbp / 2, 2, 32]: blocks 2p, 2p + 1
    return quants.reshape(rows, packed.nbp, BLOCK)[:, :nb]


def block_columns(fmt: BlockFormat, packed: PackedBlocks, in_features: int, first: int, count: int) -> PackedBlocks:
    """Blocks `first` .. `first + count - 1` of every row of a ROWS weight (inputs 32 * first onwards), in the
    ROWS layout: exact, the same quants and scales (a row-parallel shard's input columns).

        4-bit pairs re-formed:  source blocks (2p, 2p + 1) share bytes; from an odd `first` each new pair
                                takes its nibbles from two source pairs, so the quants are unpacked and repacked
    """
    nb = in_features // BLOCK
    if packed.layout != ROWS or first < 0 or count < 1 or first + count > nb:
        raise ValueError(f"block columns {first} .. {first + count - 1} of a row-layout weight of {nb} blocks")
    u = _quants(fmt, packed, nb)[:, first : first + count]  # [N, count, 32]
    return _pack_rows(fmt, u, packed.d[:, first : first + count], _slice(packed.m, first, count))


def _slice(t: Optional[torch.Tensor], first: int, count: int) -> Optional[torch.Tensor]:
    return None if t is None else t[:, first : first + count]


def _pack_rows(fmt: BlockFormat, u: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor]) -> PackedBlocks:
    """Unsigned quants u [N, nb, 32] in element order and scales [N, nb] -> the ROWS layout (padded to even)."""
    rows, nb = u.shape[0], u.shape[1]
    nbp = nb + nb % 2
    quants = torch.zeros(rows, nbp, BLOCK, dtype=torch.uint8)
    quants[:, :nb] = u
    qs = quants if fmt.bits == 8 else quants[:, 0::2] | (quants[:, 1::2] << 4)

    def padded(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows, nbp, dtype=t.dtype)
        out[:, :nb] = t
        return out

    return PackedBlocks(qs.reshape(rows, -1).contiguous(), padded(d), None if m is None else padded(m), nbp, ROWS)


def interleave16(fmt: BlockFormat, packed: PackedBlocks, in_features: int) -> PackedBlocks:
    """A ROWS weight of N rows (a multiple of 16) in the X16 layout (exact: the same quants and scales)."""
    rows, nb = packed.qs.shape[0], in_features // BLOCK
    if packed.layout != ROWS or rows % GROUP:
        raise ValueError(f"interleave16 takes a row-layout weight of a multiple of {GROUP} rows, got {rows}")
    groups = rows // GROUP
    u = _quants(fmt, packed, nb).reshape(groups, GROUP, nb, BLOCK).transpose(1, 2)  # [G, nb, 16 (c), 32 (k)]
    if fmt.bits == 8:
        qs = u.reshape(groups, nb, GROUP, 8, 4).permute(0, 1, 3, 2, 4)  # [G, nb, q, c, j]
    else:
        low = u[..., :16].reshape(groups, nb, GROUP, 4, 4)
        high = u[..., 16:].reshape(groups, nb, GROUP, 4, 4)
        qs = (low | (high << 4)).permute(0, 1, 3, 2, 4)  # [G, nb, q, c, j]

    def scales(t: torch.Tensor) -> torch.Tensor:  # [G, nb, 32 bytes]: column c's fp16 at bytes 2c, 2c + 1
        return t[:, :nb].reshape(groups, GROUP, nb).transpose(1, 2).contiguous().view(torch.uint8)

    parts = [qs.reshape(groups, nb, -1), scales(packed.d)] + ([] if packed.m is None else [scales(packed.m)])
    records = torch.cat(parts, dim=2)  # [G, nb, record bytes]
    quant_bytes = parts[0].shape[2]
    d, m = _record_scales(records, quant_bytes, packed.m is not None)
    return PackedBlocks(records.reshape(groups, -1), d, m, nb, X16)


def _record_scales(
    records: torch.Tensor, quant_bytes: int, has_min: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The scales [G, nb, 16] (and Q4_1 minimums) of X16 records [G, nb, record bytes], as views into them."""
    scale_bytes = 2 * GROUP
    d = records[:, :, quant_bytes : quant_bytes + scale_bytes].view(torch.float16)
    m = records[:, :, quant_bytes + scale_bytes :].view(torch.float16) if has_min else None
    return d, m


def rows_of_x16(fmt: BlockFormat, packed: PackedBlocks, index: torch.Tensor, in_features: int) -> PackedBlocks:
    """Rows `index` of an X16 weight, in the ROWS layout (exact; an embedding lookup's few rows)."""
    nb, nbp = in_features // BLOCK, padded_blocks(in_features)
    groups = packed.qs.shape[0]
    group, lane = index // GROUP, index % GROUP
    quants = packed.qs.view(groups, nb, -1)[:, :, : GROUP * BLOCK * fmt.bits // 8]
    if fmt.bits == 8:
        qs = quants.unflatten(2, (8, GROUP, 4))[group, :, :, lane]  # [n, nb, 8 (q), 4 (j)]
        u = qs.reshape(-1, nb, BLOCK)
    else:
        both = quants.unflatten(2, (4, GROUP, 4))[group, :, :, lane].reshape(-1, nb, 16)
        u = torch.cat([both & 0x0F, both >> 4], dim=2)  # [n, nb, 32]
    n = index.shape[0]
    padded = torch.zeros(n, nbp, BLOCK, dtype=torch.uint8)
    padded[:, :nb] = u
    if fmt.bits == 8:
        qs_rows = padded.reshape(n, -1)
    else:
        qs_rows = (padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(n, -1)

    def scales(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(n, nbp, dtype=t.dtype)
        out[:, :nb] = t[group, :, lane]
        return out

    m = None if packed.m is None else scales(packed.m)
    return PackedBlocks(qs_rows.contiguous(), scales(packed.d), m, nbp, ROWS)
