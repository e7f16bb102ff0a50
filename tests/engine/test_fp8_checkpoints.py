"""FP8 checkpoints (quant_method fp8: block-wise as DeepSeek-V3 and Qwen3-FP8 store them, per-tensor and per-channel
as AutoFP8 does): tiny float models quantized to float8_e4m3fn here, served by dequantizing at load, against HF
transformers on the same model with the dequantized weights stored as floats."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from engine.errors import SettingsConflictError
from engine.quantization.fp8_checkpoint import dequantize_fp8, fp8_scheme, fp8_weights
from engine.quantization.weight_quantizer import resolve_quantization
from tests.distributed.test_tensor_parallel_quantized import LOGPROB_TOLERANCE, generate_quantized
from tests.distributed.test_tensor_parallel import assert_same
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import check_against_hf, make_llm
from tests.engine.test_deepseek_equivalence import make_deepseek_dir
from tests.engine.test_model_equivalence import mixed_prompts, run_greedy

E4M3_MAX = 448.0
BLOCKWISE = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}
PER_TENSOR = {"quant_method": "fp8", "activation_scheme": "static"}
PROMPTS = mixed_prompts()[:6]  # up to 33 tokens: several prefill chunks of the tiny preset's blocks


def quantize_fp8(weight: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn codes, the scale a checkpoint stores, the dequantized float32 matrix) for `layout`:
    (rows, columns) per block, "tensor" or "channel"; each scale maps its amax to e4m3's largest value."""
    w = weight.float()
    rows, columns = w.shape
    if layout == "tensor":
        scale = w.abs().amax().clamp(min=1e-8) / E4M3_MAX
        expanded = scale
    elif layout == "channel":
        scale = w.abs().amax(1, keepdim=True).clamp(min=1e-8) / E4M3_MAX  # [out, 1]
        expanded = scale
    else:
        bn, bk = layout
        padded = torch.zeros(-(-rows // bn) * bn, -(-columns // bk) * bk)
        padded[:rows, :columns] = w
        blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        scale = blocks.abs().amax((1, 3)).clamp(min=1e-8) / E4M3_MAX  # [ceil(out / bn), ceil(in / bk)]
        expanded = scale.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :columns]
    codes = (w / expanded).to(torch.float8_e4m3fn)
    return codes, scale, codes.float() * expanded


def is_quantized_linear(name: str, tensor: torch.Tensor, not_converted: tuple[str, ...]) -> bool:
    """A decoder layer's projection (real FP8 releases keep embeddings, norms, LM head and routers in floats)."""
    module = name.removesuffix(".weight")
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and tensor.dim() == 2
        and not module.endswith("mlp.gate")  # (DeepSeek's router)
        and not any(skipped in module for skipped in not_converted)
    )


