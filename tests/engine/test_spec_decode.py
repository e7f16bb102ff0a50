"""Speculative decoding end to end: outputs with n-gram drafts equal those without, token for token.

Greedy output is the same under every scheduling situation (chunked prefill, preemption, prefix caching on and off,
both policies, n > 1, aborts), with logprobs equal within 1e-5 in fp32; a seeded request at temperature > 0 draws
the same tokens too (each position's draw is the one decoding without drafts makes: see
engine/sampling/rejection_sampler.py), with penalties, logit_bias, top-k/p, min-p and min_tokens. Every test
asserts that drafts were accepted, so the verification path is the one exercised.
"""

from __future__ import annotations

import json
import re

import pytest

from engine import LLM, SamplingParams
from engine.sampling.parallel import fan_out
from tests.engine.references import assert_idle, make_llm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The step-cost model (timed at start-up) is off: on a loaded machine a timing could price every draft out, and
# these tests need drafts verified. One test below keeps it on.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
    "step_cost_model": False,
}
PROMPTS = [
    list(range(20, 30)) * 3,  # a loop to copy
    [5, 6, 7, 8, 9] * 4 + [40, 41],
    list(range(100, 131)),
    [300, 301, 302, 300, 301, 302, 303],
    [7] * 6,
    list(range(400, 412)) * 2,
]


def run(llm, prompts, params):
    results = llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)
    return [[(o.token_ids, [lp.logprob for lp in o.logprobs or []]) for o in r.outputs] for r in results]


