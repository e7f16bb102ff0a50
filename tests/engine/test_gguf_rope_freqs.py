"""A Llama 3.x GGUF's llama3 RoPE scaling, which llama.cpp's converter bakes into `rope_freqs.weight` (per-pair
frequency divisors) and transformers' GGUF loader does not read: recovered at conversion
(engine/loading/gguf_rope_freqs.py), so the GGUF, dequantized or kept in its blocks, gives the original
checkpoint's greedy tokens and logprobs in HF transformers; a tensor that is no llama3 scaling is refused."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.loading.gguf_rope_freqs import llama3_divisors, llama3_scaling
from tests.engine.factories import make_tiny_gguf, make_tiny_model_dir
from tests.engine.references import check_against_hf, make_llm
from tests.engine.test_model_equivalence import run_greedy

# a tiny model's wavelengths straddle an original context of 32 tokens: unscaled, in-between and scaled pairs
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.parametrize(
    "factor, theta, rotary_dim",
    [(8.0, 500000.0, 128), (32.0, 500000.0, 64)],  # Llama 3.1 / 3.3, Llama 3.2 1B
    ids=["llama3.1", "llama3.2-1b"],
)
def test_releases_scalings_are_recovered_from_their_divisors(factor, theta, rotary_dim):
    scaling = {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    released = {"rope_type": "llama3", **scaling, "original_max_position_embeddings": 8192}
    divisors = np.float32(llama3_divisors(released, theta, rotary_dim)).tolist()  # as the GGUF stores them
    assert llama3_scaling(divisors, theta, rotary_dim) == released
    assert llama3_scaling([1.0] * (rotary_dim // 2), theta, rotary_dim) is None


def test_divisors_that_are_no_llama3_scaling_are_refused():
    with pytest.raises(ValueError, match="rope_freqs.weight .* is not a llama3 RoPE scaling"):
        llama3_scaling([1.0, 1.5, 1.0, 3.0, 2.0, 4.0, 4.0, 8.0], 10000.0, 16)
    with pytest.raises(ValueError, match="rope_freqs.weight has 4 entries; 8 rotary pairs need one each"):
        llama3_scaling([1.0, 2.0, 4.0, 8.0], 10000.0, 16)


@pytest.fixture(scope="module")
def llama3_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3-gguf")
    model_dir = make_tiny_model_dir(root / "hf", "llama", rope_parameters=LLAMA3)
    return model_dir, make_tiny_gguf(model_dir, root / "tiny-llama3.gguf")  # float32 matrices: HF's weights


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_a_llama3_gguf_rotates_as_the_original_checkpoint(llama3_gguf, quantization):
    model_dir, gguf_path = llama3_gguf
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40)]
    with make_llm(gguf_path, quantization=quantization) as llm:
        assert llm.engine.runner.model.arch.rope_scaling == {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
        results = run_greedy(llm, prompts)
    check_against_hf(model_dir, prompts, results)  # HF on the original checkpoint, its llama3 scaling
