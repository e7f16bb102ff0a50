"""GLM-4.5 / 4.6 / 4.5-Air (Glm4MoeForCausalLM: partial rotary, q/k/v biases, optional q/k norms, a dense first
layer, DeepSeek-V3's routing over groups of experts with e_score_correction_bias, shared experts): greedy tokens
identical to HF transformers and logprobs within 1e-4 on tiny random checkpoints (float32), alone and batched, on
the cpu and torch backends, under chunked prefill with preemption, prefix-cache hits, and prompt logprobs;
--quantization int8/int4 served as the dequantized model; the router kept in float32 in bfloat16; the
multi-token-prediction layer skipped; what is not served refused at start-up."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from engine import SamplingParams
from engine.errors import SettingsConflictError
from engine.models import build_model
from engine.models.registry import check_pipeline_model
from tests.engine.factories import make_tiny_model_dir, tiny_config_dict
from tests.engine.references import assert_idle, check_against_hf, hf_prompt_logprobs, make_llm
from tests.engine.test_model_equivalence import mixed_prompts, run_greedy
from tests.engine.test_moe_int_quantization import METHODS, PARAMS, PROMPTS, dequantized_copy, prompt_logprobs_of

VARIANTS = {
    "air": {},  # one group of experts, no q/k norms (GLM-4.5-Air's settings)
    # four groups of two, the best two groups kept per token, per-head q/k norms, scaled and unnormalised weights
    "grouped": {
        "n_group": 4,
        "topk_group": 2,
        "use_qk_norm": True,
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": False,
    },
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def glm_dir(request, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), "glm4_moe", **VARIANTS[request.param])


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_batch_and_alone(glm_dir, backend):
    prompts = mixed_prompts()
    with make_llm(glm_dir, attention_backend=backend) as llm:
        model = llm.engine.runner.model
        assert type(model).__name__ == "Glm4MoeForCausalLM" and model.fused is None
        assert sorted(model.moe_blocks) == [1, 2] and model.rotary.rotary_dim == 8  # the first layer dense
        check_against_hf(glm_dir, prompts, run_greedy(llm, prompts))
        check_against_hf(glm_dir, prompts[6:7], run_greedy(llm, prompts[6:7]))  # 60 tokens, alone


def test_chunked_prefill_with_preemption(glm_dir):
    prompts = mixed_prompts(3)
    with make_llm(glm_dir, num_blocks=30, block_size=4, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        results = run_greedy(llm, prompts)
        assert llm.engine.stats().num_preemptions > 0
    check_against_hf(glm_dir, prompts, results)


def test_prefix_cache_hits(glm_dir):
    prompts = mixed_prompts(2, shared_prefix=21)
    with make_llm(glm_dir, enable_prefix_caching=True, max_num_batched_tokens=32) as llm:
        results = run_greedy(llm, prompts[:2]) + run_greedy(llm, prompts[2:])
        assert any(r.num_cached_tokens >= 20 for r in results[2:])
    check_against_hf(glm_dir, prompts, results)


def test_prompt_logprobs(glm_dir):
    prompt = mixed_prompts(4)[6]  # 60 tokens: several chunks
    with make_llm(glm_dir, max_num_batched_tokens=16) as llm:
        sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
        (result,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        got = [lp.logprob for lp in result.prompt_logprobs[1:]]
        assert got == pytest.approx(hf_prompt_logprobs(glm_dir, prompt), abs=1e-4)
        assert_idle(llm)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_quantized_experts_serve_the_dequantized_model(glm_dir, tmp_path, method):
    """Every expert, the shared experts and the attention quantized; the router and its bias kept float."""
    round_trip, weight_type = METHODS[method]
    with make_llm(glm_dir, quantization=method) as llm:
        for block in llm.engine.runner.model.moe_blocks.values():
            assert all(isinstance(w, weight_type) for w in block.matrices())
            assert block.router.dtype == torch.float32 and block.select.correction_bias.dtype == torch.float32
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    with make_llm(dequantized_copy(glm_dir, tmp_path / "deq", round_trip)) as reference:
        want = reference.generate(PROMPTS, PARAMS, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        torch.testing.assert_close(prompt_logprobs_of(g), prompt_logprobs_of(w), rtol=0, atol=1e-3)


def test_bfloat16_keeps_the_router_in_float32_and_skips_the_prediction_layer(glm_dir, tmp_path):
    """As transformers keeps them (_keep_in_fp32_modules_strict): the router and its correction bias as stored in
    float32, where rounding them to bfloat16 would move tokens to other experts. A released checkpoint's
    multi-token-prediction layer (layers.<num_hidden_layers>) is not the causal LM's: not read."""
    import shutil

    model_dir = tmp_path / "with_mtp"
    shutil.copytree(glm_dir, model_dir)
    state = load_file(str(model_dir / "model.safetensors"))
    layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    state[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with make_llm(model_dir, dtype="bfloat16") as llm:
        model = llm.engine.runner.model
        for index, block in model.moe_blocks.items():
            stored = state[f"model.layers.{index}.mlp.gate.e_score_correction_bias"]
            assert block.select.correction_bias.dtype == torch.float32
            assert torch.equal(block.select.correction_bias, stored)
            assert torch.equal(block.router, state[f"model.layers.{index}.mlp.gate.weight"])
        results = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert all(len(r.outputs[0].token_ids) == 4 for r in results)
        assert_idle(llm)


def config_of(**overrides):
    return AutoConfig.for_model(**tiny_config_dict("glm4_moe", **overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"n_group": 3}, "n_routed_experts 8 in n_group 3"),
        ({"n_group": 8}, r"n_routed_experts 8 in n_group 8: each group needs .* at least two"),
        ({"n_group": 2, "topk_group": 3}, "topk_group 3 must be between 1 and n_group 2"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 must be between 1 and the 8 experts"),
        ({"partial_rotary_factor": 0.35}, "partial_rotary_factor 0.35 rotates 5 of 16 dimensions"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            r"RoPE scaling 'dynamic' is not supported",
        ),
    ],
)
def test_unsupported_config_fields_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_model(config_of(**overrides), torch.float32, torch.device("cpu"))


def test_pipeline_stages_are_checked_by_its_layers():
    """Its layers split into stages (served so: tests/distributed/test_pipeline_parallel.py); never past one layer
    a stage (its multi-token-prediction layer not counted)."""
    config = config_of()
    check_pipeline_model(config, config.num_hidden_layers)
    with pytest.raises(SettingsConflictError, match="fewer than the stages"):
        check_pipeline_model(config, config.num_hidden_layers + 1)
