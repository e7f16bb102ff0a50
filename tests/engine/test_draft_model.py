"""Draft-model speculation end to end: greedy outputs with a draft model's drafts equal those without, token for token.

Drafts come from tiny random checkpoints of the target's vocabulary made here: a smaller model (it rarely agrees
with the target), a noisy copy of the target (it agrees about half the time: accepted and rejected drafts in
every step mix, so rollbacks are exercised) and the target itself (it agrees always). Every scenario asserts that
drafts were accepted and rejected, and that the draft's own KV cache is empty once the requests have ended. The
embedded model drafts for itself from its quantized GGUF (the target: the same file dequantized).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.errors import SettingsConflictError
from engine.loading.loader import EMBEDDED_GGUF_NAME, EMBEDDED_PACKAGE
from engine.spec_decode.draft_cache import DraftCache
from scheduler import DraftQuery
from tests.engine.factories import SMALL_DRAFT, make_noisy_copy, make_tiny_model_dir, swap_token_ids
from tests.engine.references import assert_idle, make_llm
from tests.engine.test_spec_decode import PROMPTS, assert_same, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NOISE = 0.01
"""Std of the noise on the noisy copy's weights: about half of its drafts are accepted (measured: 84 of 177)."""


@pytest.fixture(scope="module")
def drafts(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    return {
        # a shorter context than the target's: sequences past it go on without drafts
        "smaller": make_tiny_model_dir(root / "smaller", "llama", seed=1, **SMALL_DRAFT, max_position_embeddings=48),
        "noisy": make_noisy_copy(tiny_llama_dir, root / "noisy", NOISE),
        "target": tiny_llama_dir,
    }


def draft_config(model: Path, k: int = 4) -> dict:
    # The step-cost model is off: on a loaded machine its timings could price every draft out.
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, "step_cost_model": False}


def assert_draft_idle(llm: LLM) -> None:
    """The target's blocks and the draft's all free, the draft holding no request."""
    assert_idle(llm)
    proposer = llm.engine.scheduler.proposer
    assert proposer.num_requests == 0
    assert proposer.cache.num_free_blocks == proposer.cache.num_blocks


def counts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.stats().speculation
    return stats.num_accepted_tokens, stats.num_draft_tokens - stats.num_accepted_tokens


SCENARIOS = {
    "default": {},
    # a prompt longer than the budget is caught up by the draft over several steps too
    "chunked prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "preemption": {"num_blocks": 30},
    "no prefix caching, priority": {"enable_prefix_caching": False, "scheduling_policy": "priority"},
}


