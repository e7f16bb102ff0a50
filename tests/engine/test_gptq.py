"""GPTQ checkpoints (AutoGPTQ / GPTQModel's "gptq" format): a tiny model quantized and packed here by a reference
GPTQ packer, served (int4 groups, or dequantized at load), against HF transformers on the same model with the
dequantized weights stored as floats."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from engine.errors import SettingsConflictError
from engine.models.moe import MoeForCausalLM
from engine.quantization.gptq import GptqConfig, gptq_matrix, gptq_weights, unpack_columns, unpack_rows
from engine.quantization.int4_groups import Int4Groups
from engine.quantization.int4_weight import Int4Weight
from engine.quantization.weight_quantizer import resolve_group_size, resolve_quantization
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import check_against_hf, make_llm
from tests.engine.test_awq import HfConfig
from tests.engine.test_model_equivalence import mixed_prompts, run_greedy
from tests.engine.test_moe_equivalence import make_moe_dir

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gptq_config(bits: int = 4, group_size: int = 32, **changes) -> dict:
    """config.json's quantization_config as GPTQModel writes it."""
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": False,
        "sym": True,
        "static_groups": False,
        "checkpoint_format": "gptq",
        **changes,
    }


def gptq_quantize(w: torch.Tensor, bits: int, group: int, sym: bool, perm: Optional[torch.Tensor]):
    """GPTQ's Quantizer on one [out, in] matrix, without the Hessian's error feedback (the format, not the
    calibration, is under test): per group of input columns (with desc_act, of consecutive columns in the order
    `perm`), xmin = min(min, 0), xmax = max(max, 0) (sym: +-max |x|), scale = (xmax - xmin) / maxq, zero =
    round(-xmin / scale) (sym: (maxq + 1) / 2), q = clamp(round(w / scale) + zero, 0, maxq). Scales rounded to fp16
    first, as checkpoints store them. Returns codes [out, in], scales and zeros [out, groups], g_idx [in]."""
    out_features, in_features = w.shape
    maxq = 2**bits - 1
    order = torch.arange(in_features) if perm is None else perm
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // group).int()  # the group of each column's place in `order`
    groups = in_features // group
    scales, zeros = torch.empty(out_features, groups), torch.empty(out_features, groups)
    for g in range(groups):
        x = w[:, g_idx == g]
        xmin, xmax = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        scale = ((xmax - xmin).clamp(min=1e-5) / maxq).half().float()
        scales[:, g] = scale
        zeros[:, g] = torch.full_like(scale, (maxq + 1) // 2) if sym else torch.round(-xmin / scale).clamp(0, maxq)
    s, z = scales[:, g_idx.long()], zeros[:, g_idx.long()]
    q = torch.clamp(torch.round(w / s) + z, 0, maxq)
    return q.int(), scales.half(), zeros.int(), g_idx


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's qweight packing of int codes [rows, cols]: int32 [rows / P, cols], row P*r + j in bits
    bits*j .. of row r (low bits first)."""
    per = 32 // bits
    packed = torch.zeros(codes.shape[0] // per, codes.shape[1], dtype=torch.int64)
    for j in range(per):
        packed |= codes[j::per].to(torch.int64) << (bits * j)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def pack_columns(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's qzeros packing of [rows, cols]: int32 [rows, cols / P], column P*c + j in bits bits*j .. of c."""
    return pack_rows(codes.t().contiguous(), bits).t().contiguous()


def gptq_tensors(w: torch.Tensor, settings: dict, perm: Optional[torch.Tensor] = None):
    """(the GPTQ tensors of one [out, in] matrix, its dequantized float32 [out, in])."""
    bits, in_features = settings["bits"], w.shape[1]
    group = in_features if settings["group_size"] == -1 else settings["group_size"]
    q, scales, zeros, g_idx = gptq_quantize(w, bits, group, settings["sym"], perm)
    stored_zeros = zeros if settings["checkpoint_format"] == "gptq_v2" else (zeros - 1) & (2**bits - 1)  # v1: z - 1
    tensors = {
        "qweight": pack_rows(q.t().contiguous(), bits),  # [in / P, out]
        "qzeros": pack_columns(stored_zeros.t().contiguous(), bits),  # [groups, out / P]
        "scales": scales.t().contiguous(),  # [groups, out] fp16
        "g_idx": g_idx,  # [in]
    }
    reference = (q - zeros[:, g_idx.long()]).float() * scales.float()[:, g_idx.long()]
    return tensors, reference


def make_gptq_dirs(float_dir: Path, root: Path, settings: dict, seed: int = 0) -> tuple[Path, Path]:
    """`float_dir`'s model quantized and packed as AutoGPTQ does (root / "gptq"; with desc_act each matrix's
    columns quantized in a random order), and the same model with the dequantized weights as floats (root /
    "reference")."""
    gptq_dir, reference_dir = root / "gptq", root / "reference"
    shutil.copytree(float_dir, gptq_dir)
    shutil.copytree(float_dir, reference_dir)
    generator = torch.Generator().manual_seed(seed)
    gptq_state, reference_state = {}, {}
    for name, tensor in load_file(str(float_dir / "model.safetensors")).items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(PROJECTIONS):
            gptq_state[name] = reference_state[name] = tensor
            continue
        perm = torch.randperm(tensor.shape[1], generator=generator) if settings["desc_act"] else None
        tensors, reference_state[name] = gptq_tensors(tensor, settings, perm)
        gptq_state.update({f"{prefix}.{part}": t for part, t in tensors.items()})
    save_file(gptq_state, str(gptq_dir / "model.safetensors"))
    save_file(reference_state, str(reference_dir / "model.safetensors"))
    config = json.loads((gptq_dir / "config.json").read_text())
    config["quantization_config"] = settings
    (gptq_dir / "config.json").write_text(json.dumps(config))
    return gptq_dir, reference_dir


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_unpacking_is_exact_against_the_reference_packer(bits, fmt):
    """Every code and zero (0 and 2^b - 1 included: v1 stores a zero of 0 as 2^b - 1), any g_idx."""
    generator = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (64, 16), generator=generator)
    assert torch.equal(unpack_rows(pack_rows(codes, bits), bits), codes)
    assert torch.equal(unpack_columns(pack_columns(codes, bits), bits), codes)
    zeros = torch.randint(0, 2**bits, (2, 16), generator=generator)
    zeros[0, :2] = torch.tensor([0, 2**bits - 1])
    stored = zeros if fmt == "gptq_v2" else (zeros - 1) & (2**bits - 1)
    scales = torch.rand(2, 16, generator=generator).half()
    g_idx = torch.randperm(64, generator=generator).int() % 2
    parts = {"qweight": pack_rows(codes, bits), "qzeros": pack_columns(stored, bits), "scales": scales}
    config = GptqConfig.from_config(gptq_config(bits, 32, desc_act=True, checkpoint_format=fmt))
    want = ((codes - zeros[g_idx.long()]).float() * scales.float()[g_idx.long()]).t()
    assert torch.equal(gptq_matrix("x", {**parts, "g_idx": g_idx}, config), want)
    if bits == 4:  # in order: the stored values themselves as Int4Groups (codes, scales, zero offsets)
        ordered = GptqConfig.from_config(gptq_config(bits, 32, checkpoint_format=fmt))
        groups = gptq_matrix("x", parts, ordered)
        assert isinstance(groups, Int4Groups) and groups.group_size == 32
        assert torch.equal(groups.codes, codes.t().to(torch.uint8))
        assert torch.equal(groups.scales, scales.t().float())
        assert torch.equal(groups.zeros, (8 - zeros.t().float()) * scales.t().float())


