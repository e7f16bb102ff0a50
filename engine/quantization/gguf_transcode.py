"""GGUF block types the kernels do not read, carried at load into the nearest format they do.

Most GGUF files on the hub use k-quants (Q4_K_M: Q4_K matrices with some Q6_K ones). The kernels of
csrc/quant_gemm.cpp multiply 32-element blocks (Q4_0, Q4_1, Q8_0), so each other type is converted once,
at load, and stays quantized:

    Q4_K   super-blocks of 256 = 8 sub-blocks of 32, each with a 6-bit scale sc and min mn under the
           super-block's fp16 d and dmin: w = (d sc) u - (dmin mn), u in 0..15. Its 4-bit quants are
           already in Q4_1's pair layout (a 64-element chunk's 32 bytes hold sub-block 2j in the low
           nibbles, 2j + 1 in the high ones), so they are kept as they are and each sub-block becomes a
           Q4_1 block with d = fp16(d sc), m = fp16(-dmin mn): the quants exact, the two scales rounded to
           fp16 (a relative error of at most 2^-11 on a block's step and offset; 5.0 bits a weight
           against Q4_K's 4.5).
    other  (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K, IQ*) dequantized by gguf-py and requantized to Q8_0
           (8.5 bits a weight; an 8-bit step adds ~1/16 of the noise a 6-bit source already has).

Float types (F32, F16, BF16) are not touched: they load as float tensors. Blocks whose steps do not fit
in fp16 (the kernels' scale type) are not carried (`transcode` returns None: the loader keeps floats).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from engine.quantization.gguf_formats import BLOCK, FORMATS, BlockFormat, PackedBlocks, padded_blocks, repack

SUPER_BLOCK = 256
Q4_K_BYTES = 144  # d fp16 | dmin fp16 | 12 bytes of packed 6-bit scales and mins | 128 bytes of quants


def transcode(type_name: str, raw: np.ndarray, in_features: int) -> Optional[tuple[BlockFormat, PackedBlocks]]:
    """raw uint8 [N, row bytes] of GGUF type `type_name` (e.g. "Q4_K") -> a kernel format and its blocks, or
    None where a block's step or offset is beyond fp16's range."""
    if type_name == "Q4_K":
        fmt, packed = FORMATS["q4_1"], _q4_k_as_q4_1(raw, in_features)
    else:
        fmt, packed = FORMATS["q8_0"], _as_q8_0(type_name, raw, in_features)
    scales = [packed.d] if packed.m is None else [packed.d, packed.m]
    return (fmt, packed) if all(torch.isfinite(t).all() for t in scales) else None


def _q4_k_as_q4_1(raw: np.ndarray, in_features: int) -> PackedBlocks:
    from gguf.quants import Q4_K

    if in_features % SUPER_BLOCK:
        raise ValueError(f"Q4_K rows have a multiple of {SUPER_BLOCK} elements, got {in_features}")
    rows, supers = raw.shape[0], in_features // SUPER_BLOCK
    blocks = np.ascontiguousarray(raw).reshape(rows * supers, Q4_K_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [rows * supers, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    scales, mins = Q4_K.get_scale_min(blocks[:, 4:16])  # [rows * supers, 8] each, 0..63
    nb = in_features // BLOCK  # even: 8 per super-block, so no padding block
    with np.errstate(over="ignore"):  # an overflow shows as inf, which `transcode` looks for
        step = (d * scales.astype(np.float32)).astype(np.float16).reshape(rows, nb)
        offset = (-dmin * mins.astype(np.float32)).astype(np.float16).reshape(rows, nb)
    qs = np.ascontiguousarray(blocks[:, 16:]).reshape(rows, nb // 2 * BLOCK)  # pairs of sub-blocks, as stored
    return PackedBlocks(qs=torch.from_numpy(qs), d=torch.from_numpy(step), m=torch.from_numpy(offset), nbp=nb)


def _as_q8_0(type_name: str, raw: np.ndarray, in_features: int) -> PackedBlocks:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    padded_blocks(in_features)  # a multiple of 32, or a clear error
    qtype = GGMLQuantizationType[type_name]
    values = dequantize(np.ascontiguousarray(raw), qtype).reshape(raw.shape[0], in_features).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # as above
        return repack(FORMATS["q8_0"], quantize(values, GGMLQuantizationType.Q8_0), in_features)
