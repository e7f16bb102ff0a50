"""Phi-4-mini's shape (tests/engine/factories.py's "phi4mini": RoPE over the first 0.75 of each head, LongRoPE
past an original context of 32 tokens) against HF transformers in float32: greedy tokens identical and logprobs
within 1e-4, batched and alone, on the cpu, torch and batch-invariant backends, under chunked prefill with
preemption, with prefix-cache hits, and prompt logprobs.

LongRoPE's factor set is chosen once, from max_model_len (engine/layers/rotary.py): under the default 256
the long factors serve every position, which is HF's choice for sequences past 32 tokens; with max_model_len 32 the
short ones, HF's for every sequence that fits."""

from __future__ import annotations

import random

import pytest

from tests.engine.factories import make_tiny_model_dir
from engine import SamplingParams
from tests.engine.references import NEW_TOKENS, assert_idle, check_against_hf, hf_greedy, hf_prompt_logprobs, make_llm
from tests.engine.test_model_equivalence import run_greedy

ORIGINAL_CONTEXT = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("phi4mini"), "phi4mini")


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


LONG_PROMPTS = prompts_of([33, 40, 47, 60, 34])  # past the original context from the first token computed
SHORT_PROMPTS = prompts_of([1, 3, 7, 16, 17, 20], seed=1)  # with 12 new tokens, at most 32 in all


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_long_factors_batched_and_alone(model_dir, backend):
    with make_llm(model_dir, attention_backend=backend) as llm:
        rotary = llm.engine.runner.model.rotary
        assert (rotary.rotary_dim, rotary.head_dim, rotary.long_context) == (12, 16, True)
        check_against_hf(model_dir, LONG_PROMPTS, run_greedy(llm, LONG_PROMPTS))
        check_against_hf(model_dir, LONG_PROMPTS[3:4], run_greedy(llm, LONG_PROMPTS[3:4]))  # 60 tokens, alone


def test_long_factors_under_chunked_prefill_with_preemption(model_dir):
    with make_llm(model_dir, num_blocks=30, block_size=4, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        results = run_greedy(llm, LONG_PROMPTS)
        assert llm.engine.stats().num_preemptions > 0
        check_against_hf(model_dir, LONG_PROMPTS, results)


def test_long_factors_batch_invariant_mode(model_dir):
    """The batch-invariant kernels (every query through the native decode kernel) rotate the same dimensions."""
    with make_llm(model_dir, batch_invariant=True, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        assert llm.engine.runner.backend.name == "cpu-batch-invariant"
        check_against_hf(model_dir, LONG_PROMPTS, run_greedy(llm, LONG_PROMPTS))


def test_long_factors_prompt_logprobs_and_prefix_cache_hits(model_dir):
    prompt = LONG_PROMPTS[3]  # 60 tokens: several chunks
    with make_llm(model_dir, enable_prefix_caching=True, max_num_batched_tokens=16) as llm:
        sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
        for _ in range(2):  # the second time from the cached blocks
            (result,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
            got = [lp.logprob for lp in result.prompt_logprobs[1:]]
            assert got == pytest.approx(hf_prompt_logprobs(model_dir, prompt), abs=1e-4)
        (extended,) = run_greedy(llm, [prompt + LONG_PROMPTS[0][:5]])
        assert extended.num_cached_tokens >= 56
        check_against_hf(model_dir, [prompt + LONG_PROMPTS[0][:5]], [extended])
        assert_idle(llm)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_short_factors_within_the_original_context(model_dir, backend):
    """max_model_len 32: the short factors, batched and under chunked prefill."""
    with make_llm(
        model_dir, attention_backend=backend, max_model_len=ORIGINAL_CONTEXT, max_num_batched_tokens=16
    ) as llm:
        assert not llm.engine.runner.model.rotary.long_context
        check_against_hf(model_dir, SHORT_PROMPTS, run_greedy(llm, SHORT_PROMPTS))
        check_against_hf(model_dir, SHORT_PROMPTS[5:], run_greedy(llm, SHORT_PROMPTS[5:]))


def test_a_short_sequence_on_a_long_context_server_takes_the_long_factors(model_dir):
    """The documented difference from HF: under max_model_len 256 a 20-token prompt rotates with the long factors
    (HF: the short ones until it passes 32 tokens), so its logprobs are those of the long-factor model, not HF's."""
    prompt = SHORT_PROMPTS[5]
    with make_llm(model_dir) as llm:
        (result,) = run_greedy(llm, [prompt])
    _, expected_lps = hf_greedy(model_dir, prompt, NEW_TOKENS)
    got = [lp.logprob for lp in result.outputs[0].logprobs]
    assert got != pytest.approx(expected_lps, abs=1e-4)
