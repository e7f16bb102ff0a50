"""Which projections are quantized at load time, and how (`--quantization`, `--quantization-group-size`).

    int8   float checkpoint, each projection to int8 per output channel (`Int8Weight`)
    int4   float checkpoint, each projection to group-wise int4 (`Int4Weight`)
    awq    AWQ int4 checkpoint (auto-detected from config.json), read into the int4 path as stored
    gptq   GPTQ checkpoint (auto-detected; vLLM's `gptq_marlin` is the same): 4-bit groups of 32/64/128 in
           input order read into the int4 path as stored, every other served layout dequantized at load (gptq.py)

An MXFP4 checkpoint (GPT-OSS's experts, auto-detected) has no load-time quantizer: its blocks are dequantized to
the model's dtype as they are read (mxfp4.py), and int8/int4/awq/gptq are refused on it.
An FP8 checkpoint's matrices are dequantized likewise (fp8_checkpoint.py); int8/int4 then quantize those floats.

Quantized: the matrices of every decoder layer (q|k|v, o, gate|up, down), which are nearly all of a
step's weight reads in a model of some size. Kept in the model's dtype: the norms (a few KiB), the
embedding table (a lookup reads one row per token, not the table) and the LM head (by default:
the vocabulary projection is where a rounding error shows directly in the logits, and for a tied
model such as SmolLM2 it is the embedding table itself; `quantize_lm_head` turns it on, and the
perplexity script measures both).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Optional, Union

import torch

from engine.errors import SettingsConflictError
from engine.quantization.awq import awq_group_size, quantization_config
from engine.quantization.fp8_checkpoint import FP8, fp8_scheme
from engine.quantization.gptq import GPTQ, GptqConfig
from engine.quantization.int4_groups import DEFAULT_INT4_GROUP_SIZE, Int4Groups
from engine.quantization.int4_weight import Int4Weight, int4_weight
from engine.quantization.int8_weight import Int8KernelCheck, Int8Weight
from engine.quantization.mxfp4 import MXFP4
from engine.quantization.quantized_weight import QuantizedWeight

logger = logging.getLogger(__name__)

Weight = Union[torch.Tensor, QuantizedWeight]
PRE_QUANTIZED = ("awq", GPTQ, MXFP4, FP8)


@dataclass(frozen=True, slots=True)
class WeightQuantizer:
    """Turns a loaded projection into the form it is served in (the model calls it once per matrix)."""

    method: str  # "int8", "int4", "awq", "gptq"
    group_size: Optional[int]  # input columns per int4 group (int4, awq, gptq kept in groups); None: none (int8)
    device: torch.device
    quantize_lm_head: bool = False
    int8_kernel: Int8KernelCheck = field(default_factory=Int8KernelCheck, compare=False, repr=False)
    """Whether torch's int8 kernel serves this model's products: probed once, shared by its int8 matrices."""

    def __call__(self, weight: Union[torch.Tensor, Int4Groups, QuantizedWeight]) -> Weight:
        if isinstance(weight, QuantizedWeight):  # quantized already (a tensor-parallel shard cut from a whole one)
            return weight
        if isinstance(weight, Int4Groups):  # pre-quantized (AWQ, GPTQ)
            return Int4Weight(weight, self.device)
        if self.method == "int8":
            return Int8Weight.quantize(weight, self.int8_kernel).to(self.device)
        if self.method == "int4":
            assert self.group_size is not None  # resolve_group_size gives int4 one
            return int4_weight(weight, self.group_size, self.device)
        return weight

    def lm_head(self, weight: torch.Tensor) -> Weight:
        return self(weight) if self.quantize_lm_head and self.method in ("int8", "int4") else weight


LOAD_TIME_METHODS = ("int8", "int4", "awq", GPTQ)
"""The `--quantization` values this module applies while loading (gguf keeps a file's own blocks:
model_weights.py)."""


def resolve_quantization(requested: Optional[str], hf_config: Any) -> tuple[Optional[str], Optional[int]]:
    """(method, the checkpoint's int4 group size or None) for `--quantization` and a checkpoint's config.json.

    None (auto) with an AWQ checkpoint is AWQ; `awq` needs one; int8/int4 need a float checkpoint; any other
    value (none, gguf: not applied at load) is (None, None) on a float checkpoint and refused on an AWQ one.
    An MXFP4 checkpoint is (None, None) under auto or none: the model dequantizes it as it loads. So is an FP8 one
    (fp8_checkpoint.py), whose dequantized floats int8/int4 may then quantize; awq and gguf are refused on it. GPTQ is as AWQ,
    its group size None where its matrices are dequantized at load (gptq.py)."""
    config = quantization_config(hf_config)
    method = None if config is None else str(config.get("quant_method", "unknown")).lower()
    if method is not None and method not in PRE_QUANTIZED:
        raise ValueError(
            f"the checkpoint is quantized with {method!r} (config.json quantization_config), "
            f"which is not supported; supported pre-quantized formats: {', '.join(PRE_QUANTIZED)}"
        )
    if method == MXFP4:
        if requested in LOAD_TIME_METHODS:
            raise SettingsConflictError(
                f"--quantization {requested}: the checkpoint is MXFP4, whose experts are dequantized to the "
                "model's dtype at load; leave --quantization unset (or none)"
            )
        logger.info("MXFP4 checkpoint (config.json quantization_config): its experts are dequantized at load")
        return None, None
    if method == FP8:
        return _resolve_fp8(requested, hf_config)
    if requested == "awq" or (requested is None and method == "awq"):
        if method != "awq":
            raise SettingsConflictError(
                "--quantization awq needs an AWQ checkpoint (config.json quantization_config with "
                "quant_method 'awq'); for a float checkpoint use --quantization int8 or int4"
            )
        assert config is not None  # method "awq" was read from it
        return "awq", awq_group_size(config)
    if method == "awq":
        raise SettingsConflictError(
            f"--quantization {requested}: the checkpoint is already AWQ int4; leave --quantization unset (or awq)"
        )
    if requested == GPTQ or (requested is None and method == GPTQ):
        if method != GPTQ:
            raise SettingsConflictError(
                "--quantization gptq needs a GPTQ checkpoint (config.json quantization_config with quant_method "
                "'gptq'); for a float checkpoint use --quantization int8 or int4"
            )
        assert config is not None  # method "gptq" was read from it
        gptq = GptqConfig.from_config(config)
        logger.info("%s", gptq.describe())
        return GPTQ, gptq.int4_group_size
    if method == GPTQ:
        raise SettingsConflictError(
            f"--quantization {requested}: the checkpoint is already GPTQ; leave --quantization unset (or gptq)"
        )
    return (requested, None) if requested in LOAD_TIME_METHODS else (None, None)


def _resolve_fp8(requested: Optional[str], hf_config: Any) -> tuple[Optional[str], Optional[int]]:
    """An FP8 checkpoint's weights are dequantized to the model's dtype as they load: int8/int4 quantize those
    floats; awq and gguf name storages it does not have."""
    scheme = fp8_scheme(hf_config)  # (ValueError for a variant not read)
    assert scheme is not None  # quant_method fp8
    if requested in ("awq", GPTQ, "gguf"):
        raise SettingsConflictError(
            f"--quantization {requested}: the checkpoint is FP8 ({scheme.describe()}), read by dequantizing it to "
            "the model's dtype at load; leave --quantization unset (or none), or give int8 or int4 to quantize "
            "the dequantized weights"
        )
    if requested in ("int8", "int4"):
        logger.info("FP8 checkpoint (%s): dequantized at load, then quantized to %s", scheme.describe(), requested)
        return requested, None
    logger.info("FP8 checkpoint (%s): its matrices are dequantized to the model's dtype at load", scheme.describe())
    return None, None


_NO_GROUPS = MappingProxyType(
    {
        "none": "it loads float weights",
        "gguf": "a .gguf file's blocks keep their own size",
        "int8": "int8 has one scale per output row",
    }
)


def resolve_group_size(
    requested: Optional[str], method: Optional[str], group_size: Optional[int], checkpoint_group_size: Optional[int]
) -> Optional[int]:
    """The int4 group size for `--quantization-group-size` (None: unset) under the resolved method.

    int4: the flag's value, else DEFAULT_INT4_GROUP_SIZE. awq, gptq: the checkpoint's own (None for GPTQ
    dequantized at load); a flag that differs is refused. Anything else (int8, none, gguf, auto on a float checkpoint) has no groups: None, and a flag
    value is refused rather than ignored. `requested` is `--quantization` (None: auto), for the messages."""
    flag = f"--quantization {requested or 'auto'}"
    if method in ("awq", GPTQ):
        if group_size is not None and group_size != checkpoint_group_size:
            if checkpoint_group_size is None:
                raise SettingsConflictError(
                    f"--quantization-group-size {group_size} does not apply to {flag}: this GPTQ checkpoint's "
                    "matrices are dequantized at load (no int4 groups); leave --quantization-group-size unset"
                )
            raise SettingsConflictError(
                f"--quantization-group-size {group_size} differs from the {method.upper()} checkpoint's group size "
                f"{checkpoint_group_size} (config.json quantization_config), which {flag} serves as "
                f"stored; leave --quantization-group-size unset or give {checkpoint_group_size}"
            )
        return checkpoint_group_size
    if method == "int4":
        return DEFAULT_INT4_GROUP_SIZE if group_size is None else group_size
    if group_size is not None:
        reason = _NO_GROUPS.get(requested or "", "no weights are quantized to int4 at load for this checkpoint")
        raise SettingsConflictError(
            f"--quantization-group-size {group_size} does not apply to {flag} ({reason}); it sets "
            "--quantization int4's groups: leave it unset, or add --quantization int4"
        )
    return None
