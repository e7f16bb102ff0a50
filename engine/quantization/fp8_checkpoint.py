"""FP8 checkpoints (config.json `quantization_config: {quant_method: fp8, ...}`), dequantized at load to the model's
dtype, as vLLM and transformers define the format.

Each quantized linear `<prefix>` stores `<prefix>.weight` as float8_e4m3fn [out, in] and one scale tensor:

    block-wise (DeepSeek-V3, Qwen3-FP8; transformers' FineGrainedFP8Config), `weight_block_size: [bn, bk]`:
        <prefix>.weight_scale_inv  float [ceil(out / bn), ceil(in / bk)]
        W[r, c] = fp8[r, c] * weight_scale_inv[r // bn, c // bk]        (the last blocks of a row or column partial)
    per tensor or per channel (vLLM's serialized fp8: AutoFP8, older llm-compressor), no weight_block_size:
        <prefix>.weight_scale      float [] or [1] (one per tensor), [out] or [out, 1] (one per output row)
        W[r, c] = fp8[r, c] * weight_scale[r]

Also possibly `<prefix>.input_scale` (a static activation scale, which an FP8 product would apply to its inputs:
weights served dequantized take the activations as they are, so it is read and dropped) and KV-cache scales
(`k_scale`, `v_scale`, `kv_scale`): vLLM applies them only under an fp8 KV cache and ignores them otherwise; the
fp8 cache here has a fixed scale of 1.0 in every layer (attention/kv_cache.py), so they are dropped, logged.
Matrices left in floats (`modules_to_not_convert` / `ignored_layers`) are stored as such: a tensor's dtype says
whether it is FP8, and the float ones pass through unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch

from engine.quantization.awq import quantization_config

logger = logging.getLogger(__name__)

FP8 = "fp8"
FORMATS = ("e4m3",)
ACTIVATION_SCHEMES = ("dynamic", "static")
BLOCK_SCALE = "weight_scale_inv"
TENSOR_SCALE = "weight_scale"
ACTIVATION_SCALES = ("input_scale",)
KV_SCALES = ("k_scale", "v_scale", "kv_scale")
CHUNK_VALUES = 1 << 24
"""Values dequantized per step: bounds the float32 transient (~64 MB) however large the matrix (DeepSeek-V3's
embedding holds 926M values)."""


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """A supported FP8 checkpoint's layout, read from its quantization_config."""

    block: Optional[tuple[int, int]]  # (output rows, input columns) per scale; None: per tensor or per channel
    activation_scheme: str  # "dynamic" or "static" (static: input_scale tensors stored, not needed here)
    not_converted: tuple[str, ...] = ()  # modules_to_not_convert / ignored_layers, as listed (for the log)

    @property
    def scale_name(self) -> str:
        return BLOCK_SCALE if self.block is not None else TENSOR_SCALE

    def describe(self) -> str:
        layout = "per-tensor/per-channel scales" if self.block is None else f"{self.block[0]}x{self.block[1]} blocks"
        return f"FP8 e4m3, {layout}, {self.activation_scheme} activations"


