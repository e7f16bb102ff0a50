"""--tensor-parallel-size with quantized weights: GGUF blocks kept for the native kernels (`--quantization gguf`),
and float checkpoints quantized at load (`int8`, `int4`). Every rank holds exactly the whole model's quantized
values (output rows cut freely, input columns at block or group boundaries, int8's row-parallel matrices quantized
whole first), so greedy tokens equal one process's on the same quantized weights; the cuts themselves are
checked exact without processes, and the splits that would cut a block or a group are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.distributed.parallel_group import ParallelGroup
from engine.errors import SettingsConflictError
from engine.models.registry import check_tensor_parallel_model
from engine.models.tensor_parallel import check_group_split, shard_weights
from engine.quantization.gguf_formats import FORMATS, repack
from engine.quantization.gguf_weight import GgufWeight
from engine.quantization.int4_groups import Int4Groups
from engine.quantization.int8_weight import Int8Weight
from tests.distributed.test_tensor_parallel import TINY, assert_same
from tests.engine.references import assert_idle
from tests.engine.test_awq import make_awq_dirs
from tests.engine.test_gptq import gptq_config, make_gptq_dirs
from tests.engine.factories import make_tiny_gguf, make_tiny_model_dir, tiny_config_dict
from tests.engine.test_moe_equivalence import FAMILIES as MOE_FAMILIES
from tests.engine.test_moe_equivalence import make_moe_dir

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 301, 17], [40] * 18, [7, 99, 123, 4, 250]]

# Between one process and two, only the order of the all-reduced float32 partial sums differs (the integer GGUF
# product quantizes its activations per 32-input block, and every rank's blocks are the whole row's): measured
# up to 2.2e-6 on these models (int4; 1e-6 GGUF), against logprob gaps of 1e-2 and more between the top two tokens. 2e-5 leaves
# room for other CPUs' summation orders and stays far below any token flip.
LOGPROB_TOLERANCE = 2e-5


def gguf_weight(fmt: str, rows: int, inputs: int, seed: int = 0) -> GgufWeight:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from engine.kernels.quant import load_quant_kernels

    array = np.random.default_rng(seed).standard_normal((rows, inputs)).astype(np.float32)
    raw = quantize(array, GGMLQuantizationType[fmt.upper()])
    return GgufWeight(FORMATS[fmt], repack(FORMATS[fmt], raw, inputs), inputs, load_quant_kernels())


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_gguf_cuts_are_exact(fmt):
    """Input columns at any block boundary (odd ones re-pair 4-bit blocks), output rows anywhere, zero rows."""
    weight = gguf_weight(fmt, 16, 7 * 32)
    whole = weight.dequantize()
    for start, stop in [(0, 64), (32, 96), (96, 224), (32, 64), (0, 224)]:
        cut = weight.take_columns(start, stop)
        assert cut.in_features == stop - start
        torch.testing.assert_close(cut.dequantize(), whole[:, start:stop], rtol=0, atol=0)
        x = torch.zeros(3, whole.shape[1])
        x[:, start:stop] = torch.randn(3, stop - start)  # the integer product's int8 activations: the same blocks
        torch.testing.assert_close(cut.matmul(x[:, start:stop]), weight.matmul(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="32-input block boundaries"):
        weight.take_columns(16, 80)
    assert torch.count_nonzero(weight.zero_rows(3).dequantize()) == 0


def test_int8_row_shards_keep_the_whole_rows_scales():
    weight = torch.randn(8, 64)
    whole = Int8Weight.quantize(weight)
    halves = [whole.take_columns(0, 32), whole.take_columns(32, 64)]
    assert all(torch.equal(half.scales, whole.scales) for half in halves)
    x = torch.randn(2, 64)
    partial = halves[0].matmul(x[:, :32]) + halves[1].matmul(x[:, 32:])
    torch.testing.assert_close(partial, whole.matmul(x), rtol=1e-5, atol=1e-5)


def test_stacked_experts_int8_downs_keep_each_experts_whole_rows_scales():
    """Granite MoE stores its experts stacked (`output_linear` [E, H, I]): with int8 each rank gets every expert's
    down quantized whole, then cut, as a per-expert checkpoint's (a shard's own row maxima would give other
    scales)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**tiny_config_dict("llama", num_experts_per_tok=2, **MOE_FAMILIES["granitemoe"]))
    arch = check_tensor_parallel_model(config, 2)
    down = torch.randn(6, 64, 48)
    name = "model.layers.0.block_sparse_moe.output_linear.weight"
    for rank in range(2):
        ((_, shard),) = shard_weights([(name, down)], arch, ParallelGroup(rank, 2), Int8Weight.quantize)
        assert len(shard) == 6
        for expert, cut in zip(down, shard):
            whole = Int8Weight.quantize(expert)
            assert torch.equal(cut.scales, whole.scales) and cut.in_features == 24
            torch.testing.assert_close(cut.dequantize(), whole.dequantize()[:, rank * 24 : (rank + 1) * 24])


