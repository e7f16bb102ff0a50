"""Which implementation serves which HF architecture, and what each one supports (docs/models.md is
generated from this table by `python -m engine.models.table`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import logging
from typing import Any, Optional

import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.errors import SettingsConflictError
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.gated_delta_net import DeltaNetShape
from engine.layers.recurrent_state import MambaShape
from engine.layers.linear import Linear
from engine.models.decoder_arch import DecoderArch
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_arch import LlamaArch
from engine.models.moe import MoeForCausalLM
from engine.models.moe_arch import MoeArch
from engine.models.expert_padding import expert_unit, padding_notes
from engine.models.expert_parallel import describe_placement, held_experts
from engine.models.tensor_parallel import check_shardable, shard_arch, shard_moe
from engine.models.tensor_parallel import shard_deepseek
from engine.quantization.mxfp4 import MXFP4, is_mxfp4_checkpoint
from engine.quantization.weight_quantizer import WeightQuantizer

logger = logging.getLogger(__name__)

HF_FORMATS = ("safetensors", "bin")
LLAMA_FORMATS = (*HF_FORMATS, "gguf")


@dataclass(frozen=True, slots=True)
class ModelFamily:
    architecture: str  # the HF `architectures` entry
    model_types: tuple[str, ...]  # config `model_type`s it is also recognised by
    # "llama" (LlamaForCausalLM, the fused CPU decode step), "decoder" (DecoderForCausalLM), "moe"
    # (MoeForCausalLM: the Llama decoder with mixture-of-experts MLPs), "gpt_oss" (GptOssForCausalLM),
    # "deepseek" (DeepseekForCausalLM: multi-head latent attention and DeepSeek's mixture of experts), "glm4_moe"
    # (Glm4MoeForCausalLM: the Llama decoder, partial rotary, DeepSeek-V3's experts) or "decoder_moe"
    # (DecoderMoeForCausalLM: the generic decoder with mixture-of-experts MLPs)
    implementation: str
    # checkpoint formats: safetensors, bin (torch pickles), gguf (dequantized on load, or kept in its blocks with
    # --quantization gguf; the mixtures of experts from llama.cpp's stacked expert tensors), mxfp4 (safetensors
    # whose quantization_config says MXFP4, dequantized on load)
    formats: tuple[str, ...]
    features: tuple[str, ...]  # what of it is implemented, in words (the docs table's last column)


FAMILIES = (
    ModelFamily(
        "LlamaForCausalLM",
        ("llama",),
        "llama",
        LLAMA_FORMATS,
        ("RoPE default/linear/llama3/YaRN/LongRoPE", "GQA", "tied or untied LM head", "fused CPU decode step"),
    ),
    ModelFamily(
        "MistralForCausalLM",
        ("mistral",),
        "llama",
        LLAMA_FORMATS,
        ("as Llama", "sliding window (blocks behind it freed)"),
    ),
    ModelFamily(
        "Qwen2ForCausalLM",
        # (and Qwen2-VL's and Qwen2.5-VL's language models: Qwen2 with multimodal RoPE, LlamaArch.mrope_section)
        ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text"),
        "llama",
        LLAMA_FORMATS,
        ("as Llama", "q/k/v bias"),
    ),
    ModelFamily("Qwen3ForCausalLM", ("qwen3",), "llama", LLAMA_FORMATS, ("as Llama", "per-head q/k RMSNorm")),
    ModelFamily(
        "Gemma2ForCausalLM",
        ("gemma2",),
        "decoder",
        HF_FORMATS,
        (
            "sliding-window layers (their blocks behind the window freed)",
            "attention and final-logit soft-capping",
            "query_pre_attn_scalar",
            "pre/post norms (1 + w)",
            "GeGLU (tanh)",
            "embeddings x sqrt(hidden)",
        ),
    ),
    ModelFamily(
        "Gemma3ForCausalLM",
        ("gemma3_text",),
        "decoder",
        HF_FORMATS,
        ("as Gemma 2", "layer_types", "local/global RoPE bases", "per-head q/k norms"),
    ),
    ModelFamily(
        "Phi3ForCausalLM",
        ("phi3",),
        "decoder",
        HF_FORMATS,
        (
            "fused qkv_proj/gate_up_proj",
            "LongRoPE (one factor set, by max_model_len)",
            "partial rotary (Phi-4-mini)",
            "sliding window",
        ),
    ),
    ModelFamily(
        "Olmo2ForCausalLM",
        ("olmo2",),
        "decoder",
        HF_FORMATS,
        ("post-norms only", "q/k RMSNorm over the whole projection"),
    ),
    ModelFamily(
        "GraniteForCausalLM",
        ("granite",),
        "decoder",
        HF_FORMATS,
        ("embedding/residual/attention multipliers", "logits_scaling"),
    ),
    ModelFamily(
        "GemmaForCausalLM",
        ("gemma",),
        "decoder",
        HF_FORMATS,
        ("as Llama", "RMSNorm (1 + w)", "GeGLU (tanh)", "embeddings x sqrt(hidden)"),
    ),
    ModelFamily(
        "GlmForCausalLM",
        ("glm",),
        "decoder",
        HF_FORMATS,
        (
            "fused gate_up_proj",
            "q/k/v bias",
            "partial rotary (partial_rotary_factor) in interleaved pairs, reordered into halves at load",
        ),
    ),
    ModelFamily(
        "Glm4ForCausalLM",
        ("glm4",),
        "decoder",
        HF_FORMATS,
        ("as GLM", "norms after the attention and the MLP too (post_self_attn_layernorm, post_mlp_layernorm)"),
    ),
    ModelFamily(
        "Starcoder2ForCausalLM",
        ("starcoder2",),
        "decoder",
        HF_FORMATS,
        (
            "LayerNorm with bias",
            "biases on every projection (use_bias)",
            "plain GELU (tanh) MLP c_fc/c_proj",
            "sliding window (blocks behind it freed)",
            "decode steps unfused (the native step has no LayerNorm)",
        ),
    ),
    ModelFamily(
        "SmolLM3ForCausalLM",
        ("smollm3",),
        "decoder",
        HF_FORMATS,
        (
            "as Llama",
            "NoPE layers (no_rope_layers / no_rope_layer_interval)",
            "sliding-window layers by layer_types (use_sliding_window)",
            "decode steps unfused (layers without RoPE)",
        ),
    ),
    ModelFamily(
        "Olmo3ForCausalLM",
        ("olmo3",),
        "decoder",
        HF_FORMATS,
        ("as OLMo 2", "sliding-window layers by layer_types", "RoPE per layer type (scaling on the full layers)"),
    ),
    ModelFamily(
        "ArceeForCausalLM",
        ("arcee",),
        "decoder",
        HF_FORMATS,
        (
            "as Llama",
            "plain MLP up_proj -> relu^2 -> down_proj",
            "decode steps unfused (the native step's MLP is gated)",
        ),
    ),
    ModelFamily(
        "Ernie4_5ForCausalLM",
        ("ernie4_5",),
        "decoder",
        HF_FORMATS,
        ("as Llama", "biases on every projection (use_bias)", "RoPE on interleaved pairs (q/k rows reordered at load)"),
    ),
    ModelFamily(
        "Exaone4ForCausalLM",
        ("exaone4",),
        "decoder",
        HF_FORMATS,
        (
            "norms after the attention and the MLP only",
            "per-head q/k RMSNorm",
            "sliding-window layers by layer_types / sliding_window_pattern",
            "global layers without RoPE where a window is set",
            "decode steps unfused where some layer has no RoPE",
        ),
    ),
    ModelFamily(
        "PhiForCausalLM",
        ("phi",),
        "decoder",
        HF_FORMATS,
        (
            "Phi-1.5 / Phi-2",
            "LayerNorm with bias",
            "attention and MLP in parallel on one norm",
            "q/k/v, dense and LM-head biases",
            "per-head q/k LayerNorm (qk_layernorm)",
            "partial rotary (partial_rotary_factor)",
            "plain GELU MLP fc1/fc2",
            "decode steps unfused",
        ),
    ),
    ModelFamily(
        "GPTNeoXForCausalLM",
        ("gpt_neox",),
        "decoder",
        HF_FORMATS,
        (
            "GPT-NeoX / Pythia",
            "LayerNorm with bias",
            "attention and MLP in parallel on their own norms (use_parallel_residual) or in sequence",
            "fused query_key_value, per head, reordered at load; biases (attention_bias)",
            "partial rotary (rotary_pct)",
            "plain GELU MLP dense_h_to_4h/dense_4h_to_h",
            "decode steps unfused",
        ),
    ),
    ModelFamily(
        "SeedOssForCausalLM",
        ("seed_oss",),
        "decoder",
        HF_FORMATS,
        ("as Llama", "q/k/v bias (attention_bias), o_proj bias (attention_out_bias), MLP bias (mlp_bias)", "head_dim"),
    ),
    ModelFamily(
        "ApertusForCausalLM",
        ("apertus",),
        "decoder",
        HF_FORMATS,
        (
            "as Llama (llama3 RoPE)",
            "per-head q/k RMSNorm",
            "q/k/v/o bias (attention_bias)",
            "plain MLP up_proj -> xIELU -> down_proj, each layer's alpha_p/alpha_n/beta/eps",
            "decode steps unfused (the native step's MLP is gated)",
        ),
    ),
    ModelFamily(
        "GPTJForCausalLM",
        ("gptj",),
        "decoder",
        HF_FORMATS,
        (
            "LayerNorm with bias",
            "attention and MLP in parallel on one norm",
            "partial rotary (rotary_dim) in interleaved pairs, reordered into halves at load",
            "plain GELU MLP fc_in/fc_out (n_inner) with biases",
            "LM-head bias",
            "decode steps unfused",
        ),
    ),
    ModelFamily(
        "GPTBigCodeForCausalLM",
        ("gpt_bigcode",),
        "decoder",
        HF_FORMATS,
        (
            "StarCoder 1 / SantaCoder",
            "learned absolute positions (wpe), no RoPE",
            "multi-query (multi_query) or multi-head fused c_attn with biases",
            "LayerNorm with bias",
            "plain GELU MLP c_fc/c_proj (n_inner) with biases",
            "scale_attn_weights",
            "decode steps unfused",
        ),
    ),
    ModelFamily(
        "FalconForCausalLM",
        ("falcon",),
        "decoder",
        HF_FORMATS,
        (
            "Falcon-7B/1B (multi_query, parallel_attn or in sequence) and Falcon-40B/180B, Falcon2 "
            "(new_decoder_architecture: KV groups, one or two norms in parallel)",
            "LayerNorm with bias",
            "fused query_key_value, per head or per KV group reordered at load; biases (bias)",
            "plain GELU MLP dense_h_to_4h/dense_4h_to_h (ffn_hidden_size)",
            "ALiBi (Falcon-RW) refused",
            "decode steps unfused",
        ),
    ),
    ModelFamily(
        "MixtralForCausalLM",
        ("mixtral",),
        "moe",
        LLAMA_FORMATS,
        ("as Mistral", "top-k softmax routing, renormalised", "experts grouped, one product each"),
    ),
    ModelFamily(
        "Qwen2MoeForCausalLM",
        ("qwen2_moe",),
        "moe",
        LLAMA_FORMATS,
        ("as Qwen2", "shared expert with its sigmoid gate", "decoder_sparse_step / mlp_only_layers"),
    ),
    ModelFamily(
        "Qwen3MoeForCausalLM",
        ("qwen3_moe",),
        "moe",
        LLAMA_FORMATS,
        ("as Qwen3", "norm_topk_prob", "decoder_sparse_step / mlp_only_layers"),
    ),
    ModelFamily(
        "GptOssForCausalLM",
        ("gpt_oss",),
        "gpt_oss",
        (*HF_FORMATS, MXFP4),
        (
            "attention sinks",
            "layer_types (sliding / full)",
            "q/k/v/o biases",
            "YaRN",
            "router with bias, softmax over the top-k logits",
            "experts with biases and clamped SwiGLU",
            "MXFP4 experts (OpenAI's released checkpoints) dequantized to the model's dtype at load",
        ),
    ),
    ModelFamily(
        "DeepseekV2ForCausalLM",
        ("deepseek_v2",),
        "deepseek",
        HF_FORMATS,
        (
            "multi-head latent attention, absorbed, over a latent KV cache (kv_lora_rank + qk_rope_head_dim "
            "per token and layer; attention backend torch)",
            "q_lora_rank or q_proj (V2-Lite)",
            "softmax routing, greedy or group_limited_greedy",
            "routed_scaling_factor",
            "shared experts",
            "first_k_dense_replace / moe_layer_freq",
            "YaRN with mscale",
        ),
    ),
    ModelFamily(
        "DeepseekV3ForCausalLM",
        ("deepseek_v3",),
        "deepseek",
        HF_FORMATS,
        (
            "as DeepSeek-V2",
            "sigmoid routing with e_score_correction_bias (noaux_tc)",
            "norm_topk_prob",
            "rope_interleave",
            "the multi-token-prediction layer drafts with --speculative-config mtp",
        ),
    ),
    ModelFamily(
        "CohereForCausalLM",
        ("cohere",),
        "decoder",
        HF_FORMATS,
        (
            "LayerNorm without bias",
            "attention and MLP in parallel on one norm",
            "logit_scale",
            "per-head q/k LayerNorm (use_qk_norm)",
            "RoPE on interleaved pairs (q/k rows reordered at load)",
            "decode steps unfused",
        ),
    ),
    ModelFamily(
        "Cohere2ForCausalLM",
        ("cohere2",),
        "decoder",
        HF_FORMATS,
        ("as Cohere", "sliding-window layers by layer_types / sliding_window_pattern", "global layers without RoPE"),
    ),
    ModelFamily(
        "Glm4MoeForCausalLM",
        ("glm4_moe",),
        "glm4_moe",
        HF_FORMATS,
        (
            "GLM-4.5 / 4.6 / 4.5-Air",
            "q/k/v bias; per-head q/k norms (use_qk_norm)",
            "partial rotary (partial_rotary_factor)",
            "first_k_dense_replace dense layers",
            "DeepSeek-V3's routing: sigmoid scores with e_score_correction_bias, group-limited top-k (n_group, "
            "topk_group), norm_topk_prob, routed_scaling_factor; router kept in float32",
            "shared experts",
            "the multi-token-prediction layer drafts with --speculative-config mtp",
        ),
    ),
    ModelFamily(
        "OlmoeForCausalLM",
        ("olmoe",),
        "decoder_moe",
        HF_FORMATS,
        ("q/k RMSNorm over the whole projection", "top-k softmax routing", "norm_topk_prob"),
    ),
    ModelFamily(
        "GraniteMoeForCausalLM",
        ("granitemoe",),
        "decoder_moe",
        HF_FORMATS,
        (
            "as Granite",
            "experts stacked (block_sparse_moe.input_linear / output_linear)",
            "softmax over the top-k logits",
        ),
    ),
    ModelFamily(
        "GraniteMoeSharedForCausalLM",
        ("granitemoeshared",),
        "decoder_moe",
        HF_FORMATS,
        ("as Granite MoE", "shared expert (shared_mlp), ungated"),
    ),
    ModelFamily(
        "PhimoeForCausalLM",
        ("phimoe",),
        "decoder_moe",
        HF_FORMATS,
        (
            "LayerNorm with bias",
            "q/k/v/o and LM-head biases",
            "LongRoPE (one factor set, by max_model_len) with short_mscale / long_mscale",
            "sliding window",
            "sparsemixer routing (two experts, as transformers computes it at inference)",
        ),
    ),
    ModelFamily(
        "Llama4ForCausalLM",
        ("llama4_text",),
        "decoder_moe",
        HF_FORMATS,
        (
            "Llama 4 Scout / Maverick, text only (also a Llama4ForConditionalGeneration checkpoint's language model)",
            "experts on moe_layers / interleave_moe_layer_step, dense MLPs (intermediate_size_mlp) between",
            "top-k routing, each chosen expert's input scaled by the sigmoid of its logit; shared expert",
            "experts stacked transposed (feed_forward.experts.gate_up_proj [E, H, 2I]), transposed at load",
            "NoPE layers (no_rope_layers) with attention temperature tuning (floor_scale, attn_scale)",
            "RoPE (llama3 scaling) on interleaved pairs, reordered at load; q/k L2 norm after it (use_qk_norm)",
            "chunked local attention (attention_chunk_size) on the RoPE layers, past one chunk",
            "decode steps unfused",
        ),
    ),
    ModelFamily(
        "GraniteMoeHybridForCausalLM",
        ("granitemoehybrid",),
        "hybrid",
        HF_FORMATS,
        (
            "Granite 4.0 (-H Micro / Tiny / Small, Micro): as Granite MoE shared, or its shared MLP alone",
            "Mamba-2 layers by layer_types: causal conv, chunked scan (SSD), gated RMSNorm; a recurrent state per "
            "request beside the attention layers' KV cache",
            "NoPE attention (position_embedding_type) or RoPE",
            "tensor parallelism by Mamba-2 heads (B and C's groups cut, or one group on every rank)",
            "pipeline parallelism: each stage its recurrent layers' states",
            "prefix caching by snapshots of the states; no speculative decoding, LoRA, CUDA graphs",
        ),
    ),
    ModelFamily(
        "BambaForCausalLM",
        ("bamba",),
        "hybrid",
        HF_FORMATS,
        (
            "Bamba: Llama's layer, Mamba-2 layers but on attn_layer_indices (as Granite 4.0-H's)",
            "RoPE over half of each head (partial_rotary_factor)",
            "tensor parallelism as Granite 4.0-H's",
        ),
    ),
    ModelFamily(
        "NemotronHForCausalLM",
        ("nemotron_h",),
        "nemotron_h",
        HF_FORMATS,
        (
            "Nemotron-H 8B / 47B / 56B, Nemotron Nano 2, Nemotron 3 Nano: blocks of one mixer each by "
            "layers_block_type or hybrid_override_pattern",
            "Mamba-2 blocks (as Granite 4.0-H's), attention without positional embedding, plain relu^2 MLPs",
            "mixture-of-experts blocks (Nemotron 3): ungated relu^2 experts and shared expert, DeepSeek-V3's routing "
            "(sigmoid, e_score_correction_bias, groups), latent experts (moe_latent_size)",
            "backbone. names, embeddings, norm_f",
            "tensor parallelism as Granite 4.0-H's, experts cut or held (expert parallelism)",
            "prefix caching by snapshots of the states; no speculative decoding, LoRA, CUDA graphs",
        ),
    ),
    ModelFamily(
        "Lfm2ForCausalLM",
        ("lfm2",),
        "lfm2",
        HF_FORMATS,
        (
            "LFM2 (350M / 700M / 1.2B / 2.6B): Llama's layer, its mixer a gated short convolution on the layers "
            "layer_types names conv, a window of its last inputs per request beside the attention layers' KV cache",
            "per-head q/k RMSNorm (q_layernorm, k_layernorm)",
            "SwiGLU of the adjusted width (block_auto_adjust_ff_dim)",
            "tensor parallelism by channels of the convolutions",
            "pipeline parallelism: each stage its recurrent layers' states",
            "prefix caching by snapshots of the states; no speculative decoding, LoRA, CUDA graphs",
        ),
    ),
    ModelFamily(
        "Qwen3_5ForCausalLM",
        ("qwen3_5_text",),
        "qwen3_5",
        HF_FORMATS,
        (
            "Qwen3.5 (text): Gated DeltaNet layers by layer_types (linear_attention: a conv window and a "
            "[v_heads, d_k, d_v] state per request, the delta rule in chunks of 64) beside gated attention",
            "attention: q_proj's per-head gate rows, sigmoid-gated outputs, per-head q/k norms, partial RoPE",
            "zero-centred RMSNorms (1 + w)",
            "tensor parallelism by heads (the linear attention's key heads and their value heads)",
            "pipeline parallelism: each stage its recurrent layers' states",
            "prefix caching by snapshots of the states; no speculative decoding, LoRA, CUDA graphs",
        ),
    ),
    ModelFamily(
        "Qwen3_5MoeForCausalLM",
        ("qwen3_5_moe_text",),
        "qwen3_5",
        HF_FORMATS,
        (
            "Qwen3.5-MoE (text): as Qwen3.5, each MLP Qwen2-MoE's experts (top-k softmax, renormalised) and shared "
            "expert (sigmoid-gated)",
            "tensor and expert parallelism as the other mixtures'",
        ),
    ),
    ModelFamily(
        "Qwen3NextForCausalLM",
        ("qwen3_next",),
        "qwen3_5",
        HF_FORMATS,
        (
            "Qwen3-Next: as Qwen3.5-MoE, its linear attention's projections fused by key head (in_proj_qkvz, "
            "in_proj_ba: reordered at load)",
            "norm_topk_prob; dense MLPs by decoder_sparse_step / mlp_only_layers",
        ),
    ),
)
RECURRENT_IMPLEMENTATIONS = ("hybrid", "nemotron_h", "lfm2", "qwen3_5")
"""The implementations with recurrent layers (Mamba-2, short convolutions), which keep a state per request
(models/hybrid.py)."""


def supported_architectures() -> list[str]:
    return sorted(family.architecture for family in FAMILIES)


def family_of(hf_config: Any) -> ModelFamily:
    """The family serving the config's architecture (else its model_type); ValueError listing the supported."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for family in FAMILIES:
        if family.architecture in architectures:
            return family
    for family in FAMILIES:
        if hf_config.model_type in family.model_types:
            return family
    raise ValueError(
        f"architecture {architectures or hf_config.model_type} is not supported; "
        f"supported: {', '.join(supported_architectures())}"
    )


