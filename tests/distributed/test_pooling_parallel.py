"""Pooling (embeddings) with tensor and pipeline parallelism over gloo on CPU: `LLM.embed` on two tensor-parallel
ranks, or two pipeline stages, gives the one-process vectors within float32 rounding. Over prefill chunks (MEAN
sums every chunk's rows, which a pipeline's last stage sends back whole; CLS, whose last chunk pools no row), LAST
with prefix-cache hits, a request sent back mid-prompt (its partial sum is rank 0's alone, and dropped), and a LoRA
adapter beside the base model."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LoRAMix, LoRARequest
from engine.pooling import PoolingParams
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import assert_idle
from tests.lora.adapters import make_adapter

pytestmark = pytest.mark.timeout(300)

SETTINGS = dict(
    dtype="float32",
    device="cpu",
    block_size=4,
    max_num_batched_tokens=16,
    max_num_seqs=4,
    enable_prefix_caching=True,
)
PROMPTS = [
    "hello world, this is a test",
    "the quick brown fox jumps over the lazy dog " * 2,  # 42 tokens: three steps of 16
    "a",
]
LONG = "pack my box with five dozen liquor jugs " * 2  # 49 tokens: sent back after 32
PARALLEL = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A generative four-layer Llama (two layers per stage; four query heads over two KV heads, which two ranks
    split) served for embeddings (--convert embed), and an adapter over it."""
    base = make_tiny_model_dir(tmp_path_factory.mktemp("embed4"), "llama", num_hidden_layers=4)
    return base, make_adapter(base, tmp_path_factory.mktemp("adapter"), seed=1, r=4, alpha=8)


def sent_back_mid_prompt(llm: LLM) -> torch.Tensor:
    """LONG's vector when it is sent back (as a preemption does) after two of its chunks: pooled afresh."""
    engine = llm.engine
    engine.add_request("long", llm.get_tokenizer().encode(LONG), PoolingParams())
    outputs = engine.step() + engine.step()
    assert engine.scheduler.requests["long"].num_computed_tokens == 32
    engine.scheduler.recompute(["long"])
    while engine.has_work:
        outputs += engine.step()
    assert engine.stats().num_preemptions == 1
    (final,) = [out for out in outputs if out.finished]
    return torch.tensor(final.embedding)


def last_with_adapter(base, adapter, **parallel) -> list[torch.Tensor]:
    """LAST pooling: PROMPTS by the base model and by the adapter in one batch, twice (the second time from
    prefix-cache hits, each adapter's own)."""
    with LLM(str(base), **SETTINGS, convert="embed", enable_lora=True, max_loras=2, max_lora_rank=8, **parallel) as llm:
        llm.engine.lora_manager.add_lora(LoRARequest("a", str(adapter)))
        choices = [None] * len(PROMPTS) + [LoRAMix.single("a")] * len(PROMPTS)
        first, second = (llm.embed(PROMPTS * 2, use_tqdm=False, lora_request=choices) for _ in range(2))
        assert all(r.num_cached_tokens > 0 for r in second[1 :: len(PROMPTS)])
        assert_idle(llm)
    return [torch.tensor(r.outputs.embedding) for r in first + second]


def mean_sent_back(base, **parallel) -> list[torch.Tensor]:
    """MEAN pooling over prefill chunks: PROMPTS, then LONG sent back mid-prompt."""
    with LLM(str(base), **SETTINGS, convert="embed", pooler_config={"pooling_type": "MEAN"}, **parallel) as llm:
        vectors = [torch.tensor(r.outputs.embedding) for r in llm.embed(PROMPTS, use_tqdm=False)]
        vectors.append(sent_back_mid_prompt(llm))
        assert_idle(llm)
    return vectors


def first_token_over_chunks(base, **parallel) -> list[torch.Tensor]:
    """CLS pooling over prefill chunks: each prompt alone, so that a long one's last step pools no row and holds
    no other request's."""
    with LLM(str(base), **SETTINGS, convert="embed", pooler_config={"pooling_type": "CLS"}, **parallel) as llm:
        vectors = [torch.tensor(llm.embed(prompt, use_tqdm=False)[0].outputs.embedding) for prompt in PROMPTS]
        assert_idle(llm)
    return vectors


@pytest.fixture(scope="module")
def one_process(model):
    base, adapter = model
    last = last_with_adapter(base, adapter)
    assert (last[0] - last[len(PROMPTS)]).abs().max() > 1e-2  # the adapter changes the vector
    return {"last": last, "mean": mean_sent_back(base), "cls": first_token_over_chunks(base)}


def assert_same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for vector, want in zip(got, expected):
        torch.testing.assert_close(vector, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("parallel", PARALLEL)
def test_last_token_pooling_with_an_adapter_and_cache_hits(model, one_process, parallel):
    base, adapter = model
    assert_same(last_with_adapter(base, adapter, **PARALLEL[parallel]), one_process["last"])


@pytest.mark.parametrize("parallel", PARALLEL)
def test_mean_pooling_over_chunks_and_a_request_sent_back(model, one_process, parallel):
    base, _ = model
    assert_same(mean_sent_back(base, **PARALLEL[parallel]), one_process["mean"])


@pytest.mark.parametrize("parallel", PARALLEL)
def test_first_token_pooling_over_chunks(model, one_process, parallel):
    base, _ = model
    assert_same(first_token_over_chunks(base, **PARALLEL[parallel]), one_process["cls"])
