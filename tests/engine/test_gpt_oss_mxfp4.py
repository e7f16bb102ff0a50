"""GPT-OSS from MXFP4 checkpoints: the tiny random model's experts quantized here to e2m1 codes and e8m0 scales by a
small reference encoder and stored as `*_blocks`/`*_scales` with config.json's quantization_config, as OpenAI's
releases are. The dequantizer equals a float64 decode from the format's definition bit for bit (and transformers'
`convert_moe_packed_tensors`); serving the MXFP4 checkpoint gives transformers' greedy tokens, logprobs within 1e-4,
on the dequantized weights (written as a float checkpoint, and transformers' own MXFP4 loader dequantizing);
malformed or unsupported MXFP4 checkpoints are refused at start-up naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.errors import SettingsConflictError
from engine.quantization.mxfp4 import dequantize_mxfp4
from tests.engine.references import make_llm
from tests.engine.references import check_against_hf
from tests.engine.test_gpt_oss import make_gpt_oss_dir
from tests.engine.test_model_equivalence import mixed_prompts, run_greedy

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
EXPERTS = ("gate_up_proj", "down_proj")
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
CPU = torch.device("cpu")


def encode_mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., R, K] floats -> blocks uint8 [..., R, K / 32, 16] and scales uint8 [..., R, K / 32] (OCP MX: the
    block's exponent is floor(log2(amax)) - 2, e2m1's largest exponent; each value rounded to the nearest code)."""
    values = rows.double().unflatten(-1, (-1, 32))  # [..., R, G, 32]
    amax = values.abs().amax(-1, keepdim=True).clamp_min(2.0**-100)
    exponent = torch.floor(torch.log2(amax)) - 2
    scaled = (values / 2.0**exponent).clamp(-6.0, 6.0)
    magnitude = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)  # [..., R, G, 32] in 0..7
    codes = (magnitude | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # value 2j in the low nibble
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def decode_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [..., 32 G, R] from the definitions: e2m1 = sign, 2 exponent bits (bias 1), 1 mantissa bit; a
    subnormal at exponent 0; the E8M0 scale 2^(s - 127); transposed as transformers hands GPT-OSS its experts."""
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).long()  # [..., R, G, 32]
    sign = torch.where(codes & 8 != 0, -1.0, 1.0).double()
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).double()
    magnitude = torch.where(exponent == 0, mantissa / 2, 2.0 ** (exponent - 1).double() * (1 + mantissa / 2))
    scale = 2.0 ** (scales.double() - 127)
    return (sign * magnitude * scale.unsqueeze(-1)).flatten(-2).transpose(-1, -2)


def write_checkpoints(float_dir: Path, mxfp4_dir: Path, dequantized_dir: Path) -> None:
    """`float_dir`'s experts as MXFP4 in `mxfp4_dir`, and decoded back to float32 in `dequantized_dir`."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(float_dir / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        if not name.endswith(EXPERTS):
            quantized[name] = dequantized[name] = tensor
            continue
        blocks, scales = encode_mxfp4(tensor.transpose(-1, -2))  # HF's [E, in, out] -> rows of [E, out, in]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        dequantized[name] = decode_reference(blocks, scales).float().contiguous()
    for path, tensors in ((mxfp4_dir, quantized), (dequantized_dir, dequantized)):
        shutil.copytree(float_dir, path)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((mxfp4_dir / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (mxfp4_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(MXFP4 checkpoint, its float32 dequantization); experts 64 wide, two blocks of 32 per row."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    float_dir = make_gpt_oss_dir(root / "float", intermediate_size=64)
    write_checkpoints(float_dir, root / "mxfp4", root / "dequantized")
    return root / "mxfp4", root / "dequantized"


def random_pair(*shape: int, low: int = 0, high: int = 255) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(sum(shape))
    blocks = torch.randint(0, 256, (*shape, 16), generator=generator, dtype=torch.uint8)
    return blocks, torch.randint(low, high, shape, generator=generator, dtype=torch.uint8)


@pytest.mark.parametrize("chunk_values", [32, 96, 1 << 24])
def test_dequantizer_equals_a_float64_decode_of_the_bytes(chunk_values):
    blocks, scales = random_pair(3, 10, 4, low=1)  # every code; scales 2^-126 .. 2^127 (overflow to inf included)
    reference = decode_reference(blocks, scales)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = dequantize_mxfp4(blocks, scales, dtype, CPU, chunk_values=chunk_values)
        assert got.shape == (3, 128, 10) and got.dtype == dtype
        assert torch.equal(got, reference.to(dtype)), dtype


def test_dequantizer_equals_transformers_convert_moe_packed_tensors():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_pair(4, 24, 3, low=100, high=150)
    for dtype in (torch.float32, torch.bfloat16):
        expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype, CPU), expected)


def test_the_checkpoint_is_what_openai_releases(checkpoints):
    """The names, dtypes and shapes of the released checkpoints' experts, and encodings that change the model."""
    from safetensors import safe_open

    mxfp4_dir, dequantized_dir = checkpoints
    with safe_open(str(mxfp4_dir / "model.safetensors"), "pt") as f:
        p = "model.layers.0.mlp.experts."
        assert {n.removeprefix(p) for n in f.keys() if n.startswith(p)} == {
            "gate_up_proj_blocks",
            "gate_up_proj_scales",
            "gate_up_proj_bias",
            "down_proj_blocks",
            "down_proj_scales",
            "down_proj_bias",
        }
        assert f.get_tensor(p + "gate_up_proj_blocks").shape == (4, 128, 2, 16)  # [E, 2I, H / 32, 16]
        assert f.get_tensor(p + "gate_up_proj_scales").dtype == torch.uint8
        assert f.get_tensor(p + "down_proj_blocks").shape == (4, 64, 2, 16)  # [E, H, I / 32, 16]
    with (
        safe_open(str(dequantized_dir / "model.safetensors"), "pt") as f,
        safe_open(str(dequantized_dir.parent / "float" / "model.safetensors"), "pt") as original,
    ):
        name = "model.layers.0.mlp.experts.gate_up_proj"
        error = (f.get_tensor(name) - original.get_tensor(name)).abs()
        assert 0 < error.max() < 0.3 * original.get_tensor(name).abs().max()  # quantized, and near the float


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_serving_the_mxfp4_checkpoint_matches_transformers_on_its_dequantized_weights(checkpoints, backend):
    mxfp4_dir, dequantized_dir = checkpoints
    prompts = mixed_prompts()
    with make_llm(mxfp4_dir, attention_backend=backend) as llm:
        check_against_hf(dequantized_dir, prompts, run_greedy(llm, prompts))


def test_transformers_dequantizing_the_mxfp4_checkpoint_agrees(checkpoints):
    """transformers' own MXFP4 loader (dequantize=True, on CPU) reads the checkpoint into the same weights."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    mxfp4_dir, dequantized_dir = checkpoints
    hf = AutoModelForCausalLM.from_pretrained(
        mxfp4_dir, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    reference = AutoModelForCausalLM.from_pretrained(dequantized_dir, dtype=torch.float32)
    expected = reference.state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def load_into_model(checkpoint: Path):
    from transformers import AutoConfig

    from engine.loading.loader import iter_weights
    from engine.models import build_model

    model = build_model(AutoConfig.from_pretrained(checkpoint), torch.float32, CPU)
    model.load_weights(iter_weights(checkpoint))


def rewrite(source: Path, target: Path, edit_state=None, edit_config=None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    if edit_state is not None:
        state = load_file(str(source / "model.safetensors"))
        edit_state(state)
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((source / "config.json").read_text())
        edit_config(config)
        (target / "config.json").write_text(json.dumps(config))
    return target


SCALES = "model.layers.1.mlp.experts.down_proj_scales"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda state: state.pop(SCALES), f"has {SCALES.removesuffix('_scales')}_blocks but no {SCALES}"),
        (lambda state: state.update({SCALES: state[SCALES][:, :, :1].contiguous()}), r"scales of shape \(4, 64, 1\)"),
        (lambda state: state.update({SCALES: state[SCALES].float()}), "both must be uint8"),
        (
            lambda state: state.update({"model.layers.0.self_attn.o_proj.weight_blocks": state[SCALES].clone()}),
            "o_proj.weight_blocks: MXFP4 tensors are read for mlp.experts.gate_up_proj_blocks/_scales",
        ),
    ],
    ids=["scales-missing", "scales-wrong-shape", "scales-not-uint8", "not-an-expert"],
)
def test_malformed_checkpoints_are_refused_at_start_up(checkpoints, tmp_path, edit, message):
    broken = rewrite(checkpoints[0], tmp_path / "broken", edit_state=edit)
    with pytest.raises(ValueError, match=message):
        load_into_model(broken)
    with pytest.raises(ValueError, match=message):
        make_llm(broken)


def test_blocks_without_an_mxfp4_config_are_refused(checkpoints, tmp_path):
    broken = rewrite(checkpoints[0], tmp_path / "broken", edit_config=lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match="is an MXFP4 tensor but config.json's quantization_config does not"):
        load_into_model(broken)


def test_other_quantization_methods_and_architectures_are_refused(checkpoints, tmp_path):
    from transformers import AutoConfig

    from engine.models import build_model
    from engine.quantization.weight_quantizer import resolve_quantization
    from tests.engine.factories import tiny_config_dict

    fp8 = rewrite(
        checkpoints[1], tmp_path / "fp8", edit_config=lambda c: c.update(quantization_config={"quant_method": "fp8"})
    )
    with pytest.raises(ValueError, match="GptOssForCausalLM: FP8 checkpoints .* are not supported"):
        build_model(AutoConfig.from_pretrained(fp8), torch.float32, CPU)
    llama = AutoConfig.for_model(**tiny_config_dict("llama"), quantization_config=MXFP4_CONFIG)
    with pytest.raises(ValueError, match="LlamaForCausalLM: MXFP4 checkpoints .* are served for GptOssForCausalLM"):
        build_model(llama, torch.float32, CPU)
    mxfp4_config = AutoConfig.from_pretrained(checkpoints[0])
    assert resolve_quantization(None, mxfp4_config) == resolve_quantization("none", mxfp4_config) == (None, None)
    for method in ("int8", "int4", "awq"):
        with pytest.raises(SettingsConflictError, match=f"--quantization {method}: the checkpoint is MXFP4"):
            resolve_quantization(method, mxfp4_config)
        with pytest.raises(SettingsConflictError, match="the checkpoint is MXFP4"):
            make_llm(checkpoints[0], quantization=method)