def check_aborts_and_an_opted_out_request(spec, expected, features) -> None:
    """Requests r1 and r4 of PROMPTS aborted after the fourth step, r2 with `speculative: false`: the others' tokens
    `expected` (30 greedy tokens each, `run`'s), the aborted ones' a prefix of theirs; `features` (the proposer's
    per-request state) never holds r2 and drops r1 at its abort."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, speculative=False)
    engine = spec.engine
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, plain if i == 2 else params)
        tokens[f"r{i}"] = []
    step = 0
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if step == 3:
            engine.abort(["r1", "r4"])
            assert "r1" not in features
        assert "r2" not in features
        step += 1
    assert engine.stats().speculation.num_draft_tokens > 0
    for i, want in enumerate(expected):
        got = tokens[f"r{i}"]
        assert got == (want[0][0][: len(got)] if i in (1, 4) else want[0][0])


def assert_same(expected, got, abs: float = 1e-5):
    for want_prompt, got_prompt in zip(expected, got, strict=True):
        for (want_ids, want_lps), (got_ids, got_lps) in zip(want_prompt, got_prompt, strict=True):
            assert got_ids == want_ids
            assert got_lps == pytest.approx(want_lps, abs=abs)


def accepted(llm) -> int:
    return llm.engine.stats().speculation.num_accepted_tokens


SCENARIOS = {
    "default": {},
    "chunked prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "preemption": {"num_blocks": 30},
    "no prefix caching, priority": {"enable_prefix_caching": False, "scheduling_policy": "priority"},
}


@pytest.mark.parametrize("overrides", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_greedy_output_and_logprobs_equal_those_without_speculation(tiny_llama_dir, overrides):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    with make_llm(tiny_llama_dir, **overrides) as base:
        expected = run(base, PROMPTS, params)
    with make_llm(tiny_llama_dir, speculative_config=NGRAM, **overrides) as spec:
        got = run(spec, PROMPTS, params)
        assert accepted(spec) > 0
        if "num_blocks" in overrides:
            assert spec.engine.stats().num_preemptions > 0
    assert_same(expected, got)


def test_prefix_cache_hits_and_n_children_give_the_same_tokens(tiny_llama_dir):
    """The prompts share prefixes (hits on blocks the drafts' steps filled); n = 3 greedy children share
    their prompt's blocks; a second round reads blocks cached by the first."""
    params = SamplingParams(n=3, max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [PROMPTS[0], PROMPTS[0][:20] + [9, 9, 9], PROMPTS[1]]
    with make_llm(tiny_llama_dir) as base:
        expected = run(base, prompts, params)
    with make_llm(tiny_llama_dir, speculative_config=NGRAM) as spec:
        first = run(spec, prompts, params)
        second = run(spec, [p + r[0][0][:8] for p, r in zip(prompts, expected)], params)
        assert spec.engine.stats().prefix_cache_hits > 0 and accepted(spec) > 0
    with make_llm(tiny_llama_dir) as base:
        expected_second = run(base, [p + r[0][0][:8] for p, r in zip(prompts, expected)], params)
    assert_same(expected, first)
    assert_same(expected_second, second)


SEEDED = {
    "plain": {},
    "top-k, top-p, min-p": {"top_k": 20, "top_p": 0.9, "min_p": 0.02},
    "penalties and bias": {
        "presence_penalty": 0.05,
        "frequency_penalty": 0.02,
        "repetition_penalty": 1.02,
        "logit_bias": {25: 1.0, 26: -2.0},
    },  # mild: the tiny model's logits are small
    "min_tokens and stops": {"min_tokens": 20, "stop_token_ids": [27, 28], "ignore_eos": False},
    "allowed_token_ids": {"allowed_token_ids": list(range(0, 500, 3))},
}


@pytest.mark.parametrize("changes", SEEDED.values(), ids=SEEDED.keys())
def test_seeded_sampling_draws_the_same_tokens_as_without_speculation(tiny_llama_dir, changes):
    """At temperature > 0 a draft is accepted when the target's own draw at its position equals it: a seeded
    request's tokens are those it gets without drafts. A low temperature keeps the tiny model's loops, so
    drafts are accepted."""
    fields = {"max_tokens": 40, "temperature": 0.1, "ignore_eos": True, "logprobs": 1, **changes}
    params = [SamplingParams(seed=seed, **fields) for seed in range(len(PROMPTS))]
    with make_llm(tiny_llama_dir) as base:
        expected = [run(base, [p], sp)[0] for p, sp in zip(PROMPTS, params)]
    with make_llm(tiny_llama_dir, speculative_config=NGRAM) as spec:
        got = [run(spec, [p], sp)[0] for p, sp in zip(PROMPTS, params)]
        assert accepted(spec) > 0
    assert_same(expected, got)


def test_stop_tokens_and_max_tokens_cut_the_accepted_run(tiny_llama_dir):
    """A stop token or max_tokens inside an accepted run ends the request there (nothing after it)."""
    prompt = PROMPTS[4]  # the tiny model's greedy continuation loops, then changes
    with make_llm(tiny_llama_dir) as base:
        free = run(base, [prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0][0][0]
    stop = free[10]  # inside a run of accepted drafts
    cut = free[: free.index(stop) + 1]
    with make_llm(tiny_llama_dir, speculative_config=NGRAM) as spec:
        stopped = spec.generate(
            [prompt],
            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop]),
            use_tqdm=False,
        )[0].outputs[0]
        assert stopped.token_ids == cut and stopped.finish_reason == "stop"
        for max_tokens in (1, 2, 3, 7, 13, 23):
            out = spec.generate(
                [prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False
            )[0].outputs[0]
            assert out.token_ids == free[:max_tokens] and out.finish_reason == "length"
        assert accepted(spec) > 0
        assert_idle(spec)


def test_aborts_mid_run_leave_the_others_exact_and_free_every_block(tiny_llama_dir):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with make_llm(tiny_llama_dir) as base:
        expected = run(base, PROMPTS, params)
    with make_llm(tiny_llama_dir, speculative_config=NGRAM) as spec:
        engine = spec.engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
        tokens = {f"r{i}": [] for i in range(len(PROMPTS))}
        for step in range(6):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            if step == 3:
                engine.abort(["r1", "r4"])
        while engine.has_work:
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        assert accepted(spec) > 0
        assert_idle(spec)
    for i, want in enumerate(expected):
        if i in (1, 4):
            assert tokens[f"r{i}"] == want[0][0][: len(tokens[f"r{i}"])]
        else:
            assert tokens[f"r{i}"] == want[0][0]


def test_a_request_opts_out_or_asks_for_fewer_drafts(tiny_llama_dir):
    with make_llm(tiny_llama_dir, speculative_config={**NGRAM, "step_cost_model": True}) as spec:
        engine = spec.engine
        prompt = PROMPTS[1]  # the tiny model loops on it: drafts all the way
        off = engine.make_request("a", prompt, SamplingParams(speculative=False))
        fewer = engine.make_request("b", prompt, SamplingParams(num_speculative_tokens=1))
        assert (off.num_speculative_tokens, fewer.num_speculative_tokens) == (0, 1)
        run(spec, [prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, speculative=False))
        assert engine.stats().speculation.num_drafts == 0
        cost = engine.scheduler.step_cost  # measured at start-up: 1, 2, 4, ... rows (their timings: below)
        assert cost.rows[:3] == (1, 2, 4) and len(cost.seconds) == len(cost.rows)
        run(spec, [prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, num_speculative_tokens=1))
        stats = engine.stats().speculation
        assert stats.num_draft_tokens == stats.num_drafts  # one draft per step (if the cost model kept any)


def test_a_larger_step_is_never_modelled_cheaper_whatever_the_timings_say():
    from engine.runner.step_timing import step_cost_of

    cost = step_cost_of([1, 2, 4, 8], [0.010, 0.009, 0.012, 0.011])  # noise: 2 rows "faster" than 1
    assert cost.seconds == (0.010, 0.010, 0.012, 0.012)
    assert cost(3) >= cost(2) >= cost(1)


def test_n_children_fan_out_with_drafts(tiny_llama_dir):
    """Seeded children (seed + i) through the engine: each child's tokens equal its run without drafts."""
    params = SamplingParams(n=3, max_tokens=24, temperature=0.3, seed=11, ignore_eos=True)
    outputs = {}
    for config in (None, NGRAM):
        with make_llm(tiny_llama_dir, speculative_config=config) as llm:
            for child_id, child_params in fan_out("p", params):
                llm.engine.add_request(child_id, PROMPTS[1], child_params)
            got = {}
            while llm.engine.has_work:
                for out in llm.engine.step():
                    got.setdefault(out.request_id, []).extend(out.new_token_ids)
            outputs[config is None] = got
            assert config is None or accepted(llm) > 0
    assert outputs[True] == outputs[False]


COPY_PROMPT = (
    "Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, "
    "lemon, mango.\nCopy: apple, banana, cherry,"
)


def test_the_embedded_model_gives_the_same_greedy_text_with_drafts_accepted(embedded_checkpoint):
    """SmolLM2 in fp32 copying a list from its prompt: the drafts (copied from the prompt) are accepted, and the
    tokens and logprobs are those of the same engine with speculation off for the request."""
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=1)
    with LLM(
        None, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory="64MiB", speculative_config=NGRAM
    ) as llm:
        off = run(llm, [COPY_PROMPT], params.replace(speculative=False))
        assert accepted(llm) == 0
        on = run(llm, [COPY_PROMPT], params)
        assert accepted(llm) > 8
    # the drafts are verified as a prompt chunk (the prefill attention) where speculation off decodes one token at
    # a time (the decode kernel): float32 sums in two orders, 30 layers deep; on an AVX2 build 1.1e-5 to 1.4e-5
    assert_same(off, on, abs=3e-5)


def test_structured_output_checks_drafts_and_keeps_its_tokens(tiny_llama_dir):
    """The grammar checks each draft before verification (a draft it refuses cannot be accepted, nor any
    after it): constrained output with drafts is the output without them, greedy and seeded, and valid."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 12, "maxItems": 12}
    params = [
        SamplingParams(max_tokens=80, temperature=0, structured_outputs={"json": schema}),
        SamplingParams(max_tokens=80, temperature=0.1, seed=4, structured_outputs={"json": schema}),
        SamplingParams(max_tokens=80, temperature=0, structured_outputs={"regex": "(ab|ba){10}c"}),
    ]
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[0]]
    with make_llm(tiny_llama_dir) as base:
        expected = [base.generate([p], sp, use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params)]
    with make_llm(tiny_llama_dir, speculative_config=NGRAM) as spec:
        got = [spec.generate([p], sp, use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params)]
        stats = spec.engine.stats().speculation
        assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
        assert_idle(spec)
    for want, out in zip(expected, got):
        assert out.token_ids == want.token_ids and out.finish_reason == want.finish_reason == "stop"
    assert [len(json.loads(out.text)) for out in got[:2]] == [12, 12]
    assert re.fullmatch("(ab|ba){10}c", got[2].text)


@pytest.mark.parametrize("min_tokens", [0, 3, 9])
def test_stop_strings_inside_an_accepted_run_end_it_there(tiny_llama_dir, min_tokens):
    """A stop string completed by a token inside an accepted run ends the output at that token (token ids,
    logprobs, usage and text as without drafts), and counts only from min_tokens output tokens on."""
    prompt = [260, 261, 262, 263, 264] * 4  # the tiny model loops on two text tokens: a run of 5 from output 7
    with make_llm(tiny_llama_dir) as base:
        free = base.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
        tokenizer = base.engine.tokenizer
        pieces = [tokenizer.decode([t]) for t in free[0].outputs[0].token_ids]
        # longer than the loop's period, so first completed by a token inside the first run (outputs 7..11)
        stops = ["".join(pieces[3:end]) for end in (9, 10, 11)]
        params = [
            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[s], min_tokens=min_tokens, logprobs=0)
            for s in stops
        ]
        expected = [base.generate([prompt], p, use_tqdm=False)[0].outputs[0] for p in params]
    assert stops
    with make_llm(tiny_llama_dir, speculative_config=NGRAM) as spec:
        got = [spec.generate([prompt], p, use_tqdm=False)[0].outputs[0] for p in params]
        assert accepted(spec) > 0
        assert_idle(spec)
    for want, out in zip(expected, got):
        assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        )
        assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
