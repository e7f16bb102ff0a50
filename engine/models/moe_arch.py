"""The mixture-of-experts shape of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE (and its shared-expert
variant), Phi-3.5-MoE and Llama 4, read from the HF config: how they route, and what their checkpoints call the
experts, the router and the shared expert. (GPT-OSS's is read with the rest of its shape:
engine/models/gpt_oss_arch.py.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

MOE_ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeSharedForCausalLM": "granitemoeshared",
    "PhimoeForCausalLM": "phimoe",
    "Llama4ForCausalLM": "llama4_text",
}
SPARSE_MIXER_TOP_K = 2
"""Phi-3.5-MoE's sparsemixer picks exactly two experts per token, whatever num_experts_per_tok says."""


@dataclass(frozen=True, slots=True)
class SharedExpertNames:
    """Where a layer's shared expert is stored, by names within the layer."""

    gate_up: tuple[str, ...]  # its gate and up matrices, stacked in this order (one name: stored fused)
    down: str
    gate: Optional[str]  # its sigmoid gate [1, H] (Qwen2-MoE); None: added ungated (Granite MoE shared)


QWEN2_SHARED_EXPERT = SharedExpertNames(
    ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
    "mlp.shared_expert.down_proj.weight",
    "mlp.shared_expert_gate.weight",
)
LLAMA4_SHARED_EXPERT = SharedExpertNames(
    ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
    "mlp.shared_expert.down_proj.weight",
    None,
)
GRANITE_SHARED_EXPERT = SharedExpertNames(("shared_mlp.input_linear.weight",), "shared_mlp.output_linear.weight", None)

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
    # each expert's gate, up and down matrices (`experts.N.<name>.weight`); None: stored stacked only (Granite MoE)
    expert_names: Optional[tuple[str, str, str]]
    # GPT-OSS (engine/models/gpt_oss_arch.py): the top-k router logits, then a softmax over those k; the experts'
    # clamped SwiGLU (swiglu_limit None: plain SwiGLU)
    softmax_after_top_k: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: Optional[float] = None
    router_name: str = "gate.weight"  # the router's [E, H] in the block (Granite MoE: "router.layer.weight")
    # the experts stacked in the block: gate|up [E, 2I, H] and down [E, H, I] (Granite MoE: input_linear,
    # output_linear; the others where a checkpoint holds transformers' in-memory layout)
    stacked_names: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")
    shared_names: Optional[SharedExpertNames] = None  # where the shared expert is, when shared_intermediate_size
    # Phi-3.5-MoE's sparsemixer routing (moe_routing.sparse_mixer) with this jitter epsilon, its router_jitter_noise;
    # None: top-k routing
    sparse_mixer_eps: Optional[float] = None
    # Llama 4: the top-k logits each through a sigmoid (moe_routing.select_top_sigmoid), scaling the experts' inputs
    # (SparseMoeBlock's scores_on_input); its experts stacked as gate|up [E, H, 2I] and down [E, I, H], the
    # transpose of the layout above (transposed at load)
    sigmoid_scores_on_input: bool = False
    stacked_transposed: bool = False
    # expert parallelism (models/expert_parallel.py): the routed experts this rank holds, whole; None: all of them
    held_experts: Optional[range] = None
    # Nemotron-H: each expert (and the shared expert) up -> relu^2 -> down, no gate (`expert_names`' gate unused)
    ungated: bool = False
    # Nemotron 3's moe_latent_size: the routed experts' input and output width, between the block's
    # fc1_latent_proj and fc2_latent_proj (None: the model's hidden size, no projections)
    latent_size: Optional[int] = None
    # the layers with a dense MLP; None: every layer not sparse (Nemotron-H's other blocks hold no MLP at all)
    dense_layers: Optional[tuple[int, ...]] = None

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @property
    def local_experts(self) -> range:
        """The routed experts this model holds (their global numbers)."""
        return range(self.num_experts) if self.held_experts is None else self.held_experts

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
                shared_names=QWEN2_SHARED_EXPERT if shared is not None else None,
            )
        reader = _GENERIC_DECODER_MOE.get(config.model_type)
        if reader is not None:
            return reader(config)
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


def _olmoe(config: Any) -> MoeArch:
    """OLMoE: Qwen3-MoE's routing (softmax, top-k, renormalised by norm_topk_prob, weights in the model's dtype) in
    every layer."""
    return MoeArch(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        expert_intermediate_size=config.intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        weights_in_model_dtype=True,
        shared_intermediate_size=None,
        sparse_layers=tuple(range(config.num_hidden_layers)),
        prefix="mlp.",
        expert_names=("gate_proj", "up_proj", "down_proj"),
    )