TENSOR_PARALLEL_IMPLEMENTATIONS = (
    *("llama", "decoder", "moe", "glm4_moe", "decoder_moe", "deepseek", "gpt_oss", "hybrid", "nemotron_h", "lfm2"),
    "qwen3_5",
)
"""The implementations whose layers take a tensor-parallel group: Llama's, the generic decoder's, the mixtures
of experts on either, DeepSeek's, GPT-OSS's and the hybrid Mamba-2 decoders' (their families: FAMILIES' entries of
these implementations, listed in docs/models.md)."""


def check_tensor_parallel_model(hf_config: Any, world_size: int) -> LlamaArch:
    """The whole model's shape (as its family reads it) when `world_size` ranks can share it; SettingsConflictError
    naming the family or the sizes otherwise (before any process starts, and again where each rank builds its
    shard)."""
    family = family_of(hf_config)
    if family.implementation not in TENSOR_PARALLEL_IMPLEMENTATIONS:
        served = ", ".join(f.architecture for f in FAMILIES if f.implementation in TENSOR_PARALLEL_IMPLEMENTATIONS)
        raise SettingsConflictError(
            f"--tensor-parallel-size {world_size}: {family.architecture} is not served with tensor "
            f"parallelism yet (served: {served})"
        )
    arch = _dense_arch(hf_config, family)
    check_shardable(arch, world_size, moe_arch_of(hf_config))  # (experts' widths are padded, not refused)
    mamba = mamba_shape_of(hf_config)
    if mamba is not None:
        from engine.models.hybrid_arch import check_mamba_shardable

        check_mamba_shardable(mamba, world_size)
    if family.implementation == "lfm2" and arch.hidden_size % world_size:  # (its convolutions' channels)
        raise SettingsConflictError(
            f"--tensor-parallel-size {world_size} does not divide the model's {arch.hidden_size} convolution channels"
        )
    delta_net = delta_net_shape_of(hf_config)
    if delta_net is not None and delta_net.num_k_heads % world_size:  # (the value heads: whole groups of them)
        raise SettingsConflictError(
            f"--tensor-parallel-size {world_size} does not divide the model's {delta_net.num_k_heads} linear-attention "
            "key heads (linear_num_key_heads)"
        )
    return arch


