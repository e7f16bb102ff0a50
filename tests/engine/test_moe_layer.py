"""The mixture-of-experts layer (engine/layers/moe.py, moe_routing.py) against a float64 per-token reference,
through each product the CPU platform picks; routing and grouping; what MoE models refuse at start-up."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from engine.layers.invariant_linear import BatchInvariantLinear
from engine.layers.layer_ops import NativeLayerOps, TorchLayerOps
from engine.layers.linear import Linear, select_linear
from engine.layers.moe import ExpertWeights, SharedExpert, SparseMoeBlock
from engine.layers.moe_routing import Routing, group_by_expert, select_experts
from engine.models import build_model
from engine.platform import cpu_linear
from engine.attention.cpu_backend import CpuAttentionBackend
from tests.engine.moe_reference import random_experts, reference_moe

HIDDEN, INTERMEDIATE, EXPERTS = 64, 48, 8


def make_block(linear, top_k=2, renormalize=True, dtype=torch.float32, shared=False, seed=0):
    router, gate_up, down = random_experts(EXPERTS, HIDDEN, INTERMEDIATE, seed)
    shared_weights = None
    if shared:
        gen = torch.Generator().manual_seed(seed + 1)
        shared_weights = (
            torch.randn(2 * 80, HIDDEN, generator=gen) * HIDDEN**-0.5,
            torch.randn(HIDDEN, 80, generator=gen) * 80**-0.5,
            torch.randn(1, HIDDEN, generator=gen) * HIDDEN**-0.5,
        )
    experts = ExpertWeights(gate_up.to(dtype).clone(), down.to(dtype).clone())
    shared_expert = (
        None
        if shared_weights is None
        else SharedExpert(
            linear.prepare(shared_weights[0].to(dtype)),
            linear.prepare(shared_weights[1].to(dtype)),
            linear.prepare(shared_weights[2].to(dtype)),
        )
    )
    block = SparseMoeBlock(router.to(dtype), experts, top_k, renormalize, linear, shared_expert)
    return block, (router, gate_up, down, shared_weights)


def check_block(block, weights, ops, linear, dtype, rows, top_k, renormalize, tolerance):
    router, gate_up, down, shared = weights
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = block.forward(x, linear, ops)
    routing = block.route(x, linear)
    expected = reference_moe(
        x,
        router.to(dtype),
        gate_up.to(dtype),
        down.to(dtype),
        top_k,
        renormalize,
        expert_ids=routing.expert_ids,
        shared=None if shared is None else tuple(m.to(dtype) for m in shared),
    )
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("top_k, renormalize", [(2, True), (3, False)])
def test_float32_products_match_the_float64_reference(rows, top_k, renormalize):
    """Plain `F.linear` and the fp32 CPU default (column blocks on AVX2 and AVX-512 builds, else oneDNN's packed
    product: experts packed one by one)."""
    for linear in (Linear(), select_linear(torch.device("cpu"), torch.float32)):
        block, weights = make_block(linear, top_k, renormalize)
        check_block(block, weights, TorchLayerOps(), linear, torch.float32, rows, top_k, renormalize, 1e-5)


def test_shared_expert_matches_the_reference():
    linear = Linear()
    block, weights = make_block(linear, shared=True)
    check_block(block, weights, TorchLayerOps(), linear, torch.float32, 17, 2, True, 1e-5)


def test_plain_products_keep_one_copy_of_the_experts():
    block, _ = make_block(Linear())
    assert block.stacked is not None
    assert block.per_expert[3][0].data_ptr() == block.stacked.gate_up[3].data_ptr()
    packed, _ = make_block(select_linear(torch.device("cpu"), torch.float32))
    if packed.per_expert[0][0].is_mkldnn:
        assert packed.stacked is None  # packed one by one: the stacked copy is dropped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_products_match_the_reference(cpu_kernels, dtype):
    """The cpu backend's products and per-token ops (bf16: the column-block or small-batch kernel; float32: column
    blocks on AVX2 and AVX-512 builds, else oneDNN's packed weights), and the batch-invariant product, whose rows do
    not depend on which other tokens share their expert."""
    ops = NativeLayerOps(cpu_kernels)
    linears = [BatchInvariantLinear(cpu_kernels)]
    chosen = cpu_linear(CpuAttentionBackend(cpu_kernels), dtype)
    if chosen is not None:
        linears.append(chosen)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for linear in linears:
        block, weights = make_block(linear, dtype=dtype, shared=True)
        for rows in (1, 5, 40):
            check_block(block, weights, ops, linear, dtype, rows, 2, True, tolerance)
    invariant = BatchInvariantLinear(cpu_kernels)
    block, _ = make_block(invariant, dtype=dtype, shared=True)
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    together = block.forward(x, invariant, ops)
    alone = torch.cat([block.forward(x[i : i + 1], invariant, ops) for i in range(x.shape[0])])
    assert torch.equal(together, alone)


def test_routing_softmax_top_k_and_renormalisation():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    routing = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert routing.expert_ids.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(routing.weights, probs.gather(1, routing.expert_ids))
    renormalized = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(renormalized.weights.sum(-1), torch.ones(2))


def test_grouping_makes_one_contiguous_segment_per_expert():
    ids = torch.tensor([[2, 0], [0, 5], [2, 5], [1, 2]])
    weights = torch.arange(8, dtype=torch.float32).view(4, 2)
    groups = group_by_expert(Routing(weights, ids))
    assert (groups.experts, groups.counts) == ([0, 1, 2, 5], [2, 1, 3, 2])
    assert list(groups.segments()) == [(0, 0, 2), (1, 2, 1), (2, 3, 3), (5, 6, 2)]
    assert groups.token_index.tolist() == [0, 1, 3, 0, 2, 3, 1, 2]  # tokens ascending within an expert
    assert groups.weights.tolist() == [1.0, 2.0, 6.0, 0.0, 4.0, 7.0, 3.0, 5.0]


def moe_config(model_type: str, **overrides):
    fields = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
    )
    if model_type == "mixtral":
        fields["num_local_experts"] = 4
    else:
        fields.update(num_experts=4, moe_intermediate_size=16)
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    config = moe_config("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    model = build_model(config, torch.float32, torch.device("cpu"))
    assert model.moe.sparse_layers == (1, 5)
    assert build_model(moe_config("mixtral"), torch.float32, torch.device("cpu")).moe.sparse_layers == (0, 1)


@pytest.mark.parametrize(
    "model_type, field, value",
    [
        ("mixtral", "num_experts_per_tok", 5),
        ("qwen3_moe", "decoder_sparse_step", 0),
        ("qwen2_moe", "scoring_func", "sigmoid"),
        ("qwen3_moe", "routed_scaling_factor", 2.5),
        ("mixtral", "hidden_act", "gelu"),
    ],
)
def test_unsupported_moe_configs_are_refused_by_name(model_type, field, value):
    config = moe_config(model_type)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        build_model(config, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v3"])
def test_quantized_experts_are_refused_where_they_load_as_floats_only(model_type):
    from engine.quantization.weight_quantizer import WeightQuantizer

    fields = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    fields.update(num_key_value_heads=2, num_experts_per_tok=2, num_local_experts=4, n_routed_experts=4)
    fields.update(moe_intermediate_size=16, head_dim=8, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None)
    fields.update(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=0)
    config = AutoConfig.for_model(model_type, **fields)
    with pytest.raises(ValueError, match=f"--quantization int8 is not supported for {model_type}"):
        build_model(
            config, torch.float32, torch.device("cpu"), quantizer=WeightQuantizer("int8", None, torch.device("cpu"))
        )
