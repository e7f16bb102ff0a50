"""Tensor parallelism for the Llama family: each rank's share of the heads and of the MLP's width, and its slice
of every checkpoint tensor (Megatron's column- and row-parallel layers).

    q|k|v, gate|up   column-parallel: rank r keeps its heads' rows (its query heads, and the KV heads they read)
                     and its share of the intermediate rows; no communication
    o_proj, down     row-parallel: rank r keeps the matching input columns; its product is a partial sum,
                     all-reduced after the layer (the model's `tp.all_reduce`); the bias joins on rank 0 only
    embed, lm_head   vocab-parallel: rank r keeps its slice of the vocabulary's rows, zero-padded to
                     ceil(vocab / ranks) rows (engine/layers/vocab_parallel.py); tied, one slice serves both
    norms            replicated

With fewer KV heads than ranks (GQA), the KV heads are replicated: rank r reads KV head r * kv_heads // ranks,
the one its query heads share; each rank's KV cache holds its own KV heads only.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Iterator

import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.errors import SettingsConflictError
from engine.layers.vocab_parallel import VocabParallel
from engine.models.llama_arch import LlamaArch

_LAYER = re.compile(r"(?:model\.)?layers\.\d+\.(.+)")
_COLUMN = ("self_attn.q_proj.", "mlp.gate_proj.", "mlp.up_proj.")  # rows split evenly
_KV = ("self_attn.k_proj.", "self_attn.v_proj.")
_ROW = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # input columns split
_ROW_BIAS = ("self_attn.o_proj.bias", "mlp.down_proj.bias")  # added once (rank 0)
_VOCAB = re.compile(r"(?:model\.)?embed_tokens\.weight|lm_head\.weight")  # rows split by vocab_parallel


def check_shardable(arch: LlamaArch, world_size: int) -> None:
    """SettingsConflictError unless heads, KV heads and the MLP width divide among `world_size` ranks."""
    problems = []
    if arch.num_heads % world_size:
        problems.append(f"{arch.num_heads} attention heads")
    if arch.num_kv_heads % world_size and world_size % arch.num_kv_heads:
        problems.append(f"{arch.num_kv_heads} KV heads (neither a multiple nor a divisor of the ranks)")
    if arch.intermediate_size % world_size:
        problems.append(f"intermediate size {arch.intermediate_size}")
    if problems:
        raise SettingsConflictError(
            f"--tensor-parallel-size {world_size} does not divide the model's {', '.join(problems)}"
        )


def shard_arch(arch: LlamaArch, world_size: int) -> LlamaArch:
    """One rank's shape: its query heads, its KV heads (one, replicated, when there are fewer than ranks), its
    share of the MLP width."""
    check_shardable(arch, world_size)
    return dataclasses.replace(
        arch,
        num_heads=arch.num_heads // world_size,
        num_kv_heads=max(arch.num_kv_heads // world_size, 1),
        intermediate_size=arch.intermediate_size // world_size,
    )


def shard_weights(
    weights: Iterable[tuple[str, Any]], arch: LlamaArch, tp: ParallelGroup
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (HF-named) tensors of the whole model `arch`, each cut to rank `tp.rank`'s slice."""
    rank, ranks = tp.rank, tp.world_size
    head_dim = arch.head_dim
    kv_rank_heads = max(arch.num_kv_heads // ranks, 1)
    first_kv_head = rank * arch.num_kv_heads // ranks  # (replicated heads: the one this rank's queries read)
    vocab = VocabParallel(arch.vocab_size, tp)
    for name, tensor in weights:
        match = _LAYER.fullmatch(name)
        if match is None and _VOCAB.fullmatch(name) is None:
            yield name, tensor  # the final norm
            continue
        if not isinstance(tensor, torch.Tensor):
            raise SettingsConflictError(
                f"tensor parallelism takes float checkpoint tensors; {name} is stored as {type(tensor).__name__} "
                "(serve quantized weights with --tensor-parallel-size 1)"
            )
        if match is None:
            yield name, vocab.shard(tensor)
            continue
        part = match.group(1)
        if part.startswith(_COLUMN):
            yield name, tensor.chunk(ranks, dim=0)[rank].contiguous()
        elif part.startswith(_KV):
            rows = slice(first_kv_head * head_dim, (first_kv_head + kv_rank_heads) * head_dim)
            yield name, tensor[rows].contiguous()
        elif part in _ROW:
            yield name, tensor.chunk(ranks, dim=1)[rank].contiguous()
        elif part in _ROW_BIAS:
            yield name, tensor if rank == 0 else torch.zeros_like(tensor)
        else:
            yield name, tensor  # norms (Qwen3's per-head q/k norms are one head wide: the same on every rank)
