"""LoRA with tensor and pipeline parallelism over gloo on CPU: four ranks (two stages of two tensor-parallel ranks
each), every rank holding its part of every adapter, read from the adapter's files when a step message first
gives it a slot. Base, two adapters, a mix, an adapter with modules_to_save and a llama.cpp GGUF adapter in the
same steps: greedy float32 tokens identical to the one-process LoRA engine; an adapter loaded at run time reaches
the workers. A mixture of experts' expert adapter on two tensor-parallel ranks as in one process."""

from __future__ import annotations

import random

import pytest

from engine import LLM, LoRAMix, LoRARequest, SamplingParams
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import NEW_TOKENS, assert_idle, check_against_hf
from tests.engine.test_gpt_oss import make_gpt_oss_dir
from tests.engine.test_model_equivalence import mixed_prompts
from tests.engine.test_moe_equivalence import make_moe_dir
from tests.lora.adapters import make_adapter, merged_model_dir
from tests.lora.expert_adapters import EXPERT_PARAMETERS
from tests.lora.gguf_adapters import write_gguf_adapter

pytestmark = pytest.mark.timeout(300)

SETTINGS = dict(
    dtype="float32",
    device="cpu",
    block_size=4,
    max_num_batched_tokens=32,
    max_num_seqs=8,
    enable_lora=True,
    max_loras=4,
    max_lora_rank=8,
)
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
# 42 prompt tokens: a step of 32 ends inside a prompt (a chunk with an adapter)
PROMPTS = [random.Random(seed).choices(range(3, 512), k=n) for seed, n in enumerate((5, 19, 3, 9, 6))]
PROMPTS.append(PROMPTS[1])  # through the GGUF form of adapter a


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A four-layer Llama (two layers per stage; four query heads over two KV heads, split by two ranks) and three
    adapters over it: every projection; some projections with rsLoRA; v only with a new embedding and LM head."""
    base = make_tiny_model_dir(tmp_path_factory.mktemp("lora-pp-base"), "llama", num_hidden_layers=4)
    made = {
        "a": make_adapter(base, tmp_path_factory.mktemp("a"), seed=1, r=4, alpha=8),
        "b": make_adapter(
            base,
            tmp_path_factory.mktemp("b"),
            seed=2,
            r=8,
            alpha=4,
            targets=("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"),
            use_rslora=True,
        ),
        "saved": make_adapter(
            base,
            tmp_path_factory.mktemp("saved"),
            seed=3,
            r=2,
            targets=("v_proj",),
            modules_to_save=["embed_tokens", "lm_head"],
        ),
    }
    # a as llama.cpp writes it (its q/k rows permuted by the whole model's heads, which each rank must undo)
    made["a-gguf"] = write_gguf_adapter(
        made["a"], tmp_path_factory.mktemp("a-gguf") / "a.gguf", num_heads=4, num_kv_heads=2, num_layers=4
    )
    return base, made


CHOICES = [
    None,
    LoRAMix.single("a"),
    LoRAMix.single("b"),
    LoRAMix((("a", 0.5), ("b", 0.5))),
    LoRAMix.single("saved"),
    LoRAMix.single("a-gguf"),
]


def generate(base, made, **parallel) -> list[list[int]]:
    """Each prompt's greedy tokens under CHOICES[i], all in one batch: a and `saved` registered at start-up
    (--lora-modules), b loaded once the engine (and its workers) runs."""
    modules = [{"name": name, "path": str(made[name])} for name in ("a", "saved", "a-gguf")]
    with LLM(str(base), **SETTINGS, lora_modules=modules, **parallel) as llm:
        llm.engine.lora_manager.add_lora(LoRARequest("b", str(made["b"])))
        results = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=CHOICES)
        assert_idle(llm)
    return [list(result.outputs[0].token_ids) for result in results]


def test_two_stages_of_two_ranks_match_one_process(adapters):
    base, made = adapters
    expected = generate(base, made)
    assert len({tuple(tokens) for tokens in expected}) == len(CHOICES) - 1  # every adapter changes the output
    assert expected[5] == expected[1]  # a's two forms
    assert generate(base, made, tensor_parallel_size=2, pipeline_parallel_size=2) == expected


@pytest.mark.parametrize("family", ["phi3", "gpt_neox"])
def test_other_families_on_two_ranks_match_peft_merged(family, tmp_path_factory):
    """Phi-3's fused qkv_proj and gate_up_proj (each part's rows cut by its own heads), GPT-NeoX's per-head
    query_key_value (regrouped by the whole model's heads before the cut): each
    rank's delta lines up with its slice of the base product."""
    base = make_tiny_model_dir(tmp_path_factory.mktemp(family), family)
    adapter = make_adapter(base, tmp_path_factory.mktemp("adapter"), seed=5, r=4, alpha=8, targets="all-linear")
    merged = merged_model_dir(base, [(adapter, 1.0)], tmp_path_factory.mktemp("merged"))
    prompts = PROMPTS[:3]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    modules = [{"name": "a", "path": str(adapter)}]
    with LLM(str(base), **SETTINGS, lora_modules=modules, tensor_parallel_size=2) as llm:
        loras = [LoRAMix.single("a"), None, LoRAMix.single("a")]
        results = llm.generate(prompts, greedy, use_tqdm=False, lora_request=loras)
        assert_idle(llm)
    check_against_hf(merged, prompts[::2], results[::2])
    check_against_hf(base, prompts[1:2], results[1:2])


def test_gpt_oss_attention_adapter_on_two_ranks_matches_one_process(tmp_path_factory):
    """GPT-OSS's q/k/v/o (biased, its sinks cut with the heads), sliding and full layers: each rank's delta on its
    heads' rows and o_proj's columns, beside base requests in one batch; one process's tokens."""
    base = make_gpt_oss_dir(tmp_path_factory.mktemp("gpt_oss"))
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    adapter = make_adapter(base, tmp_path_factory.mktemp("adapter"), seed=6, r=4, alpha=8, targets=targets)
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1]]  # 19 tokens: past the window of 8
    modules = [{"name": "a", "path": str(adapter)}]
    loras = [LoRAMix.single("a"), None, None]
    outputs = []
    for tp in (1, 2):
        with LLM(str(base), **SETTINGS, lora_modules=modules, tensor_parallel_size=tp) as llm:
            results = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
            outputs.append([list(result.outputs[0].token_ids) for result in results])
            assert_idle(llm)
    assert outputs[1] == outputs[0]
    assert outputs[0][0] != outputs[0][2]  # the adapter changes what the model says


