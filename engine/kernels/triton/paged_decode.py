"""Paged decode attention: one query token per request, split over the context ("flash-decoding").

    context of request b:  [ partition 0 | partition 1 | ... | partition P-1 ]   PARTITION tokens each
                                 |              |                   |
    pass 1 (grid B x KVH x P):  m, l, acc     m, l, acc          m, l, acc      per query head of the KV head
    pass 2 (grid B x H):        out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p,   M = max_p m_p

A pass-1 program takes one KV head and all the query heads that share it (GQA): their
`group` query rows, padded to a tile of BLOCK_M >= 16 rows, multiply each K/V tile read once.
When the context fits one partition, pass 1 writes the normalized output and pass 2 is skipped.
Partitions past a request's length exit at once, so the grid can be sized from the block
table's width (no device-to-host read of the lengths; a fixed grid for CUDA graphs).
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

DEFAULT_PARTITION_SIZE = 512
MAX_PARTITIONS = 64
"""Past DEFAULT_PARTITION_SIZE x MAX_PARTITIONS tokens the partitions grow instead (a CUDA graph sizes its
grid for max_model_len: at 128k tokens, 64 partitions of 2048, not 256 of 512 with their scratch and a
256-wide reduction)."""
"""Context tokens per pass-1 program (vLLM's choice): long contexts spread over more programs."""


@triton.jit
def _decode_partition_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, block_size, KVH, D]
    block_table_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, H, D]: written when not SPLIT
    part_acc_ptr,  # [B, H, P, D] float32: unnormalized partial outputs, when SPLIT
    part_max_ptr,
    part_sum_ptr,  # [B, H, P] float32: running max (log2 domain) and sum of exp2
    sinks_ptr,  # [H] float32, log2 units: read when SINKS
    scale_log2,
    window,
    cap_in,
    cap_out,
    block_size,
    stride_q_seq,
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
    stride_o_seq,
    stride_o_head,
    stride_o_dim,
    num_partitions,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION
    end = tl.minimum(start + PARTITION, seq_len)
    if WINDOW:  # the query (position seq_len - 1) sees the last `window` keys
        start = tl.maximum(start, seq_len - window)
    if start >= end:
        return  # past the context, or (WINDOW) before it: the reduction skips this partition

    rows = tl.arange(0, BLOCK_M)  # query heads of this KV head, padded
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    lanes = tl.arange(0, HEAD_DIM_PAD)
    lane_mask = lanes < HEAD_DIM
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + lanes[None, :] * stride_q_dim
    q = load_for_dot(q_ptrs, row_mask[:, None] & lane_mask[None, :], UPCAST)  # [BLOCK_M, HEAD_DIM_PAD]

    table = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kc_head
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vc_head
    # every tile holds >= 1 valid token, so m turns finite at once
    acc, l_i, m_i = attend_tiles(
        q,
        rows,
        table,
        k_head,
        v_head,
        start,
        end,
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
        False,
        UPCAST,
        DOT_PRECISION,
        False,
        SOFTCAP,
        q_ptr.dtype.element_ty,
        KV_FP8,
    )

    out_mask = row_mask[:, None] & lane_mask[None, :]
    if SPLIT:
        # [B, H, P] and [B, H, P, D], contiguous
        stat = (seq * tl.num_programs(1) * GROUP + heads).to(tl.int64) * num_partitions + part
        tl.store(part_max_ptr + stat, m_i, mask=row_mask)
        tl.store(part_sum_ptr + stat, l_i, mask=row_mask)
        tl.store(part_acc_ptr + stat[:, None] * HEAD_DIM + lanes[None, :], acc, mask=out_mask)
    else:
        if SINKS:
            out = acc * sink_normalizer(m_i, l_i, tl.load(sinks_ptr + heads, mask=row_mask, other=0.0))[:, None]
        else:
            out = acc / l_i[:, None]
        o_row = out_ptr + seq.to(tl.int64) * stride_o_seq
        o_ptrs = o_row + heads[:, None] * stride_o_head + lanes[None, :] * stride_o_dim
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr,  # [B, H, P, D] float32
    part_max_ptr,
    part_sum_ptr,  # [B, H, P] float32
    seq_lens_ptr,  # [B]
    sinks_ptr,  # [H] float32, log2 units: read when SINKS
    out_ptr,  # [B, H, D]
    stride_o_seq,
    stride_o_head,
    stride_o_dim,
    num_partitions,
    window,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTITIONS_PAD: tl.constexpr,
    PARTITION: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
):
    """One program per (request, query head): combine the partitions that hold its context (its window's); a
    sink joins the denominator as a partition of no value."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, PARTITION)
    parts = tl.arange(0, PARTITIONS_PAD)
    part_mask = parts < used
    if WINDOW:
        part_mask = part_mask & (parts >= tl.maximum(seq_len - window, 0) // PARTITION)
    stat = (seq * tl.num_programs(1) + head).to(tl.int64) * num_partitions + parts  # [PARTITIONS_PAD]
    m = tl.load(part_max_ptr + stat, mask=part_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + stat, mask=part_mask, other=0.0)
    top = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head)
        top = tl.maximum(top, sink)
    weight = tl.exp2(m - top)  # 0 for unused partitions
    lanes = tl.arange(0, HEAD_DIM_PAD)
    lane_mask = lanes < HEAD_DIM
    acc = tl.load(
        part_acc_ptr + stat[:, None] * HEAD_DIM + lanes[None, :],
        mask=part_mask[:, None] & lane_mask[None, :],
        other=0.0,
    )  # [PARTITIONS_PAD, HEAD_DIM_PAD]
    denominator = tl.sum(l * weight, 0)
    if SINKS:
        denominator += tl.exp2(sink - top)
    out = tl.sum(acc * weight[:, None], 0) / denominator
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + lanes * stride_o_dim
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=lane_mask)


def paged_decode(
    q: torch.Tensor,  # [B, H, D]: one query token per request
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length of each request, the query token included (>= 1)
    scale: float,
    *,
    max_seq_len: Optional[int] = None,
    partition_size: Optional[int] = None,
    out: Optional[torch.Tensor] = None,  # [B, H, D]
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,  # [H]: each head's sink logit
    widening: Optional[int] = None,  # over an fp8 cache: how its bytes widen (default: fp8_widening's)
) -> torch.Tensor:  # [B, H, D]
    """Attention of each request's query token over the first `seq_lens[b]` tokens of its blocks (the last
    `window` of them with a sliding window; scores soft-capped by `softcap`; each head's `sinks` logit in the
    softmax's denominator).

    The number of partitions comes from `max_seq_len` when given (>= every `seq_lens[b]`: a longer
    context would be cut), else from the block table's width (`max_blocks * block_size`: no host read
    of `seq_lens`, a grid fixed for a CUDA graph). `partition_size` is a power of two >= 16; by default
    DEFAULT_PARTITION_SIZE, or larger so that there are at most MAX_PARTITIONS.
    """
    _, block_size, num_kv_heads, head_dim = check_cache(key_cache, value_cache)
    batch, num_heads, q_dim = q.shape
    _check_decode_inputs(q, key_cache, block_table, seq_lens, num_heads, num_kv_heads, head_dim, q_dim)
    max_context = max_seq_len if max_seq_len is not None else block_table.shape[1] * block_size
    partition_size, num_partitions = decode_partitions(max_context, partition_size)
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape:
        raise ValueError(f"out must be shaped like q {tuple(q.shape)}, got {tuple(out.shape)}")
    if batch == 0:
        return out
    split = num_partitions > 1
    group = num_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    if split:
        part_acc = torch.empty((batch, num_heads, num_partitions, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((batch, num_heads, num_partitions), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    _decode_partition_kernel[(batch, num_kv_heads, num_partitions)](
        q,
        as_bytes(key_cache),
        as_bytes(value_cache),
        block_table,
        seq_lens,
        out,
        part_acc,
        part_max,
        part_sum,
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
        num_partitions,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=min(64, partition_size),
        PARTITION=partition_size,
        SPLIT=split,
        UPCAST=needs_upcast(_decode_partition_kernel, q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
        WINDOW=window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        KV_FP8=fp8_widening(_decode_partition_kernel, key_cache, widening),
    )
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            part_acc,
            part_max,
            part_sum,
            seq_lens,
            sinks_log2(sinks, q),
            out,
            *out.stride(),
            num_partitions,
            window or 0,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            PARTITIONS_PAD=triton.next_power_of_2(num_partitions),
            PARTITION=partition_size,
            WINDOW=window is not None,
            SINKS=sinks is not None,
        )
    return out


def decode_partitions(max_context: int, partition_size: Optional[int] = None) -> tuple[int, int]:
    """(partition size, number of partitions) for contexts up to `max_context` tokens."""
    if partition_size is None:
        partition_size = max(DEFAULT_PARTITION_SIZE, triton.next_power_of_2(triton.cdiv(max_context, MAX_PARTITIONS)))
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    return partition_size, max(1, triton.cdiv(max_context, partition_size))


def _check_decode_inputs(q, key_cache, block_table, seq_lens, num_heads, num_kv_heads, head_dim, q_dim) -> None:
    check_query(q, key_cache)
    if q_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query [B, {num_heads}, {q_dim}] does not fit {num_kv_heads} KV heads of dim {head_dim}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or seq_lens.shape != (q.shape[0],):
        raise ValueError(
            f"block_table must be [{q.shape[0]}, max_blocks] and seq_lens [{q.shape[0]}], "
            f"got {tuple(block_table.shape)} and {tuple(seq_lens.shape)}"
        )
