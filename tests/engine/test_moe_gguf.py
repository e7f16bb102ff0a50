"""Mixtral, Qwen2-MoE and Qwen3-MoE from GGUF files in llama.cpp's layout (stacked experts, expert metadata keys):
F32 experts give HF's greedy tokens; Q8_0 / Q4_0 experts kept in their blocks (one product per expert through the
native kernels) give the tokens of the same file dequantized; the names, the per-expert cut, the config."""

from __future__ import annotations

import json
import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.loading.gguf_weights import hf_name
from engine.models.registry import FAMILIES as REGISTRY
from engine.quantization.gguf_weight import GgufWeight
from tests.engine.factories import make_tiny_model_dir
from tests.engine.moe_gguf_factory import dequantized, make_tiny_moe_gguf
from tests.engine.references import make_llm
from tests.engine.test_moe_equivalence import FAMILIES
from tests.engine.references import check_against_hf
from tests.engine.test_model_equivalence import mixed_prompts, run_greedy

# test_moe_equivalence's families with every layer sparse (llama.cpp's graphs for these have no dense layers) and
# expert widths a multiple of 32 (GGUF blocks)
_QWEN_IN_GGUF = dict(moe_intermediate_size=64, mlp_only_layers=[], decoder_sparse_step=1)
FAMILIES_GGUF = {
    "mixtral": FAMILIES["mixtral"],
    "qwen3_moe": {**FAMILIES["qwen3_moe"], **_QWEN_IN_GGUF},
    "qwen2_moe": {**FAMILIES["qwen2_moe"], **_QWEN_IN_GGUF},
}


@pytest.fixture(scope="module", params=sorted(FAMILIES_GGUF))
def moe_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return make_tiny_model_dir(path, "llama", num_experts_per_tok=2, **FAMILIES_GGUF[request.param])


def test_gguf_names_of_the_experts():
    assert hf_name("blk.2.ffn_gate_inp.weight") == "model.layers.2.block_sparse_moe.gate.weight"
    assert hf_name("blk.2.ffn_gate_inp.weight", "qwen3moe") == "model.layers.2.mlp.gate.weight"
    assert hf_name("blk.0.ffn_up_shexp.weight", "qwen2moe") == "model.layers.0.mlp.shared_expert.up_proj.weight"
    assert hf_name("blk.0.ffn_gate_inp_shexp.weight", "qwen2moe") == "model.layers.0.mlp.shared_expert_gate.weight"
    with pytest.raises(KeyError, match="gpt-oss"):
        hf_name("blk.0.ffn_gate_inp.weight", "gpt-oss")


def test_the_registry_serves_these_families_from_gguf():
    formats = {family.architecture: family.formats for family in REGISTRY}
    for config in FAMILIES_GGUF.values():
        assert "gguf" in formats[config["architectures"][0]]


def test_f32_experts_give_hfs_tokens(moe_dir, tmp_path):
    gguf = make_tiny_moe_gguf(moe_dir, tmp_path / "moe.F32.gguf")
    prompts = mixed_prompts()
    for quantization in ("none", "gguf"):
        with make_llm(gguf, quantization=quantization) as llm:
            model = llm.engine.runner.model
            assert type(model).__name__ == "MoeForCausalLM" and model.quantization == quantization
            assert len(model.moe_blocks) == model.arch.num_layers
            check_against_hf(moe_dir, prompts, run_greedy(llm, prompts))


@pytest.mark.parametrize("expert_type", ["Q8_0", "Q4_0"])
def test_quantized_experts_follow_the_dequantized_file(moe_dir, tmp_path, expert_type):
    """Experts (and the shared expert) kept in their blocks, one product per expert over its rows, against the
    same file dequantized to float32 at conversion, scored teacher-forced: the same greedy choice at nearly every
    position, logprobs close. Not at every one: the integer kernels round the activations to int8 per block, which
    breaks near-ties of the logits and of the router (a token then reaches another expert: seen at up to 7% of the
    positions, up to 1.9 nats of margin after such a switch; the dense GGUF test's bounds are 90% and 0.065). The
    block itself is exact: below."""
    gguf = make_tiny_moe_gguf(moe_dir, tmp_path / f"moe.{expert_type}.gguf", expert_type, expert_type)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(1)]
    scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    with make_llm(gguf, quantization="gguf") as llm:
        model = llm.engine.runner.model
        for block in model.moe_blocks.values():
            assert all(isinstance(w, GgufWeight) and w.format == expert_type.lower() for w in block.matrices())
            assert len(block.per_expert) == block.num_experts and block.stacked is None  # stored once, per expert
        quantized = llm.generate(prompts, scoring, use_tqdm=False)
        quantized_bytes = model.weight_bytes()
    with make_llm(gguf, quantization="none") as llm:
        reference = llm.generate(prompts, scoring, use_tqdm=False)
        assert quantized_bytes < llm.engine.runner.model.weight_bytes()
    gaps, agree = [], 0
    for got, want in zip(quantized, reference):
        for q, f in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            agree += q.top[0][0] == f.top[0][0]
            gaps.append(abs(q.logprob - f.logprob))
    assert len(gaps) > 100 and agree / len(gaps) >= 0.9, f"{agree} of {len(gaps)} positions agree"
    assert float(np.mean(gaps)) < 0.05, float(np.mean(gaps))


