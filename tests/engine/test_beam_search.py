"""Beam search (engine/sampling/beam_search.py) as vLLM runs it: the search itself on made-up next tokens, and
`LLM.beam_search` on the tiny model against greedy decoding and against the model's own logprobs."""

from __future__ import annotations

import math

import pytest

from engine import BeamSearchParams, SamplingParams
from engine.sampling.beam_search import BeamSearch, beam_score
from engine.errors import InvalidParameterError
from tests.engine.references import assert_idle, make_llm

pytestmark = pytest.mark.usefixtures("one_torch_thread")
EOS = frozenset({2})


def test_the_search_keeps_the_best_beams_and_completes_them_at_eos():
    """Width 2 over hand-made steps: each step's candidates are every (beam, next token) pair; eos completes a
    beam (its token kept only with include_stop_str_in_output); the result is the best 2 of completed and live
    beams by cumulative logprob over length (prompt included)."""
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    search = BeamSearch([7, 8], params, EOS, max_tokens=10)
    search.advance([[(10, -0.1), (2, -0.5), (11, -1.0)]])
    assert [b.tokens for b in search.beams] == [[7, 8, 10], [7, 8, 11]]
    assert [(b.tokens, b.cum_logprob, b.finish_reason) for b in search.completed] == [([7, 8], -0.5, "stop")]
    search.advance([[(12, -0.2)], [(13, -0.05)]])
    assert [b.tokens for b in search.beams] == [[7, 8, 10, 12], [7, 8, 11, 13]]
    search.advance([[(14, -3.0)], [(15, -3.0)]])
    assert search.done
    best = search.result(lambda ids, skip: " ".join(map(str, ids)))
    # scores: completed [7, 8] -0.5 / 2 = -0.25; live -3.3 / 5 and -4.05 / 5
    assert [(b.text, b.finish_reason, b.stop_reason) for b in best] == [("", "stop", 2), ("10 12 14", "length", None)]
    assert best[1].cum_logprob == pytest.approx(-3.3)


def test_length_penalty_and_a_kept_eos():
    params = BeamSearchParams(beam_width=1, max_tokens=2, include_stop_str_in_output=True, length_penalty=2.0)
    search = BeamSearch([1], params, EOS, max_tokens=2)
    search.advance([[(2, -1.0), (5, -1.5)]])
    (done,) = search.completed
    assert done.tokens == [1, 2]  # the eos kept; not counted in the length
    assert beam_score(done, EOS, 2.0) == pytest.approx(-1.0 / 1**2)
    assert beam_score(search.beams[0], EOS, 2.0) == pytest.approx(-1.5 / 2**2)


def test_steps_stop_where_the_context_does():
    search = BeamSearch([1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=50), EOS, max_tokens=4)
    assert search.steps_left == 4


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 11, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": math.nan}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature"),
    ],
)
def test_parameters_are_checked(fields, param):
    with pytest.raises(InvalidParameterError) as info:
        BeamSearchParams(**fields)
    assert info.value.field == param


def test_width_one_is_greedy(llm):
    prompts = ["The quick brown fox", [5, 6, 7, 8, 9]]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    for out, reference in zip(outs, greedy):
        (beam,) = out.sequences
        assert beam.tokens[-10:] == reference.outputs[0].token_ids
        assert beam.text == reference.outputs[0].text
    assert_idle(llm)


def test_beams_score_as_the_model_scores_them(llm):
    """Width 3, no length normalization: the beams are distinct, best first, each beam's cumulative logprob is the
    sum of its tokens' logprobs as the model gives them for the whole sequence (prompt logprobs), and the best is
    at least as likely as the greedy output."""
    prompt = [11, 12, 13, 14, 15, 16]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=0.0)
    (out,) = llm.beam_search([prompt], params)
    beams = out.sequences
    assert len(beams) == 3 and len({tuple(b.tokens) for b in beams}) == 3
    assert [b.cum_logprob for b in beams] == sorted((b.cum_logprob for b in beams), reverse=True)
    for beam in beams:
        scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        (result,) = llm.generate([{"prompt_token_ids": beam.tokens}], scored, use_tqdm=False)
        model = [result.prompt_logprobs[i][t].logprob for i, t in enumerate(beam.tokens) if i >= len(prompt)]
        assert sum(model) == pytest.approx(beam.cum_logprob, abs=1e-4)
        assert beam.logprobs == pytest.approx(model, abs=1e-4)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    (reference,) = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    assert beams[0].cum_logprob >= reference.outputs[0].cumulative_logprob - 1e-4
    assert_idle(llm)


def test_a_search_stops_where_the_kv_cache_does(tiny_llama_dir, llm):
    """A pool of 30 blocks of 4 holds a sequence of 121 tokens (the last sampled token needs no slot), fewer than
    max_model_len: a search of 30 steps on a 100-token prompt ends after 21 with the beams the same search finds
    in a roomy pool, where its 22nd step would have been refused after all that work."""
    prompt = [5 + i % 7 for i in range(100)]
    params = BeamSearchParams(beam_width=2, max_tokens=30, ignore_eos=True)
    with make_llm(tiny_llama_dir, num_blocks=30) as small:
        (out,) = small.beam_search([{"prompt_token_ids": prompt}], params)
        assert small.engine.max_sequence_len == 121 < small.engine.max_model_len
        assert_idle(small)
    (roomy,) = llm.beam_search(
        [{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=21, ignore_eos=True)
    )
    assert [len(b.tokens) - len(prompt) for b in out.sequences] == [21, 21]
    assert [b.finish_reason for b in out.sequences] == ["length", "length"]
    assert [b.tokens for b in out.sequences] == [b.tokens for b in roomy.sequences]
    assert [b.cum_logprob for b in out.sequences] == pytest.approx([b.cum_logprob for b in roomy.sequences], abs=1e-4)
