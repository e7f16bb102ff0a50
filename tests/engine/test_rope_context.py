"""The context a linear or YaRN RoPE scaling extends a config's to (engine/loading/rope_context.py), as vLLM derives
it: `max_model_len` defaults to it and may reach it, and the sequences past max_position_embeddings give HF
transformers' greedy tokens and logprobs on the same checkpoint (HF rotates any position)."""

from __future__ import annotations

import random

import pytest

from engine.loading.loader import load_hf_config
from engine.loading.model_config import ContextLengthError, ModelConfig
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import check_against_hf, make_llm
from tests.engine.test_model_equivalence import run_greedy

CASES = {
    # Vicuna-16k's shape: max_position_embeddings the trained context, a linear factor over it (32 x 4)
    "llama-linear": (dict(max_position_embeddings=32, rope_scaling={"rope_type": "linear", "factor": 4.0}), 128),
    # Qwen3's documented YaRN recipe on a mixture of experts: original_max_position_embeddings x factor (32 x 4)
    "qwen3_moe-yarn": (
        dict(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            head_dim=16,
            max_position_embeddings=40,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        ),
        128,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_scaled_rope_serves_past_max_position_embeddings_as_hf(case, tmp_path):
    overrides, context = CASES[case]
    model_dir = make_tiny_model_dir(tmp_path, "llama", **overrides)
    config = load_hf_config(model_dir)
    assert ModelConfig().resolve_max_model_len(config) == context
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 90)]  # the second past the positions
    with make_llm(model_dir, max_num_batched_tokens=32) as llm:
        assert llm.engine.max_model_len == context
        check_against_hf(model_dir, prompts, run_greedy(llm, prompts))
    with pytest.raises(ContextLengthError, match=rf"\({context}: .*max_position_embeddings 32 x the") as error:
        ModelConfig(max_model_len=context + 1).resolve_max_model_len(config)
    assert error.value.limit == context


def test_scalings_that_state_their_context_are_not_extended(tiny_llama_dir, tmp_path):
    """llama3 and LongRoPE configs already give the extended context in max_position_embeddings (vLLM's rule)."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = load_hf_config(
        tiny_llama_dir, overrides={"rope_scaling": {**llama3, "original_max_position_embeddings": 32}}
    )
    assert ModelConfig().resolve_max_model_len(config) == 256
    with pytest.raises(ContextLengthError, match=r"\(max_position_embeddings=256\)"):
        ModelConfig(max_model_len=257).resolve_max_model_len(config)