def make_fp8_dirs(float_dir: Path, root: Path, config: dict, layout, not_converted=(), extras=False):
    """`float_dir`'s model with its projections in FP8 (root / "fp8", quantization_config `config`) and the same
    model with the dequantized matrices stored as floats (root / "reference"). `extras`: static input scales and
    KV-cache scales too, which the engine reads past."""
    fp8_dir, reference_dir = root / "fp8", root / "reference"
    shutil.copytree(float_dir, fp8_dir)
    shutil.copytree(float_dir, reference_dir)
    fp8_state, reference_state = {}, {}
    scale_name = "weight_scale_inv" if isinstance(layout, tuple) else "weight_scale"
    for name, tensor in load_file(str(float_dir / "model.safetensors")).items():
        if not is_quantized_linear(name, tensor, not_converted):
            fp8_state[name] = reference_state[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        codes, scale, reference_state[name] = quantize_fp8(tensor, layout)
        fp8_state[name], fp8_state[f"{prefix}.{scale_name}"] = codes, scale.contiguous()
        if extras:
            fp8_state[f"{prefix}.input_scale"] = torch.tensor(0.02)
            if prefix.endswith("self_attn.k_proj"):
                attention = prefix.removesuffix(".k_proj")
                fp8_state[f"{attention}.k_scale"], fp8_state[f"{attention}.v_scale"] = (
                    torch.tensor(0.5),
                    torch.tensor(0.7),
                )
    save_file(fp8_state, str(fp8_dir / "model.safetensors"))
    save_file(reference_state, str(reference_dir / "model.safetensors"))
    hf_config = json.loads((fp8_dir / "config.json").read_text())
    hf_config["quantization_config"] = {**config, **({"modules_to_not_convert": list(not_converted)})}
    (fp8_dir / "config.json").write_text(json.dumps(hf_config))
    return fp8_dir, reference_dir


@pytest.fixture(scope="module")
def llama_blockwise(tmp_path_factory):
    """Hidden 96, intermediate 160, k/v 48 rows: every matrix has partial 64x64 edge blocks; layer 1's MLP kept
    in floats (modules_to_not_convert)."""
    root = tmp_path_factory.mktemp("fp8_llama")
    float_dir = make_tiny_model_dir(root / "float", hidden_size=96, intermediate_size=160)
    return make_fp8_dirs(float_dir, root, BLOCKWISE, (64, 64), not_converted=("layers.1.mlp",))


def check_served(fp8_dir, reference_dir, prompts=PROMPTS, **settings):
    with make_llm(fp8_dir, **settings) as llm:
        results = run_greedy(llm, prompts)
        model = llm.engine.runner.model
    check_against_hf(reference_dir, prompts, results)
    return model


def test_blockwise_llama_with_partial_edge_blocks_matches_hf(llama_blockwise, caplog):
    fp8_dir, reference_dir = llama_blockwise
    with caplog.at_level(logging.INFO, logger="engine.quantization.fp8_checkpoint"):
        check_served(fp8_dir, reference_dir)
    # 2 layers x 7 projections, less layer 1's gate, up and down
    assert "11 matrices dequantized to float32" in caplog.text and "64x64 blocks" in caplog.text
    assert "(4x)" in caplog.text and "kept in floats as stored: layers.1.mlp" in caplog.text


@pytest.mark.parametrize("layout", ["tensor", "channel"])
def test_per_tensor_and_per_channel_qwen3_match_hf(tmp_path, layout, caplog):
    """Static activation scales and KV-cache scales are stored too: read past, logged."""
    float_dir = make_tiny_model_dir(tmp_path / "float", "qwen3")
    fp8_dir, reference_dir = make_fp8_dirs(float_dir, tmp_path, PER_TENSOR, layout, extras=True)
    with caplog.at_level(logging.INFO, logger="engine.quantization.fp8_checkpoint"):
        check_served(fp8_dir, reference_dir, PROMPTS[:4])
    assert "14 matrices dequantized" in caplog.text
    assert "14 static activation scales" in caplog.text and "4 KV-cache scales" in caplog.text


def test_blockwise_deepseek_v3_matches_hf(tmp_path):
    """Latent attention's projections (kv_a_proj_with_mqa: 40 rows, one partial block), routed and shared experts in
    16x16 blocks; the router stays float."""
    float_dir = make_deepseek_dir(tmp_path / "float", "deepseek_v3")
    config = {**BLOCKWISE, "weight_block_size": [16, 16]}
    fp8_dir, reference_dir = make_fp8_dirs(float_dir, tmp_path, config, (16, 16))
    check_served(fp8_dir, reference_dir, PROMPTS[:4], attention_backend="auto")


def test_int8_requantizes_the_dequantized_weights(llama_blockwise):
    """--quantization int8 on an FP8 checkpoint: the dequantized floats quantized as a float checkpoint's are."""
    fp8_dir, reference_dir = llama_blockwise
    prompts = PROMPTS[:3]
    outputs = []
    for model_dir in (fp8_dir, reference_dir):
        with make_llm(model_dir, quantization="int8") as llm:
            results = run_greedy(llm, prompts)
            assert llm.engine.runner.model.layers[0].o_proj.format == "int8"
        outputs.append([(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in results])
    assert_same(outputs[0], outputs[1], abs=0)


def test_two_tensor_parallel_ranks_equal_one_process(llama_blockwise):
    """Dequantized before the cut: each rank's slices are the whole matrices' (exact)."""
    fp8_dir, _ = llama_blockwise
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 301, 17]]
    expected, _ = generate_quantized(str(fp8_dir), prompts, 1, max_tokens=6)
    got, (fmt, in_features) = generate_quantized(str(fp8_dir), prompts, 2, max_tokens=6)
    assert in_features == 48  # o_proj's input columns cut in two
    assert_same(got, expected, abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("rows,columns,block", [(200, 160, (64, 64)), (5, 7, (4, 3)), (3, 2, (4, 4)), (8, 6, (4, 3))])
def test_blockwise_dequantization_in_chunks_with_partial_blocks(rows, columns, block):
    """Whole blocks, a partial last row or column of blocks, a corner, a block larger than the matrix: each value
    times its own block's scale, whatever the chunks (at least one row of blocks each)."""
    codes, scale, want = quantize_fp8(torch.randn(rows, columns), block)
    for chunk_values in (1, 1000, 1 << 24):
        got = dequantize_fp8(codes, scale, block, torch.float32, torch.device("cpu"), chunk_values=chunk_values)
        assert torch.equal(got, want)


def test_dequantization_in_bfloat16_rounds_once():
    codes, scale, want = quantize_fp8(torch.randn(200, 160), (64, 64))
    bf16 = dequantize_fp8(codes, scale, (64, 64), torch.bfloat16, torch.device("cpu"))
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, want.to(torch.bfloat16))  # rounded once


