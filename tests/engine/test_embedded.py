"""The embedded SmolLM2-135M-Instruct: greedy text identical to HF transformers on the same weights."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.references import assert_idle

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three primary colors:",
    "Translate to French: Good morning, my friend.",
]
CHAT = [{"role": "user", "content": "What is the tallest mountain on Earth? Answer briefly."}]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def embedded_llm(embedded_checkpoint):
    # fp32 to compare token for token with HF's fp32 reference.
    with LLM(None, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory="64MiB") as llm:
        yield llm  # shut down after the module: its weights and KV cache do not stay for the rest of the run


@pytest.fixture(scope="module")
def hf_reference(embedded_checkpoint):
    """HF's fp32 model on the same weights, for this module only (references.hf_model's cache would keep it
    for the rest of the run)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(embedded_checkpoint.path), dtype=torch.float32).eval()


def hf_continuation(model, token_ids):
    from transformers import GenerationConfig

    ids = torch.tensor([token_ids])
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[2], pad_token_id=2)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, ids.shape[1] :].tolist()


def test_embedded_model_shape(embedded_llm):
    arch = embedded_llm.engine.runner.model.arch
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.vocab_size) == (
        30,
        576,
        9,
        3,
        49152,
    )


def test_greedy_prompts_match_hf(embedded_llm, hf_reference):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    results = embedded_llm.generate(PROMPTS, params, use_tqdm=False)
    tokenizer = embedded_llm.get_tokenizer()
    for prompt, result in zip(PROMPTS, results):
        expected = hf_continuation(hf_reference, result.prompt_token_ids)
        got = result.outputs[0].token_ids
        assert got == expected, prompt
        assert result.outputs[0].text == tokenizer.decode(expected)
    assert_idle(embedded_llm)


def test_chat_turn_matches_hf(embedded_llm, hf_reference):
    (result,) = embedded_llm.chat(CHAT, SamplingParams(max_tokens=NEW_TOKENS, temperature=0), use_tqdm=False)
    assert result.prompt.startswith("<|im_start|>")
    expected = hf_continuation(hf_reference, result.prompt_token_ids)
    assert result.outputs[0].token_ids == expected
    assert "Everest" in result.outputs[0].text
    assert_idle(embedded_llm)
