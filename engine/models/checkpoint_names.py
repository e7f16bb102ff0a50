"""A generic-decoder checkpoint's tensors under the names (and in the layout) the Llama loader reads.

Families whose checkpoints name their tensors otherwise (Phi-2's self_attn.dense and final_layernorm, GPT-NeoX's
gpt_neox.embed_in, attention.query_key_value, embed_out; GPT-J's transformer.h, attn.out_proj; GPT-BigCode's wpe,
attn.c_attn) say so in their DecoderArch (`renames`, `ignored`, `qkv_per_head`); the tensors are renamed here as they
stream to the model, so the layer's reading stays one. Tensor parallelism cuts the checkpoint's own names before this
(engine/models/tensor_parallel.py).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from engine.models.decoder_arch import DecoderArch


def llama_names(weights: Iterable[tuple[str, Any]], arch: DecoderArch) -> Iterator[tuple[str, Any]]:
    """Each tensor by Llama's name (`arch.renames` replaced in turn), those `arch.ignored` dropped, a per-head fused
    qkv reordered into q | k | v."""
    for name, tensor in weights:
        if name.endswith(arch.ignored) and arch.ignored:
            continue  # (GPT-NeoX's causal-mask buffers, saved by old transformers)
        for old, new in arch.renames:
            name = name.replace(old, new)
        if arch.qkv_per_head and ".self_attn.qkv_proj." in name:
            tensor = _qkv_by_part(name, tensor, arch)
        yield name, tensor


def _qkv_by_part(name: str, tensor: Any, arch: DecoderArch) -> torch.Tensor:
    """Rows [heads, 3, head_dim] (each head's q, k, v: GPT-NeoX's view of query_key_value) -> [3, heads, head_dim]
    (all q rows, then k's, then v's), a weight's or a bias's; the heads are this model's (a rank's own)."""
    if type(tensor) is not torch.Tensor:
        raise ValueError(
            f"{arch.architecture}: {name} is stored as {type(tensor).__name__}; its per-head rows "
            "are reordered as a float tensor"
        )
    rows = (arch.num_heads, 3, arch.head_dim)
    if tensor.shape[0] != arch.num_heads * 3 * arch.head_dim:
        raise ValueError(f"{arch.architecture}: {name} has {tensor.shape[0]} rows, not 3 x {arch.q_size}")
    return tensor.reshape(*rows, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape).contiguous()