def recurrent_width_of(hf_config: Any) -> Optional[int]:
    """The inputs of a recurrent layer's out_proj (a row-parallel matrix under tensor parallelism), else None."""
    mamba, delta_net = mamba_shape_of(hf_config), delta_net_shape_of(hf_config)
    if mamba is not None:
        return mamba.intermediate_size
    if delta_net is not None:
        return delta_net.value_dim
    return int(hf_config.hidden_size) if family_of(hf_config).implementation == "lfm2" else None


def delta_net_shape_of(hf_config: Any) -> Optional[DeltaNetShape]:
    """Qwen3.5's whole linear-attention shape (what tensor parallelism cuts), else None."""
    if family_of(hf_config).implementation != "qwen3_5":
        return None
    from engine.models.qwen3_5 import read_delta_net

    return read_delta_net(hf_config)


def recurrent_layers_of(hf_config: Any) -> tuple[int, ...]:
    """The layers of a hybrid model that keep a recurrent state (Mamba-2, short convolutions, Gated DeltaNet); ()
    for a model of attention layers alone (Granite 4.0 Micro's config is a hybrid one without them)."""
    implementation = family_of(hf_config).implementation
    if implementation == "hybrid":
        from engine.models.hybrid_arch import read_hybrid

        return read_hybrid(hf_config).recurrent_layers
    if implementation == "nemotron_h":
        from engine.models.nemotron_h_arch import read_nemotron_h

        return read_nemotron_h(hf_config).hybrid.recurrent_layers
    if implementation == "lfm2":
        from engine.models.families import lfm2_conv_layers

        return lfm2_conv_layers(hf_config)
    if implementation == "qwen3_5":
        from engine.models.families import qwen3_5_linear_layers

        return qwen3_5_linear_layers(hf_config)
    return ()