def _granite_moe(config: Any) -> MoeArch:
    """Granite MoE: the top-k logits, a softmax over those k (in float32, then the model's dtype); experts stacked
    as `input_linear` [E, 2I, H] (gate rows, then up) and `output_linear` [E, H, I]; the shared variant's ungated
    `shared_mlp` (none where shared_intermediate_size is 0)."""
    shared = int(getattr(config, "shared_intermediate_size", 0) or 0) or None
    return MoeArch(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        expert_intermediate_size=config.intermediate_size,
        renormalize=False,  # the softmax over the top-k logits already sums to 1
        weights_in_model_dtype=True,
        shared_intermediate_size=shared,
        sparse_layers=tuple(range(config.num_hidden_layers)),
        prefix="block_sparse_moe.",
        expert_names=None,
        softmax_after_top_k=True,
        router_name="router.layer.weight",
        stacked_names=("input_linear.weight", "output_linear.weight"),
        shared_names=GRANITE_SHARED_EXPERT if shared is not None else None,
    )


def _qwen3_5_moe(config: Any) -> MoeArch:
    """Qwen3.5-MoE: Qwen2-MoE's experts and sigmoid-gated shared expert in every layer, the top-k softmax weights
    always renormalised."""
    shared = int(config.shared_expert_intermediate_size)
    return MoeArch(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        expert_intermediate_size=config.moe_intermediate_size,
        renormalize=True,
        weights_in_model_dtype=True,
        shared_intermediate_size=shared,
        sparse_layers=tuple(range(config.num_hidden_layers)),
        prefix="mlp.",
        expert_names=("gate_proj", "up_proj", "down_proj"),
        shared_names=QWEN2_SHARED_EXPERT,
    )


def _qwen3_next(config: Any) -> MoeArch:
    """Qwen3-Next: Qwen2-MoE's experts, sigmoid-gated shared expert and sparse layers (decoder_sparse_step,
    mlp_only_layers: dense MLPs between)."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    layers = range(config.num_hidden_layers)
    return MoeArch(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        expert_intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        weights_in_model_dtype=True,
        shared_intermediate_size=int(config.shared_expert_intermediate_size),
        sparse_layers=tuple(i for i in layers if i not in dense and config.num_experts > 0 and (i + 1) % step == 0),
        prefix="mlp.",
        expert_names=("gate_proj", "up_proj", "down_proj"),
        shared_names=QWEN2_SHARED_EXPERT,
    )


def _phimoe(config: Any) -> MoeArch:
    """Phi-3.5-MoE: Mixtral's experts and names, routed by sparsemixer (two experts per token)."""
    top_k = config.num_experts_per_tok
    if top_k != SPARSE_MIXER_TOP_K:
        raise ValueError(
            f"num_experts_per_tok {top_k} is not supported for phimoe: its sparsemixer routing picks exactly "
            f"{SPARSE_MIXER_TOP_K} experts per token"
        )
    return MoeArch(
        num_experts=config.num_local_experts,
        top_k=top_k,
        expert_intermediate_size=config.intermediate_size,
        renormalize=False,
        weights_in_model_dtype=True,  # (sparsemixer's weights are in the logits' dtype already)
        shared_intermediate_size=None,
        sparse_layers=tuple(range(config.num_hidden_layers)),
        prefix="block_sparse_moe.",
        expert_names=("w1", "w3", "w2"),
        sparse_mixer_eps=float(config.router_jitter_noise),
    )


def _llama4(config: Any) -> MoeArch:
    """Llama 4: in the layers `moe_layers` names (by default every interleave_moe_layer_step-th), the top-k logits'
    sigmoids scale each chosen expert's input; a shared expert (intermediate_size wide, as each expert) added
    ungated; the experts stored stacked in transformers' layout ([E, H, 2I], [E, I, H])."""
    layers = config.num_hidden_layers
    sparse = tuple(sorted(set(config.moe_layers)))
    if any(not 0 <= layer < layers for layer in sparse):
        raise ValueError(f"moe_layers {list(config.moe_layers)} name layers outside the model's {layers}")
    return MoeArch(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        expert_intermediate_size=config.intermediate_size,
        renormalize=False,  # (each weight is its own sigmoid)
        weights_in_model_dtype=True,
        shared_intermediate_size=config.intermediate_size,
        sparse_layers=sparse,
        prefix="mlp.",  # (the checkpoint's feed_forward., renamed at load: families.llama4_arch)
        expert_names=None,
        router_name="router.weight",
        shared_names=LLAMA4_SHARED_EXPERT,
        sigmoid_scores_on_input=True,
        stacked_transposed=True,
    )


_GENERIC_DECODER_MOE: dict[str, Callable[[Any], MoeArch]] = {
    "olmoe": _olmoe,
    "granitemoe": _granite_moe,
    "granitemoeshared": _granite_moe,
    "granitemoehybrid": _granite_moe,  # (Granite 4.0-H's experts: models/hybrid.py)
    "qwen3_5_moe_text": _qwen3_5_moe,  # (models/qwen3_5.py)
    "qwen3_next": _qwen3_next,
    "phimoe": _phimoe,
    "llama4_text": _llama4,
}
"""The mixtures of experts on the generic decoder (models/decoder_moe.py), by model_type."""
