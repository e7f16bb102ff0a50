"""Experts whose width does not split into equal shares are padded with zero units (engine/models/expert_padding.py):
each rank's shard, dequantized and put side by side with the others', is the whole expert followed by zeros, in
every format padded (float, GPT-OSS's MXFP4 blocks with their interleaved gate|up, int8 quantized whole, int4
groups); the zero padding quantizes to exact zeros; GGUF experts, which are not padded, are refused by number. No
processes (ParallelGroup(rank, ranks) only names the rank); served end to end in test_tensor_parallel_families.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.errors import SettingsConflictError
from engine.models.expert_padding import expert_share, expert_unit, padding_notes
from engine.models.gpt_oss_arch import gpt_oss_arch
from engine.models.moe_arch import MoeArch
from engine.models.registry import check_tensor_parallel_model
from engine.models.tensor_parallel import check_group_split, shard_moe, shard_weights
from engine.quantization.int4_groups import Int4Groups
from engine.quantization.int8_weight import Int8Weight
from engine.quantization.mxfp4 import dequantize_mxfp4
from tests.distributed.test_tensor_parallel_quantized import gguf_weight
from tests.engine.factories import tiny_config_dict
from tests.engine.test_gpt_oss import GPT_OSS
from tests.engine.test_moe_equivalence import FAMILIES as MOE_FAMILIES

QWEN3_EXPERT = "model.layers.0.mlp.experts.1."
GPT_OSS_EXPERTS = "model.layers.0.mlp.experts."


def config(**overrides):
    from transformers import AutoConfig

    settings = tiny_config_dict("llama", **{"num_experts_per_tok": 2, **overrides})
    if settings["model_type"] == "gpt_oss":
        settings.pop("rope_theta", None)  # (its YaRN's rope_parameters carry it: tests/engine/test_gpt_oss.py)
    return AutoConfig.for_model(**settings)


def qwen3_moe(width: int, ranks: int):
    return check_tensor_parallel_model(config(**{**MOE_FAMILIES["qwen3_moe"], "moe_intermediate_size": width}), ranks)


def shards(weights, arch, ranks: int, unit: int = 1, quantize_whole=None) -> list[dict]:
    return [
        dict(shard_weights(weights, arch, ParallelGroup(rank, ranks), quantize_whole, unit)) for rank in range(ranks)
    ]


def test_widths_pad_to_whole_units_per_rank_and_start_up_says_so():
    """gpt-oss-120b's 2880 (90 MXFP4 blocks) on 4 and 8 ranks, as vLLM serves it; float widths by single units;
    widths that divide are not padded."""
    assert expert_unit(True, None) == 32 and expert_unit(False, 64) == 64 and expert_unit(False, None) == 1
    assert [expert_share(2880, ranks, 32) for ranks in (2, 4, 8)] == [1440, 736, 384]
    assert expert_share(2880, 4, 1) == 720 and expert_share(45, 2) == 23 and expert_share(33, 4, 32) == 32
    moe = gpt_oss_arch(config(**{**GPT_OSS, "intermediate_size": 2880})).moe
    assert padding_notes(moe, 4, 32) == ["expert width 2880 padded to 2944 for 4 ranks: 2.2% more expert weights"]
    assert padding_notes(moe, 8, 32) == ["expert width 2880 padded to 3072 for 8 ranks: 6.7% more expert weights"]
    assert padding_notes(moe, 2, 32) == padding_notes(moe, 4, 1) == []
    qwen2 = MoeArch.from_hf_config(config(**{**MOE_FAMILIES["qwen2_moe"], "shared_expert_intermediate_size": 91}))
    assert shard_moe(qwen2, 2).shared_intermediate_size == 46
    assert padding_notes(qwen2, 2, 1) == ["shared expert width 91 padded to 92 for 2 ranks: 1.1% more expert weights"]


def test_float_and_int8_experts_pad_with_zeros():
    """Qwen3-MoE's per-expert gate/up rows and down columns, 45 wide on 2 ranks (23 each): the shards side by side
    are the expert and one zero unit; int8's down quantized whole with its zero column keeps the rows' scales."""
    arch = qwen3_moe(45, 2)  # (check_tensor_parallel_model serves it: padded, not refused)
    gate, down = torch.randn(45, 64), torch.randn(64, 45)
    weights = [(QWEN3_EXPERT + "gate_proj.weight", gate), (QWEN3_EXPERT + "down_proj.weight", down)]
    cut = shards(weights, arch, 2)
    assert [tuple(s[QWEN3_EXPERT + "gate_proj.weight"].shape) for s in cut] == [(23, 64)] * 2
    assert torch.equal(torch.cat([s[QWEN3_EXPERT + "gate_proj.weight"] for s in cut]), pad(gate, 0, 46))
    assert torch.equal(torch.cat([s[QWEN3_EXPERT + "down_proj.weight"] for s in cut], dim=1), pad(down, 1, 46))
    int8 = shards(weights[1:], arch, 2, quantize_whole=Int8Weight.quantize)
    whole = Int8Weight.quantize(down).dequantize(torch.float32)
    got = torch.cat([s[QWEN3_EXPERT + "down_proj.weight"].dequantize(torch.float32) for s in int8], dim=1)
    assert torch.equal(got, pad(whole, 1, 46))


def test_gpt_oss_float_experts_keep_gate_and_up_interleaved():
    """gate_up_proj [E, H, 2I] interleaves gate j at 2j and up j at 2j + 1: the padded units are appended, so each
    rank's run of 2I' columns is its own units' gate|up pairs; down_proj [E, I, H] its rows; the bias likewise."""
    arch = gpt_oss_arch(config(**{**GPT_OSS, "intermediate_size": 45})).llama
    gate_up, bias, down = torch.randn(4, 64, 90), torch.randn(4, 90), torch.randn(4, 45, 64)
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj")
    cut = shards([(GPT_OSS_EXPERTS + n, t) for n, t in zip(names, (gate_up, bias, down))], arch, 2)
    assert [tuple(s[GPT_OSS_EXPERTS + "gate_up_proj"].shape) for s in cut] == [(4, 64, 46)] * 2
    assert torch.equal(torch.cat([s[GPT_OSS_EXPERTS + "gate_up_proj"] for s in cut], dim=2), pad(gate_up, 2, 92))
    assert torch.equal(torch.cat([s[GPT_OSS_EXPERTS + "gate_up_proj_bias"] for s in cut], dim=1), pad(bias, 1, 92))
    assert torch.equal(torch.cat([s[GPT_OSS_EXPERTS + "down_proj"] for s in cut], dim=1), pad(down, 1, 46))