def mamba_shape_of(hf_config: Any) -> Optional[MambaShape]:
    """A hybrid model's whole Mamba-2 layer shape (what tensor parallelism cuts), else None."""
    implementation = family_of(hf_config).implementation
    if implementation == "nemotron_h":
        from engine.models.nemotron_h_arch import read_nemotron_h

        return read_nemotron_h(hf_config).hybrid.mamba
    if implementation != "hybrid":
        return None
    from engine.models.hybrid_arch import read_hybrid

    return read_hybrid(hf_config).mamba


def tensor_parallel_expert_unit(hf_config: Any, quantizer: Optional[WeightQuantizer]) -> int:
    """What each rank's share of an expert's width holds whole (expert_padding.py): MXFP4 blocks (GPT-OSS's
    checkpoints), int4 groups (quantized at load, or an AWQ checkpoint's), else single units."""
    return expert_unit(is_mxfp4_checkpoint(hf_config), None if quantizer is None else quantizer.group_size)


def held_experts_of(hf_config: Any, tp: ParallelGroup) -> Optional[range]:
    """The routed experts rank `tp.rank` holds under expert parallelism (None: the model has none)."""
    moe = moe_arch_of(hf_config)
    return None if moe is None else held_experts(moe.num_experts, tp.rank, tp.world_size)


