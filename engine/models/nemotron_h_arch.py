"""NVIDIA's Nemotron-H (NemotronHForCausalLM: Nemotron-H 8B / 47B / 56B, Nemotron Nano 2) read from its HF config.

Its layers are blocks of one mixer each, `h + mixer(RMSNorm(h))`, of the kind `layers_block_type` (or the older
`hybrid_override_pattern`) names: a Mamba-2 layer (`M`), attention without positional embedding (`*`), or a plain
MLP, up -> relu^2 -> down (`-`). Its checkpoints name the model `backbone.`, the embedding `embeddings` and the
final norm `norm_f`, and each block's mixer `mixer.`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.attention.layer_attention import LayerAttention
from engine.layers.recurrent_state import MambaShape
from engine.models.decoder_arch import DecoderArch
from engine.models.hybrid_arch import HybridArch
from engine.models.llama_arch import shared_fields

BLOCK_KINDS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
"""transformers' names of a block's mixer (`layers_block_type`) -> this server's."""
RENAMES = (("backbone.", "model."), ("model.embeddings.", "model.embed_tokens."), ("model.norm_f.", "model.norm."))


@dataclass(frozen=True, slots=True)
class NemotronHArch:
    decoder: DecoderArch  # the attention's and MLP's shapes; one norm per block (its `attn_pre`)
    hybrid: HybridArch
    blocks: tuple[str, ...]  # each layer's mixer: "mamba", "attention" or "mlp"


def read_nemotron_h(config: Any) -> NemotronHArch:
    """The config's blocks and shapes; ValueError naming a field or block kind this server does not compute."""
    name = "NemotronHForCausalLM"
    blocks = tuple(BLOCK_KINDS.get(kind, kind) for kind in config.layers_block_type)
    if "moe" in blocks:
        raise ValueError(f"{name}: mixture-of-experts blocks (E, Nemotron 3) are not served; mamba, attention, mlp are")
    unknown = sorted(set(blocks) - {"mamba", "attention", "mlp"})
    if unknown:
        raise ValueError(f"{name}: block types {unknown} are not served (mamba, attention, mlp)")
    refused = {
        "mamba_hidden_act": getattr(config, "mamba_hidden_act", "silu") != "silu",
        "mlp_hidden_act": getattr(config, "mlp_hidden_act", "relu2") != "relu2",
        "use_bias": bool(getattr(config, "use_bias", False)),
        "attention_bias": bool(getattr(config, "attention_bias", False)),
        "sliding_window": getattr(config, "sliding_window", None) is not None,
        "num_nextn_predict_layers": int(getattr(config, "num_nextn_predict_layers", 0) or 0) > 0,
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
    return NemotronHArch(decoder, HybridArch(mamba, shape, has_experts=False), blocks)
