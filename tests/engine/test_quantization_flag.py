"""`--quantization int8|int4` on a float checkpoint: the engine serves exactly the model whose projections
are the quantized matrices dequantized (checked against that model stored as floats), keeps the
embeddings, norms and LM head float, and stays close to the float model. `--quantization-group-size`:
32 when unset with int4, the checkpoint's with awq, refused wherever it would not apply."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.shard_builder import _quantizer
from engine.quantization.int4_groups import Int4Groups
from engine.quantization.int4_weight import Int4Weight
from engine.quantization.int8_weight import Int8Weight
from engine.sampling.params import SamplingParams
from engine.kernels.column_block_weight import PackedWeight
from tests.engine.references import make_llm

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time, in a small town by the sea"]
PROJECTIONS = (
    *("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj"),
    *("c_fc", "c_proj", "fc1", "fc2", "dense_h_to_4h", "dense_4h_to_h", "fc_in", "fc_out"),
    *("dense", "query_key_value", "out_proj", "c_attn"),
)
"""Every decoder projection, as separate matrices or fused as stored (Phi-3: qkv_proj, gate_up_proj; GPT-NeoX:
query_key_value; GPT-BigCode: c_attn), a plain MLP's (StarCoder2: c_fc, c_proj; Phi-2: fc1, fc2; GPT-NeoX:
dense_h_to_4h, dense_4h_to_h; GPT-J: fc_in, fc_out), or an output projection by another name (Phi-2's and GPT-NeoX's
dense, GPT-J's out_proj)."""
PARAMS = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, logprobs=0)
CPU = torch.device("cpu")
FLOAT_CHECKPOINT = SimpleNamespace()  # an HF config without quantization_config
AWQ_CHECKPOINT = SimpleNamespace(
    quantization_config={"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128, "zero_point": True}
)


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


@pytest.mark.parametrize(
    "settings,round_trip,weight_type",
    [
        ({"quantization": "int8"}, lambda w: Int8Weight.quantize(w).dequantize(), Int8Weight),
        (
            {"quantization": "int4"},  # the default group, 32
            lambda w: Int4Groups.quantize(w, 32).dequantize(),
            Int4Weight,
        ),
        (
            {"quantization": "int4", "quantization_group_size": 128},  # over the tiny model's 64 columns: padded groups
            lambda w: Int4Groups.quantize(w, 128).dequantize(),
            Int4Weight,
        ),
    ],
)
def test_quantized_engine_serves_the_dequantized_model(tiny_llama_dir, tmp_path, settings, round_trip, weight_type):
    llm = make_llm(tiny_llama_dir, **settings)
    model = llm.engine.runner.model
    assert all(isinstance(w, weight_type) for w in model.weight_tensors()[:-1])
    assert isinstance(model.lm_head, (torch.Tensor, PackedWeight)) and isinstance(
        model.embed, (torch.Tensor, PackedWeight)
    )  # float (maybe packed)
    reference = make_llm(_dequantized_copy(tiny_llama_dir, tmp_path / "deq", round_trip))
    for got, want in zip(
        llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference.generate(PROMPTS, PARAMS, use_tqdm=False)
    ):
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
    with pytest.raises(ValueError, match="--quantization-group-size 64 does not apply to --quantization int8"):
        make_llm(tiny_llama_dir, quantization="int8", quantization_group_size=64)


def _quantizer_for(quantization, group_size, checkpoint=FLOAT_CHECKPOINT):
    """What the builder makes of --quantization (None: auto) and --quantization-group-size (None: unset)."""
    return _quantizer(quantization, group_size, checkpoint, CPU, torch.bfloat16)


def test_int4_groups_default_to_32_and_take_the_flag():
    assert _quantizer_for("int4", None).group_size == 32
    for group_size in (32, 64, 128):
        assert _quantizer_for("int4", group_size).group_size == group_size
    int8 = _quantizer_for("int8", None)
    assert int8.method == "int8" and int8.group_size is None
    assert _quantizer_for("none", None) is None and _quantizer_for("gguf", None) is None
    assert _quantizer_for(None, None) is None


@pytest.mark.parametrize(
    "quantization,reason",
    [
        ("none", "it loads float weights"),
        ("gguf", "a .gguf file's blocks keep their own size"),
        ("int8", "int8 has one scale per output row"),
        (None, "no weights are quantized to int4 at load for this checkpoint"),  # auto, on a float checkpoint
    ],
)
@pytest.mark.parametrize("group_size", [32, 128])
def test_a_group_size_where_no_groups_apply_is_refused(quantization, reason, group_size):
    """Even the int4 default (32) is refused when given explicitly: the flag would be ignored."""
    with pytest.raises(ValueError) as error:
        _quantizer_for(quantization, group_size)
    message = str(error.value)
    assert message.startswith(
        f"--quantization-group-size {group_size} does not apply to --quantization {quantization or 'auto'} ({reason})"
    )
    assert "--quantization int4" in message


@pytest.mark.parametrize("quantization", [None, "awq"])
def test_awq_takes_the_checkpoints_group_size_and_refuses_another(quantization):
    assert _quantizer_for(quantization, None, AWQ_CHECKPOINT).group_size == 128
    assert _quantizer_for(quantization, 128, AWQ_CHECKPOINT).group_size == 128  # the same value: accepted
    for group_size in (32, 64):
        with pytest.raises(
            ValueError,
            match=rf"--quantization-group-size {group_size} differs from the AWQ "
            rf"checkpoint's group size 128 .* which --quantization {quantization or 'auto'} "
            "serves as stored",
        ):
            _quantizer_for(quantization, group_size, AWQ_CHECKPOINT)