def moe_arch_of(hf_config: Any) -> Optional[MoeArch]:
    """The experts' shape of a mixture of experts on Llama's decoder or the generic one, or DeepSeek's (what tensor
    parallelism cuts), else None."""
    implementation = family_of(hf_config).implementation
    if implementation in ("moe", "decoder_moe"):
        return MoeArch.from_hf_config(hf_config)
    if implementation == "hybrid":
        from engine.models.hybrid_arch import read_hybrid

        return MoeArch.from_hf_config(hf_config) if read_hybrid(hf_config).has_experts else None
    if implementation == "qwen3_5":
        return MoeArch.from_hf_config(hf_config) if hf_config.model_type in ("qwen3_5_moe_text", "qwen3_next") else None
    if implementation == "nemotron_h":
        from engine.models.nemotron_h_arch import read_nemotron_h

        return read_nemotron_h(hf_config).moe
    if implementation == "glm4_moe":
        from engine.models.glm4_moe_arch import read_glm4_moe

        return read_glm4_moe(hf_config).moe
    if implementation == "deepseek":
        from engine.loading.rope_settings import rope_settings
        from engine.models.deepseek_arch import read_deepseek

        return read_deepseek(hf_config, rope_settings(hf_config)[1]).moe
    if implementation == "gpt_oss":
        from engine.models.gpt_oss_arch import gpt_oss_arch

        return gpt_oss_arch(hf_config).moe
    return None


