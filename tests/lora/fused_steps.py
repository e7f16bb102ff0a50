"""The fused decode step with adapters against the unfused path, on one engine."""

from __future__ import annotations

from typing import Any, Sequence

from engine import SamplingParams
from tests.engine.references import assert_idle


def fused_then_unfused(llm: Any, prompts: Sequence[Any], loras: Sequence[Any], params: SamplingParams):
    """Generate `prompts` (each with its `loras` choice) with the model's fused decode step, counting the rows of
    its steps that carry adapters, then again with the fused step removed. Steps admitting prompts run unfused
    (they sum in another order), so both runs' decodes are comparable bit for bit. Returns (fused results,
    unfused results, rows per fused adapter step); a result is (token ids, logprobs)."""
    model = llm.engine.runner.model
    assert model.fused is not None and model.lora is not None and model.lora.native is not None
    rows: list[int] = []
    forward = model.fused.forward

    def counting(m, input_ids, *args):
        if m.lora_step is not None:
            rows.append(input_ids.shape[0])
        return forward(m, input_ids, *args)

    model.fused.forward = counting
    model.fused.mixed_prefill_tokens = 0

    def run():
        results = llm.generate(list(prompts), params, use_tqdm=False, lora_request=list(loras))
        assert_idle(llm)
        return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]

    fused = run()
    model.fused = None
    return fused, run(), rows