def test_a_width_of_partial_groups_is_padded():
    """96 inputs in groups of 64: the second group half padded, the matrix exact."""
    codes = torch.randint(0, 16, (96, 8))
    scales, zeros = torch.rand(2, 8).half(), torch.randint(0, 16, (2, 8))
    parts = {"qweight": pack_rows(codes, 4), "qzeros": pack_columns(zeros, 4), "scales": scales}
    groups = gptq_matrix("x", parts, GptqConfig.from_config(gptq_config(4, 64, checkpoint_format="gptq_v2")))
    assert isinstance(groups, Int4Groups) and (groups.in_features, groups.padded_in_features) == (96, 128)
    g = torch.arange(96) // 64
    want = ((codes - zeros[g]).float() * scales.float()[g]).t()
    torch.testing.assert_close(groups.dequantize(), want, rtol=0, atol=1e-6)


VARIANTS = {
    "4bit-sym-g32": gptq_config(4, 32),
    "4bit-asym-g64-v2": gptq_config(4, 64, sym=False, checkpoint_format="gptq_v2"),
    "4bit-asym-g32-v1": gptq_config(4, 32, sym=False),
    "4bit-desc-act": gptq_config(4, 32, desc_act=True, sym=False),
    "8bit": gptq_config(8, 32, sym=False),
    "4bit-whole-rows": gptq_config(4, -1),
}


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("float")
    return {arch: make_tiny_model_dir(root / arch, arch) for arch in ("llama", "qwen2")}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gptq_checkpoint_serves_its_dequantized_weights(float_dirs, tmp_path, variant):
    """Greedy tokens HF's on the dequantized floats, logprobs within 1e-4 (float32). Qwen2 (q/k/v biases stored
    beside the GPTQ tensors) for the asymmetric variants, Llama for the others."""
    settings = VARIANTS[variant]
    gptq_dir, reference_dir = make_gptq_dirs(float_dirs["qwen2" if "asym" in variant else "llama"], tmp_path, settings)
    prompts = mixed_prompts()[1:7:2]
    with make_llm(gptq_dir) as llm:
        model = llm.engine.runner.model
        kept = all(isinstance(w, Int4Weight) for w in model.weight_tensors()[:-1])
        assert kept == (settings["bits"] == 4 and settings["group_size"] > 0 and not settings["desc_act"])
        assert model.quantization == ("gptq" if kept else "none")  # (dequantized: read as float weights)
        check_against_hf(reference_dir, prompts, run_greedy(llm, prompts))