PIPELINE_IMPLEMENTATIONS = (
    *("llama", "decoder", "moe", "glm4_moe", "decoder_moe", "deepseek", "gpt_oss"),
    *RECURRENT_IMPLEMENTATIONS,
)
"""The implementations whose layer loop takes a stage's slice of the layers (`hold_stage`) and the stage before's
hidden states: Llama's, the generic decoder's, the mixtures of experts on either, DeepSeek's (latent attention,
its dense first layers), GPT-OSS's (sliding and full layers with sinks) and the hybrids' (each stage its recurrent
layers' states)."""


def check_pipeline_model(hf_config: Any, num_stages: int) -> None:
    """SettingsConflictError unless the model's layers can be split into `num_stages` pipeline stages."""
    family = family_of(hf_config)
    if family.implementation not in PIPELINE_IMPLEMENTATIONS:
        served = ", ".join(f.architecture for f in FAMILIES if f.implementation in PIPELINE_IMPLEMENTATIONS)
        raise SettingsConflictError(
            f"--pipeline-parallel-size {num_stages}: {family.architecture} is not served with pipeline "
            f"parallelism yet (served: {served})"
        )
    num_layers = hf_config.num_hidden_layers
    if num_stages > num_layers:
        raise SettingsConflictError(
            f"--pipeline-parallel-size {num_stages}: the model has {num_layers} layers, fewer than the stages"
        )


