"""Granite 4.0's hybrid decoder (GraniteMoeHybridForCausalLM) read from its HF config: Granite's layer, whose token
mixer is, on the layers `layer_types` names so, a Mamba-2 layer instead of attention (Bamba's alike: Llama's layer
with partial RoPE, its attention layers by attn_layer_indices).

    attention layers   Granite's attention (attention_multiplier as its scale); RoPE where
                       position_embedding_type is "rope", else none (Granite 4.0-H's NoPE)
    Mamba-2 layers     layers/mamba2.py, shaped by the config's mamba_* fields
    every layer        the MLP: a mixture of experts with its shared expert (num_local_experts > 0: Granite MoE
                       shared's block), or the shared MLP alone as a dense gated MLP (num_local_experts 0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.errors import SettingsConflictError
from engine.layers.recurrent_state import MambaShape
from engine.models.decoder_arch import DecoderArch
from engine.models.families import bamba_arch, granite_arch

MAMBA_LAYER_TYPES = ("mamba", "linear_attention")
"""Granite 4.0's names of a Mamba-2 layer (its checkpoints' "mamba"; transformers 5 rewrites it "linear_attention")."""
ATTENTION_LAYER_TYPES = ("attention", "full_attention")

DENSE_RENAMES = (("shared_mlp.input_linear.", "mlp.gate_up_proj."), ("shared_mlp.output_linear.", "mlp.down_proj."))
"""Without experts, the shared MLP is each layer's whole MLP: gate|up stacked as the generic decoder's gate_up_proj."""


@dataclass(frozen=True, slots=True)
class HybridArch:
    """Which layers are recurrent (Mamba-2) layers, and their shape."""

    recurrent_layers: tuple[int, ...]
    mamba: MambaShape
    has_experts: bool


def read_hybrid(config: Any) -> HybridArch:
    """The config's Mamba-2 layers and shape; ValueError naming a field this server does not compute."""
    # (Bamba's config names them by attn_layer_indices: its layers_block_type)
    types = list(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or [])
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"{config.model_type}: layer_types must name each of the {config.num_hidden_layers} layers")
    unknown = sorted(set(types) - set(MAMBA_LAYER_TYPES) - set(ATTENTION_LAYER_TYPES))
    if unknown:
        raise ValueError(f"{config.model_type}: layer types {unknown} are not served (mamba, attention)")
    if getattr(config, "mamba_proj_bias", False):
        raise ValueError(f"{config.model_type}: mamba_proj_bias is not served")
    if config.hidden_act != "silu":
        raise ValueError(f"{config.model_type}: hidden_act {config.hidden_act!r} is not served (silu)")
    heads, groups = int(config.mamba_n_heads), int(config.mamba_n_groups)
    intermediate = int(config.mamba_expand * config.hidden_size)
    head_dim = int(config.mamba_d_head)
    if heads * head_dim != intermediate or heads % groups:
        raise ValueError(
            f"{config.model_type}: mamba_n_heads {heads} x mamba_d_head {head_dim} must be mamba_expand x hidden_size "
            f"({intermediate}), in whole groups of mamba_n_groups {groups}"
        )
    limit = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
    shape = MambaShape(
        num_heads=heads,
        head_dim=head_dim,
        state_size=int(config.mamba_d_state),
        num_groups=groups,
        conv_kernel=int(config.mamba_d_conv),
        intermediate_size=intermediate,
        chunk_size=int(config.mamba_chunk_size),
        time_step_limit=(float(limit[0]), float(limit[1])),
        norm_eps=float(config.rms_norm_eps),
    )
    mamba = tuple(i for i, kind in enumerate(types) if kind in MAMBA_LAYER_TYPES)
    return HybridArch(mamba, shape, int(getattr(config, "num_local_experts", 0) or 0) > 0)


def hybrid_decoder_arch(config: Any) -> DecoderArch:
    """The layer recipe of a hybrid decoder on the generic one: Bamba's or Granite 4.0-H's."""
    return bamba_arch(config) if config.model_type == "bamba" else granite_hybrid_arch(config)


def granite_hybrid_arch(config: Any) -> DecoderArch:
    """Granite's layer recipe; the attention layers rotate by RoPE only where position_embedding_type is "rope";
    without experts, the shared MLP read as the dense MLP."""
    arch = granite_arch(config)
    if getattr(config, "position_embedding_type", None) != "rope":
        arch = dataclasses.replace(arch, layer_rope=(None,) * config.num_hidden_layers)
    if not read_hybrid(config).has_experts:
        arch = dataclasses.replace(arch, renames=DENSE_RENAMES, intermediate_size=int(config.shared_intermediate_size))
    return arch


def check_mamba_shardable(shape: MambaShape, world_size: int) -> None:
    """SettingsConflictError unless the Mamba-2 heads divide among `world_size` ranks and the groups of B and C do
    too, or are one group every rank holds (vLLM's rule)."""
    problems = []
    if shape.num_heads % world_size:
        problems.append(f"{shape.num_heads} Mamba-2 heads (mamba_n_heads)")
    if shape.num_groups % world_size and shape.num_groups != 1:
        problems.append(f"{shape.num_groups} Mamba-2 groups (mamba_n_groups: a multiple of the ranks, or 1)")
    if problems:
        raise SettingsConflictError(
            f"--tensor-parallel-size {world_size} does not divide the model's {', '.join(problems)}"
        )


def shard_mamba(shape: MambaShape, world_size: int) -> MambaShape:
    """One rank's Mamba-2 layer: its share of the heads (their x, dt, A, D, gate and norm channels) and of the
    groups of B and C, or the one group whole, whose norm then spans every rank."""
    check_mamba_shardable(shape, world_size)
    split_groups = shape.num_groups % world_size == 0
    return dataclasses.replace(
        shape,
        num_heads=shape.num_heads // world_size,
        intermediate_size=shape.intermediate_size // world_size,
        num_groups=shape.num_groups // world_size if split_groups else 1,
        norm_ranks=1 if split_groups else world_size,
    )
