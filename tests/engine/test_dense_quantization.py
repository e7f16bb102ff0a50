"""`--quantization int8|int4` on the generic decoder's families (Gemma 2, Gemma 3, Phi-3, Phi-4-mini's partial
rotary, OLMo 2, Granite, ... every family in DENSE_FAMILIES: Phi-2, GPT-NeoX's per-head query_key_value), judged as tests/engine/test_quantization_flag.py judges Llama: every projection (fused
qkv_proj / gate_up_proj quantized as stored) is served as exactly the model whose matrices are the quantized ones
dequantized, embeddings, norms and the LM head stay float, and per-channel int8 stays close to the float model."""

from __future__ import annotations

import pytest
import torch

from engine.quantization.int4_groups import Int4Groups
from engine.quantization.int4_weight import Int4Weight
from engine.quantization.int8_weight import Int8Weight
from engine.kernels.column_block_weight import PackedWeight
from tests.engine.factories import DENSE_FAMILIES, make_tiny_model_dir
from tests.engine.references import make_llm
from tests.engine.test_quantization_flag import PARAMS, PROMPTS, _dequantized_copy, _prompt_logprobs

FAMILIES = sorted(DENSE_FAMILIES) + ["phi4mini"]
METHODS = {
    "int8": (lambda w: Int8Weight.quantize(w).dequantize(), Int8Weight),
    "int4": (lambda w: Int4Groups.quantize(w, 32).dequantize(), Int4Weight),  # the default group, 32
}


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_quantized_engine_serves_the_dequantized_model(model_dir, tmp_path, method):
    round_trip, weight_type = METHODS[method]
    with make_llm(model_dir, quantization=method) as llm:
        model = llm.engine.runner.model
        assert all(isinstance(w, weight_type) for w in model.weight_tensors()[:-1])
        # float (a packed float matrix where the column-block product multiplies: float32 on AVX2 or AVX-512, bf16 on
        # AVX512-BF16)
        assert isinstance(model.lm_head, (torch.Tensor, PackedWeight)) and isinstance(
            model.embed, (torch.Tensor, PackedWeight)
        )
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    with make_llm(_dequantized_copy(model_dir, tmp_path / "deq", round_trip)) as reference:
        want = reference.generate(PROMPTS, PARAMS, use_tqdm=False)
    for ours, theirs in zip(got, want):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        torch.testing.assert_close(_prompt_logprobs(ours), _prompt_logprobs(theirs), rtol=0, atol=1e-3)


def test_int8_stays_close_to_the_float_model(model_dir):
    """Per-channel int8 moves the tiny model's prompt perplexity by well under 1%."""
    with make_llm(model_dir) as llm:
        float_results = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    with make_llm(model_dir, quantization="int8") as llm:
        int8_results = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    float_nll = -torch.cat([_prompt_logprobs(r) for r in float_results]).mean()
    int8_nll = -torch.cat([_prompt_logprobs(r) for r in int8_results]).mean()
    assert abs(float(torch.exp(int8_nll - float_nll)) - 1) < 0.01
