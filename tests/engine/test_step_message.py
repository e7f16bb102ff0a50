"""The step message is complete: a fresh runner fed the pickled messages samples the same tokens."""

import pickle

import pytest

from engine import SamplingParams
from engine.attention.kv_cache import KVCache
from engine.runner.model_runner import ModelRunner
from tests.engine.references import assert_idle, make_llm


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "step_cost_model": False}  # no timing: drafts verified


@pytest.mark.parametrize("speculative_config", [None, NGRAM], ids=["plain", "with draft tokens"])
def test_a_fresh_runner_replaying_pickled_step_messages_samples_the_same_tokens(tiny_llama_dir, speculative_config):
    """With speculation the drafts travel in the message too: the fresh runner verifies them alike."""
    llm = make_llm(
        tiny_llama_dir,
        num_blocks=20,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        scheduling_policy="priority",
        speculative_config=speculative_config,
    )
    engine = llm.engine
    runner = engine.runner
    recorded: list[tuple[bytes, dict, dict]] = []
    execute = runner.execute

    def recording_execute(scheduler_output):
        out = execute(scheduler_output)
        recorded.append((pickle.dumps(scheduler_output), out.sampled_token_ids, out.prompt_logprobs))
        return out

    runner.execute = recording_execute
    prompts = [list(range(3 + i, 15 + 4 * i)) for i in range(6)]  # 12 to 32 tokens
    params = [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, seed=11, ignore_eos=True, top_k=20),
        SamplingParams(
            max_tokens=28, temperature=0.8, seed=5, presence_penalty=0.5, repetition_penalty=1.2, ignore_eos=True
        ),
        SamplingParams(max_tokens=24, temperature=0, prompt_logprobs=1, ignore_eos=True, min_tokens=4),
        SamplingParams(max_tokens=30, temperature=1.0, seed=3, logit_bias={7: 5.0}, ignore_eos=True),
        # eos (id 2) forced by logit_bias but held back by min_tokens: needs the message's eos ids
        SamplingParams(max_tokens=30, temperature=0, min_tokens=3, logit_bias={2: 100.0}),
    ]
    prompts.append([5, 6, 7, 8, 9] * 4 + [40, 41])  # the tiny model loops on it: drafts are accepted
    params.append(SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    results = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, priority=[1, -1, 0, 2, -2, 0, 1]
    )
    assert_idle(llm)
    forced = results[5].outputs[0]
    assert len(forced.token_ids) == 4 and forced.token_ids[-1] == 2 and forced.finish_reason == "stop"
    assert engine.stats().num_preemptions > 0  # resumed requests travel in the message too
    if speculative_config is not None:
        assert engine.stats().speculation.num_accepted_tokens > 0

    fresh = ModelRunner(
        runner.model,
        KVCache(runner.kv_cache.spec, runner.kv_cache.num_blocks, runner.device),
        runner.backend,
        runner.device,
        runner.limits,
    )
    for step, (message, sampled, prompt_logprobs) in enumerate(recorded):
        out = fresh.execute(pickle.loads(message))
        assert out.sampled_token_ids == sampled, f"step {step}"
        assert out.prompt_logprobs == prompt_logprobs
    assert fresh.num_requests == runner.num_requests == 0


def test_seeded_requests_draw_the_same_tokens_across_preemptions(tiny_llama_dir):
    """Nothing survives a preemption in the runner, and nothing needs to: a seeded draw depends on
    the seed and the output position only."""
    prompts = [list(range(3 + i, 15 + 4 * i)) for i in range(4)]
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(4)]
    tight = make_llm(tiny_llama_dir, num_blocks=16, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    crowded = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    roomy = make_llm(tiny_llama_dir)
    for prompt, param, result in zip(prompts, params, crowded):
        (alone,) = roomy.generate([{"prompt_token_ids": prompt}], param, use_tqdm=False)
        assert alone.outputs[0].token_ids == result.outputs[0].token_ids
