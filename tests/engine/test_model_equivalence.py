"""Greedy tokens and logprobs identical to HF transformers on the same weights (fp32)."""

import random

import pytest

from engine import SamplingParams
from tests.engine.references import NEW_TOKENS, assert_idle, check_against_hf, hf_prompt_logprobs, make_llm


def mixed_prompts(seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(shared_prefix)]
    lengths = [1, 3, 7, 16, 17, 33, 60, 5]
    return [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def run_greedy(llm, prompts, **params):
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0, **params)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert_idle(llm)
    return results


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def model_dir(request, tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "qwen3": tiny_qwen3_dir}[request.param]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_plain_batch(model_dir, backend):
    """`cpu` (the default on CPU): native kernels; `torch`: plain torch ops throughout."""
    prompts = mixed_prompts()
    llm = make_llm(model_dir, attention_backend=backend)
    assert llm.engine.runner.backend.name == backend and llm.engine.runner.model.ops.name == backend
    check_against_hf(model_dir, prompts, run_greedy(llm, prompts))


def test_batch_invariant_mode(model_dir):
    """The batch-invariant kernels (qkv biases and q/k norms included), chunked prefill: HF's tokens."""
    prompts = mixed_prompts(5)
    llm = make_llm(model_dir, batch_invariant=True, max_num_batched_tokens=16, max_num_seqs=4)
    check_against_hf(model_dir, prompts, run_greedy(llm, prompts))


def test_chunked_prefill(model_dir):
    llm = make_llm(model_dir, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = mixed_prompts(1)
    check_against_hf(model_dir, prompts, run_greedy(llm, prompts))


def test_long_prefill_token_threshold(tiny_llama_dir):
    """Prompts prefilled side by side in chunks of at most 5 tokens (vLLM's long_prefill_token_threshold)."""
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=32, max_num_seqs=8, long_prefill_token_threshold=5)
    prompts = mixed_prompts(2)
    check_against_hf(tiny_llama_dir, prompts, run_greedy(llm, prompts))


def test_prefix_caching_with_repeated_prefixes(model_dir):
    llm = make_llm(model_dir, enable_prefix_caching=True)
    prompts = mixed_prompts(2, shared_prefix=21)
    first = run_greedy(llm, prompts[:2])
    results = first + run_greedy(llm, prompts[2:])  # later requests hit the cached prefix
    assert llm.engine.stats().prefix_cache_hits > 0
    assert any(r.num_cached_tokens >= 20 for r in results[2:])
    check_against_hf(model_dir, prompts, results)


def test_preemption(model_dir):
    llm = make_llm(model_dir, num_blocks=30, block_size=4, max_num_batched_tokens=64)
    prompts = mixed_prompts(3)
    results = run_greedy(llm, prompts)
    assert llm.engine.stats().num_preemptions > 0
    check_against_hf(model_dir, prompts, results)


def test_prompt_logprobs(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=16)
    prompt = mixed_prompts(4)[5]  # 33 tokens: several chunks
    sp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    (result,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    assert result.prompt_logprobs[0] is None
    got = result.prompt_logprobs[1:]
    assert [lp.token_id for lp in got] == prompt[1:]
    assert [lp.logprob for lp in got] == pytest.approx(hf_prompt_logprobs(tiny_llama_dir, prompt), abs=1e-4)
    assert all(len(lp.top) == 3 for lp in got)
    assert_idle(llm)


def test_prompt_logprobs_survive_preemption(tiny_llama_dir):
    """A prompt recomputed after a preemption is scored once, not twice."""
    llm = make_llm(tiny_llama_dir, num_blocks=20, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = mixed_prompts(5)[4:7]  # 17, 33, 60 tokens
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=1)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    for prompt, result in zip(prompts, results):
        assert len(result.prompt_logprobs) == len(prompt)
        got = [lp.logprob for lp in result.prompt_logprobs[1:]]
        assert got == pytest.approx(hf_prompt_logprobs(tiny_llama_dir, prompt), abs=1e-4)
    assert_idle(llm)


def test_priority_policy_with_a_tiny_pool(tiny_llama_dir):
    """Priority scheduling, preemption, chunked prefill and prefix hits at once: still HF's tokens."""
    llm = make_llm(
        tiny_llama_dir,
        num_blocks=24,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        scheduling_policy="priority",
        enable_prefix_caching=True,
    )
    prompts = mixed_prompts(6, shared_prefix=9) + mixed_prompts(7)[3:]
    priorities = [(i * 7) % 5 - 2 for i in range(len(prompts))]
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, priority=priorities)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_idle(llm)
    check_against_hf(tiny_llama_dir, prompts, results)