def test_llama4_transposed_experts_int8_downs_keep_each_experts_whole_rows_scales():
    """Llama 4 stores its experts stacked and transposed (`feed_forward.experts.down_proj` [E, I, H], gate_up_proj
    [E, H, 2I]): each rank's down of every expert is its [H, I] matrix quantized whole, then cut; its gate_up its
    gate columns, then its up columns."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**tiny_config_dict("llama", num_experts_per_tok=2, **MOE_FAMILIES["llama4"]))
    arch = check_tensor_parallel_model(config, 2)
    down, gate_up = torch.randn(6, 48, 64), torch.randn(6, 64, 96)
    prefix = "model.layers.1.feed_forward.experts."
    for rank in range(2):
        weights = [(prefix + "down_proj", down), (prefix + "gate_up_proj", gate_up)]
        (_, down_shard), (_, gate_up_shard) = shard_weights(weights, arch, ParallelGroup(rank, 2), Int8Weight.quantize)
        assert len(down_shard) == 6
        for expert, cut in zip(down, down_shard):
            whole = Int8Weight.quantize(expert.t())
            assert torch.equal(cut.scales, whole.scales) and cut.in_features == 24
            torch.testing.assert_close(cut.dequantize(), whole.dequantize()[:, rank * 24 : (rank + 1) * 24])
        gate, up = gate_up[..., :48], gate_up[..., 48:]
        mine = slice(rank * 24, (rank + 1) * 24)
        assert torch.equal(gate_up_shard, torch.cat([gate[..., mine], up[..., mine]], dim=2))


def test_what_cannot_be_cut_exactly_is_refused_by_name(tiny_dir, embedded_checkpoint):

    from engine.loading.loader import load_hf_config

    embedded = check_tensor_parallel_model(load_hf_config(embedded_checkpoint.path), 3)  # 9 heads, 3 KV heads
    check_group_split(embedded, 3, 32, "--quantization int4 (group size 32)")  # 192 and 512 inputs per rank
    with pytest.raises(SettingsConflictError, match="o_proj's 576 inputs split into 192 per rank, not a whole"):
        check_group_split(embedded, 3, 128, "--quantization int4 (group size 128)")
    with pytest.raises(SettingsConflictError, match="9 attention heads"):
        check_tensor_parallel_model(load_hf_config(embedded_checkpoint.path), 2)
    # (an expert's down whose share would cut a group is padded to whole groups instead: test_expert_padding.py)
    # four ranks of the tiny model's 64-input o_proj: 16 inputs each, half a Q8_0 block (rank 1's own cut)
    arch = check_tensor_parallel_model(load_hf_config(tiny_dir), 4)
    o_proj = ("model.layers.0.self_attn.o_proj.weight", gguf_weight("q8_0", 64, 64))
    with pytest.raises(SettingsConflictError, match=r"o_proj.weight \(q8_0, 64 inputs\) splits into 16 inputs"):
        list(shard_weights([o_proj], arch, ParallelGroup(1, 4)))


def test_awq_cuts_are_exact():
    """An AWQ matrix's groups (Int4Groups) cut at group boundaries: rows anywhere, input columns by whole groups
    (the last group's padding kept with the matrix's end); a cut inside a group is refused."""
    weight = Int4Groups.quantize(torch.randn(12, 100), 32)  # 100 inputs: 4 groups, the last padded to 128
    whole = weight.dequantize()
    for start, stop in [(0, 32), (32, 96), (64, 100), (0, 100)]:
        cut = weight.take_columns(start, stop)
        assert cut.in_features == stop - start
        torch.testing.assert_close(cut.dequantize(), whole[:, start:stop], rtol=0, atol=0)
    torch.testing.assert_close(weight.take_rows(3, 9).dequantize(), whole[3:9], rtol=0, atol=0)
    with pytest.raises(ValueError, match="columns 16 .. 48 cut a 32-input group of 100 inputs"):
        weight.take_columns(16, 48)


def test_awq_groups_a_split_would_cut_are_refused(tiny_dir, tmp_path):
    """An AutoAWQ checkpoint with groups of 64 on two ranks would cut o_proj's (32 inputs per rank): refused at
    start-up, naming it (its groups of 32 are served as a GPTQ checkpoint's int4 groups are, below and in
    test_awq_mixture_of_experts_on_two_ranks_serves_one_process_weights)."""
    wide_dir, _ = make_awq_dirs(tiny_dir, tmp_path / "g64", 64)
    with pytest.raises(SettingsConflictError, match=r"an AWQ checkpoint \(group size 64\): o_proj's 64 inputs"):
        LLM(str(wide_dir), **TINY, quantization="awq", tensor_parallel_size=2)


def test_awq_mixture_of_experts_on_two_ranks_serves_one_process_weights(tmp_path):
    """Qwen3-MoE's AWQ experts (each expert's gate, up and down in groups of 32, a dense layer between) cut like
    an MLP's: 32 inputs of each expert's down per rank, whole groups; one process's tokens."""
    float_dir = make_moe_dir(tmp_path / "float", "qwen3_moe", moe_intermediate_size=64)
    awq_dir, _ = make_awq_dirs(float_dir, tmp_path, 32)
    expected, _ = generate_quantized(str(awq_dir), PROMPTS, 1, quantization="awq")
    got, _ = generate_quantized(str(awq_dir), PROMPTS, 2, quantization="awq")
    assert_same(got, expected, abs=LOGPROB_TOLERANCE)


