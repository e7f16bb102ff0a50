"""MXFP4 tensors (OpenAI's GPT-OSS checkpoints), dequantized at load to the model's dtype.

A quantized tensor `<name>` is stored as two, its rows cut into blocks of 32 values along the reduced dimension:

    <name>_blocks  uint8 [..., rows, G, 16]   FP4 e2m1 codes, two per byte: value 2j in the low nibble, 2j+1 high
    <name>_scales  uint8 [..., rows, G]       one E8M0 exponent per block (bias 127): the block's scale 2^(s - 127)

    value[..., r, 32g + j] = E2M1[code j of blocks[..., r, g, :]] * 2^(scales[..., r, g] - 127)

and config.json says `quantization_config: {quant_method: mxfp4, ...}`. Decoded, a tensor is [..., rows, 32 G];
transformers (integrations/mxfp4.py, `convert_moe_packed_tensors`) hands GPT-OSS's experts its transpose,
[..., 32 G, rows]: `gate_up_proj` [E, H, 2I] from blocks [E, 2I, H / 32, 16], `down_proj` [E, I, H] from
[E, H, I / 32, 16]. The biases stay float.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from engine.quantization.awq import quantization_config

MXFP4 = "mxfp4"
BLOCK_VALUES = 32  # values sharing one scale
BLOCK_BYTES = BLOCK_VALUES // 2
E8M0_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 FP4 e2m1 codes: sign bit 3, exponent bits 2-1, mantissa bit 0."""
SUFFIXES = ("_blocks", "_scales")
CHUNK_VALUES = 1 << 24
"""Values decoded per step: bounds the transient buffers (float32 values, int32 indices) however
large the tensor (a 120B layer's gate_up_proj holds 2.1G values): ~7 bytes per value, ~120 MB."""


def is_mxfp4_checkpoint(hf_config: Any) -> bool:
    """Whether config.json's quantization_config names MXFP4."""
    config = quantization_config(hf_config)
    return config is not None and str(config.get("quant_method", "")).lower() == MXFP4


def dequantize_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    chunk_values: int = CHUNK_VALUES,
) -> torch.Tensor:
    """[..., rows, G, 16] codes and [..., rows, G] exponents -> [..., 32 G, rows] in `dtype` on `device`.

    The result is transformers' layout as a transposed view of the decoded [..., rows, 32 G] (a consumer that
    wants the rows, as the house's experts do, transposes back without a copy). Each chunk of rows is decoded
    in float32, where every e2m1 value times a power of two is exact, and rounded once into `dtype` (what
    transformers' `ldexp` into its output does)."""
    _check_pair(blocks, scales)
    *lead, rows, groups, _ = blocks.shape
    width = groups * BLOCK_VALUES
    out = torch.empty(*lead, rows, width, dtype=dtype, device=device)
    flat_out = out.view(-1, width)  # [all rows, 32 G]
    flat_blocks = blocks.reshape(-1, groups * BLOCK_BYTES)
    flat_scales = scales.reshape(-1, groups)
    table = _byte_table(device)
    step = max(1, chunk_values // width)
    for start in range(0, flat_out.shape[0], step):
        codes = flat_blocks[start : start + step].to(device)  # [r, 16 G] uint8
        values = table[codes.to(torch.int32)].view(-1, groups, BLOCK_VALUES)  # [r, G, 32]
        exponents = flat_scales[start : start + step].to(device).to(torch.int32) - E8M0_BIAS  # [r, G]
        torch.ldexp(values, exponents.unsqueeze(-1), out=values)
        flat_out[start : start + step] = values.view(-1, width)
    return out.transpose(-1, -2)


def _byte_table(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: byte b's two values, low nibble first (byte j of a block holds values 2j and 2j+1), so one
    lookup per byte decodes both."""
    nibbles = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack((nibbles[byte & 0x0F], nibbles[byte >> 4]), dim=-1)


def mxfp4_weights(
    weights: Iterable[tuple[str, Any]], targets: tuple[str, ...], dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with each `<name>_blocks`/`<name>_scales` pair turned into `<name>` dequantized
    (`dequantize_mxfp4`); ValueError for a pair whose `<name>` does not end in one of `targets` (the tensors the
    model reads in transformers' transposed layout), a part without its partner, or parts that do not agree."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        if not base.endswith(targets):
            raise ValueError(
                f"{name}: MXFP4 tensors are read for {', '.join(t + '_blocks/_scales' for t in targets)} only"
            )
        parts = pending.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) == len(SUFFIXES):
            del pending[base]
            try:
                yield base, dequantize_mxfp4(parts["_blocks"], parts["_scales"], dtype, device)
            except ValueError as error:
                raise ValueError(f"{base}: {error}") from None
    if pending:
        base, parts = next(iter(pending.items()))
        (have,) = parts
        (missing,) = set(SUFFIXES) - {have}
        raise ValueError(f"MXFP4 checkpoint has {base}{have} but no {base}{missing}")


def _check_pair(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    problems = []
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        problems.append(f"dtypes {blocks.dtype} and {scales.dtype} (both must be uint8)")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK_BYTES:
        problems.append(f"blocks of shape {tuple(blocks.shape)} (expected [..., rows, G, {BLOCK_BYTES}])")
    elif tuple(scales.shape) != tuple(blocks.shape[:-1]):
        problems.append(f"scales of shape {tuple(scales.shape)} (expected {tuple(blocks.shape[:-1])}, one per block)")
    if problems:
        raise ValueError("malformed MXFP4 tensors: " + "; ".join(problems))
