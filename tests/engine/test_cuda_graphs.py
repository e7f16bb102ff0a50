"""Decode graphs: bucket choice, padding and the static step buffers, tested on CPU.

Off CUDA nothing can be captured, so `EagerReplay` runs each bucket's padded step through the same
persistent buffers and views a CUDA graph would read: the padding rows (token 0 at position 0, the
cache's padding block) must not change any real request's tokens, and the scheduler must never hand
out the padding block. The capture itself runs in scripts/gpu_check.sh on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.runner.cuda_graphs import EagerReplay, bucket_for, decode_buckets
from tests.engine.references import assert_idle, make_llm


def test_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(3) == (1, 2, 3)
    assert decode_buckets(8) == (1, 2, 4, 8)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    buckets = decode_buckets(300)
    assert buckets[-4:] == (256, 272, 288, 300)
    assert all(b - a == 8 for a, b in zip(buckets[3:], buckets[4:]) if b <= 256)
    with pytest.raises(ValueError):
        decode_buckets(0)
    for max_num_seqs in (1, 5, 64, 257, 512):
        buckets = decode_buckets(max_num_seqs)
        assert list(buckets) == sorted(set(buckets))
        for n in range(1, max_num_seqs + 1):
            bucket = bucket_for(buckets, n)
            assert bucket is not None and n <= bucket
            assert bucket == min(b for b in buckets if b >= n)
        assert bucket_for(buckets, max_num_seqs + 1) is None
        assert bucket_for(buckets, 0) is None


def _generate(llm, prompts, params):
    return [r.outputs[0] for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_padded_decode_steps_give_the_tokens_of_eager_steps(tiny_llama_dir, backend):
    """Decode batches of 7, 6, 5 .. 1 requests (ragged lengths, so requests finish one by one) through
    buckets 8, 4, 2, 1 give the same greedy tokens and logprobs as unpadded eager steps; the padding
    block is written by padding rows only, and everything is freed at the end."""
    prompts = [list(range(3, 3 + 5 * i)) for i in range(1, 8)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True, logprobs=1) for i in range(7)]
    eager = make_llm(tiny_llama_dir, attention_backend=backend, max_num_seqs=8)
    expected = _generate(eager, prompts, params)

    llm = make_llm(tiny_llama_dir, attention_backend=backend, max_num_seqs=8)
    runner = llm.engine.runner
    runner.capture_decode_graphs(decode_buckets(8), EagerReplay)
    assert runner.cuda_graphs == "decode batches 1-8 (4 sizes)"
    cache = runner.kv_cache
    pad_key = cache.layers[0][0][cache.pad_block]
    pad_key.zero_()
    got = _generate(llm, prompts, params)
    for want, out in zip(expected, got):
        assert out.token_ids == want.token_ids
        assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
    replays = {size: graph.replays for size, graph in runner.graphs._graphs.items()}
    assert replays[8] > 0 and replays[1] > 0, replays  # decode steps went through the graphs, padded
    assert pad_key.abs().sum() > 0  # padding rows wrote their K/V to the padding block
    assert cache.pad_block == llm.engine.scheduler.kv_cache_manager.block_pool.num_blocks  # never handed out
    assert_idle(llm)


def test_steps_with_prefill_chunks_or_beyond_the_largest_bucket_run_eagerly(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, attention_backend="torch", max_num_seqs=8, max_num_batched_tokens=16)
    runner = llm.engine.runner
    runner.capture_decode_graphs((1, 2), EagerReplay)  # batches of 3+ decodes run eagerly
    prompts = [list(range(3, 30)), [5, 9, 11], [4, 6], list(range(40, 60))]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    reference = _generate(
        make_llm(tiny_llama_dir, attention_backend="torch", max_num_seqs=8, max_num_batched_tokens=16), prompts, params
    )
    assert [o.token_ids for o in _generate(llm, prompts, params)] == [o.token_ids for o in reference]
    assert runner.graphs._graphs[1].replays + runner.graphs._graphs[2].replays > 0
    assert_idle(llm)


def test_capture_refuses_a_backend_that_cannot_run_in_a_graph(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, attention_backend="torch")
    with pytest.raises(ValueError, match="does not run in CUDA graphs"):
        llm.engine.runner.capture_decode_graphs((1, 2))
    assert llm.engine.runner.cuda_graphs == "off"


def test_enforce_eager_is_a_flag_and_an_llm_argument():
    from engine.llm import engine_config_from_kwargs
    from server.config.settings import load_settings

    assert engine_config_from_kwargs(None, enforce_eager=True).enforce_eager
    assert not engine_config_from_kwargs(None).enforce_eager
    assert load_settings(["--enforce-eager"], {}).engine.enforce_eager
    assert load_settings([], {"PAGEDSERVE_ENFORCE_EAGER": "1"}).engine.enforce_eager


def test_off_cuda_no_graph_is_captured(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    assert llm.engine.runner.graphs is None and llm.engine.runner.cuda_graphs == "off"
    assert torch.device(llm.engine.runner.device).type == "cpu"


def test_a_request_with_prompt_logprobs_decodes_through_the_graphs_once_scored(tiny_llama_dir):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2)
    prompts = [list(range(3, 20)), list(range(30, 41))]
    reference = _generate(make_llm(tiny_llama_dir, attention_backend="torch", max_num_seqs=4), prompts, params)
    llm = make_llm(tiny_llama_dir, attention_backend="torch", max_num_seqs=4)
    runner = llm.engine.runner
    runner.capture_decode_graphs((1, 2, 4), EagerReplay)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in got] == [o.token_ids for o in reference]
    assert all(len(r.prompt_logprobs) == len(p) for r, p in zip(got, prompts))
    assert runner.graphs._graphs[2].replays >= 4  # the decodes after the prompt went through the graph
    assert_idle(llm)
