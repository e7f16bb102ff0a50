"""A generic-decoder checkpoint's tensors under the names (and in the layout) the Llama loader reads.

Families whose checkpoints name their tensors otherwise (Phi-2's self_attn.dense and final_layernorm, GPT-NeoX's
gpt_neox.embed_in, attention.query_key_value, embed_out; GPT-J's transformer.h, attn.out_proj; GPT-BigCode's wpe,
attn.c_attn; Falcon's self_attention, query_key_value by KV group) say so in their DecoderArch (`renames`, `ignored`,
`qkv_per_head`); the tensors are renamed here as they stream to the model, so the layer's reading stays one.
Families whose RoPE turns interleaved pairs have q's and k's rows reordered into halves (`rope_interleaved`).
Tensor parallelism cuts the checkpoint's own names before this (engine/models/tensor_parallel.py). A LoRA
adapter's B matrices go through the same transform, under their base matrix's name (engine/lora/adapter_layout.py).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from engine.models.decoder_arch import DecoderArch


def checkpoint_rows(weights: Iterable[tuple[str, Any]], arch: DecoderArch) -> Iterable[tuple[str, Any]]:
    """The checkpoint's tensors as the model reads them: Llama's names, q | k | v, RoPE halves."""
    if arch.renames or arch.ignored or arch.qkv_per_head or arch.base_prefix:
        weights = llama_names(weights, arch)
    if arch.attention_gate:
        weights = gated_queries(weights, arch)
    return rope_halves(weights, arch) if arch.rope_interleaved else weights


def gated_queries(weights: Iterable[tuple[str, Any]], arch: DecoderArch) -> Iterator[tuple[str, Any]]:
    """Qwen3.5's q_proj, whose rows per head are [q_h; gate_h] (head_dim each), as q_proj (the heads' q rows) and
    gate_proj (their gate rows); a tensor-parallel rank's shard holds whole heads, so it splits alike."""
    for name, tensor in weights:
        if name.endswith(".self_attn.q_proj.weight"):
            per_head = tensor.unflatten(0, (-1, 2, arch.head_dim))  # [heads, 2, head_dim, hidden]
            yield name, per_head[:, 0].flatten(0, 1).contiguous()
            yield name.replace(".q_proj.", ".gate_proj."), per_head[:, 1].flatten(0, 1).contiguous()
        elif name.endswith(".self_attn.q_proj.bias"):
            raise ValueError(f"{arch.architecture}: {name}: a gated q_proj's bias is not served")
        else:
            yield name, tensor


def rope_halves(weights: Iterable[tuple[str, Any]], arch: DecoderArch) -> Iterator[tuple[str, Any]]:
    """Each head's rows of q and k (their projections, biases and norm weights) from the checkpoint's interleaved
    rotary pairs (x0, x1, x2, x3, ...) to the halves the rotary turns (x0, x2, ..., x1, x3, ...); dimensions past
    rotary_dim keep their place. q and k move alike, so every score is the same; a norm over a head's dimensions
    does not depend on their order."""
    head_dim = arch.head_dim
    rotated = arch.rotary_dim or head_dim
    order = torch.cat([torch.arange(0, rotated, 2), torch.arange(1, rotated, 2), torch.arange(rotated, head_dim)])
    for name, tensor in weights:
        part = name.rsplit(".", 2)
        if len(part) == 3 and part[1] in ("q_norm", "k_norm") and name.endswith(".weight"):
            tensor = tensor.reshape(-1, head_dim)[:, order].reshape(tensor.shape)
        elif len(part) == 3 and part[1] in ("q_proj", "k_proj", "qkv_proj"):
            if part[1] == "qkv_proj":  # v's rows would move too: no family fuses them and interleaves
                raise ValueError(f"{arch.architecture}: {name}: interleaved RoPE over a fused qkv_proj")
            tensor = tensor.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)  # [rows, ...] per head
        yield name, tensor


def llama_names(weights: Iterable[tuple[str, Any]], arch: DecoderArch) -> Iterator[tuple[str, Any]]:
    """Each tensor by Llama's name (`arch.renames` replaced in turn, after a base model's names get the causal LM's
    `base_prefix`), those `arch.ignored` dropped, a per-head fused qkv reordered into q | k | v."""
    prefix = arch.base_prefix
    heads = ("lm_head.", *(old for old, new in arch.renames if new.startswith("lm_head.")))  # (outside the prefix)
    for name, tensor in weights:
        if name.endswith(arch.ignored) and arch.ignored:
            continue  # (GPT-NeoX's causal-mask buffers, saved by old transformers)
        if prefix and not name.startswith((prefix, *heads)):
            name = prefix + name
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
