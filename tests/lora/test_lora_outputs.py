"""Served LoRA outputs against PEFT's merged weights: greedy float32 tokens identical, logprobs within 1e-4."""

from __future__ import annotations

import random

import pytest

from engine import LoRAMix, LoRARequest, SamplingParams
from engine.errors import InvalidParameterError
from engine.runner.cuda_graphs import EagerReplay, decode_buckets
from tests.engine.references import NEW_TOKENS, assert_idle, check_against_hf, make_llm
from tests.lora.adapters import make_adapter, merged_model_dir
from tests.lora.fused_steps import fused_then_unfused

PROMPTS = [
    random.Random(0).choices(range(3, 512), k=9),
    random.Random(1).choices(range(3, 512), k=37),
    random.Random(2).choices(range(3, 512), k=150),  # chunked: longer than a step's token budget
]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def lora_llm(lora_base_dir, adapter_a, adapter_b):
    with make_llm(lora_base_dir, enable_lora=True, max_loras=3, max_lora_rank=8) as llm:
        manager = llm.engine.lora_manager
        manager.add_lora(LoRARequest("a", str(adapter_a)))
        manager.add_lora(LoRARequest("b", str(adapter_b)))
        yield llm


@pytest.fixture(scope="module")
def merged(lora_base_dir, adapter_a, adapter_b, tmp_path_factory):
    """name -> the base with that adapter (or mix) merged."""

    def build(name, parts):
        return merged_model_dir(lora_base_dir, parts, tmp_path_factory.mktemp(f"merged-{name}"))

    return {
        "a": build("a", [(adapter_a, 1.0)]),
        "b": build("b", [(adapter_b, 1.0)]),
        "half": build("half", [(adapter_a, 0.5), (adapter_b, 0.5)]),
    }


def test_each_adapter_matches_peft_merged(lora_llm, merged):
    for name in ("a", "b"):
        results = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRAMix.single(name))
        check_against_hf(merged[name], PROMPTS, results)
    assert_idle(lora_llm)


def test_one_batch_mixing_base_and_adapters_gives_each_its_solo_output(lora_llm, lora_base_dir, merged):
    """Base, a, b and a mix interleaved in one batch (decodes and prefill chunks of several adapters in the
    same steps): each request gets what it gets alone."""
    choices = [None, LoRAMix.single("a"), LoRAMix.single("b"), LoRAMix((("a", 0.5), ("b", 0.5)))]
    references = [lora_base_dir, merged["a"], merged["b"], merged["half"]]
    prompts = [p for p in PROMPTS[:2] for _ in choices]
    loras = [c for _ in PROMPTS[:2] for c in choices]
    results = lora_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for i, result in enumerate(results):
        check_against_hf(references[i % len(choices)], [prompts[i]], [result])
    assert_idle(lora_llm)


def test_modules_to_save_replace_embedding_and_lm_head(lora_llm, lora_base_dir, tmp_path):
    adapter = make_adapter(
        lora_base_dir, tmp_path / "saved", seed=3, r=2, targets=("v_proj",), modules_to_save=["embed_tokens", "lm_head"]
    )
    reference = merged_model_dir(lora_base_dir, [(adapter, 1.0)], tmp_path / "merged")
    lora_llm.engine.lora_manager.add_lora(LoRARequest("saved", str(adapter)))
    try:
        # beside a base request in the same steps: only its rows take the adapter's matrices
        results = lora_llm.generate(
            [PROMPTS[1], PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=[LoRAMix.single("saved"), None]
        )
        check_against_hf(reference, [PROMPTS[1]], results[:1])
        check_against_hf(lora_base_dir, [PROMPTS[1]], results[1:])
        # in a weighted mix its replacement matrices have no defined meaning (PEFT refuses or drops them)
        with pytest.raises(InvalidParameterError, match="modules_to_save .* runs alone"):
            lora_llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRAMix((("saved", 0.5), ("a", 0.5))))
    finally:
        lora_llm.engine.lora_manager.remove_lora("saved")
    assert_idle(lora_llm)


def test_prefix_cache_is_keyed_by_the_adapter(lora_llm):
    """A new prompt under a, then b, the base and a mix of both: no hit on another's blocks; then under a again:
    every full block of a's first run is hit."""
    prompt = random.Random(5).choices(range(3, 512), k=26)
    short = SamplingParams(max_tokens=1, temperature=0)
    mixes = [LoRAMix.single("a"), LoRAMix.single("b"), None, LoRAMix((("a", 0.5), ("b", 0.5))), LoRAMix.single("a")]
    cached = []
    for choice in mixes:
        (result,) = lora_llm.generate([prompt], short, use_tqdm=False, lora_request=choice)
        cached.append(result.num_cached_tokens)
    block_size = lora_llm.engine.scheduler.block_size
    assert cached == [0, 0, 0, 0, len(prompt) // block_size * block_size]
    assert_idle(lora_llm)


def test_decode_graphs_replay_steps_with_adapters(lora_llm, lora_base_dir, merged):
    """Decode graphs captured with their static LoRA inputs (EagerReplay: the padded step a CUDA graph runs, on
    CPU): base, a, b and a mix decoding together replay them, each request still matching its merged reference."""
    runner = lora_llm.engine.runner
    runner.capture_decode_graphs(decode_buckets(runner.limits.max_num_seqs), EagerReplay)
    try:
        choices = [None, LoRAMix.single("a"), LoRAMix.single("b"), LoRAMix((("a", 0.5), ("b", 0.5)))]
        references = [lora_base_dir, merged["a"], merged["b"], merged["half"]]
        results = lora_llm.generate([PROMPTS[0]] * 4, GREEDY, use_tqdm=False, lora_request=choices)
        assert sum(graph.replays for graph in runner.graphs._graphs.values()) >= NEW_TOKENS - 1
        for reference, result in zip(references, results):
            check_against_hf(reference, [PROMPTS[0]], [result])
    finally:
        runner.graphs.release()
        runner.graphs = None
    assert_idle(lora_llm)


def test_fused_decode_with_adapters_equals_the_unfused_path(lora_base_dir, adapter_a, adapter_b, cpu_kernels):
    """bf16 on the cpu backend: decode steps holding base, a, b and a mix run fused (the deltas inside the native
    step, csrc/decode_layer.cpp) and give the unfused path's tokens and logprobs, bit for bit."""
    with make_llm(
        lora_base_dir,
        dtype="bfloat16",
        attention_backend="cpu",
        enable_prefix_caching=False,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
    ) as llm:
        manager = llm.engine.lora_manager
        manager.add_lora(LoRARequest("a", str(adapter_a)))
        manager.add_lora(LoRARequest("b", str(adapter_b)))
        choices = [None, LoRAMix.single("a"), LoRAMix.single("b"), LoRAMix((("a", 0.5), ("b", 0.5)))]
        prompts = [p for p in PROMPTS[:2] for _ in choices]
        loras = [c for _ in PROMPTS[:2] for c in choices]
        fused, unfused, fused_rows = fused_then_unfused(llm, prompts, loras, GREEDY)
        assert max(fused_rows) == len(prompts)  # every request's decodes in one fused step
        assert unfused == fused
