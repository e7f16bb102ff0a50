"""On a CUDA device (skipped without one): a mixture of experts through the grouped Triton kernel, eager and
replayed from CUDA graphs, gives the CPU engine's tokens (fp32: the CPU engine is HF's, token for token); Qwen3-MoE,
and on the generic decoder Phi-3.5-MoE (sparsemixer routing, LayerNorms, biases) and Granite MoE with its shared
expert (stacked experts)."""

import pytest
import torch

from engine import SamplingParams
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import make_llm
from tests.engine.test_moe_equivalence import make_moe_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    head_dim=16,
    num_hidden_layers=3,
    mlp_only_layers=[1],
    norm_topk_prob=True,
)


@pytest.mark.parametrize("family", ["qwen3_moe", "phimoe", "granitemoeshared"])
@pytest.mark.parametrize("eager", [True, False])
def test_moe_on_cuda_matches_cpu(tmp_path, eager, family):
    pytest.importorskip("triton")
    if family == "qwen3_moe":
        model_dir = make_tiny_model_dir(tmp_path, "llama", **QWEN3_MOE)
    else:
        model_dir = make_moe_dir(tmp_path / family, family)
    prompts = [[5, 6, 7], list(range(10, 50)), [300] * 17, list(range(3, 80, 3))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with make_llm(model_dir) as llm:
        cpu = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    with make_llm(model_dir, device="cuda", attention_backend="triton", enforce_eager=eager) as llm:
        block = next(iter(llm.engine.runner.model.moe_blocks.values()))
        assert block.stacked is not None and block.stacked.gate_up.is_cuda  # the grouped kernel's operands
        cuda = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    assert cuda == cpu
