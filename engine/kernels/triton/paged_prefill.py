"""Paged prefill/extend attention: variable-length query chunks, causal over each request's cache.

Request b's queries are rows `[cu_seqlens_q[b], cu_seqlens_q[b+1])` of the flat batch and the
last `query_len` positions of its context of `seq_lens[b]` tokens, whose K/V (the new tokens'
included) are already in the cache:

    positions  0 ............ seq_len - query_len ........... seq_len - 1
               [ cached prefix ][ this chunk's queries (and their K/V) ]
    query i (position seq_len - query_len + i) sees keys 0 .. seq_len - query_len + i

A program takes BLOCK_Q query tokens of one request and one KV head, with the `group`
query heads that share it stacked into the rows of one tile (GQA: K/V tiles read once):

    row r  ->  token  r // group,  head  kv_head * group + r % group      (BLOCK_Q = BLOCK_M // group)

It covers whole prefills (no prefix), chunked prefill and prefix-cache hits, and one-token
rows (decodes in a mixed batch).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from engine.kernels.triton.paged_kv import (
    LOG2_E,
    attend_tiles,
    as_bytes,
    check_cache,
    check_query,
    dot_precision,
    fp8_widening,
    load_for_dot,
    needs_upcast,
    sink_normalizer,
    sinks_log2,
    softcap_factors,
)


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, KVH, D]
    block_table_ptr,  # [B, max_blocks]
    cu_seqlens_q_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    out_ptr,  # [T, H, D]
    sinks_ptr,  # [H] float32, log2 units: read when SINKS
    scale_log2,
    window,
    cap_in,
    cap_out,
    block_size,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    stride_bt_seq,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first = q_tile * BLOCK_Q  # this tile's first query of the request
    if first >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - query_len  # position of query 0

    rows = tl.arange(0, BLOCK_M)
    token_in_tile = rows // GROUP
    query_idx = first + token_in_tile  # [BLOCK_M]
    row_mask = (token_in_tile < BLOCK_Q) & (query_idx < query_len)
    query_pos = prefix + query_idx  # padding rows get positions past the context: never all masked
    heads = kv_head * GROUP + rows % GROUP
    lanes = tl.arange(0, HEAD_DIM_PAD)
    lane_mask = lanes < HEAD_DIM
    q_rows = (q_start + query_idx).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_q_tok + heads[:, None] * stride_q_head + lanes[None, :] * stride_q_dim
    q = load_for_dot(q_ptrs, row_mask[:, None] & lane_mask[None, :], UPCAST)  # [BLOCK_M, HEAD_DIM_PAD]

    table = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kc_head
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vc_head
    kv_end = tl.minimum(seq_len, prefix + first + BLOCK_Q)  # keys past the tile's last query are never seen
    kv_start = 0  # without a window key 0 is visible to every row: m turns finite after the first tile
    if WINDOW:  # keys before the tile's first query's window are never seen
        kv_start = tl.maximum(prefix + first - window + 1, 0)
    acc, l_i, m_i = attend_tiles(
        q,
        query_pos,
        table,
        k_head,
        v_head,
        kv_start,
        kv_end,
        lanes,
        lane_mask,
        block_size,
        stride_kc_block,
        stride_kc_slot,
        stride_kc_dim,
        stride_vc_block,
        stride_vc_slot,
        stride_vc_dim,
        scale_log2,
        window,
        cap_in,
        cap_out,
        BLOCK_M,
        BLOCK_N,
        HEAD_DIM_PAD,
        True,
        UPCAST,
        DOT_PRECISION,
        WINDOW,
        SOFTCAP,
        q_ptr.dtype.element_ty,
        KV_FP8,
    )

    if WINDOW:  # a padding row (past the chunk) may see no key in its window: 0 / 0 where it is never stored
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    if SINKS:  # a row that saw nothing (padding) has l 0, m 0 or -inf: its output is 0, never stored
        out = acc * sink_normalizer(m_i, l_i, tl.load(sinks_ptr + heads, mask=row_mask, other=0.0))[:, None]
    else:
        out = acc / l_i[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_o_tok + heads[:, None] * stride_o_head + lanes[None, :] * stride_o_dim
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & lane_mask[None, :])


def prefill_tiles(group: int, head_dim: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N). Query rows: the batch's longest chunk times the group, between 16 and 64
    (and at least the group: one token of every query head of a KV head), so a batch of short chunks
    (decodes in a mixed batch) does not pad to 64 rows. Keys in tiles of 64, 32 for heads over 128."""
    rows = triton.next_power_of_2(max_query_len * group)
    block_m = max(16, triton.next_power_of_2(group), min(64, rows))
    block_n = 32 if head_dim > 128 else 64
    return block_m, block_n


def paged_prefill(
    q: torch.Tensor,  # [T, H, D]: the batch's query tokens, request after request
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32: request b's queries are rows cu[b] .. cu[b+1]-1
    seq_lens: torch.Tensor,  # [B] int32: KV length of each request, its queries included
    block_table: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    max_query_len: int,
    *,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    out: Optional[torch.Tensor] = None,  # [T, H, D]
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,  # [H]: each head's sink logit
    widening: Optional[int] = None,  # over an fp8 cache: how its bytes widen (default: fp8_widening's)
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each request's query chunk over its cached context (prefix + chunk); with a
    sliding `window` each query sees its last `window` keys; scores soft-capped by `softcap`; each head's
    `sinks` logit in the softmax's denominator.

    `max_query_len` (a host int, >= every request's query length: longer chunks would be cut) sizes
    the grid and the query tile. `block_m` and `block_n` (powers of two, block_m >= 16 and >= the GQA
    group, block_n >= 16) override the tiles.
    """
    _, block_size, num_kv_heads, head_dim = check_cache(key_cache, value_cache)
    num_tokens, num_heads, q_dim = q.shape
    batch = seq_lens.shape[0]
    check_query(q, key_cache)
    if q_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query [T, {num_heads}, {q_dim}] {q.dtype} does not fit the cache's {num_kv_heads} "
            f"KV heads of dim {head_dim} ({key_cache.dtype})"
        )
    if cu_seqlens_q.shape != (batch + 1,) or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"cu_seqlens_q must be [{batch + 1}] and block_table [{batch}, max_blocks], "
            f"got {tuple(cu_seqlens_q.shape)} and {tuple(block_table.shape)}"
        )
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape:
        raise ValueError(f"out must be shaped like q {tuple(q.shape)}, got {tuple(out.shape)}")
    if batch == 0 or num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    default_m, default_n = prefill_tiles(group, head_dim, max_query_len)
    block_m, block_n = block_m or default_m, block_n or default_n
    if block_m < max(16, group) or block_n < 16 or block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError(
            f"block_m ({block_m}) and block_n ({block_n}) must be powers of two >= 16, block_m >= the group ({group})"
        )
    block_q = block_m // group
    grid = (batch, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        q,
        as_bytes(key_cache),
        as_bytes(value_cache),
        block_table,
        cu_seqlens_q,
        seq_lens,
        out,
        sinks_log2(sinks, q),
        scale * LOG2_E,
        window or 0,
        *softcap_factors(scale, softcap),
        block_size,
        *q.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        block_table.stride(0),
        *out.stride(),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        UPCAST=needs_upcast(_prefill_kernel, q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
        WINDOW=window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        KV_FP8=fp8_widening(_prefill_kernel, key_cache, widening),
    )
    return out