@pytest.mark.parametrize("bits", [4, 8])
def test_mixture_of_experts(tmp_path, bits):
    """Qwen3-MoE's GPTQ experts: int4 groups, one matrix per expert (4 bits), or dequantized at load and served as
    a float checkpoint's experts are (8 bits)."""
    float_dir = make_moe_dir(tmp_path / "float", "qwen3_moe", moe_intermediate_size=64)
    gptq_dir, reference_dir = make_gptq_dirs(float_dir, tmp_path, gptq_config(bits, 32, sym=False))
    prompts = mixed_prompts()[1:7:2]
    with make_llm(gptq_dir, quantization="gptq_marlin") as llm:  # vLLM's other name: the same checkpoints
        model = llm.engine.runner.model
        assert isinstance(model, MoeForCausalLM) and model.moe_blocks
        block = next(iter(model.moe_blocks.values()))
        assert all(isinstance(m, Int4Weight) == (bits == 4) for pair in block.per_expert for m in pair)
        check_against_hf(reference_dir, prompts, run_greedy(llm, prompts))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"bits": 3}, "bits 3 (only 4 and 8)"),
        ({"bits": 2}, "bits 2"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"checkpoint_format": "gptq_v3"}, "checkpoint_format 'gptq_v3'"),
        ({"is_marlin_format": True}, "is_marlin_format"),
        ({"dynamic": {"-:.*mlp.*": {}}}, "dynamic"),
    ],
)
def test_unsupported_gptq_variants_are_named(change, message):
    with pytest.raises(ValueError, match="--quantization gptq: this GPTQ checkpoint is not supported") as error:
        resolve_quantization(None, HfConfig(gptq_config(**change)))
    assert message in str(error.value)


def test_quantization_flag_against_the_checkpoint_kind():
    plain = HfConfig()
    assert resolve_quantization(None, HfConfig(gptq_config(4, 128))) == ("gptq", 128)
    assert resolve_quantization("gptq", HfConfig(gptq_config(4, 128))) == ("gptq", 128)
    for dequantized in (gptq_config(8, 128), gptq_config(4, -1), gptq_config(4, 256), gptq_config(desc_act=True)):
        assert resolve_quantization(None, HfConfig(dequantized)) == ("gptq", None)
    for storage in ("none", "gguf", "int8", "int4", "awq"):
        with pytest.raises(ValueError, match="already GPTQ|needs an AWQ checkpoint"):
            resolve_quantization(storage, HfConfig(gptq_config()))
    with pytest.raises(SettingsConflictError, match="--quantization gptq needs a GPTQ checkpoint"):
        resolve_quantization("gptq", plain)
    assert resolve_group_size(None, "gptq", 32, 32) == 32
    with pytest.raises(SettingsConflictError, match="differs from the GPTQ checkpoint's group size 32"):
        resolve_group_size(None, "gptq", 64, 32)
    with pytest.raises(SettingsConflictError, match="dequantized at load"):
        resolve_group_size(None, "gptq", 64, None)


