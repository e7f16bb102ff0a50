"""The mixture-of-experts shape of Mixtral, Qwen2-MoE and Qwen3-MoE, read from the HF config; what their
checkpoints call the experts. (GPT-OSS's is read with the rest of its shape: engine/models/gpt_oss_arch.py.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

MOE_ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

_ROUTING_FIELDS = {
    # config fields of other MoE families that would change the routing if honoured: refused, not ignored
    "scoring_func": ("softmax",),
    "topk_method": ("greedy",),
    "routed_scaling_factor": (1.0,),
    "n_group": (None, 1),
    "n_shared_experts": (None, 0),
    "moe_layer_freq": (None, 1),
    "first_k_dense_replace": (None, 0),
}


@dataclass(frozen=True, slots=True)
class MoeArch:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool  # divide the top-k probabilities by their sum
    weights_in_model_dtype: bool  # the top-k weights rounded to the model's dtype before scaling (Qwen MoE)
    shared_intermediate_size: Optional[int]  # Qwen2-MoE's shared expert (None: none)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the MoE block (others are dense)
    prefix: str  # the block's name in a layer: "block_sparse_moe." (Mixtral) or "mlp."
    expert_names: tuple[str, str, str]  # each expert's gate, up and down matrices
    # GPT-OSS (engine/models/gpt_oss_arch.py): the top-k router logits, then a softmax over those k; the experts'
    # clamped SwiGLU (swiglu_limit None: plain SwiGLU)
    softmax_after_top_k: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: Optional[float] = None

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @classmethod
    def from_hf_config(cls, config: Any) -> "MoeArch":
        _refuse_unsupported(config)
        layers = config.num_hidden_layers
        if config.model_type == "mixtral":
            return cls(
                num_experts=config.num_local_experts,
                top_k=config.num_experts_per_tok,
                expert_intermediate_size=config.intermediate_size,
                renormalize=True,
                weights_in_model_dtype=False,
                shared_intermediate_size=None,
                sparse_layers=tuple(range(layers)),
                prefix="block_sparse_moe.",
                expert_names=("w1", "w3", "w2"),
            )
        if config.model_type in ("qwen2_moe", "qwen3_moe"):
            step = int(getattr(config, "decoder_sparse_step", 1) or 1)
            dense = set(getattr(config, "mlp_only_layers", None) or [])
            sparse = tuple(
                i for i in range(layers) if i not in dense and config.num_experts > 0 and (i + 1) % step == 0
            )
            shared = config.shared_expert_intermediate_size if config.model_type == "qwen2_moe" else None
            return cls(
                num_experts=config.num_experts,
                top_k=config.num_experts_per_tok,
                expert_intermediate_size=config.moe_intermediate_size,
                renormalize=bool(config.norm_topk_prob),
                weights_in_model_dtype=True,
                shared_intermediate_size=shared,
                sparse_layers=sparse,
                prefix="mlp.",
                expert_names=("gate_proj", "up_proj", "down_proj"),
            )
        raise ValueError(
            f"model_type {config.model_type!r} is not a supported mixture of experts; "
            f"supported: {', '.join(sorted(MOE_ARCHITECTURES))}"
        )


def _refuse_unsupported(config: Any) -> None:
    for field, accepted in _ROUTING_FIELDS.items():
        value = getattr(config, field, None)
        if value is not None and value not in accepted:
            raise ValueError(
                f"config field {field}={value!r} is not supported for {config.model_type} "
                f"(supported: {', '.join(map(repr, accepted))})"
            )
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    top_k = getattr(config, "num_experts_per_tok", 0)
    if experts and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {experts} experts")
    step = getattr(config, "decoder_sparse_step", 1)
    if step is not None and step < 1:
        raise ValueError(f"decoder_sparse_step {step} must be at least 1")