def fp8_scheme(hf_config: Any) -> Optional[Fp8Scheme]:
    """The checkpoint's FP8 layout (None unless quant_method is fp8); ValueError naming what is not supported."""
    config = quantization_config(hf_config)
    if config is None or str(config.get("quant_method", "")).lower() != FP8:
        return None
    problems = []
    fmt = str(config.get("fmt", "e4m3")).lower()
    if fmt not in FORMATS:
        problems.append(f"fmt {fmt!r} (only e4m3 weights are read)")
    scheme = str(config.get("activation_scheme", "dynamic")).lower()  # (transformers' default)
    if scheme not in ACTIVATION_SCHEMES:
        problems.append(f"activation_scheme {scheme!r} (only {' or '.join(ACTIVATION_SCHEMES)})")
    block = config.get("weight_block_size")
    if block is not None and not (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        problems.append(f"weight_block_size {block!r} (two positive ints: [rows, columns] per scale)")
    if problems:
        raise ValueError(
            "this FP8 checkpoint (config.json quantization_config) is not supported: " + "; ".join(problems)
        )
    skipped = config.get("modules_to_not_convert") or config.get("ignored_layers") or ()
    return Fp8Scheme(None if block is None else (int(block[0]), int(block[1])), scheme, tuple(map(str, skipped)))


def dequantize_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: Optional[tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device,
    chunk_values: int = CHUNK_VALUES,
) -> torch.Tensor:
    """float8_e4m3fn [out, in] and its scale -> [out, in] in `dtype` on `device`: each chunk of rows widened to
    float32 (exact), multiplied by its scales there and rounded once into `dtype`; ValueError for a scale of the
    wrong shape or dtype."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight dtype {weight.dtype} (only float8_e4m3fn)")
    if not scale.is_floating_point():
        raise ValueError(f"scale dtype {scale.dtype} (a float)")
    scale = _scale_rows(weight, scale, block).to(device=device, dtype=torch.float32)
    rows, columns = weight.shape
    out = torch.empty(rows, columns, dtype=dtype, device=device)
    step = max(1, chunk_values // max(columns, 1))
    if block is not None:  # whole block rows per chunk, so each chunk's scale rows start at a block boundary
        step = max(block[0], step // block[0] * block[0])
    for start in range(0, rows, step):
        values = weight[start : start + step].to(device).to(torch.float32)  # [r, in]
        if block is None:
            values.mul_(scale if scale.dim() == 0 else scale[start : start + step])
        else:
            bn = block[0]
            _scale_blocks(values, scale[start // bn : (start + values.shape[0] + bn - 1) // bn], block)
        out[start : start + step] = values
    return out


def _scale_blocks(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> None:
    """values [r, c] *= each one's block scale, scales [ceil(r / bn), ceil(c / bk)], in place: the whole blocks
    through a broadcast view (no scale expanded to every value: that doubled the time), then the partial last
    row of blocks, column of blocks and corner.

        columns:  0 .. full_c (whole bk-wide blocks) | full_c .. c (partial)
        rows:     0 .. full_r (whole bn-high blocks) | full_r .. r (partial)"""
    bn, bk = block
    rows, columns = values.shape
    full_r, full_c = rows // bn, columns // bk  # whole blocks each way
    body = values[: full_r * bn, : full_c * bk].unflatten(1, (full_c, bk)).unflatten(0, (full_r, bn))
    body.mul_(scales[:full_r, :full_c, None].unsqueeze(1))  # [R, bn, C, bk] x [R, 1, C, 1]
    if full_c * bk < columns:
        values[: full_r * bn, full_c * bk :].unflatten(0, (full_r, bn)).mul_(scales[:full_r, full_c, None, None])
    if full_r * bn < rows:
        values[full_r * bn :, : full_c * bk].unflatten(1, (full_c, bk)).mul_(scales[full_r, :full_c, None])
        if full_c * bk < columns:
            values[full_r * bn :, full_c * bk :].mul_(scales[full_r, full_c])


def _scale_rows(weight: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]]) -> torch.Tensor:
    """The scale as [] (per tensor), [out, 1] (per row) or [blocks of rows, blocks of columns]; ValueError
    naming the shape expected."""
    if weight.dim() != 2:
        raise ValueError(f"weight of shape {tuple(weight.shape)} (FP8 matrices are read as [out, in])")
    rows, columns = weight.shape
    if block is not None:
        expected = (-(-rows // block[0]), -(-columns // block[1]))
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"{BLOCK_SCALE} of shape {tuple(scale.shape)} for a weight of shape {(rows, columns)} "
                f"(expected {expected}: one per {block[0]}x{block[1]} block)"
            )
        return scale
    if scale.numel() == 1 and scale.dim() <= 1:
        return scale.reshape(())
    if tuple(scale.shape) in ((rows,), (rows, 1)):
        return scale.reshape(rows, 1)
    raise ValueError(
        f"{TENSOR_SCALE} of shape {tuple(scale.shape)} for a weight of shape {(rows, columns)} "
        f"(expected [] or [1] per tensor, [{rows}] or [{rows}, 1] per channel)"
    )


def fp8_checkpoint_weights(
    weights: Iterable[tuple[str, Any]], hf_config: Any, dtype: torch.dtype, device: torch.device
) -> Iterable[tuple[str, Any]]:
    """`weights` unchanged for a checkpoint that is not FP8, else `fp8_weights` of them."""
    scheme = fp8_scheme(hf_config)
    return weights if scheme is None else fp8_weights(weights, scheme, dtype, device)


def fp8_weights(
    weights: Iterable[tuple[str, Any]], scheme: Fp8Scheme, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with each FP8 `<prefix>.weight` and its scale turned into `<prefix>.weight` in
    `dtype` (`dequantize_fp8`), activation and KV-cache scales dropped, everything else as stored; ValueError
    naming the tensor for an FP8 weight without its scale, a scale without an FP8 weight, a scale of the other
    layout's name or of the wrong shape, or an FP8 tensor in another format. What was read is logged at the end."""
    pending_weights: dict[str, torch.Tensor] = {}
    pending_scales: dict[str, torch.Tensor] = {}
    float_weights: set[str] = set()  # prefixes whose float weight has passed (a scale arriving later is refused)
    counts = {"matrices": 0, "fp8_bytes": 0, "served_bytes": 0, "activation": 0, "kv": 0}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part in ACTIVATION_SCALES or part in KV_SCALES:
            counts["activation" if part in ACTIVATION_SCALES else "kv"] += 1
            continue
        if part in (BLOCK_SCALE, TENSOR_SCALE):
            if part != scheme.scale_name:
                raise ValueError(f"{name}: a checkpoint of {scheme.describe()} stores {scheme.scale_name}, not {part}")
            if prefix in float_weights:
                raise ValueError(f"{name}: {prefix}.weight is stored in floats, not FP8")
            weight = pending_weights.pop(prefix, None)
            if weight is None:
                pending_scales[prefix] = tensor
                continue
            yield _dequantized(prefix, weight, tensor, scheme, dtype, device, counts)
            continue
        if isinstance(tensor, torch.Tensor) and tensor.dtype in _FLOAT8_DTYPES:
            if part != "weight" or tensor.dtype != torch.float8_e4m3fn:
                raise ValueError(
                    f"{name}: {tensor.dtype} tensor (FP8 checkpoints are read for float8_e4m3fn <module>.weight only)"
                )
            scale = pending_scales.pop(prefix, None)
            if scale is None:
                pending_weights[prefix] = tensor
                continue
            yield _dequantized(prefix, tensor, scale, scheme, dtype, device, counts)
            continue
        if part == "weight":
            float_weights.add(prefix)
        yield name, tensor
    if pending_weights:
        prefix = next(iter(pending_weights))
        raise ValueError(f"FP8 checkpoint has {prefix}.weight in float8_e4m3fn but no {prefix}.{scheme.scale_name}")
    if pending_scales:
        prefix = next(iter(pending_scales))
        raise ValueError(f"FP8 checkpoint has {prefix}.{scheme.scale_name} but no float8_e4m3fn {prefix}.weight")
    _log_read(scheme, dtype, counts)


_FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _dequantized(
    prefix: str,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scheme: Fp8Scheme,
    dtype: torch.dtype,
    device: torch.device,
    counts: dict[str, int],
) -> tuple[str, torch.Tensor]:
    try:
        matrix = dequantize_fp8(weight, scale, scheme.block, dtype, device)
    except ValueError as error:
        raise ValueError(f"{prefix}: {error}") from None
    counts["matrices"] += 1
    counts["fp8_bytes"] += weight.numel()
    counts["served_bytes"] += matrix.numel() * matrix.element_size()
    return f"{prefix}.weight", matrix


def _log_read(scheme: Fp8Scheme, dtype: torch.dtype, counts: dict[str, int]) -> None:
    logger.info(
        "FP8 checkpoint (%s): %d matrices dequantized to %s at load, %.1f MB stored as FP8 now %.1f MB (%.0fx)%s",
        scheme.describe(),
        counts["matrices"],
        str(dtype).removeprefix("torch."),
        counts["fp8_bytes"] / 1e6,
        counts["served_bytes"] / 1e6,
        counts["served_bytes"] / max(counts["fp8_bytes"], 1),
        f"; kept in floats as stored: {', '.join(scheme.not_converted)}" if scheme.not_converted else "",
    )
    if counts["activation"]:
        logger.info(
            "FP8 checkpoint: %d static activation scales (input_scale) not needed: the weights are served "
            "dequantized and the activations stay in the model's dtype",
            counts["activation"],
        )
    if counts["kv"]:
        logger.info(
            "FP8 checkpoint: %d KV-cache scales (k_scale/v_scale/kv_scale) not read: vLLM applies them only under "
            "an fp8 KV cache; here an fp8 cache (--kv-cache-dtype fp8) stores K/V with a scale of 1.0 in every layer",
            counts["kv"],
        )