class _Config:
    def __init__(self, quantization_config):
        self.quantization_config = quantization_config


@pytest.mark.parametrize(
    "change,message",
    [
        ({"fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"activation_scheme": "per_token"}, "activation_scheme 'per_token'"),
        ({"weight_block_size": [128]}, r"weight_block_size \[128\]"),
        ({"weight_block_size": [128, 128, 1]}, "weight_block_size"),
        ({"weight_block_size": [128.0, 128]}, "weight_block_size"),
    ],
)
def test_unsupported_fp8_variants_are_named(change, message):
    with pytest.raises(ValueError, match="FP8 checkpoint.*not supported") as error:
        resolve_quantization(None, _Config({**BLOCKWISE, **change}))
    assert re.search(message, str(error.value))


def test_quantization_flag_against_an_fp8_checkpoint():
    fp8 = _Config(BLOCKWISE)
    assert resolve_quantization(None, fp8) == resolve_quantization("none", fp8) == (None, None)
    assert resolve_quantization("int8", fp8) == ("int8", None)
    assert resolve_quantization("int4", fp8) == ("int4", None)
    for storage in ("awq", "gptq", "gguf"):
        with pytest.raises(SettingsConflictError, match=f"--quantization {storage}: the checkpoint is FP8"):
            resolve_quantization(storage, fp8)


def _stream(tensors: dict, config=BLOCKWISE):
    scheme = fp8_scheme(_Config(config))
    assert scheme is not None
    return list(fp8_weights(tensors.items(), scheme, torch.float32, torch.device("cpu")))


@pytest.mark.parametrize(
    "tensors,message",
    [
        (
            {"l.weight": torch.zeros(70, 70).to(torch.float8_e4m3fn)},
            "l.weight in float8_e4m3fn but no l.weight_scale_inv",
        ),
        ({"l.weight_scale_inv": torch.ones(2, 2)}, "l.weight_scale_inv but no float8_e4m3fn l.weight"),
        ({"l.weight": torch.zeros(4, 4), "l.weight_scale_inv": torch.ones(1, 1)}, "l.weight is stored in floats"),
        (
            {"l.weight": torch.zeros(70, 70).to(torch.float8_e4m3fn), "l.weight_scale_inv": torch.ones(1, 2)},
            r"l: weight_scale_inv of shape \(1, 2\).*expected \(2, 2\)",
        ),
        ({"l.weight_scale": torch.ones(())}, "stores weight_scale_inv, not weight_scale"),
        ({"l.weight": torch.zeros(4, 4).to(torch.float8_e5m2)}, "float8_e5m2 tensor"),
    ],
)
def test_malformed_blockwise_tensors_are_refused(tensors, message):
    with pytest.raises(ValueError, match=message):
        _stream(tensors)


def test_malformed_per_tensor_scales_are_refused():
    codes = torch.zeros(6, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"weight_scale of shape \(4,\).*\[6\] or \[6, 1\] per channel"):
        _stream({"l.weight": codes, "l.weight_scale": torch.ones(4)}, PER_TENSOR)
    ((name, matrix),) = _stream({"l.weight_scale": torch.tensor([2.0]), "l.weight": codes}, PER_TENSOR)
    assert name == "l.weight" and matrix.shape == (6, 4)  # the scale first: held until its weight comes


def test_deepseek_v3_prediction_layer_in_fp8_drafts_exactly(tmp_path):
    """The multi-token-prediction layer of an FP8 checkpoint is FP8 too (its projections and experts): dequantized as
    the target's layers are, its drafts leave greedy tokens and logprobs as they are without speculation."""
    from tests.engine.test_mtp import add_prediction_layer, mtp_config
    from tests.engine.test_spec_decode import PROMPTS as SPEC_PROMPTS
    from tests.engine.test_spec_decode import assert_same as assert_spec_same
    from tests.engine.test_spec_decode import run

    whole = make_deepseek_dir(tmp_path / "whole", "deepseek_v3", num_hidden_layers=4)
    float_dir = add_prediction_layer(whole, tmp_path / "float")
    config = {**BLOCKWISE, "weight_block_size": [16, 16]}
    fp8_dir, _ = make_fp8_dirs(float_dir, tmp_path, config, (16, 16), not_converted=("embed_tokens", "shared_head"))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
    with make_llm(fp8_dir) as base:
        expected = run(base, SPEC_PROMPTS[:3], params)
    with make_llm(fp8_dir, speculative_config=mtp_config(2)) as spec:
        got = run(spec, SPEC_PROMPTS[:3], params)
        assert spec.engine.stats().speculation.num_draft_tokens > 0
    assert_spec_same(expected, got)
