"""Model pieces against HF: RoPE frequency scaling, architecture refusals, KV sizing."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.attention.kv_cache import KVCache, KVCacheSpec
from engine.loading.rope_settings import rope_settings
from engine.models import build_model
from engine.layers.rotary import RotaryEmbedding, attention_factor, inverse_frequencies

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3_SCALING])
def test_inverse_frequencies_match_hf(scaling):
    params = {"rope_theta": 500000.0, "rope_type": "default"}
    if scaling is not None:
        params.update(scaling)
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=params)
    theta, parsed = rope_settings(config)
    ours = inverse_frequencies(64, theta, parsed)
    rope_type = params["rope_type"]
    if rope_type == "default":
        expected = 1.0 / (theta ** (torch.arange(0, 64, 2).float() / 64))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](config)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


YARN_SCALING = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


@pytest.mark.parametrize(
    "scaling",
    [
        YARN_SCALING,
        {**YARN_SCALING, "mscale": 1.0, "mscale_all_dim": 0.5},
        {**YARN_SCALING, "attention_factor": 1.3, "truncate": False},
    ],
)
def test_yarn_matches_hf(scaling):
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=16384,
        rope_parameters={"rope_theta": 10000.0, **scaling},
    )
    theta, parsed = rope_settings(config)
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    torch.testing.assert_close(inverse_frequencies(64, theta, parsed, 16384), expected.float(), rtol=1e-6, atol=0)
    assert attention_factor(parsed, 16384) == pytest.approx(factor)


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("max_model_len, long", [(128, False), (129, True), (None, True)])
def test_longrope_tables_match_hf_by_max_model_len(partial, max_model_len, long):
    """Every position rotates with one factor set (engine/layers/rotary.py): HF's short frequencies where
    max_model_len stays within original_max_position_embeddings, its long ones (those of a sequence past it)
    otherwise (None: the config's 512); over the first int(16 * partial) dimensions of a head; cos and sin
    carry the attention factor."""
    from transformers import Phi3Config

    pairs = int(16 * partial) // 2
    short = [1.0 + i / 16 for i in range(pairs)]
    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
        pad_token_id=0,
        original_max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": short,
            "long_factor": [2 * f for f in short],
            "partial_rotary_factor": partial,
        },
    )
    theta, parsed = rope_settings(config)
    parsed.setdefault("original_max_position_embeddings", 128)
    expected, factor = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=129 if long else None)
    cpu = torch.device("cpu")
    rope = RotaryEmbedding(16, 512, theta, parsed, torch.float32, cpu, 2 * pairs, max_model_len)
    assert rope.long_context == long and rope.cos.shape == (512, 2 * pairs)
    for position in (5, 127, 128, 400):
        angles = position * torch.cat([expected, expected]).float()
        torch.testing.assert_close(rope.cos[position], angles.cos() * factor, rtol=1e-5, atol=1e-6)
    assert factor != 1.0


def test_partial_rotary_rotates_the_first_dimensions_as_hf():
    """HF Phi-3's apply_rotary_pos_emb: the first rotary_dim dimensions of each head rotated, the rest passed."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    cpu = torch.device("cpu")
    rope = RotaryEmbedding(16, 64, 10000.0, None, torch.float32, cpu, rotary_dim=12)
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0))  # [tokens, heads, head_dim]
    positions = torch.tensor([0, 3, 9, 31, 63])
    cos, sin_signed = rope.tables(positions)
    sin = torch.cat([-sin_signed[..., :6], sin_signed[..., 6:]], dim=-1)  # HF's sin: not negated
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1), x.transpose(0, 1), cos[:, 0], sin[:, 0], unsqueeze_dim=0)
    torch.testing.assert_close(rope.apply(x, cos, sin_signed), want.transpose(0, 1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="rotary_dim 7 must be even"):
        RotaryEmbedding(16, 64, 10000.0, None, torch.float32, cpu, rotary_dim=7)


def test_unsupported_rope_and_architecture_are_refused():
    with pytest.raises(ValueError, match=r"'dynamic' is not supported \(supported: default, linear, llama3, yarn"):
        inverse_frequencies(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1)
    config.architectures = ["GPT2LMHeadModel"]
    config.model_type = "gpt2"
    with pytest.raises(ValueError, match="not supported"):
        build_model(config, torch.float32, torch.device("cpu"))
    gelu = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act"):
        build_model(gelu, torch.float32, torch.device("cpu"))


def test_kv_cache_layout_and_sizing():
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    assert spec.bytes_per_block == 2 * 2 * 16 * 3 * 64 * 4
    assert spec.num_blocks_for(10 * spec.bytes_per_block + 5) == 10
    cache = KVCache(spec, 10, torch.device("cpu"))
    assert len(cache.layers) == 2
    key, value = cache.layers[0]
    assert key.shape == value.shape == (11, 16, 3, 64)  # and the padding block, which no request gets
    assert cache.pad_block == 10
    assert cache.num_tokens == 160 and cache.nbytes == 10 * spec.bytes_per_block


def test_weights_missing_or_unused_are_errors(tiny_llama_dir):
    from engine.loading.loader import iter_weights, load_hf_config

    config = load_hf_config(tiny_llama_dir)
    model = build_model(config, torch.float32, torch.device("cpu"))
    weights = dict(iter_weights(tiny_llama_dir))
    with pytest.raises(ValueError, match="not used"):
        model.load_weights(list(weights.items()) + [("model.layers.9.mlp.extra.weight", torch.zeros(1))])
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="down_proj"):
        build_model(config, torch.float32, torch.device("cpu")).load_weights(weights.items())


def test_models_doc_is_generated_from_the_registry():
    """docs/models.md is what `python -m engine.models.table` writes (run it after changing the registry)."""
    from engine.models.registry import FAMILIES
    from engine.models.table import DOC, render

    assert DOC.read_text() == render()
    assert all(f"`{family.architecture}`" in DOC.read_text() for family in FAMILIES)
