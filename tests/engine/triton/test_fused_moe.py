"""The grouped Triton MoE kernel (engine/kernels/triton/fused_moe.py) against the float64 per-token reference;
the row alignment that gives every tile one expert. On CPU through Triton's interpreter: small shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton import fused_moe  # noqa: E402
from engine.kernels.triton.fused_moe import align_rows  # noqa: E402
from engine.layers.moe_routing import select_experts  # noqa: E402
from tests.engine.moe_reference import random_experts, reference_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def test_align_rows_gives_each_tile_one_expert():
    ids = torch.tensor([[3, 0], [0, 3], [3, 1], [0, 3], [3, 2]])
    sorted_pairs, tile_expert, num_padded = align_rows(ids, 5, block_m=4)
    pairs = ids.numel()
    flat = ids.reshape(-1)
    assert num_padded.item() == 20  # pairs per expert 3, 1, 1, 0, 5 -> padded to 4 + 4 + 4 + 0 + 8
    tiles = sorted_pairs[: num_padded.item()].view(-1, 4)
    for tile, expert in zip(tiles, tile_expert.tolist()):
        real = tile[tile < pairs]
        assert real.numel() > 0 and (flat[real.long()] == expert).all()
    assert sorted(sorted_pairs[sorted_pairs < pairs].tolist()) == list(range(pairs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, top_k, renormalize", [(1, 2, True), (7, 2, False), (19, 3, True)])
def test_fused_moe_matches_the_float64_reference(dtype, tokens, top_k, renormalize):
    experts, hidden, intermediate = 6, 40, 24  # widths that are no powers of two: masked tails
    router, gate_up, down = random_experts(experts, hidden, intermediate, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    routing = select_experts(x.float() @ router.T, top_k, renormalize)
    got = fused_moe(
        x.to(DEVICE),
        gate_up.to(dtype).to(DEVICE),
        down.to(dtype).to(DEVICE),
        routing.weights.to(DEVICE),
        routing.expert_ids.to(DEVICE),
    )
    expected = reference_moe(
        x, router, gate_up.to(dtype), down.to(dtype), top_k, renormalize, expert_ids=routing.expert_ids
    )
    assert got.dtype == dtype and got.shape == x.shape
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().double(), expected, atol=tolerance, rtol=tolerance)


def test_fused_moe_takes_int32_expert_ids_with_experts_left_empty():
    """Top-k ids as int32 (vLLM's routing gives them so) route alike; experts 3 and 5 receive no token."""
    experts, hidden, intermediate, tokens, top_k = 6, 40, 24, 9, 2
    _, gate_up, down = random_experts(experts, hidden, intermediate, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, generator=gen)
    expert_ids = torch.stack([torch.randperm(3, generator=gen)[:top_k] for _ in range(tokens)])
    expert_ids[0, 0] = 4
    weights = torch.rand(tokens, top_k, generator=gen)
    got = fused_moe(x, gate_up, down, weights, expert_ids.to(torch.int32))
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for e, w in zip(expert_ids[t].tolist(), weights[t].double()):
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            expected[t] += w * (down[e].double() @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_with_biases_and_the_clamped_swiglu(dtype):
    """GPT-OSS's experts: biases on both products, the clamped SwiGLU between, against float64 per token."""
    from engine.layers.clamped_swiglu import ClampedSwiGLU

    experts, hidden, intermediate, tokens, top_k = 4, 40, 24, 11, 2
    router, gate_up, down = random_experts(experts, hidden, intermediate, seed=7)
    gen = torch.Generator().manual_seed(8)
    gate_up_bias = torch.randn(experts, 2 * intermediate, generator=gen) * 0.5
    down_bias = torch.randn(experts, hidden, generator=gen) * 0.5
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    activation = ClampedSwiGLU(alpha=1.702, limit=0.8)
    routing = select_experts(x.float() @ router.T, top_k, True)
    got = fused_moe(
        x.to(DEVICE),
        gate_up.to(dtype).to(DEVICE),
        down.to(dtype).to(DEVICE),
        routing.weights.to(DEVICE),
        routing.expert_ids.to(DEVICE),
        gate_up_bias=gate_up_bias.to(dtype).to(DEVICE),
        down_bias=down_bias.to(dtype).to(DEVICE),
        activation=activation,
    )
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for e, w in zip(routing.expert_ids[t].tolist(), routing.weights[t].double()):
            h = gate_up[e].to(dtype).double() @ x[t].double() + gate_up_bias[e].to(dtype).double()
            expected[t] += w * (down[e].to(dtype).double() @ activation(h[None])[0] + down_bias[e].to(dtype).double())
    clamped = (gate_up.double() @ x.double().T).abs().max() > activation.limit
    assert clamped  # the clamp bites
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().double(), expected, atol=tolerance, rtol=tolerance)


def test_a_gpt_oss_block_runs_the_same_through_the_kernel(monkeypatch):
    """SparseMoeBlock with GPT-OSS's router (bias, softmax over the top-k logits) and experts (biases, clamped
    SwiGLU): the grouped kernel, as on CUDA, gives the per-expert products' output."""
    from engine.layers.clamped_swiglu import ClampedSwiGLU
    from engine.layers.layer_ops import TorchLayerOps
    from engine.layers.linear import Linear
    from engine.layers.moe import ExpertWeights, SparseMoeBlock

    experts, hidden, intermediate = 4, 40, 24
    router, gate_up, down = random_experts(experts, hidden, intermediate, seed=9)
    gen = torch.Generator().manual_seed(10)
    weights = ExpertWeights(
        gate_up,
        down,
        torch.randn(experts, 2 * intermediate, generator=gen) * 0.5,
        torch.randn(experts, hidden, generator=gen) * 0.5,
    )
    linear = Linear()  # plain weights: the per-expert matrices are views of the stacked ones, as on CUDA
    block = SparseMoeBlock(
        router,
        weights,
        2,
        False,
        linear,
        router_bias=torch.randn(experts, generator=gen),
        softmax_after_top_k=True,
        activation=ClampedSwiGLU(1.702, 0.8),
    )
    assert block.stacked is not None
    x = torch.randn(13, hidden, generator=gen)
    grouped = block.forward(x, linear, TorchLayerOps())
    monkeypatch.setattr(block, "_fused_kernel", lambda device: fused_moe)
    torch.testing.assert_close(block.forward(x, linear, TorchLayerOps()), grouped, atol=1e-5, rtol=1e-5)


def test_the_grouped_product_compiles_for_hopper_without_a_gpu(compile_ahead_of_time):
    """The interpreter runs Python, not the compiler: both grouped products as `fused_moe` launches them, in
    bfloat16 and float32, compiled for sm_90 in a process without TRITON_INTERPRET, down to a cubin by
    Triton's own ptxas."""
    assert len(compile_ahead_of_time(90, "moe")) == 4


def test_align_rows_leaves_out_the_pairs_of_another_ranks_experts():
    """Expert parallelism: experts 2 and 3 held (first_expert 2, two of them); the pairs of 0, 1 and 4 get no row."""
    ids = torch.tensor([[3, 0], [0, 3], [3, 1], [2, 4], [3, 2]])
    sorted_pairs, tile_expert, num_padded = align_rows(ids, 2, block_m=4, first_expert=2)
    pairs, flat = ids.numel(), ids.reshape(-1)
    assert num_padded.item() == 8  # expert 2's two pairs and expert 3's four, each padded to 4
    tiles = sorted_pairs[: num_padded.item()].view(-1, 4)
    for tile, expert in zip(tiles, tile_expert.tolist()):
        real = tile[tile < pairs]
        assert real.numel() > 0 and (flat[real.long()] == expert + 2).all()
    held = sorted_pairs[: num_padded.item()]
    assert sorted(held[held < pairs].tolist()) == [j for j in range(pairs) if flat[j] in (2, 3)]


@pytest.mark.parametrize("kernel", [False, True], ids=["per-expert", "grouped-kernel"])
def test_blocks_holding_a_share_of_the_experts_sum_to_the_whole_block(kernel, monkeypatch):
    """Expert parallelism's blocks: 5 experts held as 3 + 2 (first_expert 0 and 3, with GPT-OSS's biases and
    clamped SwiGLU), each computing only its experts' pairs; their outputs add up to the whole block's."""
    from engine.layers.clamped_swiglu import ClampedSwiGLU
    from engine.layers.layer_ops import TorchLayerOps
    from engine.layers.linear import Linear
    from engine.layers.moe import ExpertWeights, SparseMoeBlock

    experts, hidden, intermediate = 5, 40, 24
    router, gate_up, down = random_experts(experts, hidden, intermediate, seed=11)
    gen = torch.Generator().manual_seed(12)
    gate_up_bias = torch.randn(experts, 2 * intermediate, generator=gen) * 0.5
    down_bias = torch.randn(experts, hidden, generator=gen) * 0.5
    router_bias = torch.randn(experts, generator=gen)
    linear = Linear()

    def block(held: range) -> SparseMoeBlock:
        share = slice(held.start, held.stop)
        weights = ExpertWeights(gate_up[share], down[share], gate_up_bias[share], down_bias[share])
        made = SparseMoeBlock(
            router,
            weights,
            2,
            False,
            linear,
            router_bias=router_bias,
            softmax_after_top_k=True,
            activation=ClampedSwiGLU(1.702, 0.8),
            first_expert=held.start,
        )
        if kernel:
            monkeypatch.setattr(made, "_fused_kernel", lambda device: fused_moe)
        return made

    x = torch.randn(13, hidden, generator=gen)
    whole = block(range(5)).forward(x, linear, TorchLayerOps())
    shares = [block(held).forward(x, linear, TorchLayerOps()) for held in (range(0, 3), range(3, 5))]
    assert all(share.abs().sum() > 0 for share in shares)  # (both ranks' experts are chosen)
    torch.testing.assert_close(shares[0] + shares[1], whole, atol=1e-5, rtol=1e-5)
    tokens = torch.randn(1, hidden, generator=gen)  # one token: a share whose experts it did not choose gives zeros
    outs = [block(held).forward(tokens, linear, TorchLayerOps()) for held in (range(0, 3), range(3, 5))]
    torch.testing.assert_close(outs[0] + outs[1], block(range(5)).forward(tokens, linear, TorchLayerOps()))