def test_gpt_oss_mxfp4_shards_dequantize_to_the_experts_and_zeros():
    """Down 3 blocks wide (96 inputs) on 2 ranks: padded to 4 blocks, 2 per rank; zero blocks decode to zeros (code
    0 is +0.0 under any scale), gate_up's rows padded alike (interleaved, appended)."""
    arch = gpt_oss_arch(config(**{**GPT_OSS, "intermediate_size": 96})).llama
    experts, hidden, width = 4, 64, 96
    gate_up = random_mxfp4(experts, 2 * width, hidden // 32)  # [E, 2I, H / 32, 16], [E, 2I, H / 32]
    down = random_mxfp4(experts, hidden, width // 32)  # [E, H, I / 32, 16]: three blocks per row
    weights = [
        (GPT_OSS_EXPERTS + name + suffix, tensor)
        for name, pair in (("gate_up_proj", gate_up), ("down_proj", down))
        for suffix, tensor in zip(("_blocks", "_scales"), pair)
    ]
    cut = shards(weights, arch, 2, unit=expert_unit(True, None))
    assert [tuple(s[GPT_OSS_EXPERTS + "down_proj_blocks"].shape) for s in cut] == [(experts, hidden, 2, 16)] * 2

    def decoded(name: str, shard: dict) -> torch.Tensor:  # transformers' layout: [E, H, 2I'] and [E, I', H]
        return dequantize_mxfp4(shard[name + "_blocks"], shard[name + "_scales"], torch.float32, torch.device("cpu"))

    whole = {name: decoded(GPT_OSS_EXPERTS + name, dict(weights)) for name in ("gate_up_proj", "down_proj")}
    gate_up_cut = torch.cat([decoded(GPT_OSS_EXPERTS + "gate_up_proj", s) for s in cut], dim=2)
    down_cut = torch.cat([decoded(GPT_OSS_EXPERTS + "down_proj", s) for s in cut], dim=1)
    assert torch.equal(gate_up_cut, pad(whole["gate_up_proj"], 2, 256))
    assert torch.equal(down_cut, pad(whole["down_proj"], 1, 128))


def test_int4_groups_pad_with_exact_zeros():
    """int4 quantized at load: a group of zeros quantizes to exactly zero, and each rank's padded shard of 32-input
    groups quantizes to the whole expert's groups (its last one zero-padded as the whole matrix's is) and zero ones.
    AWQ's groups (Int4Groups as read): rows and whole zero groups appended. The experts' downs are no longer
    refused by check_group_split: their shares are whole groups."""
    zero = Int4Groups.quantize(torch.zeros(3, 64), 32).dequantize()
    assert torch.equal(zero, torch.zeros(3, 64)) and not zero.signbit().any()
    arch = qwen3_moe(48, 2)  # 48 inputs: 24 per rank would cut a group of 32; padded to 64, 32 per rank
    check_group_split(arch, 2, 32, "--quantization int4", MoeArch.from_hf_config(config(**MOE_FAMILIES["qwen3_moe"])))
    up, down = torch.randn(48, 64), torch.randn(64, 48)
    weights = [(QWEN3_EXPERT + "up_proj.weight", up), (QWEN3_EXPERT + "down_proj.weight", down)]
    floats = shards(weights, arch, 2, unit=expert_unit(False, 32))
    groups = [Int4Groups.quantize(s[QWEN3_EXPERT + "down_proj.weight"], 32).dequantize() for s in floats]
    whole = Int4Groups.quantize(down, 32)
    assert torch.equal(torch.cat(groups, dim=1), dataclasses.replace(whole, in_features=64).dequantize())
    # groups of 16: 48 inputs on 2 ranks pad to 64, rank 1's last group all zeros
    awq = [(name, Int4Groups.quantize(tensor, 16)) for name, tensor in weights]
    cut = shards(awq, arch, 2, unit=expert_unit(False, 16))
    rows = torch.cat([s[QWEN3_EXPERT + "up_proj.weight"].dequantize() for s in cut])
    columns = torch.cat([s[QWEN3_EXPERT + "down_proj.weight"].dequantize() for s in cut], dim=1)
    assert torch.equal(rows, pad(awq[0][1].dequantize(), 0, 64))
    assert torch.equal(columns, pad(awq[1][1].dequantize(), 1, 64))


def test_gguf_experts_that_do_not_divide_are_refused_by_number():
    arch = qwen3_moe(45, 2)
    gate = (QWEN3_EXPERT + "gate_proj.weight", gguf_weight("q8_0", 45, 64))
    with pytest.raises(SettingsConflictError, match=r"gate_proj.weight \(q8_0\) is an expert 45 wide, which does"):
        shards([gate], arch, 2)


def test_with_expert_parallelism_an_expert_of_any_width_and_format_is_held_whole():
    """The same GGUF expert, 45 wide: held whole by the rank its expert is placed on (expert 1 of 8 on rank 0 of 2),
    left out by the other; the shared expert still cut; the router on both."""
    arch = qwen3_moe(45, 2)
    gate = (QWEN3_EXPERT + "gate_proj.weight", gguf_weight("q8_0", 45, 64))
    other = ("model.layers.0.mlp.experts.6.down_proj.weight", torch.randn(64, 45))
    router = ("model.layers.0.mlp.gate.weight", torch.randn(8, 64))
    held = [
        dict(shard_weights([gate, other, router], arch, ParallelGroup(r, 2), held_experts=span))
        for r, span in enumerate((range(0, 4), range(4, 8)))
    ]
    assert held[0][gate[0]] is gate[1] and other[0] not in held[0]
    assert held[1][other[0]] is other[1] and gate[0] not in held[1]
    assert all(shard[router[0]] is router[1] for shard in held)
    stacked = ("model.layers.0.mlp.experts.gate_up_proj", torch.randn(8, 90, 64))  # (transformers' layout)
    (name, part), *_ = shard_weights([stacked], arch, ParallelGroup(1, 2), held_experts=range(4, 8))
    assert torch.equal(part, stacked[1][4:]) and part.untyped_storage().nbytes() == part.numel() * 4  # a copy


def pad(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`tensor` followed by zeros along `dim` up to `size`."""
    shape = list(tensor.shape)
    shape[dim] = size - shape[dim]
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def random_mxfp4(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [*shape, 16] and scales [*shape] (exponents near 2^0)."""
    generator = torch.Generator().manual_seed(sum(shape))
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=generator)
    return blocks, torch.randint(120, 134, shape, dtype=torch.uint8, generator=generator)