def build_model(
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    ops: Optional[TorchLayerOps] = None,
    linear: Optional[Linear] = None,
    quantizer: Optional[WeightQuantizer] = None,
    max_model_len: Optional[int] = None,
    tp: ParallelGroup = ParallelGroup.single(),
    expert_parallel: bool = False,
) -> LlamaForCausalLM:
    """An empty model for the config's architecture (load weights with `load_weights`); `max_model_len`: the
    longest sequence it will serve (None: the config's context), which picks LongRoPE's factor set; `tp`: the
    tensor-parallel group whose rank's shard it holds (its weights cut by tensor_parallel.shard_weights);
    `expert_parallel`: that rank holds its share of the routed experts whole (models/expert_parallel.py), not its
    share of each one's width."""
    from engine.loading.rope_settings import rope_settings

    family = family_of(hf_config)
    if is_mxfp4_checkpoint(hf_config) and MXFP4 not in family.formats:
        raise ValueError(
            f"{family.architecture}: MXFP4 checkpoints (config.json quantization_config) are served for "
            f"{', '.join(f.architecture for f in FAMILIES if MXFP4 in f.formats)} only"
        )
    if tp.is_parallel:
        whole_moe = moe_arch_of(hf_config)
        shard = shard_arch(check_tensor_parallel_model(hf_config, tp.world_size), tp.world_size, whole_moe)
        unit = tensor_parallel_expert_unit(hf_config, quantizer)
        held = None
        if expert_parallel and whole_moe is not None:
            held = held_experts(whole_moe.num_experts, tp.rank, tp.world_size)
        if whole_moe is not None and tp.rank == 0:
            if held is not None:
                logger.info("%s", describe_placement(whole_moe.num_experts, tp.world_size))
            for note in padding_notes(whole_moe, tp.world_size, unit, routed=held is None):
                logger.info("%s", note)
        if family.implementation == "hybrid":
            from engine.models.hybrid import HybridForCausalLM, HybridMoeForCausalLM
            from engine.models.hybrid_arch import read_hybrid, shard_mamba

            assert isinstance(shard, DecoderArch)  # _dense_arch reads it so
            hybrid = read_hybrid(hf_config)
            hybrid = dataclasses.replace(hybrid, mamba=shard_mamba(hybrid.mamba, tp.world_size))
            if whole_moe is not None:
                moe = shard_moe(whole_moe, tp.world_size, unit, held)
                return HybridMoeForCausalLM(
                    shard, moe, hybrid, dtype, device, ops, linear, quantizer, max_model_len, tp
                )
            return HybridForCausalLM(shard, hybrid, dtype, device, ops, linear, quantizer, max_model_len, tp)
        if family.implementation == "qwen3_5":
            from engine.models.families import qwen3_5_linear_layers
            from engine.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, read_delta_net

            assert isinstance(shard, DecoderArch)  # _dense_arch reads it so
            whole = read_delta_net(hf_config)
            delta_net = dataclasses.replace(
                whole, num_k_heads=whole.num_k_heads // tp.world_size, num_v_heads=whole.num_v_heads // tp.world_size
            )
            layers = qwen3_5_linear_layers(hf_config)
            if whole_moe is not None:
                moe = shard_moe(whole_moe, tp.world_size, unit, held)
                return Qwen3_5MoeForCausalLM(
                    shard, moe, layers, delta_net, dtype, device, ops, linear, quantizer, max_model_len, tp
                )
            return Qwen3_5ForCausalLM(
                shard, layers, delta_net, dtype, device, ops, linear, quantizer, max_model_len, tp
            )
        if family.implementation == "lfm2":
            from engine.models.families import lfm2_conv_layers
            from engine.models.lfm2 import Lfm2ForCausalLM

            assert isinstance(shard, DecoderArch)  # _dense_arch reads it so
            layers, kernel = lfm2_conv_layers(hf_config), int(hf_config.conv_L_cache)
            return Lfm2ForCausalLM(shard, layers, kernel, dtype, device, ops, linear, quantizer, max_model_len, tp)
        if family.implementation == "nemotron_h":
            from engine.models.hybrid_arch import shard_mamba
            from engine.models.nemotron_h import NemotronHForCausalLM, NemotronHMoeForCausalLM
            from engine.models.nemotron_h_arch import read_nemotron_h

            assert isinstance(shard, DecoderArch)  # _dense_arch reads it so
            nemotron = read_nemotron_h(hf_config)
            hybrid = dataclasses.replace(nemotron.hybrid, mamba=shard_mamba(nemotron.hybrid.mamba, tp.world_size))
            nemotron = dataclasses.replace(nemotron, decoder=shard, hybrid=hybrid)
            if whole_moe is not None:
                nemotron = dataclasses.replace(nemotron, moe=shard_moe(whole_moe, tp.world_size, unit, held))
                return NemotronHMoeForCausalLM(nemotron, dtype, device, ops, linear, quantizer, max_model_len, tp)
            return NemotronHForCausalLM(nemotron, dtype, device, ops, linear, quantizer, max_model_len, tp)
        if family.implementation == "decoder_moe":
            from engine.models.decoder_moe import DecoderMoeForCausalLM

            moe = shard_moe(MoeArch.from_hf_config(hf_config), tp.world_size, unit, held)
            assert isinstance(shard, DecoderArch)  # _dense_arch reads these families so
            return DecoderMoeForCausalLM(shard, moe, dtype, device, ops, linear, quantizer, tp, max_model_len)
        if family.implementation == "moe":
            moe = shard_moe(MoeArch.from_hf_config(hf_config), tp.world_size, unit, held)
            return MoeForCausalLM(shard, moe, dtype, device, ops, linear, quantizer, tp, max_model_len)
        if family.implementation == "glm4_moe":
            from engine.models.glm4_moe import Glm4MoeForCausalLM
            from engine.models.glm4_moe_arch import read_glm4_moe

            glm = read_glm4_moe(hf_config)
            glm = dataclasses.replace(glm, moe=shard_moe(glm.moe, tp.world_size, unit, held))
            return Glm4MoeForCausalLM(shard, glm, dtype, device, ops, linear, quantizer, max_model_len, tp)
        if family.implementation == "deepseek":
            from engine.models.deepseek import DeepseekForCausalLM
            from engine.models.deepseek_arch import read_deepseek

            deepseek = shard_deepseek(read_deepseek(hf_config, rope_settings(hf_config)[1]), tp.world_size, unit, held)
            return DeepseekForCausalLM(shard, deepseek, dtype, device, ops, linear, quantizer, max_model_len, tp)
        if family.implementation == "gpt_oss":
            from engine.models.gpt_oss import GptOssForCausalLM
            from engine.models.gpt_oss_arch import gpt_oss_arch, shard_gpt_oss_arch

            gpt_oss = shard_gpt_oss_arch(gpt_oss_arch(hf_config), tp.world_size, unit, held)
            return GptOssForCausalLM(gpt_oss, dtype, device, ops, linear, quantizer, max_model_len, tp)
        if isinstance(shard, DecoderArch):
            from engine.models.decoder import DecoderForCausalLM

            return DecoderForCausalLM(shard, dtype, device, ops, linear, quantizer, max_model_len, tp)
        return LlamaForCausalLM(shard, dtype, device, ops, linear, quantizer, max_model_len, tp)
    if family.implementation == "gpt_oss":
        from engine.models.gpt_oss import GptOssForCausalLM
        from engine.models.gpt_oss_arch import gpt_oss_arch

        return GptOssForCausalLM(gpt_oss_arch(hf_config), dtype, device, ops, linear, quantizer, max_model_len)
    if family.implementation == "deepseek":
        from engine.models.deepseek import DeepseekForCausalLM
        from engine.models.deepseek_arch import read_deepseek

        rope = rope_settings(hf_config)
        return DeepseekForCausalLM(
            LlamaArch.from_hf_config(hf_config, rope),
            read_deepseek(hf_config, rope[1]),
            dtype,
            device,
            ops,
            linear,
            quantizer,
            max_model_len,
        )
    if family.implementation == "glm4_moe":
        from engine.models.glm4_moe import Glm4MoeForCausalLM
        from engine.models.glm4_moe_arch import read_glm4_moe

        arch = LlamaArch.from_hf_config(hf_config, rope_settings(hf_config))
        glm = read_glm4_moe(hf_config)
        return Glm4MoeForCausalLM(arch, glm, dtype, device, ops, linear, quantizer, max_model_len)
    if family.implementation in ("llama", "moe"):
        arch = LlamaArch.from_hf_config(hf_config, rope_settings(hf_config))
        if family.implementation == "moe":
            moe = MoeArch.from_hf_config(hf_config)
            return MoeForCausalLM(arch, moe, dtype, device, ops, linear, quantizer, max_model_len=max_model_len)
        return LlamaForCausalLM(arch, dtype, device, ops, linear, quantizer, max_model_len)
    if family.implementation == "hybrid":
        from engine.models.hybrid import HybridForCausalLM, HybridMoeForCausalLM
        from engine.models.hybrid_arch import hybrid_decoder_arch, read_hybrid

        arch, hybrid = hybrid_decoder_arch(hf_config), read_hybrid(hf_config)
        if hybrid.has_experts:
            moe = MoeArch.from_hf_config(hf_config)
            return HybridMoeForCausalLM(arch, moe, hybrid, dtype, device, ops, linear, quantizer, max_model_len)
        return HybridForCausalLM(arch, hybrid, dtype, device, ops, linear, quantizer, max_model_len)
    if family.implementation == "nemotron_h":
        from engine.models.nemotron_h import NemotronHForCausalLM, NemotronHMoeForCausalLM
        from engine.models.nemotron_h_arch import read_nemotron_h

        nemotron = read_nemotron_h(hf_config)
        model_class = NemotronHForCausalLM if nemotron.moe is None else NemotronHMoeForCausalLM
        return model_class(nemotron, dtype, device, ops, linear, quantizer, max_model_len)
    if family.implementation == "qwen3_5":
        from engine.models.families import qwen3_5_arch, qwen3_5_linear_layers
        from engine.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, read_delta_net

        arch, layers, delta_net = qwen3_5_arch(hf_config), qwen3_5_linear_layers(hf_config), read_delta_net(hf_config)
        experts = moe_arch_of(hf_config)
        if experts is not None:
            return Qwen3_5MoeForCausalLM(
                arch, experts, layers, delta_net, dtype, device, ops, linear, quantizer, max_model_len
            )
        return Qwen3_5ForCausalLM(arch, layers, delta_net, dtype, device, ops, linear, quantizer, max_model_len)
    if family.implementation == "lfm2":
        from engine.models.families import lfm2_arch, lfm2_conv_layers
        from engine.models.lfm2 import Lfm2ForCausalLM

        arch, layers, kernel = lfm2_arch(hf_config), lfm2_conv_layers(hf_config), int(hf_config.conv_L_cache)
        return Lfm2ForCausalLM(arch, layers, kernel, dtype, device, ops, linear, quantizer, max_model_len)
    if family.implementation == "decoder_moe":
        from engine.models.decoder_moe import DecoderMoeForCausalLM
        from engine.models.families import MOE_ARCH_READERS

        arch = MOE_ARCH_READERS[family.architecture](hf_config)
        moe = MoeArch.from_hf_config(hf_config)
        return DecoderMoeForCausalLM(arch, moe, dtype, device, ops, linear, quantizer, max_model_len=max_model_len)
    from engine.models.decoder import DecoderForCausalLM
    from engine.models.families import ARCH_READERS

    arch = ARCH_READERS[family.architecture](hf_config)
    return DecoderForCausalLM(arch, dtype, device, ops, linear, quantizer, max_model_len)


