"""The `triton` attention backend end to end on CPU, through Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine import SamplingParams  # noqa: E402
from engine.attention import get_attention_backend  # noqa: E402
from engine.kernels.triton.paged_kv import KV_FP8_BITS, KV_FP8_CONVERT, KV_FP8_E5M2  # noqa: E402
from tests.engine.references import assert_idle, make_llm  # noqa: E402


def test_greedy_tokens_match_the_torch_backend(tiny_llama_dir):
    """Chunked prefill, prefix-cache hits and decodes through the Triton kernels: the same greedy tokens
    (and logprobs within float32 tolerance) as plain torch, on the tiny random llama in float32."""
    prompts = [list(range(3, 40)), list(range(3, 30)) + [7, 8], [5, 9, 11], list(range(100, 117))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    results = {}
    for backend in ("torch", "triton"):
        llm = make_llm(tiny_llama_dir, attention_backend=backend, max_num_batched_tokens=16, max_num_seqs=4)
        assert llm.engine.runner.backend.name == backend
        results[backend] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.stats().prefix_cache_hits > 0
        assert_idle(llm)
    for reference, got in zip(results["torch"], results["triton"]):
        assert got.outputs[0].token_ids == reference.outputs[0].token_ids
        assert [lp.logprob for lp in got.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in reference.outputs[0].logprobs], abs=1e-4
        )


def test_the_backend_is_refused_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton", torch.device("cpu"), torch.float32)


def test_decode_graph_steps_match_the_torch_backend(tiny_llama_dir):
    """The triton backend is one that CUDA graphs capture: its decode steps padded to a bucket and read at
    the graph's fixed width (the whole max_model_len; the kernel stops at each request's length) give the
    torch backend's greedy tokens."""
    from engine.runner.cuda_graphs import EagerReplay

    prompts = [list(range(3, 20)), [5, 9, 11], list(range(30, 40))]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    reference = make_llm(tiny_llama_dir, attention_backend="torch", max_num_seqs=4).generate(
        requests, params, use_tqdm=False
    )
    llm = make_llm(tiny_llama_dir, attention_backend="triton", max_num_seqs=4)
    llm.engine.runner.capture_decode_graphs((1, 2, 4), EagerReplay)
    got = llm.generate(requests, params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in reference]
    assert llm.engine.runner.graphs._graphs[4].replays > 0
    assert_idle(llm)


def test_a_bf16_cache_under_an_fp32_model_matches_the_torch_backend(tiny_llama_dir):
    """--kv-cache-dtype bfloat16 with an fp32 model: the Triton kernels read the bf16 cache (the query
    converted to it) and give the torch backend's greedy tokens over the same bf16 cache (logprobs within
    bf16 rounding: the kernels also round the query, the probabilities and their output to bf16, where the
    torch backend widens the cache to fp32)."""
    prompts = [list(range(3, 40)), [5, 9, 11]]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    results = {}
    for backend in ("torch", "triton"):
        llm = make_llm(
            tiny_llama_dir,
            attention_backend=backend,
            kv_cache_dtype="bfloat16",
            max_num_batched_tokens=16,
            max_num_seqs=4,
        )
        assert llm.engine.runner.kv_cache.layers[0][0].dtype == torch.bfloat16
        results[backend] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for reference, got in zip(results["torch"], results["triton"]):
        assert got.outputs[0].token_ids == reference.outputs[0].token_ids
        assert [lp.logprob for lp in got.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in reference.outputs[0].logprobs], abs=6e-2
        )


@pytest.mark.parametrize(
    "dtype, kv_cache_dtype, widening",
    [
        ("float32", "fp8", KV_FP8_CONVERT),
        ("float32", "fp8", KV_FP8_BITS),
        ("bfloat16", "fp8", KV_FP8_CONVERT),
        ("float32", "fp8_e5m2", KV_FP8_E5M2),
    ],
)
def test_an_fp8_cache_matches_the_torch_backend(tiny_llama_dir, dtype, kv_cache_dtype, widening):
    """--kv-cache-dtype fp8 (e4m3) or fp8_e5m2: the triton backend converts K/V as the torch backend does (torch's
    rounding) and its kernels widen them to the query's dtype, exactly, as they read them (e4m3 both ways);
    chunked prefill, a prefix hit and decodes, eagerly and replayed from decode graphs, give the torch backend's greedy tokens over
    the same fp8 cache (float32: logprobs within float32 sums apart; bfloat16: the same tokens, logprobs
    within what bf16 activations rounded apart in each of the model's ops move them, ~2% here)."""
    from engine.runner.cuda_graphs import EagerReplay

    prompts = [list(range(3, 40)), list(range(3, 30)) + [7, 8], [5, 9, 11]]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in prompts]
    settings = dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=16, max_num_seqs=4)
    reference = make_llm(tiny_llama_dir, attention_backend="torch", **settings).generate(
        requests, params, use_tqdm=False
    )
    tolerance = 1e-4 if dtype == "float32" else 1e-1
    for graphs in (False, True):
        llm = make_llm(tiny_llama_dir, attention_backend="triton", **settings)
        expected_cache = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
        assert llm.engine.runner.kv_cache.layers[0][0].dtype == expected_cache
        if widening == KV_FP8_BITS:  # what an A100 runs: the integer widening (the interpreter converts otherwise)
            llm.engine.runner.backend._widening = KV_FP8_BITS
        if graphs:
            llm.engine.runner.capture_decode_graphs((1, 2, 4), EagerReplay)
        got = llm.generate(requests, params, use_tqdm=False)
        assert llm.engine.stats().prefix_cache_hits > 0
        for expected, result in zip(reference, got):
            assert result.outputs[0].token_ids == expected.outputs[0].token_ids
            assert [lp.logprob for lp in result.outputs[0].logprobs] == pytest.approx(
                [lp.logprob for lp in expected.outputs[0].logprobs], abs=tolerance
            )
        if graphs:
            assert llm.engine.runner.graphs._graphs[4].replays > 0
        # how the kernels widen this cache, asked once: the interpreter's conversion for e4m3, a shift for e5m2
        assert llm.engine.runner.backend._widening == widening
        assert_idle(llm)


def test_draft_rows_through_the_triton_kernels_and_the_decode_graphs(tiny_llama_dir):
    """Speculative decoding's verification rows (a request's k + 1 decodes over one block table row) through
    the Triton kernels, eagerly and replayed from decode graphs: the torch backend's greedy tokens without
    drafts."""
    from engine.runner.cuda_graphs import EagerReplay

    prompts = [[5, 6, 7, 8, 9] * 4 + [40, 41], list(range(30, 40))]  # the tiny model loops on the first
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    reference = make_llm(tiny_llama_dir, attention_backend="torch", max_num_seqs=4).generate(
        requests, params, use_tqdm=False
    )
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "step_cost_model": False}  # no timing: interpreted
    for graphs in (False, True):
        llm = make_llm(tiny_llama_dir, attention_backend="triton", max_num_seqs=4, speculative_config=ngram)
        if graphs:
            llm.engine.runner.capture_decode_graphs((1, 2, 4, 8, 16), EagerReplay)
        got = llm.generate(requests, params, use_tqdm=False)
        assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in reference]
        assert llm.engine.stats().speculation.num_accepted_tokens > 0
        if graphs:
            assert sum(g.replays for size, g in llm.engine.runner.graphs._graphs.items() if size > 4) > 0
        assert_idle(llm)
