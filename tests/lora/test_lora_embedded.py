"""LoRA on the embedded SmolLM2-135M (its GGUF dequantized, quantization "none") against PEFT's own forward."""

from __future__ import annotations

import pytest

from engine import LLM, LoRAMix, LoRARequest, SamplingParams
from tests.engine.references import assert_idle
from tests.engine.references import hf_greedy_of
from tests.lora.adapters import make_adapter

pytestmark = pytest.mark.slow
NEW_TOKENS = 8


def test_embedded_model_with_an_adapter_matches_peft(embedded_checkpoint, tmp_path):
    base_dir = embedded_checkpoint.path
    adapter, reference = make_adapter(
        base_dir,
        tmp_path / "adapter",
        seed=11,
        r=8,
        alpha=16,
        weight_scale=0.05,
        keep=True,  # PEFT's own forward as the reference (merge_and_unload: the tiny model's tests)
    )
    with LLM(
        None,
        dtype="float32",
        device="cpu",
        quantization="none",
        max_model_len=256,
        kv_cache_memory="32MiB",
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
    ) as llm:
        llm.engine.lora_manager.add_lora(LoRARequest("smol", str(adapter)))
        prompt = llm.get_tokenizer().encode("The capital of France is")
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
        served, base = llm.generate(
            [prompt, prompt], params, use_tqdm=False, lora_request=[LoRAMix.single("smol"), None]
        )
        assert_idle(llm)
    expected, expected_logprobs = hf_greedy_of(reference, prompt, NEW_TOKENS)
    assert served.outputs[0].token_ids == expected
    assert [lp.logprob for lp in served.outputs[0].logprobs] == pytest.approx(expected_logprobs, abs=1e-4)
    assert base.outputs[0].token_ids != expected  # the adapter changes the output