def _dense_arch(hf_config: Any, family: ModelFamily) -> LlamaArch:
    """The shape and recipe of a Llama-family or generic-decoder model (DecoderArch for the latter)."""
    from engine.loading.rope_settings import rope_settings

    if family.implementation == "decoder":
        from engine.models.families import ARCH_READERS

        return ARCH_READERS[family.architecture](hf_config)
    if family.implementation == "decoder_moe":
        from engine.models.families import MOE_ARCH_READERS

        return MOE_ARCH_READERS[family.architecture](hf_config)
    if family.implementation == "hybrid":
        from engine.models.hybrid_arch import hybrid_decoder_arch

        return hybrid_decoder_arch(hf_config)
    if family.implementation == "nemotron_h":
        from engine.models.nemotron_h_arch import read_nemotron_h

        return read_nemotron_h(hf_config).decoder
    if family.implementation == "lfm2":
        from engine.models.families import lfm2_arch

        return lfm2_arch(hf_config)
    if family.implementation == "qwen3_5":
        from engine.models.families import qwen3_5_arch

        return qwen3_5_arch(hf_config)
    if family.implementation == "gpt_oss":  # (its refusals of what is not served too)
        from engine.models.gpt_oss_arch import gpt_oss_arch

        return gpt_oss_arch(hf_config).llama
    return LlamaArch.from_hf_config(hf_config, rope_settings(hf_config))
