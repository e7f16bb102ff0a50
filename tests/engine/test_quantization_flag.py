"""`--quantization int8|int4` on a float checkpoint: the engine serves exactly the model whose projections
are the quantized matrices dequantized (checked against that model stored as floats), keeps the
embeddings, norms and LM head float, and stays close to the float model."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.quantization.int4_groups import Int4Groups
from engine.quantization.int4_weight import Int4Weight
from engine.quantization.int8_weight import Int8Weight
from engine.sampling.params import SamplingParams
from tests.engine.references import make_llm

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time, in a small town by the sea"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARAMS = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, logprobs=0)


def _dequantized_copy(model_dir, target, round_trip):
    shutil.copytree(model_dir, target)
    state = load_file(str(model_dir / "model.safetensors"))
    for name, tensor in state.items():
        if name.removesuffix(".weight").endswith(PROJECTIONS):
            state[name] = round_trip(tensor).contiguous()
    save_file(state, str(target / "model.safetensors"))
    return target


def _prompt_logprobs(result) -> torch.Tensor:
    return torch.tensor([entry.logprob for entry in result.prompt_logprobs[1:]])


@pytest.mark.parametrize("settings,round_trip,weight_type", [
    ({"quantization": "int8"}, lambda w: Int8Weight.quantize(w).dequantize(), Int8Weight),
    ({"quantization": "int4"},  # the default group, 32
     lambda w: Int4Groups.quantize(w, 32).dequantize(), Int4Weight),
    ({"quantization": "int4", "quantization_group_size": 128},  # over the tiny model's 64 columns: padded groups
     lambda w: Int4Groups.quantize(w, 128).dequantize(), Int4Weight),
])
def test_quantized_engine_serves_the_dequantized_model(tiny_llama_dir, tmp_path, settings, round_trip,
                                                       weight_type):
    llm = make_llm(tiny_llama_dir, **settings)
    model = llm.engine.runner.model
    assert all(isinstance(w, weight_type) for w in model.weight_tensors()[:-1])
    assert isinstance(model.lm_head, torch.Tensor) and isinstance(model.embed, torch.Tensor)
    reference = make_llm(_dequantized_copy(tiny_llama_dir, tmp_path / "deq", round_trip))
    for got, want in zip(llm.generate(PROMPTS, PARAMS, use_tqdm=False),
                         reference.generate(PROMPTS, PARAMS, use_tqdm=False)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        torch.testing.assert_close(_prompt_logprobs(got), _prompt_logprobs(want), rtol=0, atol=1e-3)


def test_int8_stays_close_to_the_float_model(tiny_llama_dir):
    """Per-channel int8 moves the tiny model's prompt perplexity by well under 1%."""
    float_results = make_llm(tiny_llama_dir).generate(PROMPTS, PARAMS, use_tqdm=False)
    int8_results = make_llm(tiny_llama_dir, quantization="int8").generate(PROMPTS, PARAMS, use_tqdm=False)
    float_nll = -torch.cat([_prompt_logprobs(r) for r in float_results]).mean()
    int8_nll = -torch.cat([_prompt_logprobs(r) for r in int8_results]).mean()
    assert abs(float(torch.exp(int8_nll - float_nll)) - 1) < 0.01


def test_bad_quantization_settings_are_config_errors(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization"):
        make_llm(tiny_llama_dir, quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size"):
        make_llm(tiny_llama_dir, quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="--quantization awq needs an AWQ checkpoint"):
        make_llm(tiny_llama_dir, quantization="awq")
    with pytest.raises(ValueError, match="--quantization int8 cannot be combined with --batch-invariant"):
        make_llm(tiny_llama_dir, quantization="int8", batch_invariant=True)
