"""DeepSeek-V2 and V3 (multi-head latent attention, grouped routing, shared experts, a dense first layer): greedy
tokens identical to HF transformers on tiny random checkpoints (fp32), alone and batched, under chunked prefill,
prefix-cache hits and preemption; prompt logprobs; the latent KV cache's footprint; backends that cannot read it
refused at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import check_against_hf, hf_prompt_logprobs, make_llm
from tests.engine.test_model_equivalence import mixed_prompts, run_greedy

KV_LORA_RANK, ROPE_DIM, LAYERS = 32, 8, 3
COMMON = dict(
    num_hidden_layers=LAYERS,
    first_k_dense_replace=1,
    kv_lora_rank=KV_LORA_RANK,
    qk_nope_head_dim=16,
    qk_rope_head_dim=ROPE_DIM,
    v_head_dim=12,
    moe_intermediate_size=24,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_key_value_heads=4,
    routed_scaling_factor=1.5,
)
FAMILIES = {
    # q_proj straight from the hidden state (V2-Lite), softmax scores, group-limited greedy, interleaved rope
    "deepseek_v2": dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        q_lora_rank=None,
        topk_method="group_limited_greedy",
    ),
    # q through its low rank, sigmoid scores with a correction bias (made random below), renormalised top-k,
    # interleaved rope, YaRN whose mscale_all_dim scales the softmax
    "deepseek_v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        q_lora_rank=24,
        norm_topk_prob=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
}


def make_deepseek_dir(path: Path, family: str, **overrides) -> Path:
    """A tiny random checkpoint; V3's e_score_correction_bias random (transformers initialises it to zeros)."""
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_model_dir(path, "llama", **{**COMMON, **FAMILIES[family], **overrides})
    state = load_file(str(model_dir / "model.safetensors"))
    biases = [name for name in state if name.endswith("e_score_correction_bias")]
    generator = torch.Generator().manual_seed(1)
    for name in biases:
        state[name] = torch.randn(state[name].shape, generator=generator) * 0.2
    if biases:
        save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def deepseek_dir(request, tmp_path_factory):
    return make_deepseek_dir(tmp_path_factory.mktemp(request.param), request.param)


def test_batch_and_alone(deepseek_dir):
    """auto picks the torch backend (the one that reads the latent cache); the cache holds the latent alone."""
    prompts = mixed_prompts()
    with make_llm(deepseek_dir, attention_backend="auto") as llm:
        runner = llm.engine.runner
        assert type(runner.model).__name__ == "DeepseekForCausalLM" and runner.backend.name == "torch"
        assert sorted(runner.model.moe_blocks) == [1, 2]  # the first layer dense
        check_against_hf(deepseek_dir, prompts, run_greedy(llm, prompts))
        check_against_hf(deepseek_dir, prompts[5:6], run_greedy(llm, prompts[5:6]))


def test_chunked_prefill(deepseek_dir):
    prompts = mixed_prompts()  # the batch test's: HF's tokens computed once
    with make_llm(deepseek_dir, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        check_against_hf(deepseek_dir, prompts, run_greedy(llm, prompts))


def test_prefix_cache_hits(deepseek_dir):
    prompts = mixed_prompts(2, shared_prefix=21)
    with make_llm(deepseek_dir, enable_prefix_caching=True) as llm:
        results = run_greedy(llm, prompts[:2]) + run_greedy(llm, prompts[2:])
        assert llm.engine.stats().prefix_cache_hits > 0
    check_against_hf(deepseek_dir, prompts, results)


def test_preemption(deepseek_dir):
    prompts = mixed_prompts()
    with make_llm(deepseek_dir, num_blocks=30, block_size=4, max_num_batched_tokens=64) as llm:
        results = run_greedy(llm, prompts)
        assert llm.engine.stats().num_preemptions > 0
    check_against_hf(deepseek_dir, prompts, results)


def test_prompt_logprobs(deepseek_dir):
    prompt = mixed_prompts(4)[5]  # 33 tokens: several chunks
    with make_llm(deepseek_dir, max_num_batched_tokens=16) as llm:
        sp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
        (result,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    got = [lp.logprob for lp in result.prompt_logprobs[1:]]
    assert got == pytest.approx(hf_prompt_logprobs(deepseek_dir, prompt), abs=1e-4)


def test_an_fp8_latent_cache_reads_the_same_values_whole_or_in_chunks(deepseek_dir):
    """--kv-cache-dtype fp8 over a latent cache: a prompt's first chunk attends over its entries rounded as the
    cache holds them, as every later chunk reads them, so the prompt in one chunk and in chunks of 8 gives the
    same prompt logprobs (unrounded, the first chunk's differed by up to ~0.1)."""
    prompt = mixed_prompts(4)[5]  # 33 tokens
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    logprobs = []
    for chunk in (64, 8):
        with make_llm(deepseek_dir, kv_cache_dtype="fp8", max_num_batched_tokens=chunk, max_num_seqs=1) as llm:
            assert llm.engine.runner.kv_cache.layers[0][0].dtype == torch.float8_e4m3fn
            (result,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        logprobs.append([lp.logprob for lp in result.prompt_logprobs[1:]])
    assert logprobs[1] == pytest.approx(logprobs[0], abs=1e-4)


def test_the_cache_stores_the_latent_per_token(deepseek_dir):
    """(kv_lora_rank + qk_rope_head_dim) x layers x dtype size per token: no expanded heads, no V tensor."""
    with make_llm(deepseek_dir, num_blocks=8) as llm:
        cache = llm.engine.runner.kv_cache
        spec = cache.spec
        assert spec.bytes_per_token == (KV_LORA_RANK + ROPE_DIM) * LAYERS * 4
        assert spec.bytes_per_block == spec.block_size * spec.bytes_per_token
        assert cache.nbytes == 8 * spec.block_size * (KV_LORA_RANK + ROPE_DIM) * LAYERS * 4
        for entries, values in cache.layers:
            assert entries.shape[2:] == (1, KV_LORA_RANK + ROPE_DIM)
            assert values.data_ptr() == entries.data_ptr() and values.shape[-1] == KV_LORA_RANK  # a view
        allocated = {entries.data_ptr(): entries.nbytes for entries, _ in cache.layers}
        assert sum(allocated.values()) == (cache.num_blocks + 1) * spec.bytes_per_block  # + the padding block


@pytest.mark.parametrize("settings", [dict(attention_backend="cpu"), dict(batch_invariant=True)])
def test_backends_without_latent_attention_are_refused(deepseek_dir, settings, cpu_kernels):
    with pytest.raises(ValueError, match=r"cannot serve Deepseek.*multi-head latent attention"):
        make_llm(deepseek_dir, **settings)
