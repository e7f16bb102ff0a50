"""`--quantization`: which storage a model's weights load into (the one place the flag is resolved).

    none   float tensors in the model's dtype (a GGUF dequantized once by gguf_converter.py)
    gguf   a GGUF file's Q4_0/Q4_1/Q8_0 matrices kept in their blocks, multiplied by the native CPU
           kernels (csrc/quant_gemm.cpp); its float tensors (norms, F32/F16 matrices) load as floats
    auto   `gguf` for GGUF checkpoints on CPU in bfloat16 when GGUF_BY_DEFAULT, else `none`

Which layers stay in high precision with `gguf`: none is re-quantized; the norms stay as the GGUF has
them (F32); the token embedding keeps its GGUF format too (Q8_0 in the embedded model: the looked-up rows
are dequantized per step) and, tied, is the LM head through the same integer kernels.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

from engine.errors import SettingsConflictError
from engine.quantization.quantized_weight import QuantizedWeight

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "gguf")
GGUF_BY_DEFAULT = False
"""Whether `auto` keeps a GGUF's blocks quantized on CPU in bfloat16 (float32 stays `none`: exact float
products are what its tests compare with HF). Off for now: in bf16 decode steps are faster and perplexity
is equal (measured in docs/performance.md and docs/quantization.md), but greedy answers
change where the float path's top two tokens are close (the embedded model's "What is the capital of
France?" chat starts with "L'" instead of "The", 0.08 apart in float32), which the end-to-end test of the
default server pins; the lead decides after measuring on a quiet machine."""

WeightItem = tuple[str, Union[torch.Tensor, QuantizedWeight]]


def resolve_gguf_storage(
    requested: str, gguf_file: Optional[Path], device: torch.device, dtype: torch.dtype, batch_invariant: bool = False
) -> str:
    """The storage to load with: `none` or `gguf`. SettingsConflictError, naming the reason, when `gguf` cannot
    be: a setting that cannot run with this model, device, dtype or --batch-invariant (exit 2, as a bad flag)."""
    if requested not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {requested!r}; expected one of {', '.join(QUANTIZATIONS)}")
    if requested == "none":
        return "none"
    problem = _gguf_problem(gguf_file, device, dtype, batch_invariant)
    if requested == "gguf":
        if problem:
            raise SettingsConflictError(f"--quantization gguf is unavailable: {problem}")
        return "gguf"
    return "gguf" if GGUF_BY_DEFAULT and problem is None and dtype == torch.bfloat16 else "none"


def _gguf_problem(
    gguf_file: Optional[Path], device: torch.device, dtype: torch.dtype, batch_invariant: bool
) -> Optional[str]:
    if gguf_file is None:
        return "the model is not a .gguf file"
    if device.type != "cpu":
        return f"its kernels run on CPU only (the model is on {device.type})"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"its kernels take float32 or bfloat16 activations, not {str(dtype).removeprefix('torch.')}"
    if batch_invariant:
        return "its products are not batch-invariant (--batch-invariant)"
    return None


def model_weights(
    quantization: str, checkpoint_dir: Path, gguf_file: Optional[Path], num_heads: int, num_kv_heads: int
) -> Iterator[WeightItem]:
    """(HF name, tensor or quantized weight) for every weight, in the storage `quantization` names."""
    from engine.loading.loader import iter_weights

    if quantization == "none":
        return iter_weights(checkpoint_dir)
    from engine.kernels.quant import load_quant_kernels
    from engine.loading.gguf_weights import iter_gguf_weights

    assert gguf_file is not None  # resolve_gguf_storage gives "gguf" only for a .gguf model
    return iter_gguf_weights(gguf_file, load_quant_kernels(), num_heads, num_kv_heads)


def fuse_rows(weights, dtype: torch.dtype) -> Union[torch.Tensor, QuantizedWeight]:
    """[w0; w1; ...] along the output rows (q|k|v, gate|up): one quantized weight where they share a format,
    else (a GGUF mixing formats, or quantized with float) a float tensor in `dtype`, logged."""
    if all(isinstance(w, QuantizedWeight) for w in weights):
        try:
            return type(weights[0]).concat_rows(weights)
        except (ValueError, NotImplementedError) as error:
            reason = str(error)
    else:
        reason = "quantized and float matrices"
    logger.info(
        "fusing %s as %s floats: %s",
        " | ".join(getattr(w, "format", "float") for w in weights),
        str(dtype).removeprefix("torch."),
        reason,
    )
    rows = [w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w.to(dtype) for w in weights]
    return torch.cat(rows).contiguous()
