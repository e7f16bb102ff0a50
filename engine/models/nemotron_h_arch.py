"""NVIDIA's Nemotron-H (NemotronHForCausalLM: Nemotron-H 8B / 47B / 56B, Nemotron Nano 2, Nemotron 3) read from its
HF config.

Its layers are blocks of one mixer each, `h + mixer(RMSNorm(h))`, of the kind `layers_block_type` (or the older
`hybrid_override_pattern`) names: a Mamba-2 layer (`M`), attention without positional embedding (`*`), a plain
MLP, up -> relu^2 -> down (`-`), or (Nemotron 3) a mixture of such MLPs (`E`): DeepSeek-V3's routing (sigmoid scores,
e_score_correction_bias, the best topk_group of n_group groups, norm_topk_prob, routed_scaling_factor) over
n_routed_experts ungated experts (moe_latent_size: narrower, between two projections), and a shared expert of
moe_shared_expert_intermediate_size added to every token.
Its checkpoints name the model `backbone.`, the embedding `embeddings` and the final norm `norm_f`, and each block's
mixer `mixer.` (a mixture's: `mixer.gate.weight`, `mixer.gate.e_score_correction_bias`, `mixer.experts.N.up_proj`,
`mixer.experts.N.down_proj`, `mixer.shared_experts.up_proj`, `mixer.shared_experts.down_proj`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from engine.attention.layer_attention import LayerAttention
from engine.layers.grouped_routing import GroupedTopK
from engine.layers.recurrent_state import MambaShape
from engine.models.decoder_arch import DecoderArch
from engine.models.hybrid_arch import HybridArch
from engine.models.llama_arch import shared_fields
from engine.models.moe_arch import MoeArch

BLOCK_KINDS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
"""transformers' names of a block's mixer (`layers_block_type`) -> this server's."""
RENAMES = (("backbone.", "model."), ("model.embeddings.", "model.embed_tokens."), ("model.norm_f.", "model.norm."))


@dataclass(frozen=True, slots=True)
class NemotronHArch:
    decoder: DecoderArch  # the attention's and MLP's shapes; one norm per block (its `attn_pre`)
    hybrid: HybridArch
    blocks: tuple[str, ...]  # each layer's mixer: "mamba", "attention", "mlp" or "moe"
    moe: Optional[MoeArch] = None  # the "moe" blocks' experts (None: none)
    routing: Optional[GroupedTopK] = None  # and their router's settings


def read_nemotron_h(config: Any) -> NemotronHArch:
    """The config's blocks and shapes; ValueError naming a field or block kind this server does not compute."""
    name = "NemotronHForCausalLM"
    blocks = tuple(BLOCK_KINDS.get(kind, kind) for kind in config.layers_block_type)
    unknown = sorted(set(blocks) - {"mamba", "attention", "mlp", "moe"})
    if unknown:
        raise ValueError(f"{name}: block types {unknown} are not served (mamba, attention, mlp, moe)")
    refused = {
        "mamba_hidden_act": getattr(config, "mamba_hidden_act", "silu") != "silu",
        "mlp_hidden_act": getattr(config, "mlp_hidden_act", "relu2") != "relu2",
        "use_bias": bool(getattr(config, "use_bias", False)),
        "attention_bias": bool(getattr(config, "attention_bias", False)),
        "sliding_window": getattr(config, "sliding_window", None) is not None,
        "num_nextn_predict_layers": int(getattr(config, "num_nextn_predict_layers", 0) or 0) > 0,
        # (the experts' and the shared expert's biases: not read; the latent projections' would be added by every
        # rank under tensor parallelism)
        "mlp_bias": bool(getattr(config, "mlp_bias", False)) and "moe" in blocks,
    }
    for field, given in refused.items():
        if given:
            raise ValueError(f"{name}: {field}={getattr(config, field)!r} is not served")
    heads, head_dim, groups = int(config.mamba_num_heads), int(config.mamba_head_dim), int(config.n_groups)
    if heads % groups:
        raise ValueError(f"{name}: mamba_num_heads {heads} are not whole groups of n_groups {groups}")
    limit = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
    eps = float(config.layer_norm_epsilon)
    shape = MambaShape(
        num_heads=heads,
        head_dim=head_dim,
        state_size=int(config.ssm_state_size),
        num_groups=groups,
        conv_kernel=int(config.conv_kernel),
        intermediate_size=heads * head_dim,
        chunk_size=int(config.chunk_size),
        time_step_limit=(float(limit[0]), float(limit[1])),
        norm_eps=eps,
    )
    fields = shared_fields(config, (10000.0, None), eps)
    count = len(blocks)
    decoder = DecoderArch(
        **{**fields, "num_layers": count},
        sliding_window=None,
        architecture=name,
        norms=(("attn_pre", "norm"),),  # (each block's one norm, before its mixer)
        activation="relu2",
        plain_mlp=("up_proj", "down_proj"),
        layer_attention=(LayerAttention(fields["head_dim"] ** -0.5),) * count,
        ropes=((10000.0, None),),
        layer_rope=(None,) * count,  # (no block rotates: its attention has no positional embedding)
        renames=RENAMES,
    )
    mamba = tuple(i for i, kind in enumerate(blocks) if kind == "mamba")
    sparse = tuple(i for i, kind in enumerate(blocks) if kind == "moe")
    hybrid = HybridArch(mamba, shape, has_experts=bool(sparse))
    if not sparse:
        return NemotronHArch(decoder, hybrid, blocks)
    dense = tuple(i for i, kind in enumerate(blocks) if kind == "mlp")
    return NemotronHArch(decoder, hybrid, blocks, *_experts(config, sparse, dense))


def _experts(config: Any, sparse: tuple[int, ...], dense: tuple[int, ...]) -> tuple[MoeArch, GroupedTopK]:
    """The mixture-of-experts blocks' experts and routing (Nemotron 3)."""
    experts, groups = int(config.n_routed_experts), int(getattr(config, "n_group", 1) or 1)
    if experts % groups:
        raise ValueError(f"NemotronHForCausalLM: n_routed_experts {experts} are not whole groups of n_group {groups}")
    shared = getattr(config, "moe_shared_expert_intermediate_size", None)
    moe = MoeArch(
        num_experts=experts,
        top_k=int(config.num_experts_per_tok),
        expert_intermediate_size=int(config.moe_intermediate_size),
        renormalize=bool(config.norm_topk_prob),
        weights_in_model_dtype=False,
        shared_intermediate_size=int(shared) if shared else None,
        sparse_layers=sparse,
        prefix="mixer.",
        expert_names=("", "up_proj", "down_proj"),
        stacked_names=("experts.up_proj", "experts.down_proj"),
        ungated=True,
        latent_size=int(latent) if (latent := getattr(config, "moe_latent_size", None)) else None,
        dense_layers=dense,
    )
    routing = GroupedTopK(
        top_k=moe.top_k,
        scoring="sigmoid",
        method="noaux_tc",
        num_groups=groups,
        topk_groups=int(getattr(config, "topk_group", None) or groups),
        renormalize=moe.renormalize,
        scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
    )
    return moe, routing
