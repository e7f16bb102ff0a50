"""AWQ (AutoAWQ GEMM) checkpoints: a tiny Llama quantized and packed here by a reference AWQ packer, served
through the int4 path, against the same model with the dequantized weights stored as floats."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.quantization.awq import awq_group_size, unpack_awq
from engine.quantization.int4_weight import Int4Weight
from engine.quantization.weight_quantizer import resolve_quantization
from engine.sampling.params import SamplingParams
from engine.kernels.column_block_weight import PackedWeight
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import make_llm

GROUP = 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_CONFIG = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": GROUP, "zero_point": True}


def awq_pseudo_quantize(w: torch.Tensor, group: int):
    """AutoAWQ's pseudo_quantize_tensor (zero point, 4 bits): per group of `group` input columns,
    scales = (max - min) / 15, zeros = -round(min / scales), q = clamp(round(w / scales) + zeros, 0, 15).
    Returns int codes [out, in], scales and zeros [out, in / group] (scales in fp16, as checkpoints store)."""
    out_features, in_features = w.shape
    g = w.float().view(out_features, in_features // group, group)
    high, low = g.amax(-1), g.amin(-1)
    scales = ((high - low).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(low / scales)).clamp(0, 15)
    q = torch.clamp(torch.round(g / scales[..., None]) + zeros[..., None], 0, 15)
    return q.view(out_features, in_features).int(), scales.half(), zeros.int()


def awq_pack_columns(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM packing of [rows, cols] ints: int32 [rows, cols / 8], nibble i holding
    column order_map[i] of each 8."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    rows, cols = intweight.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for col in range(cols // 8):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + order_map[i]].to(torch.int64) << (i * 4)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.fixture(scope="module")
def awq_pair(tmp_path_factory):
    """(an AWQ checkpoint, the same model with (q - z) * s stored as floats)."""
    root = tmp_path_factory.mktemp("awq")
    float_dir = make_tiny_model_dir(root / "float", hidden_size=128, intermediate_size=256, head_dim=32)
    return make_awq_dirs(float_dir, root, GROUP)


def make_awq_dirs(float_dir: Path, root: Path, group: int) -> tuple[Path, Path]:
    """`float_dir`'s model quantized and packed as AutoAWQ does, with groups of `group` inputs (root / "awq"), and
    the same model with its dequantized weights stored as floats (root / "reference")."""
    awq_dir, reference_dir = root / "awq", root / "reference"
    shutil.copytree(float_dir, awq_dir)
    shutil.copytree(float_dir, reference_dir)
    state = load_file(str(float_dir / "model.safetensors"))
    awq_state, reference_state = {}, {}
    for name, tensor in state.items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(PROJECTIONS):
            awq_state[name] = reference_state[name] = tensor
            continue
        q, scales, zeros = awq_pseudo_quantize(tensor, group)
        awq_state[prefix + ".qweight"] = awq_pack_columns(q.t().contiguous())  # [in, out / 8]
        awq_state[prefix + ".qzeros"] = awq_pack_columns(zeros.t().contiguous())  # [in / G, out / 8]
        awq_state[prefix + ".scales"] = scales.t().contiguous()  # [in / G, out]
        deq = (q.view(q.shape[0], -1, group) - zeros[..., None]) * scales.float()[..., None]
        reference_state[name] = deq.view_as(tensor).contiguous()
    save_file(awq_state, str(awq_dir / "model.safetensors"))
    save_file(reference_state, str(reference_dir / "model.safetensors"))
    config = json.loads((awq_dir / "config.json").read_text())
    config["quantization_config"] = {**AWQ_CONFIG, "group_size": group}
    (awq_dir / "config.json").write_text(json.dumps(config))
    return awq_dir, reference_dir


def test_unpacking_inverts_the_reference_packer():
    codes = torch.randint(0, 16, (6, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_awq(awq_pack_columns(codes)), codes.to(torch.uint8))


@pytest.mark.parametrize("quantization", [None, "awq"])  # detected from config.json, or named
def test_awq_checkpoint_serves_its_dequantized_weights(awq_pair, quantization):
    awq_dir, reference_dir = awq_pair
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, logprobs=0)
    prompts = ["The quick brown fox jumps over", "Once upon a time, in a small town"]
    awq = make_llm(awq_dir, quantization=quantization)
    model = awq.engine.runner.model
    assert all(isinstance(w, Int4Weight) and w.format == "int4-g128" for w in model.weight_tensors()[:-1])
    assert isinstance(model.lm_head, (torch.Tensor, PackedWeight))  # the LM head stays float (maybe packed)
    got = awq.generate(prompts, params, use_tqdm=False)
    want = make_llm(reference_dir).generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(
            torch.tensor([e.logprob for e in a.prompt_logprobs[1:]]),
            torch.tensor([e.logprob for e in b.prompt_logprobs[1:]]),
            rtol=0,
            atol=1e-3,
        )


class HfConfig:
    """An HF config holding only a quantization_config (or none)."""

    def __init__(self, quantization_config=None):
        if quantization_config is not None:
            self.quantization_config = quantization_config


@pytest.mark.parametrize(
    "change,message",
    [
        ({"version": "gemv"}, "version 'gemv'"),
        ({"version": "marlin"}, "version 'marlin'"),
        ({"bits": 8}, "bits 8"),
        ({"zero_point": False}, "zero_point false"),
        ({"group_size": 256}, "group_size 256"),
    ],
)
def test_unsupported_awq_variants_are_named(change, message):
    with pytest.raises(ValueError, match="--quantization awq") as error:
        awq_group_size({**AWQ_CONFIG, **change})
    assert message in str(error.value)


def test_quantization_flag_against_the_checkpoint_kind():
    awq, plain = HfConfig(AWQ_CONFIG), HfConfig()
    assert resolve_quantization(None, awq) == ("awq", 128)
    assert resolve_quantization(None, plain) == (None, None)
    assert resolve_quantization("int4", plain) == ("int4", None)
    assert resolve_quantization("none", plain) == resolve_quantization("gguf", plain) == (None, None)
    for storage in ("none", "gguf"):  # float or GGUF weights were asked for: never AWQ in their place
        with pytest.raises(ValueError, match="already AWQ"):
            resolve_quantization(storage, awq)
    with pytest.raises(ValueError, match="--quantization awq needs an AWQ checkpoint"):
        resolve_quantization("awq", plain)
    with pytest.raises(ValueError, match="--quantization int8: the checkpoint is already AWQ"):
        resolve_quantization("int8", awq)
    with pytest.raises(ValueError, match="'bitsandbytes'.*not supported"):
        resolve_quantization(None, HfConfig({"quant_method": "bitsandbytes", "load_in_4bit": True}))


def test_an_unsupported_awq_checkpoint_fails_at_load(awq_pair, tmp_path):
    awq_dir, _ = awq_pair
    broken = tmp_path / "gemv"
    shutil.copytree(awq_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="version 'gemv'"):
        make_llm(Path(broken))
