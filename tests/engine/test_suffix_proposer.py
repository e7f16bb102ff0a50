"""The suffix proposer: drafts from recent requests' outputs (a suffix trie) and from the request's own tokens."""

from __future__ import annotations

import random

from engine import SamplingParams
from engine.spec_decode.speculative_config import SpeculativeConfig
from engine.spec_decode.suffix import SuffixProposer, _Node
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


def _snapshot(node: _Node) -> dict:
    """The trie as nested dicts: token -> (count, children)."""
    return {token: (child.count, _snapshot(child)) for token, child in node.children.items()}


def _num_nodes(node: _Node) -> int:
    return sum(1 + _num_nodes(child) for child in node.children.values())


def test_evicting_a_request_removes_exactly_its_counts():
    rng = random.Random(0)
    outputs = [[rng.randrange(6) for _ in range(rng.randrange(1, 40))] for _ in range(8)]  # small vocab: shared paths
    evicted = SuffixProposer(3, max_depth=5, max_cached_requests=5)
    for output in outputs:
        evicted.on_request_finished(output)
    never = SuffixProposer(3, max_depth=5, max_cached_requests=5)
    for output in outputs[3:]:
        never.on_request_finished(output)
    assert _snapshot(evicted._root) == _snapshot(never._root)
    assert evicted.num_nodes == never.num_nodes == _num_nodes(never._root)


def test_the_node_cap_holds_after_many_long_outputs_and_evicts_the_oldest_whole():
    rng = random.Random(1)
    p = SuffixProposer(4, max_depth=8, max_cached_requests=1000, max_tree_nodes=5000)
    outputs = [[rng.randrange(1000) for _ in range(300)] for _ in range(30)]  # ~2400 nodes each
    for output in outputs:
        p.on_request_finished(output)
        assert p.num_nodes == _num_nodes(p._root) <= 5000
    kept = [list(output) for output in p._cached]
    assert kept == outputs[-len(kept) :] and len(kept) == 2  # the newest, whole
    rebuilt = SuffixProposer(4, max_depth=8, max_tree_nodes=None)
    for output in kept:
        rebuilt.on_request_finished(output)
    assert _snapshot(p._root) == _snapshot(rebuilt._root)
    last = outputs[-1]
    assert p.propose([5000, *last[100:104]], 4) == last[104:108]  # proposals still come from the trie
    assert p.propose([5000, *outputs[0][100:104]], 4) != outputs[0][104:108]  # evicted


def test_an_output_over_the_cap_alone_keeps_its_start():
    p = SuffixProposer(4, max_depth=4, max_tree_nodes=100)
    output = list(range(1000, 1200))
    p.on_request_finished(output)
    assert p.num_nodes <= 100 and [list(o) for o in p._cached] == [output[:25]]
    assert p.propose([7, 1003, 1004], 4) == [1005, 1006]
    assert p.propose([7, 1100, 1101], 4) == [] and p.num_nodes == _num_nodes(p._root)


def test_the_node_cap_is_configured():
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=3, suffix_decoding_max_tree_nodes=123)
    proposer = config.make_proposer()
    assert isinstance(proposer, SuffixProposer) and proposer.max_tree_nodes == 123
    unbounded = SpeculativeConfig(method="suffix", num_speculative_tokens=3, suffix_decoding_max_tree_nodes=None)
    proposer = unbounded.make_proposer()
    assert isinstance(proposer, SuffixProposer) and proposer.max_tree_nodes is None


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
