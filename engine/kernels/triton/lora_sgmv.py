"""Segmented LoRA products for a batch whose tokens use different adapters (Punica's SGMV), in Triton (CUDA;
tests run them on CPU tensors under Triton's interpreter).

    lora_shrink(x [T, in], a_stack [S, r, in], token_slots [T] | [T, M] int32, scales [T] | [T, M] float32,
                out [T, r] | [T, M, r])
        out[t, m] = scales[t, m] * x[t] @ a_stack[token_slots[t, m]]^T      (zeros where the slot is -1)
    lora_expand(y [T, r] | [T, M, r], b_stack [S, out_dim, r], token_slots [T] | [T, M],
                out [T, out_total], offset, add)
        out[t, offset:offset + out_dim] (+)= sum over m of y[t, m] @ b_stack[token_slots[t, m]]^T

S adapters are stacked (rank padded to r with zeros); slot -1 is "no adapter". M > 1 is a weighted mix of
adapters in one request: the shrink keeps one row per part (its scale applied), the expand sums the parts,
since sum_m s_m B_m A_m x cannot be formed from sum_m s_m A_m x. A fused output (q|k|v, gate|up) takes one
expand per slice, each at its column `offset`; `add` accumulates onto the base layer's output in float32.

Sort-free: a program takes BLOCK_M consecutive tokens (or, with `token_order`, BLOCK_M tokens of that
permutation) and serves each adapter present among them in turn, smallest slot first:

    tile rows   slots [2, 0, 2, -1]      pass 1: slot 0, rows {1}     masked rows load zeros, so each
                                         pass 2: slot 2, rows {0, 2}  row's sum gets its own slot's
                                                                      product only; -1 rows none

so one tile of one adapter (prefill, or tokens ordered by `group_by_slot`) costs one pass: a dense
BLOCK_M x BLOCK_N product over the reduction, each weight tile read once for all its rows. A decode batch
of many adapters in request order costs one pass per distinct adapter in a tile; `group_by_slot` once per
step (one argsort, shared by every layer) brings that to one or two. The shrink's reduction (in, up to
8192) splits into `split_k` ranges when the tiles alone cannot fill the GPU (decode); their float32
partials are summed in a fixed order (no atomics), so a token's result does not depend on timing.

What the others do: Punica's SGMV takes segments (`s[i]:s[i+1]` rows use adapter i, the batch sorted by
adapter) and pointers to each adapter's matrices, through CUTLASS grouped GEMMs (and a custom shrink for
ranks 16-128); its BGMV serves decode with one adapter index per token. vLLM's Triton `lora_shrink` /
`lora_expand` sort tokens by adapter (argsort, per-adapter counts and starts, computed once per step),
launch a grid over (tiles, slices, active adapters) in which programs past their adapter's token count
exit, split the shrink's reduction with atomic adds into a zeroed float32 buffer, cast the expand's input
to the weights' dtype, take one float `scaling`, and write fused outputs through per-slice offsets.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from engine.kernels.triton.paged_kv import SUPPORTED_DTYPES, dot_precision, load_for_dot, needs_upcast

_NO_SLOT = tl.constexpr(2147483647)
"""Above every slot: the rows already served are out of the running for `tl.min` (a constexpr: compiled
kernels read no other module globals)."""

_TARGET_PROGRAMS = 256
"""About two programs per SM of an H100/H200 (132 SMs): below that, the shrink splits its reduction."""

_MIN_CHUNKS_PER_SPLIT = 2
"""Each split covers at least this many BLOCK_K chunks, so a program's loads outweigh its launch."""


