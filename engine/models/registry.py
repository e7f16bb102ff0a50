"""Which implementation serves which HF architecture."""

from __future__ import annotations

from typing import Any, Optional

import torch

from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_arch import LlamaArch
from engine.models.moe import moe_model
from engine.models.moe_arch import MOE_ARCHITECTURES
from engine.quantization.weight_quantizer import WeightQuantizer

_LLAMA_FAMILY = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def supported_architectures() -> list[str]:
    return sorted({**_LLAMA_FAMILY, **MOE_ARCHITECTURES})


def build_model(hf_config: Any, dtype: torch.dtype, device: torch.device,
                ops: Optional[TorchLayerOps] = None, linear: Optional[Linear] = None,
                quantizer: Optional[WeightQuantizer] = None) -> LlamaForCausalLM:
    """An empty model for the config's architecture (load weights with `load_weights`)."""
    from engine.loading.loader import rope_settings

    architectures = list(getattr(hf_config, "architectures", None) or [])
    known = {**_LLAMA_FAMILY, **MOE_ARCHITECTURES}
    if not any(a in known for a in architectures) and hf_config.model_type not in known.values():
        raise ValueError(
            f"architecture {architectures or hf_config.model_type} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
        )
    arch = LlamaArch.from_hf_config(hf_config, rope_settings(hf_config))
    moe = moe_model(hf_config, arch, dtype, device, ops, linear, quantizer)  # Mixtral, Qwen2-MoE, Qwen3-MoE
    return moe if moe is not None else LlamaForCausalLM(arch, dtype, device, ops, linear, quantizer)
