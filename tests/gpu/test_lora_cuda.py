"""On a CUDA device (skipped without one): the multi-LoRA Triton kernels compiled, at a 7-8B model's shapes (hidden
4096, q|k|v 4096 + 1024 + 1024), against a float64 reference: a decode batch of 8 adapters interleaved (in request
order and grouped), a prefill of 2048 tokens, a mix; and shrink + expand captured in a CUDA graph and replayed
with new adapters in the same buffers (no host sync, no reallocation)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HIDDEN = 4096
SLICES = (4096, 1024, 1024)
NUM_SLOTS = 8


def stacks(rank: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(NUM_SLOTS, rank, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5).bfloat16()
    bs = [(torch.randn(NUM_SLOTS, w, rank, device="cuda", generator=gen) / rank**0.5).bfloat16() for w in SLICES]
    return a, bs


def reference(x, a, bs, slots, scales) -> torch.Tensor:
    """The LoRA delta [T, sum(SLICES)] in float64, adapter by adapter over the rows that use it."""
    delta = torch.zeros(x.shape[0], sum(SLICES), dtype=torch.float64, device="cuda")
    for m in range(slots.shape[1]):
        for slot in slots[:, m].unique().tolist():
            if slot < 0:
                continue
            rows = slots[:, m] == slot
            y = scales[rows, m, None].double() * (x[rows].double() @ a[slot].double().T)
            delta[rows] += torch.cat([y @ b[slot].double().T for b in bs], dim=1)
    return delta


def apply(x, a, bs, slots, scales, out, order=None) -> None:
    from engine.kernels.triton import lora_expand, lora_shrink

    shrunk = torch.empty(x.shape[0], slots.shape[1], a.shape[1], dtype=torch.float32, device="cuda")
    lora_shrink(x, a, slots, scales, shrunk, token_order=order)
    offset = 0
    for b in bs:
        lora_expand(shrunk, b, slots, out, offset, True, token_order=order)
        offset += b.shape[1]


def check(tokens: int, rank: int, parts: int, grouped: bool, seed: int) -> None:
    from engine.kernels.triton import group_by_slot

    gen = torch.Generator(device="cuda").manual_seed(seed)
    a, bs = stacks(rank, seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    slots = torch.randint(-1, NUM_SLOTS, (tokens, parts), device="cuda", generator=gen, dtype=torch.int32)
    scales = torch.rand(tokens, parts, device="cuda", generator=gen) + 0.25
    base = torch.randn(tokens, sum(SLICES), device="cuda", generator=gen).bfloat16()
    out = base.clone()
    apply(x, a, bs, slots, scales, out, group_by_slot(slots) if grouped else None)
    expected = base.double() + reference(x, a, bs, slots, scales)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("grouped", [False, True])
def test_decode_batch_of_eight_adapters(grouped):
    pytest.importorskip("triton")
    check(256, 16, 1, grouped, seed=1)


def test_prefill_and_a_mix():
    pytest.importorskip("triton")
    check(2048, 64, 1, True, seed=2)
    check(64, 16, 3, False, seed=3)


def test_shrink_and_expand_replay_from_a_cuda_graph():
    pytest.importorskip("triton")
    tokens, rank = 32, 16
    gen = torch.Generator(device="cuda").manual_seed(4)
    a, bs = stacks(rank, 4)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    slots = torch.randint(-1, NUM_SLOTS, (tokens, 1), device="cuda", generator=gen, dtype=torch.int32)
    scales = torch.ones(tokens, 1, device="cuda")
    out = torch.zeros(tokens, sum(SLICES), device="cuda", dtype=torch.bfloat16)
    apply(x, a, bs, slots, scales, out)  # compiles before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply(x, a, bs, slots, scales, out)
    new_a, new_bs = stacks(rank, 5)  # another step: other adapters loaded into the same stacks, other slots
    a.copy_(new_a)
    for b, new_b in zip(bs, new_bs):
        b.copy_(new_b)
    slots.copy_(torch.randint(-1, NUM_SLOTS, (tokens, 1), device="cuda", generator=gen, dtype=torch.int32))
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out.double(), reference(x, a, bs, slots, scales), atol=3e-2, rtol=3e-2)