@triton.jit
def _tile_rows(order_ptr, tile, T, ORDERED: tl.constexpr, BLOCK_M: tl.constexpr):
    """The token rows of tile `tile` (int64) and which of its BLOCK_M lanes hold one."""
    positions = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = positions < T
    if ORDERED:
        rows = tl.load(order_ptr + positions, mask=in_range, other=0).to(tl.int64)
    else:
        rows = positions.to(tl.int64)
    return rows, in_range


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, in]
    a_ptr,  # [S, r, in]
    out_ptr,  # [split_k, T, M, r] (split_k 1: the caller's out as [1, T, M, r])
    slots_ptr,  # [T, M] int32
    scales_ptr,  # [T, M] float32
    order_ptr,  # [T] int32 (ORDERED only)
    T,
    N,  # r
    K,  # in
    k_per_split,
    num_splits,
    stride_xt,
    stride_xk,
    stride_as,
    stride_an,
    stride_ak,
    stride_os,
    stride_ot,
    stride_om,
    stride_on,
    stride_slot_t,
    stride_slot_m,
    stride_scale_t,
    stride_scale_m,
    ORDERED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows, in_range = _tile_rows(order_ptr, tl.program_id(0), T, ORDERED, BLOCK_M)
    part = tl.program_id(2) // num_splits  # which adapter of a mix
    split = tl.program_id(2) % num_splits
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    slots = tl.load(slots_ptr + rows * stride_slot_t + part * stride_slot_m, mask=in_range, other=-1)  # [BLOCK_M]
    k_begin = split * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    remaining = in_range & (slots >= 0)
    while tl.max(remaining.to(tl.int32), axis=0) > 0:  # one pass per distinct adapter in the tile
        slot = tl.min(tl.where(remaining, slots, _NO_SLOT), axis=0)
        chosen = remaining & (slots == slot)
        a_slot = a_ptr + slot.to(tl.int64) * stride_as
        for k_start in range(k_begin, k_end, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_mask = ks < k_end
            x = load_for_dot(
                x_ptr + rows[:, None] * stride_xt + ks[None, :] * stride_xk, chosen[:, None] & k_mask[None, :], UPCAST
            )  # [BLOCK_M, BLOCK_K], zero rows outside `chosen`
            a = load_for_dot(
                a_slot + cols[None, :] * stride_an + ks[:, None] * stride_ak,
                col_mask[None, :] & k_mask[:, None],
                UPCAST,
            )  # [BLOCK_K, BLOCK_N]
            acc += tl.dot(x, a, input_precision=DOT_PRECISION)
        remaining = remaining & (slots != slot)
    scale = tl.load(scales_ptr + rows * stride_scale_t + part * stride_scale_m, mask=in_range, other=0.0)
    acc = acc * tl.where(slots >= 0, scale, 0.0)[:, None]  # a padding slot's scale may be anything
    out = out_ptr + split * stride_os + rows[:, None] * stride_ot + part * stride_om + cols[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_range[:, None] & col_mask[None, :])


@triton.jit
def _expand_kernel(
    y_ptr,  # [T, M, r]
    b_ptr,  # [S, out_dim, r]
    out_ptr,  # [T, out_total]
    slots_ptr,  # [T, M] int32
    order_ptr,  # [T] int32 (ORDERED only)
    T,
    N,  # out_dim
    R,  # r
    num_parts,  # M
    offset,
    stride_yt,
    stride_ym,
    stride_yr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    stride_slot_t,
    stride_slot_m,
    ADD: tl.constexpr,
    ORDERED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows, in_range = _tile_rows(order_ptr, tl.program_id(0), T, ORDERED, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    adapted = tl.zeros((BLOCK_M,), dtype=tl.int1)  # rows with an adapter in some part
    for part in range(0, num_parts):  # a mix's parts add up in the one accumulator
        slots = tl.load(slots_ptr + rows * stride_slot_t + part * stride_slot_m, mask=in_range, other=-1)
        remaining = in_range & (slots >= 0)
        adapted = adapted | remaining
        while tl.max(remaining.to(tl.int32), axis=0) > 0:
            slot = tl.min(tl.where(remaining, slots, _NO_SLOT), axis=0)
            chosen = remaining & (slots == slot)
            b_slot = b_ptr + slot.to(tl.int64) * stride_bs
            for k_start in range(0, R, BLOCK_K):
                ks = k_start + tl.arange(0, BLOCK_K)
                k_mask = ks < R
                y = tl.load(
                    y_ptr + rows[:, None] * stride_yt + part * stride_ym + ks[None, :] * stride_yr,
                    mask=chosen[:, None] & k_mask[None, :],
                    other=0.0,
                )  # [BLOCK_M, BLOCK_K]
                y = y.to(b_ptr.dtype.element_ty)  # a float32 shrink output meets 16-bit weights in their dtype
                if UPCAST:
                    y = y.to(tl.float32)
                b = load_for_dot(
                    b_slot + cols[None, :] * stride_bn + ks[:, None] * stride_br,
                    col_mask[None, :] & k_mask[:, None],
                    UPCAST,
                )  # [BLOCK_K, BLOCK_N]
                acc += tl.dot(y, b, input_precision=DOT_PRECISION)
            remaining = remaining & (slots != slot)
    out = out_ptr + rows[:, None] * stride_ot + (offset + cols)[None, :] * stride_on
    if ADD:  # rows without any adapter keep the base output untouched (and are not read)
        mask = adapted[:, None] & col_mask[None, :]
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    else:
        mask = in_range[:, None] & col_mask[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def group_by_slot(token_slots: torch.Tensor) -> torch.Tensor:
    """A `token_order` [T] int32 listing the tokens by adapter (by a mix's first part), stable: compute it once
    per step and pass it to every layer's shrink and expand, so that most tiles hold a single adapter."""
    first = token_slots if token_slots.dim() == 1 else token_slots[:, 0]
    return torch.argsort(first, stable=True).to(torch.int32)


def lora_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    *,
    token_order: Optional[torch.Tensor] = None,
    split_k: Optional[int] = None,
) -> None:
    """out[t, (m,)] = scales[t, (m)] * x[t] @ a_stack[token_slots[t, (m)]]^T (see the module docstring).

    `split_k` (default: chosen from the grid size) splits the reduction over `in`; a caller that wants a token's
    result independent of the batch size (batch-invariant mode) passes a fixed value.
    """
    num_tokens, in_dim = x.shape
    num_slots, rank = a_stack.shape[0], a_stack.shape[1]
    slots, parts = _as_parts(token_slots, num_tokens, "token_slots")
    scale_parts, _ = _as_parts(scales, num_tokens, "scales")
    if a_stack.shape[2] != in_dim or x.dtype != a_stack.dtype or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"a_stack {tuple(a_stack.shape)} {a_stack.dtype} does not fit x {tuple(x.shape)} {x.dtype}")
    if scale_parts.shape != slots.shape:
        raise ValueError(f"scales {tuple(scales.shape)} must have token_slots' shape {tuple(token_slots.shape)}")
    out3 = _parts_view(out, num_tokens, parts, rank, token_slots.dim(), "out")
    _check_order(token_order, num_tokens)
    if num_tokens == 0 or num_slots == 0:
        out.zero_()
        return
    block_m, block_n, block_k = shrink_blocks(num_tokens, rank, in_dim)
    tiles = triton.cdiv(num_tokens, block_m) * triton.cdiv(rank, block_n) * parts
    splits = _num_splits(split_k, tiles, triton.cdiv(in_dim, block_k))
    k_per_split = triton.cdiv(triton.cdiv(in_dim, block_k), splits) * block_k
    splits = triton.cdiv(in_dim, k_per_split)  # no empty split
    target = out3.unsqueeze(0) if splits == 1 else out.new_empty((splits, num_tokens, parts, rank), dtype=torch.float32)
    scale_parts = scale_parts.to(torch.float32)
    _shrink_kernel[(triton.cdiv(num_tokens, block_m), triton.cdiv(rank, block_n), parts * splits)](
        x,
        a_stack,
        target,
        slots,
        scale_parts,
        token_order if token_order is not None else slots,
        num_tokens,
        rank,
        in_dim,
        k_per_split,
        splits,
        *x.stride(),
        *a_stack.stride(),
        *target.stride(),
        *slots.stride(),
        *scale_parts.stride(),
        ORDERED=token_order is not None,
        UPCAST=needs_upcast(_shrink_kernel, x.dtype),
        DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    if splits > 1:
        out3.copy_(target.sum(dim=0))  # split 0 + split 1 + ...: the same order every time


def lora_expand(
    y: torch.Tensor,
    b_stack: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    offset: int,
    add: bool,
    *,
    token_order: Optional[torch.Tensor] = None,
) -> None:
    """out[t, offset:offset + out_dim] (+)= sum_m y[t, (m)] @ b_stack[token_slots[t, (m)]]^T (see the module
    docstring). Without `add`, rows without any adapter get zeros; with it, they are left as they are."""
    num_tokens = out.shape[0]
    num_slots, out_dim, rank = b_stack.shape
    slots, parts = _as_parts(token_slots, num_tokens, "token_slots")
    y3 = _parts_view(y, num_tokens, parts, rank, token_slots.dim(), "y")
    if out.dim() != 2 or not 0 <= offset <= out.shape[1] - out_dim:
        raise ValueError(f"columns {offset}..{offset + out_dim} do not fit out {tuple(out.shape)}")
    if b_stack.dtype not in SUPPORTED_DTYPES or y.dtype not in SUPPORTED_DTYPES or out.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtypes y {y.dtype}, b_stack {b_stack.dtype}, out {out.dtype}: float32/float16/bfloat16 only")
    _check_order(token_order, num_tokens)
    if num_tokens == 0 or out_dim == 0:
        return
    if num_slots == 0:
        if not add:
            out[:, offset : offset + out_dim].zero_()
        return
    block_m, block_n, block_k = expand_blocks(num_tokens, rank)
    _expand_kernel[(triton.cdiv(num_tokens, block_m), triton.cdiv(out_dim, block_n))](
        y3,
        b_stack,
        out,
        slots,
        token_order if token_order is not None else slots,
        num_tokens,
        out_dim,
        rank,
        parts,
        offset,
        *y3.stride(),
        *b_stack.stride(),
        *out.stride(),
        *slots.stride(),
        ADD=add,
        ORDERED=token_order is not None,
        UPCAST=needs_upcast(_expand_kernel, b_stack.dtype),
        DOT_PRECISION=dot_precision(b_stack.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def _as_parts(per_token: torch.Tensor, num_tokens: int, name: str) -> tuple[torch.Tensor, int]:
    """[T] or [T, M] -> a [T, M] view (M = 1 for [T]) and M."""
    if per_token.dim() not in (1, 2) or per_token.shape[0] != num_tokens:
        raise ValueError(f"{name} {tuple(per_token.shape)} must be [T] or [T, M] with T = {num_tokens}")
    if name == "token_slots" and per_token.dtype != torch.int32:
        raise ValueError(f"token_slots must be int32, got {per_token.dtype}")
    view = per_token if per_token.dim() == 2 else per_token.unsqueeze(1)
    return view, view.shape[1]


def _parts_view(t: torch.Tensor, num_tokens: int, parts: int, rank: int, slot_dims: int, name: str) -> torch.Tensor:
    """The rank-wide tensor as [T, M, r]: [T, r] goes with [T] slots, [T, M, r] with [T, M] slots."""
    expected = (num_tokens, rank) if slot_dims == 1 else (num_tokens, parts, rank)
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} {tuple(t.shape)} must be {expected} for token_slots of {slot_dims} dimension(s)")
    return t if slot_dims == 2 else t.unsqueeze(1)


def _check_order(token_order: Optional[torch.Tensor], num_tokens: int) -> None:
    if token_order is not None and (token_order.shape != (num_tokens,) or token_order.dtype != torch.int32):
        raise ValueError(f"token_order must be a [{num_tokens}] int32 permutation, got {tuple(token_order.shape)}")


class Blocks(NamedTuple):
    """A launch's tile: BLOCK_M tokens x BLOCK_N output columns, BLOCK_K of the reduction per step."""

    m: int
    n: int
    k: int


def _block_m(num_tokens: int) -> int:
    """16-token tiles for decode batches (fewer adapters meet in a tile), 64 for prefill (weights reused)."""
    return 16 if num_tokens <= 256 else 64


def shrink_blocks(num_tokens: int, rank: int, in_dim: int) -> Blocks:
    """The whole rank in one tile (r <= 64); 64-wide steps over `in`."""
    k = 64 if in_dim >= 64 else max(16, triton.next_power_of_2(in_dim))
    return Blocks(_block_m(num_tokens), max(16, triton.next_power_of_2(rank)), k)


def expand_blocks(num_tokens: int, rank: int) -> Blocks:
    """The whole rank in one step (r <= 64); wider column tiles for prefill."""
    return Blocks(
        _block_m(num_tokens), 64 if num_tokens <= 256 else 128, max(16, min(64, triton.next_power_of_2(rank)))
    )


def _num_splits(split_k: Optional[int], tiles: int, k_chunks: int) -> int:
    if split_k is not None:
        if split_k < 1:
            raise ValueError(f"split_k must be at least 1, got {split_k}")
        return min(split_k, k_chunks)
    wanted = triton.cdiv(_TARGET_PROGRAMS, tiles)
    return max(1, min(wanted, k_chunks // _MIN_CHUNKS_PER_SPLIT))
