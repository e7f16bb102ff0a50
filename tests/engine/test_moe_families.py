"""The mixtures of experts on the generic decoder (OLMoE, Granite MoE, Phi-3.5-MoE) beyond their equivalence with HF
(tests/engine/test_moe_equivalence.py): Phi-3.5-MoE's sparsemixer routing equal to transformers' own function,
its LongRoPE's factor set and mscale, and the config fields refused at start-up by name."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig

from engine.layers.moe_routing import sparse_mixer
from engine.layers.rotary import inverse_frequencies
from engine.models import build_model
from engine.models.decoder_moe import DecoderMoeForCausalLM
from tests.engine.factories import tiny_config_dict
from tests.engine.test_moe_equivalence import FAMILIES, SHORT_FACTORS


def config_of(family: str, **overrides):
    """The family's tiny config, its nested dicts copied (a test may change them in place)."""
    settings = copy.deepcopy({"num_experts_per_tok": 2, **FAMILIES[family], **overrides})
    return AutoConfig.for_model(**tiny_config_dict("llama", **settings))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.01, 0.1, 0.5])
def test_sparse_mixer_is_transformers_sparsemixer_at_inference(dtype, eps):
    """Bit for bit, ties included (logits rounded to a coarse grid tie often: the lowest index wins in both)."""
    # (imported here: transformers' Phi-MoE module imports triton, which tests/engine/triton must import first)
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=generator) * 2
    tied = (logits * 2).round() / 2  # many exact ties
    for scores in (logits.to(dtype), tied.to(dtype), -logits.abs().to(dtype)):  # all-negative rows too
        weights, experts = sparsemixer(scores, jitter_eps=eps, training=False, top_k=2)
        routing = sparse_mixer(scores, eps)
        assert torch.equal(routing.expert_ids, experts) and torch.equal(routing.weights, weights)
        assert routing.weights.dtype == dtype and (routing.expert_ids[:, 0] != routing.expert_ids[:, 1]).all()


def test_phimoe_longrope_serves_one_factor_set_with_its_mscale():
    """Within the original context the short factors and short_mscale (what HF computes there); a max_model_len
    past it the long factors and long_mscale for every position (HF's Phi-3.5-MoE port keeps the short factors
    with long_mscale there; Microsoft's code and vLLM take the long ones)."""
    config = config_of("phimoe")
    head_dim = 16
    for max_model_len, factors, mscale in [(256, SHORT_FACTORS, 1.3), (512, [f * 2 for f in SHORT_FACTORS], 1.7)]:
        model = build_model(config, torch.float32, torch.device("cpu"), max_model_len=max_model_len)
        assert isinstance(model, DecoderMoeForCausalLM) and model.arch.norm_kind == "layer"
        inv_freq = inverse_frequencies(head_dim, 10000.0, {"rope_type": "longrope", "short_factor": factors}, None)
        angles = torch.arange(max_model_len).float()[:, None] * inv_freq[None, :]
        cos = torch.cat([angles, angles], dim=-1).cos() * mscale
        torch.testing.assert_close(model.rotary.cos, cos, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("olmoe", {"clip_qkv": 8.0}, "OlmoeForCausalLM: clip_qkv 8.0 is not supported"),
        ("olmoe", {"sliding_window": 16}, "OlmoeForCausalLM: sliding_window is not supported"),
        ("granitemoe", {"hidden_act": "gelu"}, "GraniteMoeForCausalLM: hidden_act 'gelu' is not supported"),
        (
            "phimoe",
            {"num_experts_per_tok": 3},
            "num_experts_per_tok 3 is not supported for phimoe: its sparsemixer routing picks exactly 2",
        ),
        (
            "phimoe",
            {
                "rope_parameters": {
                    "rope_type": "linear",
                    "factor": 2.0,
                    "rope_theta": 1e4,
                    "short_mscale": 1,
                    "long_mscale": 1,
                }
            },
            r"PhimoeForCausalLM: RoPE scaling 'linear' is not supported \(supported: default, longrope\)",
        ),
    ],
)
def test_unsupported_config_fields_are_refused(family, overrides, message):
    with pytest.raises(ValueError, match=message):
        build_model(config_of(family, **overrides), torch.float32, torch.device("cpu"))


def test_phimoe_longrope_without_its_mscales_is_refused():
    config = config_of("phimoe")
    del config.rope_parameters["long_mscale"]  # (transformers' own check runs when the config is made)
    with pytest.raises(ValueError, match=r"LongRoPE needs short_mscale and long_mscale, got \[1.3, None\]"):
        build_model(config, torch.float32, torch.device("cpu"))
