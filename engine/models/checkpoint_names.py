"""A generic-decoder checkpoint's tensors under the names (and in the layout) the Llama loader reads.

Families whose checkpoints name their tensors otherwise (Phi-2's self_attn.dense and final_layernorm, GPT-NeoX's
gpt_neox.embed_in, attention.query_key_value, embed_out; GPT-J's transformer.h, attn.out_proj; GPT-BigCode's wpe,
attn.c_attn; Falcon's self_attention, query_key_value by KV group) say so in their DecoderArch (`renames`, `ignored`,
`qkv_per_head`); the tensors are renamed here as they stream to the model, so the layer's reading stays one. Tensor
parallelism cuts the checkpoint's own names before this (engine/models/tensor_parallel.py).
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
    """Rows [kv_heads, group + 2, head_dim] (each KV group's `group` query heads, its k, its v: GPT-NeoX's view of
    query_key_value, one query per group; Falcon's new_decoder_architecture) -> all q rows (heads in order), then k's,
    then v's; a weight's or a bias's; the heads are this model's (a rank's own)."""
    if type(tensor) is not torch.Tensor:
        raise ValueError(
            f"{arch.architecture}: {name} is stored as {type(tensor).__name__}; its per-head rows "
            "are reordered as a float tensor"
        )
    kv_heads, head_dim = arch.num_kv_heads, arch.head_dim
    if tensor.shape[0] != arch.q_size + 2 * arch.kv_size:
        raise ValueError(
            f"{arch.architecture}: {name} has {tensor.shape[0]} rows, not {arch.q_size + 2 * arch.kv_size}"
        )
    grouped = tensor.reshape(kv_heads, arch.num_heads // kv_heads + 2, head_dim, *tensor.shape[1:])
    parts = (grouped[:, :-2], grouped[:, -2:-1], grouped[:, -1:])  # [kv_heads, n, head_dim, ...] each
    return torch.cat([part.reshape(-1, *tensor.shape[1:]) for part in parts]).contiguous()
