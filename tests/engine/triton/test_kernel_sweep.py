"""Random cases of the Triton paged-attention kernels as serving hands them over, against float64 attention
written here from the definition (not the reference the other kernel tests share).

Each case draws the shapes real models hit (head dims 64/80/96/128/256, GQA groups 1/2/4/8 and odd ones,
MQA, blocks of 16/32/64), contexts of 1 token, exactly a block, a block + 1 and lengths that are no multiple of
a tile, chunks over a cached prefix that ends inside a block, decodes and prefills mixed in one batch, a
sliding window, a soft-cap, attention sinks, fp8 caches; and builds the cache as the scheduler leaves it:
every slot outside the requests' contexts is NaN (fp8: a NaN code), and a sliding window's entries for blocks
wholly behind it name the null block (NaN too), as scheduler/kv_cache_manager.py frees them. A kernel that
reads one of those slots answers NaN.

A few cases run in `make test`; PAGEDSERVE_KERNEL_SWEEP=N runs N more (minutes under the interpreter).
"""

from __future__ import annotations

import os
import random
from typing import NamedTuple, Optional

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton import paged_attention, paged_decode, paged_prefill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-4, torch.float16: 6e-3, torch.bfloat16: 3e-2}  # times max(1, |expected|)
NAN_CODE = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7E}
QUICK_SEEDS = 6
SWEEP_SEEDS = int(os.environ.get("PAGEDSERVE_KERNEL_SWEEP", "0"))


class Case(NamedTuple):
    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, width] int32
    window: Optional[int]
    softcap: Optional[float]
    sinks: Optional[torch.Tensor]  # [H]
    kernel: str  # "dispatch" (paged_attention), "decode" (split, small partitions) or "prefill" (small tiles)


def draw_case(seed: int) -> Case:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    head_dim = rng.choice([64, 80, 96, 128, 256])
    num_kv_heads = rng.choice([1, 2])
    group = rng.choice([1, 2, 4, 8, 3, 7])
    block_size = rng.choice([16, 32, 64])
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    fp8 = rng.choice([None, None, torch.float8_e4m3fn, torch.float8_e5m2])
    window = rng.choice([None, None, 1, 7, block_size, block_size + 3])
    decode_only = rng.random() < 0.4
    requests = []  # (context length, query length), decodes first
    for _ in range(rng.randint(1, 3)):
        context = rng.choice([1, block_size, block_size + 1, 2 * block_size - 1, 70, 130])
        query = 1 if decode_only else rng.choice([1, context, rng.randint(1, context)])
        requests.append((context, query))
    requests.sort(key=lambda r: r[1] != 1)
    needed = sum(-(-context // block_size) for context, _ in requests)
    null = needed  # the scheduler's null block: never handed out
    ids = list(range(needed))
    rng.shuffle(ids)
    cache_dtype = fp8 or dtype
    shape = (needed + 1, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    value_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    used = torch.zeros(shape[0] * block_size, dtype=torch.bool)
    tables = []
    for context, query in requests:
        blocks, ids = ids[: -(-context // block_size)], ids[-(-context // block_size) :]
        if window is not None:  # blocks no query of this step reaches are back in the pool
            behind = max(context - query - window + 1, 0) // block_size
            blocks = [null] * behind + blocks[behind:]
        for position in range(context):
            if blocks[position // block_size] != null:
                used[blocks[position // block_size] * block_size + position % block_size] = True
        tables.append(blocks)
    for cache in (key_cache, value_cache):
        if fp8 is None:
            cache.view(-1, num_kv_heads, head_dim)[~used] = float("nan")
        else:
            cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)[~used] = NAN_CODE[fp8]
    width = max(len(blocks) for blocks in tables) + rng.randint(0, 2)
    table = torch.tensor([blocks + [null] * (width - len(blocks)) for blocks in tables], dtype=torch.int32)
    starts = [0]
    for _, query in requests:
        starts.append(starts[-1] + query)
    num_heads = num_kv_heads * group
    return Case(
        query=torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        cu_seqlens_q=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([context for context, _ in requests], dtype=torch.int32),
        block_table=table,
        window=window,
        softcap=rng.choice([None, None, 5.0, 30.0]),
        sinks=2 * torch.randn(num_heads, generator=gen) if rng.random() < 0.3 else None,
        kernel=rng.choice(["dispatch", "decode" if decode_only else "prefill"]),
    )


def expected_output(case: Case, scale: float) -> torch.Tensor:
    """float64 attention of each query over the keys it sees, read token by token through the block table."""
    query = case.query.double()
    key_cache, value_cache = case.key_cache.double(), case.value_cache.double()
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = query.shape[1] // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts, lens = case.cu_seqlens_q.tolist(), case.seq_lens.tolist()
    for b, context in enumerate(lens):
        rows = range(starts[b], starts[b + 1])
        for i, row in enumerate(rows):
            position = context - len(rows) + i
            first = 0 if case.window is None else max(position - case.window + 1, 0)
            seen = range(first, position + 1)
            slots = [(int(case.block_table[b, p // block_size]), p % block_size) for p in seen]
            k = torch.stack([key_cache[block, slot] for block, slot in slots]).repeat_interleave(group, 1)
            v = torch.stack([value_cache[block, slot] for block, slot in slots]).repeat_interleave(group, 1)
            scores = torch.einsum("hd,khd->hk", query[row], k) * scale  # [H, seen]
            if case.softcap is not None:
                scores = case.softcap * torch.tanh(scores / case.softcap)
            if case.sinks is not None:
                scores = torch.cat([scores, case.sinks.double()[:, None]], dim=1)
            probs = torch.softmax(scores, dim=1)[:, : len(slots)]
            out[row] = torch.einsum("hk,khd->hd", probs, v)
    return out


def run_case(seed: int) -> None:
    case = draw_case(seed)
    scale = case.query.shape[-1] ** -0.5
    tensors = [t.to(DEVICE) for t in case[:6]]
    query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table = tensors
    options = dict(
        window=case.window, softcap=case.softcap, sinks=None if case.sinks is None else case.sinks.to(DEVICE)
    )
    max_query_len = int(case.cu_seqlens_q.diff().max())
    if case.kernel == "decode":
        args = (query, key_cache, value_cache, block_table, seq_lens, scale)
        out = paged_decode(*args, partition_size=16, **options)
    elif case.kernel == "prefill":
        group = query.shape[1] // key_cache.shape[2]
        args = (query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, scale, max_query_len)
        out = paged_prefill(*args, block_m=max(16, 1 << (group - 1).bit_length()), block_n=16, **options)
    else:
        args = (query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, scale, max_query_len)
        out = paged_attention(*args, **options)
    expected = expected_output(case, scale)
    tolerance = TOLERANCE[case.query.dtype] * max(1.0, expected.abs().max().item())
    error = (out.cpu().double() - expected).abs().max().item()
    assert error <= tolerance, f"seed {seed}: max abs error {error:.3g} (NaN: a slot outside a context was read)"


@pytest.mark.parametrize("seed", range(QUICK_SEEDS))
def test_random_steps_match_float64_and_never_read_outside_the_contexts(seed):
    run_case(seed)


@pytest.mark.skipif(not SWEEP_SEEDS, reason="set PAGEDSERVE_KERNEL_SWEEP=N to run N more random cases")
def test_kernel_sweep():
    for seed in range(QUICK_SEEDS, QUICK_SEEDS + SWEEP_SEEDS):
        run_case(seed)
