"""Llama-family sliding windows against HF transformers, past the window (max_model_len no longer capped to it):
Mistral's window on every layer, Qwen2's from `max_window_layers` on (a full and a sliding layer group).
Float32 greedy tokens identical and logprobs within 1e-4 under chunked prefill, preemption and prefix hits;
the sliding blocks behind the window are freed (the scheduler's side: tests/scheduler)."""

from __future__ import annotations


import pytest

from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import check_against_hf, make_llm
from tests.engine.test_model_equivalence import mixed_prompts, run_greedy

CASES = {
    "mistral": {},  # sliding_window 8 on every layer
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},  # layer 0 full, then slide
}


@pytest.fixture(scope="module", params=sorted(CASES))
def model_dir(request, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param, **CASES[request.param])


def test_windows_past_the_window_with_chunks_and_preemption(model_dir):
    # Every layer sliding: a window's blocks per request; a full group besides: the whole sequence's too.
    num_blocks = 12 if "mistral" in model_dir.name else 40
    with make_llm(model_dir, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        assert llm.engine.max_model_len > 8  # not capped to the window
        windows = llm.engine.scheduler.kv_cache_manager.group_windows
        assert 8 in windows
        prompts = mixed_prompts(7)
        results = run_greedy(llm, prompts)
        assert llm.engine.stats().num_preemptions > 0
        check_against_hf(model_dir, prompts, results)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_prefix_hits_need_only_the_window(model_dir, backend):
    with make_llm(model_dir, enable_prefix_caching=True, block_size=4, attention_backend=backend) as llm:
        prompts = mixed_prompts(8, shared_prefix=40)
        results = run_greedy(llm, prompts[:2]) + run_greedy(llm, prompts[2:])
        assert any(r.num_cached_tokens >= 36 for r in results[2:])
        check_against_hf(model_dir, prompts, results)
