"""A mixture-of-experts MLP as two grouped Triton products over stacked expert weights (CUDA; tests run it
on CPU tensors under Triton's interpreter).

    fused_moe(x [T, H], gate_up [E, 2I, H], down [E, H, I], weights [T, k] float32, expert_ids [T, k]) -> [T, H]
        optional: gate_up_bias [E, 2I], down_bias [E, H] (added to each product's rows of their expert), and
        the activation of [gate | up] (default SwiGLU; GPT-OSS's clamped one, layers/clamped_swiglu.py);
        first_expert (expert parallelism: the weights are experts [first, first + E) of those the ids name, and
        the other experts' pairs add nothing)

The T * k (token, expert) pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M,
so every tile of BLOCK_M rows belongs to one expert (`align_rows`, plain torch on the device: no host
sync, a CUDA graph can hold it):

    pair j = t * k + slot            sorted_pairs   [j of expert 0 ..., pad, j of expert 1 ..., pad, ...]
    tile m: rows m*BLOCK_M ..        tile_expert[m]  the expert of the tile; num_padded: where tiles end
    pad entries hold T * k           (masked: they read nothing and write nothing)

    first product   rows x[j // k]              @ gate_up[e]^T -> h1 [T*k, 2I]; silu(gate) * up -> h2 [T*k, I]
    second product  rows h2[j]                  @ down[e]^T * weights[j] -> h3 [T*k, H]
    out[t] = sum over the k slots of h3[t * k + slot]

Each program computes one BLOCK_M x BLOCK_N tile with float32 accumulation (`ieee` for float32 inputs:
no TF32 rounding), reading each of its expert's weight tiles once for all its rows.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.triton.paged_kv import dot_precision, needs_upcast


@triton.jit
def _grouped_product_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    bias_ptr,
    sorted_pairs_ptr,
    tile_expert_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    a_row_divisor,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_bias_e,
    SCALE_ROWS: tl.constexpr,
    BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)  # [BLOCK_M]: pair index, num_pairs for padding
    valid = pairs < num_pairs
    a_rows = (pairs // a_row_divisor).to(tl.int64)
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=valid[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk,
            mask=col_mask[None, :] & k_mask[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if BIAS:  # the expert's bias, before the routing weight scales the row (as HF adds it)
        acc += tl.load(bias_ptr + expert * stride_bias_e + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if SCALE_ROWS:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_mask[None, :])


def align_rows(expert_ids: torch.Tensor, num_experts: int, block_m: int, first_expert: Optional[int] = None):
    """expert_ids [T, k] -> (sorted_pairs [P_max] int32, tile_expert [P_max / block_m] int32, num_padded [1]).
    `first_expert` (expert parallelism): the weights hold experts [first, first + num_experts) only; the pairs of
    other experts get no row (their outputs stay as the caller made them)."""
    flat = expert_ids.reshape(-1).long()  # int32 ids too (vLLM's top-k ids): scatter_add_ takes int64 indices
    num_pairs = flat.numel()
    buckets = num_experts
    if first_expert is not None:  # another rank's pairs: one bucket after every held expert's, past the tiles
        flat = flat - first_expert
        flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
        buckets += 1
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: bincount sizes its output from the largest id, a host sync on CUDA
    counts = torch.zeros(buckets, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    starts = padded_end - padded
    if first_expert is not None:
        starts = torch.cat([starts, padded_end[-1:]])  # (read by the kernel up to num_padded only)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    destination = starts[sorted_experts] + rank
    # each expert with pairs adds at most one partly filled tile
    num_tiles = num_pairs // block_m + min(num_pairs, num_experts)
    room = num_pairs if first_expert is not None else 0  # where the other experts' pairs land, cut off below
    sorted_pairs = torch.full((num_tiles * block_m + room,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[destination] = order.to(torch.int32)
    sorted_pairs = sorted_pairs[: num_tiles * block_m]
    tile_starts = torch.arange(num_tiles, device=flat.device) * block_m
    tile_expert = torch.searchsorted(padded_end, tile_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, tile_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


def _grouped_product(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    aligned,
    a_row_divisor: int,
    weights,
    block_m: int,
    bias: Optional[torch.Tensor] = None,
) -> None:
    sorted_pairs, tile_expert, num_padded = aligned
    n, k = b.shape[1], b.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (tile_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_product_kernel[grid](
        a,
        b,
        out,
        weights if weights is not None else out,
        bias if bias is not None else out,
        sorted_pairs,
        tile_expert,
        num_padded,
        n,
        k,
        out.shape[0],
        a_row_divisor,
        *a.stride(),
        *b.stride(),
        *out.stride(),
        bias.stride(0) if bias is not None else 0,
        SCALE_ROWS=weights is not None,
        BIAS=bias is not None,
        UPCAST=needs_upcast(_grouped_product_kernel, a.dtype),
        DOT_PRECISION=dot_precision(a.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    block_m: int = 16,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    first_expert: Optional[int] = None,
) -> torch.Tensor:
    """The experts' weighted sum for each token of x (see the module docstring). `first_expert` (expert
    parallelism): gate_up and down hold experts [first, first + E) of those expert_ids name; the sum over those."""
    num_tokens, top_k = expert_ids.shape
    num_experts, intermediate = gate_up.shape[0], down.shape[2]
    if gate_up.shape[1:] != (2 * intermediate, x.shape[1]) or down.shape[:2] != (num_experts, x.shape[1]):
        raise ValueError(f"expert weights {tuple(gate_up.shape)} and {tuple(down.shape)} do not fit x {tuple(x.shape)}")
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    aligned = align_rows(expert_ids, num_experts, block_m, first_expert)
    h1 = x.new_empty((num_pairs, 2 * intermediate))
    _grouped_product(x, gate_up, h1, aligned, top_k, None, block_m, _contiguous(gate_up_bias))
    if activation is None:
        gate, up = h1.chunk(2, dim=-1)
        h2 = (F.silu(gate) * up).contiguous()  # [T * k, I]
    else:
        h2 = activation(h1).contiguous()
    # (another rank's pairs are never written: zeros in the sum)
    h3 = x.new_empty((num_pairs, x.shape[1])) if first_expert is None else x.new_zeros((num_pairs, x.shape[1]))
    _grouped_product(
        h2, down, h3, aligned, 1, weights.reshape(-1).float().contiguous(), block_m, _contiguous(down_bias)
    )
    return h3.view(num_tokens, top_k, -1).sum(dim=1)


def _contiguous(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if bias is None else bias.contiguous()
