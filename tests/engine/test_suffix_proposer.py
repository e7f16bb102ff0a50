"""The suffix proposer: drafts from recent requests' outputs (a suffix trie) and from the request's own tokens."""

from __future__ import annotations

from engine import SamplingParams
from engine.spec_decode.suffix import SuffixProposer
from tests.engine.references import assert_idle, make_llm


def test_drafts_follow_the_most_frequent_continuation_of_the_longest_match():
    p = SuffixProposer(5, max_depth=8, max_cached_requests=3, min_token_prob=0.3)
    assert p.propose([1, 2, 3], 5) == []
    p.on_request_finished([10, 11, 12, 13, 14, 15])
    p.on_request_finished([10, 11, 12, 13, 20])
    assert p.propose([9, 10, 11], 5) == [12, 13]  # match of 2: at most 2 tokens (max_spec_factor 1)
    assert p.propose([9, 10, 11, 12, 13], 5) == [14, 15]  # 14 and 20 tie at 1/2: 14, then 15 (always after 14)
    assert p.propose([11, 12, 13], 1) == [14]


def test_the_oldest_outputs_leave_the_trie():
    p = SuffixProposer(4, max_depth=6, max_cached_requests=1)
    p.on_request_finished([10, 11, 12, 13])
    assert p.propose([5, 10, 11], 4) == [12, 13]
    p.on_request_finished([30, 31])
    assert p.propose([5, 10, 11], 4) == []
    assert set(p._root.children) == {30, 31}  # nothing of the evicted output remains


def test_the_requests_own_tokens_are_looked_up_too():
    p = SuffixProposer(3, max_depth=8)
    assert p.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]


def test_a_repeated_request_is_drafted_from_the_first_ones_output_and_gives_its_tokens(tiny_llama_dir):
    """An agentic workload in miniature: the same prompt twice. The second run's drafts come from the first
    run's output (cached when it finished) and are accepted; the tokens are those without speculation."""
    prompt = list(range(100, 131))  # the tiny model does not loop on it: n-gram lookup alone finds little
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with make_llm(tiny_llama_dir) as base:
        expected = base.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    config = {
        "method": "suffix",
        "num_speculative_tokens": 4,
        "suffix_decoding_max_spec_factor": 4.0,
        "step_cost_model": False,
    }
    with make_llm(tiny_llama_dir, speculative_config=config) as spec:
        first = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        accepted_first = spec.engine.stats().speculation.num_accepted_tokens
        second = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        stats = spec.engine.stats().speculation
        assert stats.num_accepted_tokens - accepted_first >= 20
        assert_idle(spec)
    assert first == second == expected
