"""LoRA on a pooling model (embeddings) against PEFT: a request's vector with an adapter is HF's base model with
that adapter merged (merge_and_unload), the last token's final hidden state, normalized; and not the base model's.
A generative checkpoint served for embeddings (--convert embed), and a base-model checkpoint (architectures
["LlamaModel"]) whose adapter was trained on the base model (tensor names without "model.")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LoRAMix, LoRARequest
from tests.engine.factories import make_tiny_embedding_dir
from tests.engine.references import assert_idle, make_llm
from tests.lora.adapters import ALL_TARGETS, merged_model

PROMPTS = [
    [5, 17, 99, 230, 7],
    list(range(40, 90)),  # chunked: longer than a step's token budget of 32 below
    [311],
]


def hf_last_token(base_model, prompts) -> list[torch.Tensor]:
    """HF's base model (no LM head): the last token's last hidden state, L2-normalized."""
    with torch.no_grad():
        return [F.normalize(base_model(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1) for ids in prompts]


def assert_close(results, references) -> None:
    assert len(results) == len(references)
    for result, reference in zip(results, references):
        torch.testing.assert_close(torch.tensor(result.outputs.embedding), reference, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def references(lora_base_dir, adapter_a, adapter_b):
    """name -> the vectors of PROMPTS by HF's base model with that adapter (or mix) merged; None: no adapter."""
    mixes = {None: [], "a": [(adapter_a, 1.0)], "b": [(adapter_b, 1.0)], "half": [(adapter_a, 0.5), (adapter_b, 0.5)]}
    return {name: hf_last_token(merged_model(lora_base_dir, parts).model, PROMPTS) for name, parts in mixes.items()}


def test_a_converted_model_with_adapters_embeds_as_peft_merged(lora_base_dir, adapter_a, adapter_b, references):
    """Base, a, b and a mix in one batch (prefill chunks of several adapters in the same steps), then again from
    the prefix cache: each request gets its own model's vector."""
    llm = make_llm(
        lora_base_dir, convert="embed", enable_lora=True, max_loras=3, max_lora_rank=8, max_num_batched_tokens=32
    )
    llm.engine.lora_manager.add_lora(LoRARequest("a", str(adapter_a)))
    llm.engine.lora_manager.add_lora(LoRARequest("b", str(adapter_b)))
    choices = {
        None: None,
        "a": LoRAMix.single("a"),
        "b": LoRAMix.single("b"),
        "half": LoRAMix((("a", 0.5), ("b", 0.5))),
    }
    prompts = [p for _ in choices for p in PROMPTS]
    loras = [choice for choice in choices.values() for _ in PROMPTS]
    expected = [vector for name in choices for vector in references[name]]
    for run in range(2):
        results = llm.embed(prompts, use_tqdm=False, lora_request=loras)
        assert_close(results, expected)
        assert run == 0 or all(r.num_cached_tokens > 0 for r in results[1 :: len(PROMPTS)])
    for name in ("a", "b", "half"):  # each adapter changes every vector
        for vector, base in zip(references[name], references[None]):
            assert (vector - base).abs().max() > 1e-2
    assert_idle(llm)


def test_an_adapter_over_a_base_model_checkpoint(tmp_path):
    """An embedding checkpoint saved as the HF base model, and a PEFT adapter trained on that base model (its
    tensors named base_model.model.layers...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    model_dir = make_tiny_embedding_dir(tmp_path / "embed")
    torch.manual_seed(5)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL_TARGETS), init_lora_weights=False)
    peft_model = get_peft_model(AutoModel.from_pretrained(str(model_dir), dtype=torch.float32), config)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    expected = hf_last_token(peft_model.merge_and_unload().eval(), PROMPTS)
    base = hf_last_token(AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval(), PROMPTS)

    llm = make_llm(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8, max_num_batched_tokens=32)
    assert llm.engine.pooler is not None
    adapter = LoRARequest("tuned", str(tmp_path / "adapter"))
    results = llm.embed(PROMPTS * 2, use_tqdm=False, lora_request=[adapter] * len(PROMPTS) + [None] * len(PROMPTS))
    assert_close(results, expected + base)
    for vector, plain in zip(expected, base):
        assert (vector - plain).abs().max() > 1e-2
    assert_idle(llm)