def test_expert_adapter_on_two_ranks_matches_one_process(tmp_path_factory):
    """Qwen3-MoE (a dense layer between sparse ones) with an adapter of its attention and its experts (PEFT's
    target_parameters): each rank's B rows of its share of every expert's gate and up, A's columns of its share of
    every expert's down (a partial delta summed by the layer's all-reduce), beside a base request; and with expert
    parallelism, each rank the whole deltas of its own experts."""
    base = make_moe_dir(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")
    adapter = make_adapter(
        base,
        tmp_path_factory.mktemp("adapter"),
        seed=6,
        r=4,
        alpha=8,
        targets=("q_proj", "k_proj", "v_proj", "o_proj"),
        target_parameters=EXPERT_PARAMETERS,
    )
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(3)[4:7]]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    loras = [LoRAMix.single("a"), None, LoRAMix.single("a")]
    outputs = []
    for parallel in ({}, {"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}):
        with LLM(str(base), **SETTINGS, lora_modules=[{"name": "a", "path": str(adapter)}], **parallel) as llm:
            results = llm.generate(prompts, greedy, use_tqdm=False, lora_request=loras)
            assert_idle(llm)
        outputs.append([result.outputs[0] for result in results])
    one = outputs[0]
    for parallel in outputs[1:]:
        assert [out.token_ids for out in parallel] == [out.token_ids for out in one]
        for got, expected in zip(parallel, one):
            assert [lp.logprob for lp in got.logprobs] == pytest.approx(
                [lp.logprob for lp in expected.logprobs], abs=1e-4
            )
    assert one[0].token_ids != one[1].token_ids or one[2].token_ids != one[1].token_ids