def test_missing_parts_are_named(tmp_path):
    """desc_act needs each layer's g_idx; without desc_act a g_idx read after its layer must be in order."""
    codes, zeros, scales = torch.randint(0, 16, (64, 8)), torch.randint(0, 16, (2, 8)), torch.rand(2, 8).half()
    parts = [("l.qweight", pack_rows(codes, 4)), ("l.qzeros", pack_columns(zeros, 4)), ("l.scales", scales)]
    with pytest.raises(ValueError, match="GPTQ layer l lacks g_idx"):
        list(gptq_weights(parts, GptqConfig.from_config(gptq_config(desc_act=True))))
    ordered = GptqConfig.from_config(gptq_config())
    assert [name for name, _ in gptq_weights(parts + [("l.g_idx", torch.arange(64) // 32)], ordered)] == ["l.weight"]
    with pytest.raises(ValueError, match="g_idx is not input // group_size"):
        list(gptq_weights(parts + [("l.g_idx", torch.arange(64) % 2)], ordered))
    with pytest.raises(ValueError, match="GPTQ layer l lacks qzeros"):
        list(gptq_weights(parts[::2], ordered))


def test_an_unsupported_checkpoint_fails_at_load(float_dirs, tmp_path):
    gptq_dir, _ = make_gptq_dirs(float_dirs["llama"], tmp_path, gptq_config(4, 32))
    config = json.loads((gptq_dir / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (gptq_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="bits 3"):
        make_llm(gptq_dir)


def test_generic_decoder_families_take_dequantized_gptq(tmp_path):
    """Gemma 2 (the generic decoder): a GPTQ checkpoint dequantized at load is float weights, served as any; one
    kept in int4 groups is refused as AWQ's are (pre-quantized storage: the Llama family's)."""
    float_dir = make_tiny_model_dir(tmp_path / "float", "gemma2")
    gptq_dir, reference_dir = make_gptq_dirs(float_dir, tmp_path / "g8", gptq_config(8, 32, desc_act=True))
    prompts = mixed_prompts()[1:7:2]
    with make_llm(gptq_dir) as llm:
        check_against_hf(reference_dir, prompts, run_greedy(llm, prompts))
    int4_dir, _ = make_gptq_dirs(float_dir, tmp_path / "g4", gptq_config(4, 32))
    with pytest.raises(ValueError, match="pre-quantized checkpoints are served for the Llama family only"):
        make_llm(int4_dir)


def test_a_mixture_of_experts_with_float_experts_takes_dequantized_gptq(tmp_path):
    """DeepSeek-V2 keeps its experts in floats (no int4 experts): a GPTQ checkpoint dequantized at load (8 bits,
    desc_act, one group per column) is float weights, served as an FP8 checkpoint's are (it was refused as if
    asked to quantize the experts)."""
    from tests.engine.test_deepseek_equivalence import make_deepseek_dir

    float_dir = make_deepseek_dir(tmp_path / "float", "deepseek_v2")
    gptq_dir, reference_dir = make_gptq_dirs(float_dir, tmp_path, gptq_config(8, -1, desc_act=True))
    prompts = mixed_prompts()[1:3]
    with make_llm(gptq_dir) as llm:
        check_against_hf(reference_dir, prompts, run_greedy(llm, prompts))


@pytest.mark.parametrize("quantization", [None, "gptq"])
def test_a_vision_language_checkpoint_reads_its_quantization_config_at_the_top(tmp_path, quantization):
    """Qwen2-VL with its language model's projections in GPTQ groups (as Qwen2-VL-7B-Instruct-GPTQ-Int4): the
    quantization_config sits at the top of config.json, beside text_config, not in the text model's config that
    builds the model (it was read there, and found missing)."""
    from tests.engine.qwen_vl_factories import make_tiny_qwen_vl_dir

    model_dir = make_tiny_qwen_vl_dir(tmp_path / "vl")
    settings = gptq_config(4, 32)
    state, stored = load_file(str(model_dir / "model.safetensors")), {}
    for name, tensor in state.items():
        prefix = name.removesuffix(".weight")
        if "visual" not in name and name.endswith(".weight") and prefix.endswith(PROJECTIONS):
            tensors, _ = gptq_tensors(tensor, settings)
            stored.update({f"{prefix}.{part}": value for part, value in tensors.items()})
        else:
            stored[name] = tensor
    save_file(stored, str(model_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": settings}))
    with make_llm(model_dir, **({} if quantization is None else {"quantization": quantization})) as llm:
        assert llm.engine.runner.model.quantization == "gptq"
        results = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(results[0].outputs[0].token_ids) == 3