@pytest.mark.parametrize("expert_type", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_the_block_multiplies_each_experts_blocks(expert_type, rows):
    """A block of GGUF experts against the float64 reference on their dequantized weights (the same experts for
    each token): within the int8 activations' rounding at decode sizes, float32-exact where an expert's rows reach
    the dense product (float32, from 64 rows)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from engine.kernels.quant import load_quant_kernels
    from engine.layers.layer_ops import TorchLayerOps
    from engine.layers.linear import Linear
    from engine.layers.moe import ExpertWeights, SparseMoeBlock
    from engine.quantization.gguf_formats import FORMATS, repack
    from tests.engine.moe_reference import random_experts, reference_moe

    kernels, fmt, qtype = load_quant_kernels(), FORMATS[expert_type.lower()], GGMLQuantizationType[expert_type]
    router, gate_up, down = random_experts(4, 64, 64)

    def blocks(matrix: torch.Tensor) -> GgufWeight:
        raw = quantize(matrix.numpy(), qtype)
        return GgufWeight(fmt, repack(fmt, raw, matrix.shape[1]), matrix.shape[1], kernels)

    experts = ExpertWeights([blocks(m) for m in gate_up], [blocks(m) for m in down])
    linear = Linear()
    block = SparseMoeBlock(router, experts, 2, True, linear)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    routing = block.route(x, linear)
    got = block.forward(x, linear, TorchLayerOps())
    dequantized_gate_up = torch.stack([w.dequantize() for w in experts.gate_up])
    dequantized_down = torch.stack([w.dequantize() for w in experts.down])
    expected = reference_moe(x, router, dequantized_gate_up, dequantized_down, 2, True, expert_ids=routing.expert_ids)
    counts = torch.bincount(routing.expert_ids.flatten(), minlength=4)
    exact = bool((counts[counts > 0] >= 64).all())
    tolerance = 1e-4 if exact else 3e-2
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=tolerance * float(expected.abs().max()))


def test_each_expert_is_cut_from_its_stack_exactly(moe_dir, tmp_path):
    from gguf import GGUFReader
    from safetensors.torch import load_file

    from engine.kernels.quant import load_quant_kernels
    from engine.loading.gguf_weights import iter_gguf_weights

    gguf = make_tiny_moe_gguf(moe_dir, tmp_path / "moe.Q4_0.gguf", "Q4_0")
    config = json.loads((moe_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    got = dict(iter_gguf_weights(gguf, load_quant_kernels(), heads, kv_heads))
    state = load_file(str(moe_dir / "model.safetensors"))
    assert set(got) == set(state)
    stacks = [t for t in GGUFReader(str(gguf)).tensors if t.name.endswith("_exps.weight")]
    assert stacks and all(len(t.shape) == 3 for t in stacks)
    for name, tensor in state.items():
        if ".experts." in name:
            assert isinstance(got[name], GgufWeight)
            expected = dequantized(tensor.numpy(), "Q4_0")
            np.testing.assert_array_equal(got[name].dequantize().numpy(), expected)
        else:
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)


def test_the_converted_config_reads_the_expert_keys(moe_dir, tmp_path):
    from transformers import AutoConfig

    from engine.loading.gguf_moe_checkpoint import moe_architecture, moe_config

    gguf = make_tiny_moe_gguf(moe_dir, tmp_path / "moe.F32.gguf")
    architecture = moe_architecture(gguf)
    assert architecture is not None
    converted = AutoConfig.for_model(**moe_config(gguf, architecture))
    original = AutoConfig.from_pretrained(moe_dir)
    assert converted.model_type == original.model_type
    fields = ("num_experts_per_tok", "num_local_experts", "num_experts", "moe_intermediate_size", "norm_topk_prob")
    fields += ("shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers")
    for field in fields:
        assert getattr(converted, field, None) == getattr(original, field, None), field
    for config in (converted, original):  # Mixtral's unset head_dim is hidden / heads, the GGUF's the same value
        config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert converted.head_dim == original.head_dim
    if original.model_type == "mixtral":
        assert converted.intermediate_size == original.intermediate_size


def test_a_dense_gguf_is_not_taken_for_a_mixture(tmp_path):
    from engine.loading.gguf_moe_checkpoint import moe_architecture
    from tests.engine.factories import make_tiny_gguf

    dense = make_tiny_model_dir(tmp_path / "dense", "llama")
    assert moe_architecture(make_tiny_gguf(dense, tmp_path / "dense.gguf")) is None
