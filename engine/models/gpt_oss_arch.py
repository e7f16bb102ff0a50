"""GPT-OSS's shape read from its HF config: the Llama layer's (q/k/v/o biases, YaRN), its mixture of experts and
each layer's attention (sliding or full by `layer_types`, with attention sinks), refusing what is not served."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import torch

from engine.attention.layer_attention import LayerAttention
from engine.layers.rotary import check_rope_scaling
from engine.loading.rope_settings import rope_settings
from engine.models.llama_arch import LlamaArch
from engine.models.moe_arch import MoeArch
from engine.models.tensor_parallel import shard_arch, shard_moe
from engine.quantization.awq import quantization_config
from engine.quantization.mxfp4 import is_mxfp4_checkpoint

LAYER_TYPES = ("sliding_attention", "full_attention")


class GptOssArch(NamedTuple):
    llama: LlamaArch  # its `sliding_window` None: windows are per layer, in `layer_attention`
    moe: MoeArch
    layer_attention: tuple[LayerAttention, ...]  # one per layer; its sinks zeros until the weights load
    mxfp4: bool = False  # config.json's quantization_config says MXFP4: the experts' blocks are dequantized at load


def gpt_oss_arch(config: Any) -> GptOssArch:
    """GPT-OSS's shape and whether its experts are MXFP4; ValueError naming an unsupported field."""
    _refuse_unsupported(config)
    theta, scaling = rope_settings(config)
    check_rope_scaling(scaling)
    llama = dataclasses.replace(LlamaArch.from_hf_config(config, (theta, scaling)), sliding_window=None)
    layers = config.num_hidden_layers
    moe = MoeArch(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        expert_intermediate_size=config.intermediate_size,
        renormalize=False,  # the softmax over the top-k logits already sums to 1
        weights_in_model_dtype=True,  # HF's softmax runs in the logits' dtype
        shared_intermediate_size=None,
        sparse_layers=tuple(range(layers)),
        prefix="mlp.",
        expert_names=("gate_up_proj", "gate_up_proj", "down_proj"),  # stacked: [E, H, 2I] and [E, I, H]
        softmax_after_top_k=True,
        swiglu_alpha=float(config.swiglu_alpha),
        swiglu_limit=float(config.swiglu_limit),
    )
    scale = llama.head_dim**-0.5
    # every layer has sinks: zeros until the checkpoint's replace them at load, so the backend's check at
    # start-up (before the weights) already sees the feature
    attention = tuple(
        LayerAttention(
            scale,
            sliding_window=config.sliding_window if kind == "sliding_attention" else None,
            sinks=torch.zeros(llama.num_heads),
        )
        for kind in config.layer_types
    )
    return GptOssArch(llama, moe, attention, is_mxfp4_checkpoint(config))


def shard_gpt_oss_arch(
    arch: GptOssArch, world_size: int, expert_unit: int = 1, held: Optional[range] = None
) -> GptOssArch:
    """One tensor-parallel rank's shape: its heads (and their sinks, zeros until the weights load), each expert's
    share of the width, padded to whole `expert_unit`s (32 for MXFP4 blocks: engine/models/expert_padding.py),
    or its `held` experts whole (expert parallelism); the windows as the whole model's."""
    llama = shard_arch(arch.llama, world_size, arch.moe)
    attention = tuple(dataclasses.replace(a, sinks=torch.zeros(llama.num_heads)) for a in arch.layer_attention)
    moe = shard_moe(arch.moe, world_size, expert_unit, held)
    return arch._replace(llama=llama, moe=moe, layer_attention=attention)


def _refuse_unsupported(config: Any) -> None:
    quantization = quantization_config(config)
    method = None if quantization is None else quantization.get("quant_method")
    if method is not None and not is_mxfp4_checkpoint(config):
        raise ValueError(
            f"GptOssForCausalLM: {str(method).upper()} checkpoints (quantization_config quant_method "
            f"{method!r}) are not supported; supported: float checkpoints and MXFP4 (dequantized at load)"
        )
    layer_types = list(getattr(config, "layer_types", None) or [])
    if len(layer_types) != config.num_hidden_layers:
        raise ValueError(f"GptOssForCausalLM: layer_types must name each of the {config.num_hidden_layers} layers")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"GptOssForCausalLM: layer types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})"
        )
    if not 0 < config.num_experts_per_tok <= config.num_local_experts:
        raise ValueError(
            f"num_experts_per_tok {config.num_experts_per_tok} must be between 1 and the "
            f"{config.num_local_experts} experts"
        )
