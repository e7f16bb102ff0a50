"""Storing the new tokens' K and V into the paged cache through `slot_mapping`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.paged_kv import FP8_DTYPES, as_bytes, check_cache


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]
    block_size,
    stride_k_tok,
    stride_k_head,
    stride_k_dim,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """One program per token: its [num_kv_heads, head_dim] K and V tiles to slot s,
    i.e. block s // block_size, offset s % block_size. A negative slot writes nothing."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PAD)
    lanes = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (lanes < HEAD_DIM)[None, :]  # [HEADS_PAD, HEAD_DIM_PAD]

    k = tl.load(
        key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + lanes[None, :] * stride_k_dim, mask=mask
    )
    v = tl.load(
        value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + lanes[None, :] * stride_v_dim, mask=mask
    )
    kc = key_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    vc = value_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    tl.store(kc + heads[:, None] * stride_kc_head + lanes[None, :] * stride_kc_dim, k, mask=mask)
    tl.store(vc + heads[:, None] * stride_vc_head + lanes[None, :] * stride_vc_dim, v, mask=mask)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64 or int32: block_id * block_size + offset
) -> None:
    """`key_cache.view(-1, H, D)[slot_mapping] = key` (and V): the torch backend's `index_copy_`.

    Token j goes to slot `slot_mapping[j]`; no other slot is touched. A negative slot is
    skipped (a padding token). Strided inputs (views of a fused QKV projection) are read in place;
    K/V are stored in the caches' dtype. Into an fp8 cache they come already converted (their scale is the
    caller's), and their bytes are copied.
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_cache(key_cache, value_cache)
    num_tokens = slot_mapping.shape[0]
    for name, t in (("key", key), ("value", value)):
        if t.shape != (num_tokens, num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [{num_tokens}, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}")
        if (t.dtype in FP8_DTYPES or key_cache.dtype in FP8_DTYPES) and t.dtype != key_cache.dtype:
            raise ValueError(f"{name} is {t.dtype} for a {key_cache.dtype} cache: fp8 K/V go to a cache of their dtype")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        as_bytes(key),
        as_bytes(value),
        as_bytes(key_cache),
        as_bytes(value_cache),
        slot_mapping,
        block_size,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
