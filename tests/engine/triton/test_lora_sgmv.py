"""The multi-LoRA Triton products (engine/kernels/triton/lora_sgmv.py) against a float64 per-token reference:
ranks 8/16/64, float32 and bfloat16, slot -1, mixes of adapters, the slices of a fused q|k|v output, one token
and 300 (several tiles, in request order and grouped by adapter). On CPU through Triton's interpreter."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton import group_by_slot, lora_expand, lora_shrink  # noqa: E402
from engine.kernels.triton.lora_sgmv import _num_splits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
IN_DIM = 96  # no power of two: the reduction's last chunk is masked
SLICES = (40, 24, 24)  # q | k | v of a fused projection, at columns 0, 40, 64
NUM_SLOTS = 5


class Adapters(NamedTuple):
    a: torch.Tensor  # [S, r, in]
    bs: tuple[torch.Tensor, ...]  # per slice [S, out_dim, r]


def random_adapters(rank: int, dtype: torch.dtype, seed: int) -> Adapters:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(NUM_SLOTS, rank, IN_DIM, generator=gen) / IN_DIM**0.5
    bs = tuple(torch.randn(NUM_SLOTS, width, rank, generator=gen) / rank**0.5 for width in SLICES)
    return Adapters(a.to(dtype), tuple(b.to(dtype) for b in bs))


def random_slots(tokens: int, parts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, parts] slots in -1 .. S-1 (a row's parts distinct, -1 padding) and float32 scales."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.stack([torch.randperm(NUM_SLOTS + 1, generator=gen)[:parts] - 1 for _ in range(tokens)])
    if parts > 1:
        slots[tokens // 2, 1:] = -1  # a single adapter in a mix's rows
        slots[tokens // 3] = -1  # no adapter at all
    scales = torch.rand(tokens, parts, generator=gen) + 0.25
    return slots.to(torch.int32), scales


def reference_delta(x, adapters: Adapters, slots, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """(shrink [T, M, r], expand [T, sum(SLICES)]) in float64, token by token, part by part."""
    tokens, parts = slots.shape
    rank = adapters.a.shape[1]
    shrunk = torch.zeros(tokens, parts, rank, dtype=torch.float64)
    delta = torch.zeros(tokens, sum(SLICES), dtype=torch.float64)
    for t in range(tokens):
        for m in range(parts):
            slot = int(slots[t, m])
            if slot < 0:
                continue
            shrunk[t, m] = float(scales[t, m]) * (adapters.a[slot].double() @ x[t].double())
            delta[t] += torch.cat([b[slot].double() @ shrunk[t, m] for b in adapters.bs])
    return shrunk, delta


def run_lora(x, adapters: Adapters, slots, scales, base, *, add=True, order=None, split_k=None):
    """Shrink once, expand each slice into its columns of the fused output (on DEVICE); returns both."""
    tokens, parts = slots.shape
    rank = adapters.a.shape[1]
    shrunk = torch.empty(tokens, parts, rank, dtype=torch.float32, device=DEVICE)
    lora_shrink(
        x.to(DEVICE), adapters.a.to(DEVICE), slots.to(DEVICE), scales.to(DEVICE), shrunk,
        token_order=order, split_k=split_k,
    )  # fmt: skip
    out = base.to(DEVICE).clone()
    offset = 0
    for b in adapters.bs:
        lora_expand(shrunk, b.to(DEVICE), slots.to(DEVICE), out, offset, add, token_order=order)
        offset += b.shape[1]
    return shrunk.cpu(), out.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("tokens", [1, 300])
def test_one_adapter_per_token_matches_the_float64_reference(dtype, rank, tokens):
    adapters = random_adapters(rank, dtype, seed=rank)
    slots, scales = random_slots(tokens, 1, seed=tokens + rank)
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(tokens, IN_DIM + 32, generator=gen).to(dtype)
    x = wide[:, 16 : 16 + IN_DIM]  # a view with a row stride wider than its row
    base = torch.randn(tokens, sum(SLICES), generator=gen).to(dtype)
    shrunk, out = run_lora(x, adapters, slots, scales, base)
    expected_shrunk, delta = reference_delta(x, adapters, slots, scales)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(shrunk.double(), expected_shrunk, atol=tolerance, rtol=tolerance)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), base.double() + delta, atol=tolerance, rtol=tolerance)
    untouched = slots[:, 0] < 0
    assert torch.equal(out[untouched], base[untouched])  # add: a row without an adapter is not rewritten


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 300])
def test_a_weighted_mix_of_adapters_per_token(dtype, tokens):
    """[T, 3] slots with -1 padding: each token's parts scaled in the shrink and summed in the expand."""
    adapters = random_adapters(16, dtype, seed=11)
    slots, scales = random_slots(tokens, 3, seed=12)
    x = torch.randn(tokens, IN_DIM, generator=torch.Generator().manual_seed(13)).to(dtype)
    base = torch.zeros(tokens, sum(SLICES), dtype=dtype)
    shrunk, out = run_lora(x, adapters, slots, scales, base, add=False)
    expected_shrunk, delta = reference_delta(x, adapters, slots, scales)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(shrunk.double(), expected_shrunk, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(out.double(), delta, atol=tolerance, rtol=tolerance)


def test_an_even_mix_equals_the_averaged_adapter():
    """Scales (0.5, 0.5) over adapters 1 and 2 give what one adapter with 0.5 * (B1 A1 + B2 A2) merged gives."""
    adapters = random_adapters(8, torch.float32, seed=21)
    tokens = 20
    slots = torch.tensor([[1, 2]] * tokens, dtype=torch.int32)
    x = torch.randn(tokens, IN_DIM, generator=torch.Generator().manual_seed(22))
    _, out = run_lora(x, adapters, slots, torch.full((tokens, 2), 0.5), torch.zeros(tokens, sum(SLICES)))
    merged = torch.cat(
        [0.5 * (b[1].double() @ adapters.a[1].double() + b[2].double() @ adapters.a[2].double()) for b in adapters.bs]
    )
    torch.testing.assert_close(out.double(), x.double() @ merged.T, atol=1e-5, rtol=1e-5)


def test_grouping_by_adapter_and_splitting_the_reduction_change_nothing():
    """300 tokens of 5 adapters interleaved: in request order, grouped by `group_by_slot`, and with the shrink's
    reduction split in 2 (as a decode batch would be), the same outputs."""
    adapters = random_adapters(16, torch.float32, seed=31)
    slots, scales = random_slots(300, 1, seed=32)
    x = torch.randn(300, IN_DIM, generator=torch.Generator().manual_seed(33))
    base = torch.randn(300, sum(SLICES), generator=torch.Generator().manual_seed(34))
    plain = run_lora(x, adapters, slots, scales, base)
    order = group_by_slot(slots.to(DEVICE))
    assert sorted(order.tolist()) == list(range(300)) and (slots[order.long().cpu(), 0].diff() >= 0).all()
    grouped = run_lora(x, adapters, slots, scales, base, order=order, split_k=2)
    for got, expected in zip(grouped, plain):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_without_add_rows_without_an_adapter_get_zeros_and_the_other_columns_stay():
    adapters = random_adapters(8, torch.float32, seed=41)
    slots = torch.tensor([[-1], [2], [-1], [0]], dtype=torch.int32)
    x = torch.randn(4, IN_DIM, generator=torch.Generator().manual_seed(42))
    shrunk = torch.full((4, 8), float("nan"), device=DEVICE)
    lora_shrink(x.to(DEVICE), adapters.a.to(DEVICE), slots.to(DEVICE), torch.ones(4, 1, device=DEVICE), shrunk[:, None])
    shrunk = shrunk.cpu()
    assert torch.equal(shrunk[[0, 2]], torch.zeros(2, 8))  # written, as zeros, not left as they were
    out = torch.full((4, 100), 7.0, device=DEVICE)
    lora_expand(shrunk.to(DEVICE), adapters.bs[1].to(DEVICE), slots[:, 0].to(DEVICE), out, 50, add=False)
    out = out.cpu()
    assert torch.equal(out[[0, 2], 50:74], torch.zeros(2, 24))
    assert (out[:, :50] == 7).all() and (out[:, 74:] == 7).all()
    expected = torch.stack([adapters.bs[1][s].double() @ shrunk[t].double() for t, s in ((1, 2), (3, 0))])
    torch.testing.assert_close(out[[1, 3], 50:74].double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_shapes_split_the_shrink_and_prefill_shapes_do_not():
    """One token, rank 16, in 8192 (BLOCK_K 64: 128 chunks): one tile alone would walk 8192 columns serially."""
    assert _num_splits(None, tiles=1, k_chunks=128) == 64
    assert _num_splits(None, tiles=16, k_chunks=128) == 16  # 256 decode tokens in 16-token tiles
    assert _num_splits(None, tiles=128, k_chunks=128) == 2
    assert _num_splits(None, tiles=512, k_chunks=128) == 1  # 8192 prefill tokens: the tiles fill the GPU
    assert _num_splits(3, tiles=1, k_chunks=2) == 2


def test_shapes_and_dtypes_are_checked():
    x = torch.zeros(3, IN_DIM)
    a = torch.zeros(2, 8, IN_DIM)
    with pytest.raises(ValueError, match="int32"):
        lora_shrink(x, a, torch.zeros(3, dtype=torch.int64), torch.ones(3), torch.empty(3, 8))
    with pytest.raises(ValueError, match="out"):
        lora_shrink(x, a, torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2), torch.empty(3, 8))
    with pytest.raises(ValueError, match="does not fit"):
        lora_shrink(x.bfloat16(), a, torch.zeros(3, dtype=torch.int32), torch.ones(3), torch.empty(3, 8))
    with pytest.raises(ValueError, match="columns"):
        lora_expand(
            torch.zeros(3, 8), torch.zeros(2, 24, 8), torch.zeros(3, dtype=torch.int32), torch.zeros(3, 40), 20, True
        )


def test_the_kernels_compile_for_hopper_without_a_gpu(compile_ahead_of_time):
    """The interpreter runs Python, not the compiler: every launch configuration is also compiled for sm_90 (the
    H100/H200) in a process without TRITON_INTERPRET, down to a cubin by Triton's own ptxas."""
    assert len(compile_ahead_of_time(90, "lora")) == 8  # shrink and expand, 2 dtypes, 2 block shapes
