"""--tensor-parallel-size over gloo on CPU: real worker processes (forked), each holding a shard, fed every step
through the shared-memory broadcast. Greedy tokens identical to one process and logprobs within 1e-5 in float32,
on tiny Llama-family models (GQA, fewer KV heads than ranks, the embedded model's 9 and 3 heads on 3 ranks), under chunked prefill,
prefix caching, preemption, aborts and speculative decoding; refusals of what it does not serve."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.errors import SettingsConflictError
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import assert_idle
from tests.engine.test_model_equivalence import mixed_prompts
from tests.distributed.stepping import tokens_with_an_abort

pytestmark = pytest.mark.timeout(300)

TINY = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def kv1_model_dir(tmp_path_factory):
    """Fewer KV heads than ranks: each rank keeps a copy of the one KV head."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen2"), "qwen2", num_key_value_heads=1)


def generate(model_dir, prompts, tp: int, **overrides):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(str(model_dir), **{**TINY, **overrides}, tensor_parallel_size=tp) as llm:
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.engine.stats()
        assert_idle(llm)
    return [(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in results], stats


def assert_same(got, expected, abs: float = 1e-5) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=abs)


@pytest.mark.parametrize("which", ["model_dir", "kv1_model_dir"], ids=["llama", "qwen2-kv1"])
def test_chunked_prefill_and_preemption(which, request):
    model_dir = request.getfixturevalue(which)
    prompts = mixed_prompts(11)
    expected, _ = generate(model_dir, prompts, 1, num_blocks=20)
    got, stats = generate(model_dir, prompts, 2, num_blocks=20)
    assert stats.num_preemptions > 0
    assert_same(got, expected)


