"""The generic decoder's families split over two gloo ranks compute what the whole model computes: Gemma 2 and 3
(sandwich norms on all-reduced outputs, soft-caps, per-head q/k norms, sliding windows), Phi-3 (fused qkv_proj and
gate_up_proj cut part by part, LongRoPE), OLMo 2 (q/k norms over the whole projection: the mean square all-reduced;
with one KV head replicated on both ranks too), Granite (multipliers), Cohere (a q/k norm weight per head, cut by
heads; attention and MLP side by side), Cohere 2 (layers without RoPE), Gemma 1, GLM and GLM-4-0414 (each rank
reorders its own heads' interleaved rotary pairs), StarCoder2, SmolLM3 (NoPE layers, MLP biases), OLMo 3 (OLMo 2's
q/k norms, sliding layers), Arcee (a plain MLP), ERNIE 4.5 (biases, interleaved rotary pairs), EXAONE 4 (per-head q/k
norms, global layers without RoPE), Phi-2 (row-parallel dense and fc2, the q/k LayerNorms replicated), GPT-NeoX
(query_key_value cut by whole heads, each rank reordering its own rows; parallel and sequential residuals), Seed-OSS
(q/k/v/o and MLP biases), Apertus (xIELU's per-layer scalars replicated), GPT-J (interleaved rotary pairs, the LM
head's bias), GPT-BigCode (multi-query c_attn cut part by part, multi-head c_attn by whole heads; learned positions
replicated), Falcon (query_key_value part by part with one KV head, by whole KV groups under
new_decoder_architecture; one or two norms beside the branches, or in sequence), and the mixtures of experts Mixtral
(its experts also stacked in one tensor), Qwen2-MoE (a shared expert, dense layers between), Qwen3-MoE (each expert
cut like an MLP), GLM-4.5 (shared experts, grouped routing), OLMoE (q/k norms over the projection), Granite MoE
(stacked input_linear / output_linear, the shared variant's fused shared_mlp) and Phi-3.5-MoE (LayerNorms, q/k/v/o
biases, the LM head's bias on gathered logits), DeepSeek-V2 (q_proj, or q_a_proj and q_b_proj) and V3 (latent
attention cut by heads over a latent cache the same on every rank; shared experts, grouped routing, a dense first
layer), and GPT-OSS (q/k/v/o biases, attention sinks cut by heads, sliding and full layers; its interleaved gate|up
experts with biases cut along their width, float and MXFP4, whose blocks are cut whole; widths that do not split
into equal shares, as gpt-oss-120b's over 4 ranks, padded with zero units, as Qwen2-MoE's). Every family's logits of a
prefill and a decode over a paged cache in one pair of worker processes, then OLMo 2,
DeepSeek-V3 (its multi-token-prediction layer drafting) and the padded widths served end to end: greedy
float32 tokens identical to one process; heads and dense widths that do not divide refused by number."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.distributed.parallel_group import ParallelGroup
from engine.errors import SettingsConflictError
from engine.loading.loader import load_hf_config
from engine.models.registry import moe_arch_of
from tests.distributed.test_tensor_parallel import TINY, assert_same, generate
from tests.distributed.test_tensor_parallel_model import EXPERT_PARALLEL, run_model, two_rank_results
from tests.engine.factories import make_tiny_model_dir
from tests.engine.test_deepseek_equivalence import make_deepseek_dir
from tests.engine.test_gpt_oss import make_gpt_oss_dir
from tests.engine.test_gpt_oss_mxfp4 import write_checkpoints
from tests.engine.test_moe_equivalence import FAMILIES as MOE_FAMILIES
from tests.engine.test_moe_equivalence import make_moe_dir

pytestmark = pytest.mark.timeout(300)

FAMILIES = {  # name: (factory arch, config overrides)
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "olmo2-kv1": ("olmo2", {"num_key_value_heads": 1}),
    "granite": ("granite", {}),
    "cohere": ("cohere", {}),  # q/k norms of a weight per head, cut by heads; biases; parallel branches
    "cohere-kv1": ("cohere", {"num_key_value_heads": 1}),  # its one KV head's norm replicated on both ranks
    "cohere2": ("cohere2", {}),
    "gemma": ("gemma", {}),
    "glm": ("glm", {}),  # (each rank reorders its own heads' rotary pairs)
    "glm4": ("glm4", {}),
    "starcoder2": ("starcoder2", {}),  # c_fc column-, c_proj row-parallel (its bias on rank 0)
    "olmo3": ("olmo3", {}),
    "ernie4_5": ("ernie4_5", {}),
    "arcee": ("arcee", {}),
    "exaone4": ("exaone4", {}),  # up_proj column-, down_proj row-parallel, with no gate beside them
    "smollm3": ("smollm3", {}),  # NoPE layers; gate/up/down biases cut like their matrices (down's on rank 0)
    "phi": ("phi", {}),  # dense and fc2 row-parallel, the q/k LayerNorms (one head wide) and LM-head bias replicated
    "gpt_neox": ("gpt_neox", {}),  # query_key_value cut by whole heads, each rank reordering its own into q | k | v
    "gpt_neox_sequential": ("gpt_neox_sequential", {}),
    "seed_oss": ("seed_oss", {}),  # q/k/v biases cut like their rows, o_proj's and down_proj's on rank 0
    "apertus": ("apertus", {}),  # xIELU's scalars replicated; per-head q/k norms one head wide
    "gpt_bigcode": ("gpt_bigcode", {}),  # multi-query c_attn cut part by part, its one KV head replicated; wpe too
    "gpt_bigcode_mha": ("gpt_bigcode_mha", {}),  # c_attn's rows per head: whole heads, each rank reordering its own
    "falcon": ("falcon", {}),  # one KV head replicated, query_key_value cut part by part
    "falcon_new": ("falcon_new", {}),  # query_key_value by KV group: each rank its whole groups, reordered
    "falcon_new-ln1": ("falcon_new", {"num_ln_in_parallel_attn": 1}),  # Falcon2's one norm for both branches
    "falcon_sequential": ("falcon_sequential", {}),
    "gptj": ("gptj", {}),  # transformer.h.N.attn/mlp cut as Llama's; each rank reorders its heads' rotary pairs
    # GLM-4.5: shared experts cut like an MLP, the router and its correction bias replicated; groups and q/k norms
    "glm4_moe": ("glm4_moe", {"n_group": 4, "topk_group": 2, "use_qk_norm": True}),
}
DEEPSEEK = {  # name: (tests/engine/test_deepseek_equivalence.py's family, config overrides)
    "deepseek_v2": ("deepseek_v2", {}),  # q_proj cut by heads (V2-Lite), group-limited greedy routing
    "deepseek_v2-q_lora": ("deepseek_v2", {"q_lora_rank": 24}),  # q_a_proj and its norm replicated, q_b_proj cut
    "deepseek_v3": ("deepseek_v3", {}),  # sigmoid routing with a (random) correction bias replicated, YaRN
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    dirs = {name: make_tiny_model_dir(root / name, arch, **o) for name, (arch, o) in FAMILIES.items()}
    dirs.update({name: make_moe_dir(root / name, name) for name in MOE_FAMILIES})
    dirs["mixtral-stacked"] = stacked_copy(dirs["mixtral"], root / "mixtral-stacked")
    dirs["qwen3_moe-5"] = make_moe_dir(root / "qwen3_moe-5", "qwen3_moe", num_experts=5)  # (3 + 2 under experts)
    dirs.update({name: make_deepseek_dir(root / name, family, **o) for name, (family, o) in DEEPSEEK.items()})
    # GPT-OSS: 4 heads over 2 KV heads, experts 64 wide (two MXFP4 blocks per row of down_proj: one per rank)
    dirs["gpt_oss"] = make_gpt_oss_dir(root / "gpt_oss", intermediate_size=64)
    dirs["gpt_oss-kv1"] = make_gpt_oss_dir(root / "gpt_oss-kv1", num_key_value_heads=1)  # its KV head replicated
    write_checkpoints(dirs["gpt_oss"], root / "gpt_oss-mxfp4", root / "gpt_oss-dequantized")
    dirs["gpt_oss-mxfp4"] = root / "gpt_oss-mxfp4"
    return dirs


def stacked_copy(model_dir: Path, path: Path) -> Path:
    """The checkpoint with each layer's experts stacked as transformers holds them in memory: experts.gate_up_proj
    [E, 2I, H] (every expert's w1 rows, then its w3 rows) and experts.down_proj [E, H, I]."""
    shutil.copytree(model_dir, path)
    state = load_file(str(model_dir / "model.safetensors"))
    expert = re.compile(r"(.+\.experts\.)(\d+)\.(w1|w2|w3)\.weight")
    parts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    stacked = {}
    for name, tensor in state.items():
        match = expert.fullmatch(name)
        if match is None:
            stacked[name] = tensor
        else:
            parts.setdefault((match.group(1), match.group(3)), {})[int(match.group(2))] = tensor
    for prefix in {prefix for prefix, _ in parts}:
        w1, w2, w3 = (parts[(prefix, w)] for w in ("w1", "w2", "w3"))
        stacked[prefix + "gate_up_proj"] = torch.stack([torch.cat([w1[e], w3[e]]) for e in sorted(w1)])
        stacked[prefix + "down_proj"] = torch.stack([w2[e] for e in sorted(w2)])
    save_file(stacked, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.timeout(180)
def test_two_ranks_compute_every_familys_logits(model_dirs):
    """Each mixture of experts also with expert parallelism (each rank its experts whole; Qwen3-MoE's 5 experts
    over 2 ranks: 3 and 2)."""
    expected = {name: run_model(model_dir, ParallelGroup.single()) for name, model_dir in model_dirs.items()}
    experts = [name for name, d in model_dirs.items() if moe_arch_of(load_hf_config(d)) is not None]
    assert len(experts) >= 15  # (every mixture among them: Mixtral .. Llama 4, DeepSeek, GPT-OSS)
    runs = {name: str(d) for name, d in model_dirs.items()} | {n + EXPERT_PARALLEL: str(model_dirs[n]) for n in experts}
    results = two_rank_results(runs)
    for name in runs:
        want = expected[name.removesuffix(EXPERT_PARALLEL)]
        for rank in range(2):
            for got, logits in zip(results[(name, rank)], want):
                torch.testing.assert_close(got, logits, atol=1e-5, rtol=1e-5, msg=f"{name}, rank {rank}")


def test_olmo2_served_on_two_ranks(model_dirs):
    """Through the engine (each rank builds its shard from the checkpoint, its KV heads in its cache): the tokens
    and logprobs of one process."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 301, 17], [40] * 18]
    expected, _ = generate(model_dirs["olmo2-kv1"], prompts, 1)
    got, _ = generate(model_dirs["olmo2-kv1"], prompts, 2)
    assert_same(got, expected)


def test_deepseek_v3_served_on_two_ranks(tmp_path):
    """Through the engine, under chunked prefill (each rank builds its shard: its heads, its share of every expert,
    the latent cache whole), its prediction layer drafting whole on rank 0 beside them: the tokens and logprobs of
    one process without drafts."""
    from tests.engine.test_mtp import add_prediction_layer

    whole = make_deepseek_dir(tmp_path / "whole", "deepseek_v3", num_hidden_layers=4)
    target = add_prediction_layer(whole, tmp_path / "target")
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 8, [40, 41, 42]]
    expected, _ = generate(target, prompts, 1)
    mtp = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False, "step_cost_model": False}
    got, stats = generate(target, prompts, 2, speculative_config=mtp)
    assert stats.speculation is not None and stats.speculation.num_draft_tokens > 0
    assert_same(got, expected)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48},
            "does not divide the model's 3 attention heads",
        ),
        ({"intermediate_size": 129}, "does not divide the model's intermediate size 129"),  # (its dense layer)
    ],
    ids=["heads", "dense-mlp"],
)
def test_deepseek_sizes_that_do_not_divide_are_refused(tmp_path, overrides, message):
    model_dir = make_deepseek_dir(tmp_path, "deepseek_v2", **overrides)
    with pytest.raises(SettingsConflictError, match=message):
        LLM(str(model_dir), **TINY, tensor_parallel_size=2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_attention_heads": 3, "num_key_value_heads": 3}, "3 attention heads"),
        ({"num_attention_heads": 6, "num_key_value_heads": 3}, r"3 KV heads \(neither a multiple"),
    ],
    ids=["heads", "kv-heads"],
)
def test_gpt_oss_sizes_that_do_not_divide_are_refused(tmp_path, overrides, message):
    """At start-up, before any worker is spawned or a weight is read (its experts' width is padded instead)."""
    model_dir = make_gpt_oss_dir(tmp_path / "float", **overrides)
    with pytest.raises(SettingsConflictError, match=message):
        LLM(str(model_dir), **TINY, tensor_parallel_size=2)


@pytest.mark.parametrize("family", ["gpt_oss-mxfp4", "qwen2_moe"])
def test_expert_widths_that_do_not_divide_are_padded_or_held_whole(tmp_path, family):
    """Each rank's share of the width padded with zero units (as vLLM serves gpt-oss-120b on 4 and 8 ranks): the
    tokens and logprobs of one process (GPT-OSS float, 45 wide: its interleaved gate|up padded at the end, checked
    cut by cut in test_expert_padding.py). MXFP4 with down_proj 3 blocks wide (1.5 per rank: padded to 4 blocks, 2
    per rank, the zero blocks decoding to zeros); Qwen2-MoE's experts 45 and shared expert 91 wide (23 and 46 per
    rank; dense layers between). With expert parallelism the routed experts are held whole (GPT-OSS's MXFP4 blocks
    and biases sliced by expert; Qwen2-MoE's 6 experts 3 per rank, its shared expert still padded), also int8."""
    if family == "qwen2_moe":
        model_dir = make_moe_dir(tmp_path, family, moe_intermediate_size=45, shared_expert_intermediate_size=91)
    else:
        model_dir = make_gpt_oss_dir(tmp_path / "float", intermediate_size=45 if family == "gpt_oss" else 96)
    if family == "gpt_oss-mxfp4":
        write_checkpoints(model_dir, tmp_path / "mxfp4", tmp_path / "dequantized")
        model_dir = tmp_path / "mxfp4"
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [300, 301, 17], [40] * 18]
    expected, _ = generate(model_dir, prompts, 1)
    got, _ = generate(model_dir, prompts, 2)
    assert_same(got, expected)
    assert_same(generate(model_dir, prompts, 2, enable_expert_parallel=True)[0], expected)
    if family == "qwen2_moe":  # (each expert quantized whole, as one process quantizes it)
        int8, _ = generate(model_dir, prompts, 1, quantization="int8")
        assert_same(generate(model_dir, prompts, 2, enable_expert_parallel=True, quantization="int8")[0], int8)
