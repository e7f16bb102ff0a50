"""Random paged attention steps and their float64 reference, for backends compared across devices.

A step is built the way the runner builds one: decodes first, then prefill chunks (a chunk may
continue a cached prefix); each request's blocks are scattered over the cache; the cached prefix
is already in the cache (the rest of the cache is finite garbage that must never be read); the
new tokens' K/V come with the batch and reach the cache through `slot_mapping`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch

from engine.attention.step_metadata import StepMetadata, step_metadata_for


@dataclass
class PagedRequest:
    """`seq_len` tokens in all, the last `query_len` of them new this step."""

    seq_len: int
    query_len: int
    blocks: list[int]
    keys: torch.Tensor  # [seq_len, kv_heads, head_dim]
    values: torch.Tensor
    queries: torch.Tensor  # [query_len, heads, head_dim]


@dataclass
class PagedStep:
    requests: list[PagedRequest]  # batch order, decodes first
    query: torch.Tensor  # [num_tokens, heads, head_dim]
    key: torch.Tensor  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]: cached prefixes written
    value_cache: torch.Tensor
    metadata: StepMetadata
    block_size: int


def slot_of(blocks: list[int], pos: int, block_size: int) -> int:
    return blocks[pos // block_size] * block_size + pos % block_size


def random_paged_step(
    shapes: list[tuple[int, int]],  # (seq_len, query_len) per request, decodes first
    num_decodes: int,
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_blocks: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device = torch.device("cpu"),
    value_std: float = 1.0,
    seed: int = 0,
) -> PagedStep:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen) * 10
    value_cache = torch.randn(cache_shape, generator=gen) * 10
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, unordered block tables
    requests = []
    for seq_len, query_len in shapes:
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        request = PagedRequest(
            seq_len,
            query_len,
            blocks,
            torch.randn(seq_len, num_kv_heads, head_dim, generator=gen),
            torch.randn(seq_len, num_kv_heads, head_dim, generator=gen) * value_std,
            torch.randn(query_len, num_heads, head_dim, generator=gen),
        )
        for pos in range(seq_len - query_len):  # the cached prefix
            slot = slot_of(blocks, pos, block_size)
            key_cache.view(-1, num_kv_heads, head_dim)[slot] = request.keys[pos]
            value_cache.view(-1, num_kv_heads, head_dim)[slot] = request.values[pos]
        requests.append(request)
    assert all(r.query_len == 1 for r in requests[:num_decodes])
    slots = [slot_of(r.blocks, p, block_size) for r in requests for p in range(r.seq_len - r.query_len, r.seq_len)]
    metadata = step_metadata_for(
        [(r.seq_len, r.query_len, r.blocks) for r in requests],
        torch.tensor(slots, dtype=torch.int64),
        num_decodes,
        device,
    )

    def batch(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors).to(device=device, dtype=dtype)

    return PagedStep(
        requests,
        batch([r.queries for r in requests]),
        batch([r.keys[r.seq_len - r.query_len :] for r in requests]),
        batch([r.values[r.seq_len - r.query_len :] for r in requests]),
        key_cache.to(device=device, dtype=dtype),
        value_cache.to(device=device, dtype=dtype),
        metadata,
        block_size,
    )


def reference_attention(
    step: PagedStep,
    scale: float,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal softmax attention in float64 over each request's own K/V (not the cache): [num_tokens, heads,
    head_dim], on the CPU. Query i of a request sits at position seq_len - query_len + i; with a `window` it
    sees the keys after its position - window; `softcap` caps the scaled scores (softcap * tanh(s / softcap));
    `sinks` [heads]: each head's logit is one more softmax column, with no value (HF's GPT-OSS eager attention)."""
    outputs = []
    for r in step.requests:
        q = r.queries.double()
        group = q.shape[1] // r.keys.shape[1]
        k = r.keys.double().repeat_interleave(group, dim=1)  # [seq_len, heads, head_dim]
        v = r.values.double().repeat_interleave(group, dim=1)
        query_pos = torch.arange(r.seq_len - r.query_len, r.seq_len)[:, None]
        key_pos = torch.arange(r.seq_len)[None, :]
        visible = key_pos <= query_pos  # [query_len, seq_len]
        if window is not None:
            visible &= key_pos > query_pos - window
        scores = torch.einsum("qhd,thd->hqt", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.double().cpu().view(-1, 1, 1).expand(-1, r.query_len, 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        outputs.append(torch.einsum("hqt,thd->qhd", probs, v))
    return torch.cat(outputs)