@pytest.mark.parametrize("overrides", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_greedy_output_and_logprobs_equal_those_without_speculation(tiny_llama_dir, drafts, overrides):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    with make_llm(tiny_llama_dir, **overrides) as base:
        expected = run(base, PROMPTS, params)
    with make_llm(tiny_llama_dir, speculative_config=draft_config(drafts["noisy"]), **overrides) as spec:
        got = run(spec, PROMPTS, params)
        accepted, rejected = counts(spec)
        assert accepted > 0 and rejected > 0
        if "num_blocks" in overrides:
            assert spec.engine.stats().num_preemptions > 0
        assert_draft_idle(spec)
    assert_same(expected, got)


def test_a_smaller_draft_gives_the_same_tokens(tiny_llama_dir, drafts):
    """Also past the draft's context (48 positions): prompts of up to 31 tokens and 30 more."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1)
    with make_llm(tiny_llama_dir) as base:
        expected = run(base, PROMPTS, params)
    with make_llm(tiny_llama_dir, speculative_config=draft_config(drafts["smaller"], k=3)) as spec:
        got = run(spec, PROMPTS, params)
        stats = spec.engine.stats().speculation
        assert stats.num_draft_tokens > 0
        assert_draft_idle(spec)
    assert_same(expected, got)


def test_a_draft_identical_to_the_target_has_almost_every_draft_accepted(tiny_llama_dir, drafts):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with make_llm(tiny_llama_dir) as base:
        expected = run(base, PROMPTS, params)
    with make_llm(tiny_llama_dir, speculative_config=draft_config(drafts["target"])) as spec:
        got = run(spec, PROMPTS, params)
        stats = spec.engine.stats().speculation
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
        assert stats.mean_acceptance_length > 4  # k = 4: nearly k + 1 tokens per drafted step
        assert_draft_idle(spec)
    assert_same(expected, got)


def test_n_children_greedy_and_seeded_give_the_same_tokens(tiny_llama_dir, drafts):
    """n = 3 greedy children share their prompt (each its own draft state); seeded children at temperature > 0
    draw what they draw without drafts."""
    greedy = SamplingParams(n=3, max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    seeded = SamplingParams(n=3, max_tokens=24, temperature=0.3, seed=11, ignore_eos=True)
    config = draft_config(drafts["noisy"])
    with make_llm(tiny_llama_dir) as base:
        expected = run(base, PROMPTS[:3], greedy)
        expected_seeded = run(base, PROMPTS[:3], seeded)
    with make_llm(tiny_llama_dir, speculative_config=config) as spec:
        got = run(spec, PROMPTS[:3], greedy)
        got_seeded = run(spec, PROMPTS[:3], seeded)
        assert counts(spec)[0] > 0
        assert_draft_idle(spec)
    assert_same(expected, got)
    assert_same(expected_seeded, got_seeded)


def test_aborts_mid_run_leave_the_others_exact_and_free_the_draft_cache(tiny_llama_dir, drafts):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with make_llm(tiny_llama_dir) as base:
        expected = run(base, PROMPTS, params)
    with make_llm(tiny_llama_dir, speculative_config=draft_config(drafts["noisy"])) as spec:
        engine = spec.engine
        tokens: dict[str, list[int]] = {}
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
            tokens[f"r{i}"] = []
        for step in range(6):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            if step == 3:
                engine.abort(["r1", "r4"])
                assert engine.scheduler.proposer.num_requests == len(PROMPTS) - 2
        while engine.has_work:
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        assert counts(spec)[0] > 0
        assert_draft_idle(spec)
    for i, want in enumerate(expected):
        got = tokens[f"r{i}"]
        assert got == (want[0][0][: len(got)] if i in (1, 4) else want[0][0])


def test_a_draft_of_another_vocabulary_or_architecture_is_refused_at_start_up(tiny_llama_dir, drafts, tmp_path):
    swapped = shutil.copytree(drafts["smaller"], tmp_path / "swapped")
    swap_token_ids(swapped, "a", "b")
    narrow = make_tiny_model_dir(tmp_path / "narrow", "llama", **SMALL_DRAFT, vocab_size=256)
    other = shutil.copytree(drafts["smaller"], tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    config.update(architectures=["GPT2ForCausalLM"], model_type="gpt2", n_embd=32, n_layer=1, n_head=2)
    (other / "config.json").write_text(json.dumps(config))
    cases = {
        swapped: "the draft model's tokenizer differs from the target's (512 vs 512 tokens, 2 mapped differently",
        narrow: "the draft model's embedding has 256 rows, fewer than its tokenizer's 512 tokens",
        other: "cannot be served: architecture ['GPT2ForCausalLM'] is not supported",
    }
    for model, message in cases.items():
        with pytest.raises(SettingsConflictError, match=re.escape(message)):
            make_llm(tiny_llama_dir, speculative_config=draft_config(model))


def test_the_embedded_model_drafts_for_itself_from_its_quantized_gguf(embedded_checkpoint):
    """The target: the embedded GGUF dequantized to fp32; the draft: the same file on the native Q4_1 kernels.
    Greedy tokens are those of the same engine with speculation off for the request; most drafts are accepted
    (measured: 34 of 42, a mean acceptance length of 3.6 at k = 4)."""
    gguf = Path(importlib.util.find_spec(EMBEDDED_PACKAGE).submodule_search_locations[0]) / EMBEDDED_GGUF_NAME
    config = draft_config(gguf)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)
    prompt = "Once upon a time, in a small town by the sea,"
    with LLM(
        None, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory="64MiB", speculative_config=config
    ) as llm:
        assert llm.engine.scheduler.proposer.model.quantization == "gguf"
        off = run(llm, [prompt], params.replace(speculative=False))
        on = run(llm, [prompt], params)
        stats = llm.engine.stats().speculation
        print(
            f"quantized self-draft: {stats.num_accepted_tokens} of {stats.num_draft_tokens} drafts accepted, "
            f"mean acceptance length {stats.mean_acceptance_length:.2f}"
        )
        assert stats.num_accepted_tokens >= 0.5 * stats.num_draft_tokens > 0
        assert_draft_idle(llm)
    (off_ids, off_lps), (on_ids, on_lps) = off[0][0], on[0][0]
    assert on_ids == off_ids
    # verification rows and single decodes run different kernels on 30 layers: float sums in another order
    assert on_lps == pytest.approx(off_lps, abs=1e-4)


def test_proposals_after_rollbacks_equal_those_of_a_fresh_draft(tiny_llama_dir, drafts):
    """A sequence grows by some of the drafts (none, some, all) and a token of the target's; after each, the
    proposal from the draft's incremental state equals that of a request it sees for the first time: K/V of
    rejected drafts never leak into later proposals."""
    import random

    rng = random.Random(0)
    with make_llm(tiny_llama_dir, speculative_config=draft_config(drafts["noisy"])) as llm:
        proposer = llm.engine.scheduler.proposer
        tokens = list(PROMPTS[2])
        for step in range(12):
            (got,) = proposer.propose_batch([DraftQuery("r", tokens, 4)])
            (fresh,) = proposer.propose_batch([DraftQuery(f"fresh-{step}", tokens, 4)])
            proposer.release(f"fresh-{step}")
            assert list(got) == list(fresh) and len(got) == 4
            accepted = rng.choice([0, 1, 3, 4])
            tokens += list(got[:accepted]) + [rng.randrange(3, 500)]
        proposer.release("r")
        assert proposer.num_requests == 0 and proposer.cache.num_free_blocks == proposer.cache.num_blocks


def test_the_draft_cache_rolls_back_to_the_common_prefix_and_frees_every_block():
    cache = DraftCache(num_blocks=4, block_size=4)
    sequence = cache.sync("a", [1, 2, 3])
    assert sequence.num_tokens == 0 and cache.reserve(sequence, 8) and cache.num_free_blocks == 2
    sequence.token_ids += [1, 2]  # computed: the request's own
    sequence.num_confirmed = 2
    sequence.token_ids += [7, 8, 9]  # drafts fed
    assert cache.sync("a", [1, 2, 7, 8, 5, 6]).token_ids == [1, 2, 7, 8]  # two drafts accepted, then 5
    assert cache.sync("a", [1, 2, 7, 8]).token_ids == [1, 2, 7]  # at least the last token is fed again
    assert cache.slots(sequence, 3, 5) == [cache.sequences["a"].block_ids[0] * 4 + 3, sequence.block_ids[1] * 4]
    assert not cache.reserve(cache.sync("b", [1]), 20) and cache.num_free_blocks == 2  # too few: nothing taken
    cache.release("a")
    cache.release("b")
    cache.release("c")  # never held anything
    assert cache.num_free_blocks == 4 and not cache.sequences


def test_drafts_stop_at_the_drafts_context(tiny_llama_dir, drafts):
    with make_llm(tiny_llama_dir, speculative_config=draft_config(drafts["smaller"])) as llm:
        proposer = llm.engine.scheduler.proposer
        assert proposer.max_positions == 48
        tokens = list(range(10, 56))  # 46: drafts at positions 46 and 47 only
        assert [
            len(d) for d in proposer.propose_batch([DraftQuery("a", tokens, 4), DraftQuery("b", tokens[:40], 4)])
        ] == [2, 4]
        assert [len(d) for d in proposer.propose_batch([DraftQuery("a", tokens + [3, 4], 4)])] == [0]
        proposer.release("a")
        proposer.release("b")
        assert proposer.cache.num_free_blocks == proposer.cache.num_blocks


def test_a_long_prompt_is_caught_up_over_several_proposals(tiny_llama_dir, drafts):
    """max_num_batched_tokens 16: a proposal feeds 16 tokens at most, so a 40-token prompt drafts on the third."""
    config = draft_config(drafts["noisy"])
    with make_llm(tiny_llama_dir, speculative_config=config, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        proposer = llm.engine.scheduler.proposer
        prompt = list(range(50, 90))
        assert [len(proposer.propose_batch([DraftQuery("a", prompt, 4)])[0]) for _ in range(3)] == [0, 0, 4]
        assert proposer.cache.sequences["a"].num_confirmed == 40
        proposer.release("a")
