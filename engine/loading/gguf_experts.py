"""llama.cpp's mixture-of-experts tensors under HF names: the router, Qwen2-MoE's shared expert, and each layer's
stacked experts cut into one matrix per expert.

llama.cpp stores a layer's experts stacked, one tensor per projection (shapes as torch sees them: GGUF lists
dims innermost first):

    blk.N.ffn_gate_exps.weight      [E, I, H]   -> <prefix>experts.e.<gate>.weight  [I, H]   for e < E
    blk.N.ffn_up_exps.weight        [E, I, H]   -> <prefix>experts.e.<up>.weight    [I, H]
    blk.N.ffn_down_exps.weight      [E, H, I]   -> <prefix>experts.e.<down>.weight  [H, I]
    blk.N.ffn_gate_inp.weight       [E, H]      -> <prefix>gate.weight (the router)
    blk.N.ffn_{gate,up,down}_shexp  [I_s, H]..  -> mlp.shared_expert.{gate,up,down}_proj.weight
    blk.N.ffn_gate_inp_shexp        [H]         -> mlp.shared_expert_gate.weight [1, H]

where prefix and the expert names are the HF family's: Mixtral (llama.cpp's `llama` with experts)
`block_sparse_moe.` and w1/w3/w2, Qwen2-MoE and Qwen3-MoE `mlp.` and gate_proj/up_proj/down_proj.

A quantized stack is E * rows rows of blocks, expert e's matrix the rows e * rows .. (e + 1) * rows - 1: each
expert is cut out as whole rows of blocks (exact) and read on its own (gguf_weights.py), so the model keeps
one copy of every expert, in the stack's block format, and multiplies each with the native kernels.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np


class MoeNames(NamedTuple):
    prefix: str  # the block's name in a layer
    experts: tuple[str, str, str]  # each expert's gate, up and down matrices


MOE_NAMES = {
    "llama": MoeNames("block_sparse_moe.", ("w1", "w3", "w2")),  # Mixtral
    "qwen2moe": MoeNames("mlp.", ("gate_proj", "up_proj", "down_proj")),
    "qwen3moe": MoeNames("mlp.", ("gate_proj", "up_proj", "down_proj")),
}
"""By GGUF `general.architecture`: what the HF family of its mixture-of-experts calls the block and experts."""

STACKS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
"""The stacked expert tensors, by their place in `MoeNames.experts`."""

SHARED_NAMES = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


def moe_names(architecture: str) -> MoeNames:
    names = MOE_NAMES.get(architecture)
    if names is None:
        raise KeyError(
            f"GGUF mixture-of-experts tensors of architecture {architecture!r} are not supported; "
            f"supported: {', '.join(sorted(MOE_NAMES))} (Mixtral, Qwen2-MoE, Qwen3-MoE)"
        )
    return names


def moe_layer_name(part: str, architecture: str) -> Optional[str]:
    """The HF name (in a layer, without `.weight`) of a router or shared-expert tensor; None for other parts."""
    if part == "ffn_gate_inp":
        return moe_names(architecture).prefix + "gate"
    return SHARED_NAMES.get(part)


def expert_name(part: str, architecture: str, expert: int) -> str:
    """The HF name (in a layer, without `.weight`) of expert `expert`'s matrix of stack `part`."""
    names = moe_names(architecture)
    return f"{names.prefix}experts.{expert}.{names.experts[STACKS[part]]}"


def split_stack(data: np.ndarray, shape: tuple[int, ...]) -> list[np.ndarray]:
    """A stack's data (float elements, or rows of blocks) of logical shape [E, rows, cols] -> E arrays of
    [rows, cols elements or row bytes]."""
    if len(shape) != 3:
        raise ValueError(f"a stacked expert tensor has 3 dimensions [experts, rows, columns], got {shape}")
    experts, rows = shape[0], shape[1]
    per_expert = np.ascontiguousarray(data).reshape(experts, rows, -1)
    return [per_expert[e] for e in range(experts)]
