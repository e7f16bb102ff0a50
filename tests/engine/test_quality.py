"""The quality report's measures at a small size (benchmarks/perplexity.py): on the embedded model and the
first 256 tokens of the shipped text, int8 weights keep the perplexity within 2% of the float model (over
the whole text the report measures it within 1%; on two short windows the spread is wider) and agree with
its greedy tokens; the script's own functions compute both."""

from __future__ import annotations

import pytest

from benchmarks.perplexity import TEXT, agreement, agreement_prompts, greedy_continuations, perplexity, token_windows
from engine.llm import LLM


def _embedded(checkpoint, **settings) -> LLM:
    # a KV cache for a few windows, not the default GiB: two of these live at once
    return LLM(
        str(checkpoint.path),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_batched_tokens=256,
        kv_cache_memory="64MiB",
        enable_prefix_caching=False,
        **settings,
    )


@pytest.fixture(scope="module")
def engines(embedded_checkpoint, one_torch_thread):
    with _embedded(embedded_checkpoint) as reference, _embedded(embedded_checkpoint, quantization="int8") as int8:
        yield reference, int8  # shut down after the module, not kept for the rest of the run


def test_int8_perplexity_within_one_percent_of_float(engines):
    reference, int8 = engines
    windows = token_windows(reference.get_tokenizer(), TEXT.read_text(), 128)[:2]
    assert [len(w) for w in windows] == [128, 128]
    float_ppl, int8_ppl = perplexity(reference, windows), perplexity(int8, windows)
    assert 1 < float_ppl < 100  # a real language model on real prose
    assert abs(int8_ppl / float_ppl - 1) < 0.02


def test_int8_greedy_agreement_with_float(engines):
    reference, int8 = engines
    prompts = agreement_prompts(reference.get_tokenizer(), TEXT.read_text(), 3, length=16)
    continuations = greedy_continuations(reference, prompts, 8)
    assert agreement(reference, prompts, continuations) >= 0.95  # teacher forcing reproduces its own tokens
    assert agreement(int8, prompts, continuations) >= 0.9
