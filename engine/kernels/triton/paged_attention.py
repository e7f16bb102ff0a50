"""The one entry point: decode kernel for a batch of single-token queries, prefill kernel otherwise."""

from __future__ import annotations

from typing import Optional

import torch

from engine.kernels.triton.paged_decode import _decode_partition_kernel, paged_decode
from engine.kernels.triton.paged_kv import fp8_widening
from engine.kernels.triton.paged_prefill import paged_prefill


def kv_widening(cache: torch.Tensor) -> int:
    """How the kernels widen `cache` when not told (`fp8_widening`): a caller that attends over one cache again
    and again asks once and passes it as `widening`, instead of the kernels asking the device at every call."""
    return fp8_widening(_decode_partition_kernel, cache)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32: KV length per request, its queries included
    block_table: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    max_query_len: int,
    *,
    out: Optional[torch.Tensor] = None,  # [T, H, D]
    window: Optional[int] = None,  # a sliding window: each query sees its last `window` keys
    softcap: Optional[float] = None,  # scores s -> softcap * tanh(s / softcap)
    sinks: Optional[torch.Tensor] = None,  # [H]: each head's logit in the softmax's denominator (no value)
    widening: Optional[int] = None,  # over an fp8 cache: how its bytes widen (paged_kv.fp8_widening)
) -> torch.Tensor:  # [T, H, D]
    """Causal paged attention of a flat batch of query chunks (K/V already written by `write_kv`).

    `max_query_len == 1` (every request decodes one token, so T == B and `cu_seqlens_q` is
    0, 1, .., B): the split-KV decode kernel, its partitions sized from the block table's width.
    Otherwise the prefill kernel for the whole batch, decode rows included (one-token chunks;
    their context is not split across programs).
    """
    if max_query_len == 1:
        if q.shape[0] != seq_lens.shape[0]:
            raise ValueError(
                f"max_query_len 1 needs one query per request: {q.shape[0]} queries, {seq_lens.shape[0]} requests"
            )
        return paged_decode(
            q,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            scale,
            out=out,
            window=window,
            softcap=softcap,
            sinks=sinks,
            widening=widening,
        )
    return paged_prefill(
        q,
        key_cache,
        value_cache,
        cu_seqlens_q,
        seq_lens,
        block_table,
        scale,
        max_query_len,
        out=out,
        window=window,
        softcap=softcap,
        sinks=sinks,
        widening=widening,
    )
