"""The mixture-of-experts shape of GLM-4.5 / GLM-4.6 / GLM-4.5-Air (Glm4MoeForCausalLM), read from the HF config:
which layers are sparse, the experts and shared experts, DeepSeek-V3's routing and the partial rotary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from engine.layers.grouped_routing import GroupedTopK
from engine.models.families import _rotary_dim
from engine.models.moe_arch import MoeArch


@dataclass(frozen=True, slots=True)
class Glm4MoeArch:
    moe: MoeArch
    routing: GroupedTopK  # every sparse layer's, without its correction bias (taken per layer at load)
    rotary_dim: Optional[int]  # RoPE over each head's first rotary_dim dimensions, in halves (None: all)


def read_glm4_moe(config: Any) -> Glm4MoeArch:
    """Layers from first_k_dense_replace on are sparse (HF's rule); transformers' router: sigmoid scores plus
    e_score_correction_bias choose, groups scored by their two best ("noaux_tc"), norm_topk_prob, then
    routed_scaling_factor. ValueError naming a value that is not served."""
    experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {experts} experts")
    groups = int(config.n_group or 1)
    if experts % groups or experts // groups < 2:
        raise ValueError(
            f"n_routed_experts {experts} in n_group {groups}: each group needs as many experts, at least two "
            "(a group scores its two best)"
        )
    first_dense = int(config.first_k_dense_replace or 0)
    shared = config.moe_intermediate_size * config.n_shared_experts if config.n_shared_experts else None
    moe = MoeArch(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        weights_in_model_dtype=False,
        shared_intermediate_size=shared,
        sparse_layers=tuple(range(first_dense, config.num_hidden_layers)),
        prefix="mlp.",
        expert_names=("gate_proj", "up_proj", "down_proj"),
    )
    routing = GroupedTopK(
        top_k=top_k,
        scoring="sigmoid",
        method="noaux_tc",
        num_groups=groups,
        topk_groups=int(config.topk_group or groups),
        renormalize=bool(config.norm_topk_prob),
        scaling_factor=float(config.routed_scaling_factor),
    )
    return Glm4MoeArch(moe=moe, routing=routing, rotary_dim=_rotary_dim(config))