def test_prefix_cache_hits_and_the_kv_tiers(model_dir, tmp_path):
    """Prefix-cache hits on two ranks; with --kv-cache-dir each rank writes its own file of every block, with
    --swap-space its own rows of a block's slot. The memory tier holds 24 blocks: after the pool is emptied the
    prompts come back from both ranks' files (memory kept only the last blocks written, decodes), and those
    restores are written through to memory, from which most of the longest prompt comes back once the pool is
    emptied again (disk then memory in one run). Same tokens every time."""
    prompts = mixed_prompts(12, shared_prefix=20)
    expected, _ = generate(model_dir, prompts, 1, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    swap_space = 24 * 2048 / 2**30  # 24 blocks of the tiny model (2 layers, K and V, 4 tokens, 2 KV heads of 16)
    with LLM(str(model_dir), **TINY, tensor_parallel_size=2, kv_cache_dir=str(tmp_path), swap_space=swap_space) as llm:
        runs, stats = [], []
        for batch in (prompts, prompts, prompts[6:7]):
            results = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            runs.append([(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in results])
            stats.append(llm.engine.stats())
            assert llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
        assert llm.engine.scheduler.kv_cache_manager.kv_tiers.memory.num_slots == 24
        assert_idle(llm)
    assert stats[0].prefix_cache_hits >= 16
    disk = [s.kv_tier("disk").hit_blocks for s in stats]
    memory = [s.kv_tier("memory").hit_blocks for s in stats]
    assert disk[0] == memory[0] == 0 and disk[1] >= 30 and memory[1] == 0
    # (its 5 shared-prefix blocks, restored first in the second run, have left memory since: from disk again)
    assert memory[2] > 0 and disk[2] > disk[1] and memory[2] + disk[2] - disk[1] == (len(prompts[6]) - 1) // 4
    assert stats[-1].kv_tier("disk").corrupt_files == 0
    assert len(list(tmp_path.rglob("*.r0"))) == len(list(tmp_path.rglob("*.r1"))) > 0
    for got, want in zip(runs, (expected, expected, expected[6:7])):
        assert_same(got, want)


def test_aborts_between_steps(model_dir):
    """A request aborted mid-run: the next step message tells every rank, and the others finish as alone."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = mixed_prompts(13)[:4]
    outputs = {}
    for tp in (1, 2):
        with LLM(str(model_dir), **TINY, tensor_parallel_size=tp) as llm:
            outputs[tp] = tokens_with_an_abort(llm, prompts, params, abort_at=3)
    assert len(outputs[2]["r1"]) < 12 and outputs[2] == outputs[1]


def test_speculative_decoding(model_dir):
    """n-gram drafts verified on every rank (the drafts travel in the step message): the tokens of one process
    without speculation. No step-cost timing here: on a loaded machine it may find that no draft pays, and the run
    would verify nothing (the next test runs the timing)."""
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 8]
    expected, _ = generate(model_dir, prompts, 1)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "step_cost_model": False}
    got, stats = generate(model_dir, prompts, 2, speculative_config=ngram)
    assert stats.speculation is not None and stats.speculation.num_drafts > 0
    assert_same(got, expected)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "medusa"])
def test_draft_heads_beside_two_ranks(method, model_dir, tmp_path):
    """An EAGLE or EAGLE-3 head (on a 4-layer Llama), GLM-4.5's prediction layer, or Medusa heads sharing the
    target's LM head (original_lm_head) draft on rank 0 beside a target whose ranks each hold half of the
    vocabulary's rows: the head reads the whole embedding (and EAGLE's and these Medusa heads' LM head) from the
    target's checkpoint, the target's features from rank 0's forward (the MLP speculator drafts through Medusa's
    proposer, on rank 0 alike). The tokens of one process without speculation."""
    from tests.engine.eagle_factories import make_eagle_head
    from tests.engine.medusa_factories import make_medusa_heads, random_medusa_tensors
    from tests.engine.test_mtp import add_prediction_layer

    if method == "medusa":
        target = model_dir
        tensors = {name: t for name, t in random_medusa_tensors(3).items() if not name.startswith("lm_heads.")}
        heads = make_medusa_heads(tmp_path / "heads", tensors, original_lm_head=True)
        config = {"method": method, "model": str(heads)}
    elif method == "mtp":
        whole = make_tiny_model_dir(tmp_path / "whole", "glm4_moe", num_hidden_layers=3)
        target, config = add_prediction_layer(whole, tmp_path / "target"), {"method": "mtp"}
    else:
        target = make_tiny_model_dir(tmp_path / "target", "llama", num_hidden_layers=4)
        head = make_eagle_head(tmp_path / "head", method, feature_layers=[1, 2, 0], draft_vocab=200)
        config = {"method": method, "model": str(head)}
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 8]
    expected, _ = generate(target, prompts, 1)
    config.update(num_speculative_tokens=3, adaptive=False, step_cost_model=False)
    got, stats = generate(target, prompts, 2, speculative_config=config)
    assert stats.speculation is not None and stats.speculation.num_draft_tokens > 0
    assert_same(got, expected)


def test_the_step_cost_timing_runs_on_every_rank_in_lockstep(model_dir):
    """The start-up's step-cost timing runs the same steps on every rank (a rank that skipped them would leave the
    others waiting at a collective): the engine starts, holds a cost for each row count measured, and serves the
    tokens of one process whichever drafts the timing lets through."""
    prompts = [[5, 6, 7, 8, 9] * 6]
    expected, _ = generate(model_dir, prompts, 1)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(str(model_dir), **TINY, tensor_parallel_size=2, speculative_config=ngram) as llm:
        step_cost = llm.engine.scheduler.step_cost
        assert step_cost is not None and len(step_cost.rows) >= 2  # a cost per row count (StepCost checks them)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_idle(llm)
    got = [(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in results]
    assert_same(got, expected)


def test_nine_heads_and_three_kv_heads_on_three_ranks(tmp_path):
    """The embedded model's head layout (9 query heads, 3 KV heads, tied embedding) split over three ranks, on a
    tiny model: the real checkpoint runs on three ranks in its GGUF blocks (test_tensor_parallel_quantized.py)."""
    heads = dict(num_attention_heads=9, num_key_value_heads=3, head_dim=16, hidden_size=144, intermediate_size=192)
    model = make_tiny_model_dir(tmp_path, "llama", **heads, tie_word_embeddings=True)
    prompts = mixed_prompts(3)
    expected, _ = generate(model, prompts, 1)
    got, _ = generate(model, prompts, 3)
    assert_same(got, expected)


@pytest.mark.parametrize(
    "arch, overrides, flags, message",
    [
        (
            "llama",
            {"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 16, "hidden_size": 48},
            {},
            "3 attention heads",
        ),
    ],
)
def test_refusals_name_the_combination(tmp_path, arch, overrides, flags, message):
    model_dir = make_tiny_model_dir(tmp_path / arch, arch, **overrides)
    with pytest.raises(SettingsConflictError, match=message):
        LLM(str(model_dir), **TINY, tensor_parallel_size=2, **flags)


def test_a_step_that_fails_on_rank_0_stops_every_later_step(model_dir):
    """After a step fails on rank 0 once the workers took it, the ranks may wait at different collectives: the
    engine refuses to run another step rather than pair them wrongly (silently wrong outputs)."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1)
    with LLM(str(model_dir), **TINY, tensor_parallel_size=2) as llm:
        runner = llm.engine.runner
        sample = runner._sample

        def failing(hidden, batch):
            runner._sample = sample
            raise RuntimeError("injected failure in rank 0's sampling")

        runner._sample = failing
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
        with pytest.raises(RuntimeError, match="rank 0|worker rank"):
            llm.generate([{"prompt_token_ids": [5, 6, 7, 9]}], params, use_tqdm=False)


def test_medusa_heads_sharing_the_lm_head_of_a_family_named_otherwise(tmp_path):
    """Medusa heads sharing the target's LM head beside two ranks, on GPT-J (its embedding stored as
    transformer.wte, its LM head with a bias): the whole LM head is read from the target's checkpoint by the
    family's names; the tokens of one process without speculation."""
    from tests.engine.medusa_factories import make_medusa_heads, random_medusa_tensors

    target = make_tiny_model_dir(tmp_path / "target", "gptj")
    tensors = {name: t for name, t in random_medusa_tensors(3).items() if not name.startswith("lm_heads.")}
    heads = make_medusa_heads(tmp_path / "heads", tensors, original_lm_head=True)
    config = {"method": "medusa", "model": str(heads), "num_speculative_tokens": 3}
    config.update(adaptive=False, step_cost_model=False)
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 8]
    expected, _ = generate(target, prompts, 1)
    got, stats = generate(target, prompts, 2, speculative_config=config)
    assert stats.speculation is not None and stats.speculation.num_draft_tokens > 0
    assert_same(got, expected)
