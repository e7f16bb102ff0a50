"""Model pieces against HF: RoPE frequency scaling, architecture refusals, KV sizing."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.attention.kv_cache import KVCache, KVCacheSpec
from engine.loading.loader import rope_settings
from engine.models import build_model
from engine.layers.rotary import inverse_frequencies

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
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
                         rope_parameters=params)
    theta, parsed = rope_settings(config)
    ours = inverse_frequencies(64, theta, parsed)
    rope_type = params["rope_type"]
    if rope_type == "default":
        expected = 1.0 / (theta ** (torch.arange(0, 64, 2).float() / 64))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](config)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


def test_unsupported_rope_and_architecture_are_refused():
    with pytest.raises(ValueError, match="yarn"):
        inverse_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 2.0})
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