def test_gptq_checkpoint_on_two_ranks_serves_one_process_weights(tiny_dir, tmp_path):
    """A GPTQ checkpoint (4 bits, groups of 32) on two ranks: kept in its groups, whole ones per rank (the int4
    groups AWQ's checkpoints are read into too); a split that would cut o_proj's groups of 64 refused by name, as
    AWQ's (a desc_act checkpoint's matrices, dequantized at load, are cut as any floats). One process's tokens."""
    gptq_dir, _ = make_gptq_dirs(tiny_dir, tmp_path / "g32", gptq_config(4, 32, sym=False))
    expected, whole = generate_quantized(str(gptq_dir), PROMPTS, 1)
    got, shard = generate_quantized(str(gptq_dir), PROMPTS, 2, quantization="gptq")
    assert_same(got, expected, abs=LOGPROB_TOLERANCE)
    assert whole[0] == shard[0] != "float32" and (whole[1], shard[1]) == (64, 32)
    wide_dir, _ = make_gptq_dirs(tiny_dir, tmp_path / "g64", gptq_config(4, 64))
    with pytest.raises(SettingsConflictError, match=r"a GPTQ checkpoint \(group size 64\): o_proj's 64 inputs"):
        LLM(str(wide_dir), **TINY, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama")


@pytest.mark.parametrize(
    "storage",
    ["gguf-q4_1", "int8", "int4"],
)
def test_two_ranks_serve_one_process_quantized_weights(tiny_dir, tmp_path, storage):
    """The tiny Llama (4 heads, 2 KV heads, hidden 64, MLP 128): o_proj's 32 and down's 64 inputs per rank are
    whole Q blocks and int4 groups of 32."""
    if storage.startswith("gguf"):
        fmt = storage.split("-")[1].upper()
        model = str(make_tiny_gguf(tiny_dir, tmp_path / f"tiny.{fmt}.gguf", matrix_type=fmt, embedding_type="Q8_0"))
        settings = dict(quantization="gguf")
    else:
        model, settings = str(tiny_dir), dict(quantization=storage)
    expected, whole = generate_quantized(model, PROMPTS, 1, **settings)
    got, shard = generate_quantized(model, PROMPTS, 2, **settings)
    assert_same(got, expected, abs=LOGPROB_TOLERANCE)
    assert whole[0] == shard[0] and whole[0] != "float32"  # rank 0's o_proj: quantized, half its inputs
    assert (whole[1], shard[1]) == (64, 32)


@pytest.mark.parametrize(
    "family, storage",
    [
        *(("starcoder2", "int8"), ("phi", "int4"), ("gpt_neox", "int8"), ("falcon_new", "int8")),
    ],
)
def test_two_ranks_serve_generic_decoders_quantized(tmp_path, family, storage):
    """StarCoder2's plain MLP (c_fc column-parallel; c_proj row-parallel, quantized whole before its columns are cut,
    its bias on rank 0), Phi-2's dense and fc2 (whole int4 groups per rank), GPT-NeoX's per-head query_key_value
    (each rank reorders its own heads) and dense / dense_4h_to_h, Falcon-40B's query_key_value by KV group (each rank
    its whole groups), quantized on two ranks: one process's tokens on the same quantized weights. (Experts quantized
    whole, then cut: Granite MoE's and Llama 4's below; each family's own cuts in floats: test_tensor_parallel_families.)"""
    model = str(make_tiny_model_dir(tmp_path / family, family))
    expected, whole = generate_quantized(model, PROMPTS, 1, quantization=storage)
    got, shard = generate_quantized(model, PROMPTS, 2, quantization=storage)
    assert_same(got, expected, abs=LOGPROB_TOLERANCE)
    assert whole[0] == shard[0] != "float32" and (whole[1], shard[1]) == (64, 32)


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_granite_moe_on_two_ranks_serves_one_process_quantized_weights(tmp_path, storage):
    """Granite MoE with its shared expert (stacked experts, a fused shared_mlp): two ranks serve the tokens of one
    process on the same int8 / int4 weights (experts and shared expert 64 wide: 32 inputs of their downs per rank,
    whole int4 groups of 32)."""
    widths = dict(intermediate_size=64, shared_intermediate_size=64)
    model = str(make_moe_dir(tmp_path / "granitemoeshared", "granitemoeshared", **widths))
    settings = dict(quantization=storage, **({"quantization_group_size": 32} if storage == "int4" else {}))
    expected, _ = generate_quantized(model, PROMPTS, 1, **settings)
    got, _ = generate_quantized(model, PROMPTS, 2, **settings)
    assert_same(got, expected, abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_llama4_on_two_ranks_serves_one_process_quantized_weights(tmp_path, storage):
    """Llama 4 (experts stacked transposed, a shared expert, dense layers between): two ranks serve the tokens of one
    process on the same int8 / int4 weights (experts, shared expert and dense MLPs 64 wide: 32 inputs of their downs
    per rank, whole int4 groups of 32)."""
    model = str(make_moe_dir(tmp_path / "llama4", "llama4", intermediate_size=64, intermediate_size_mlp=64))
    settings = dict(quantization=storage, **({"quantization_group_size": 32} if storage == "int4" else {}))
    expected, _ = generate_quantized(model, PROMPTS, 1, **settings)
    got, _ = generate_quantized(model, PROMPTS, 2, **settings)
    assert_same(got, expected, abs=LOGPROB_TOLERANCE)


def test_embedded_gguf_on_three_ranks(embedded_checkpoint):
    """SmolLM2-135M's Q4_1 projections and Q8_0 embedding kept in their blocks on three ranks: o_proj's 192 and
    down's 512 inputs per rank are whole blocks."""
    prompts = [[1, 504, 3458, 282, 4649, 314]]
    model, settings = str(embedded_checkpoint.gguf), dict(quantization="gguf", max_num_batched_tokens=64)
    expected, whole = generate_quantized(model, prompts, 1, max_tokens=5, **settings)
    got, shard = generate_quantized(model, prompts, 3, max_tokens=5, **settings)
    # The integer product rounds its activations to int8 steps: the all-reduce's float32 reordering (1e-7) flips
    # a few roundings, each moving a product by a step, and 30 layers carry them on (one process moves as much
    # between a prefix-cache hit and a recompute: 0.025 on the first token). Measured up to 0.04 on an AVX-512 build,
    # 0.08 and 0.17 on an AVX2 one under two builds of the decode attention whose float32 outputs differ by 4e-8;
    # these five tokens lead their runners-up by 0.42 or more, so the tokens are what must agree.
    assert_same(got, expected, abs=0.25)
    assert (whole, shard) == (("q4_1", 576), ("q4_1", 192))


def generate_quantized(model, prompts, tp: int, max_tokens: int = 10, **settings):
    """`generate`'s outputs, and the format and input width of rank 0's first o_proj."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(model, **{**TINY, **settings}, tensor_parallel_size=tp) as llm:
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        o_proj = llm.engine.runner.model.layers[0].o_proj
        assert_idle(llm)
    outputs = [(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in results]
    width = o_proj.shape[1] if isinstance(o_proj, torch.Tensor) else o_proj.in_features
    return outputs, (getattr(o_proj, "format", "float32"), width)
