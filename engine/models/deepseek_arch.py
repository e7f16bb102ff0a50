"""The shape of DeepSeek-V2/V3, read from the HF config: multi-head latent attention, the mixture of experts
(which layers, the shared experts) and its grouped routing."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from engine.layers.grouped_routing import GroupedTopK
from engine.models.moe_arch import MoeArch

DEEPSEEK_ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}


@dataclass(frozen=True, slots=True)
class MlaArch:
    """Multi-head latent attention: per head q = [q_nope | q_pe], k = [W_UK c_kv | k_pe], v = W_UV c_kv, where
    c_kv (kv_lora_rank) and k_pe (qk_rope_head_dim, one for all heads) are what the cache stores."""

    num_heads: int
    q_lora_rank: Optional[int]  # None: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool  # the rotated pairs are (x0, x1), (x2, x3), ... (V2 always; V3's rope_interleave)
    softmax_scale: float  # qk_head_dim^-0.5, times mscale^2 under YaRN with mscale_all_dim (as HF)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class DeepseekArch:
    mla: MlaArch
    moe: MoeArch
    routing: GroupedTopK  # every sparse layer's, without its correction bias (taken per layer at load)


def read_deepseek(config: Any, rope_scaling: Optional[dict]) -> DeepseekArch:
    """DeepSeek-V2/V3's shape; ValueError naming a field whose value is not served."""
    v3 = config.model_type == "deepseek_v3"
    for field in ("mlp_bias",):
        if getattr(config, field, False):
            raise ValueError(f"config field {field}=True is not supported for {config.model_type}")
    return DeepseekArch(
        mla=_read_mla(config, rope_scaling, v3), moe=_read_moe(config), routing=_read_routing(config, v3)
    )


def _read_mla(config: Any, rope_scaling: Optional[dict], v3: bool) -> MlaArch:
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    scale = qk_head_dim**-0.5
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        mscale = _yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale = scale * mscale * mscale
    return MlaArch(
        num_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rope_interleaved=bool(getattr(config, "rope_interleave", True)) if v3 else True,
        softmax_scale=scale,
    )


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _read_moe(config: Any) -> MoeArch:
    """Layers from first_k_dense_replace on are sparse, every moe_layer_freq-th of them (DeepSeek's and vLLM's
    rule; HF transformers reads no moe_layer_freq, the same layers when it is 1, as in every released config)."""
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    experts = config.n_routed_experts
    sparse = tuple(i for i in range(config.num_hidden_layers) if experts and i >= first_dense and i % freq == 0)
    shared = config.moe_intermediate_size * config.n_shared_experts if config.n_shared_experts else None
    top_k = config.num_experts_per_tok
    if experts and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {experts} experts")
    return MoeArch(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        weights_in_model_dtype=False,
        shared_intermediate_size=shared,
        sparse_layers=sparse,
        prefix="mlp.",
        expert_names=("gate_proj", "up_proj", "down_proj"),
    )


def _read_routing(config: Any, v3: bool) -> GroupedTopK:
    """V3: sigmoid scores with e_score_correction_bias, groups by their two best ("noaux_tc"), HF's only
    routing for it. V2: softmax scores, "greedy" or "group_limited_greedy", never renormalised (HF reads no
    norm_topk_prob for V2, where DeepSeek's code renormalises instead of scaling: refused, no released V2 sets it)."""
    scoring = getattr(config, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
    method = getattr(config, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
    served = ("sigmoid", ("noaux_tc",)) if v3 else ("softmax", ("greedy", "group_limited_greedy"))
    if scoring != served[0] or method not in served[1]:
        raise ValueError(
            f"{config.model_type} routing scoring_func={scoring!r} topk_method={method!r} is not "
            f"supported (supported: scoring_func {served[0]!r} with topk_method "
            f"{' or '.join(map(repr, served[1]))}, as HF transformers computes it)"
        )
    if not v3 and config.norm_topk_prob:
        raise ValueError(
            "norm_topk_prob=True is not supported for deepseek_v2: HF transformers ignores it while "
            "DeepSeek's own code renormalises the top-k weights instead of scaling them"
        )
    groups = int(config.n_group or 1)
    if config.n_routed_experts % groups:
        raise ValueError(f"n_routed_experts {config.n_routed_experts} is not a multiple of n_group {groups}")
    return GroupedTopK(
        top_k=config.num_experts_per_tok,
        scoring=scoring,
        method=method,
        num_groups=groups,
        topk_groups=int(config.topk_group or groups),
        renormalize=v3 and bool(config.norm_topk_prob),
        scaling_factor=float(config.routed_scaling_factor),
    )
