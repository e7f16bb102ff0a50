"""The rejection sampler keeps the target's distribution: chi-square tests over 10^5 seeded draws.

Critical values are chi-square's at p = 0.001 (a seeded test: it either always passes or always fails); the
acceptance rate of a point-mass draft is p(d), that of a draft drawn from q is sum(min(p, q)).
"""

from __future__ import annotations

import pytest
import torch

from engine.sampling.params import SamplingParams
from engine.sampling.rejection_sampler import num_accepted, rejection_sample
from engine.sampling.sampler import Sampler
from engine.sampling.state import SamplingState

N = 100_000
VOCAB = 8
CHI2_CRITICAL = {VOCAB - 1: 24.32}  # df -> chi-square at p = 0.001


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token of probability zero was drawn"
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def distributions(generator: torch.Generator, rows: int) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, VOCAB, generator=generator, dtype=torch.float64) * 1.5, dim=-1)


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["point-mass drafts", "drafts drawn from q"])
def test_rejection_sampling_keeps_the_target_distribution(with_draft_probs):
    g = torch.Generator().manual_seed(1234)
    p = distributions(g, 3)  # the target after 0, 1, 2 drafts (independent of them, for the test)
    if with_draft_probs:
        q = distributions(g, 2)
        drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(2)], dim=1)
        draft_probs = q.unsqueeze(0).expand(N, 2, VOCAB)
        acceptance = float(torch.minimum(p[0], q[0]).sum())
    else:  # the same draft every time: a point mass
        drafts = torch.tensor([[3, 5]]).expand(N, 2)
        draft_probs = None
        acceptance = float(p[0, 3])
    tokens, num_tokens = rejection_sample(p.unsqueeze(0).expand(N, 3, VOCAB), drafts, draft_probs, generator=g)
    assert chi_square(tokens[:, 0], p[0]) < CHI2_CRITICAL[VOCAB - 1]
    second = num_tokens >= 2  # the first draft accepted: the second token follows the target after it
    assert chi_square(tokens[second, 1], p[1]) < CHI2_CRITICAL[VOCAB - 1]
    assert float(second.double().mean()) == pytest.approx(acceptance, abs=0.01)
    assert bool((num_tokens >= 1).all() and (num_tokens <= 3).all())


def test_the_runner_rule_accepts_a_point_mass_draft_with_the_targets_probability():
    """What the runner does (sample each position with the sampler, accept while the sample equals the draft)
    emits tokens distributed as the processed target (temperature and top-k here), and accepts draft d with
    probability p(d)."""
    g = torch.Generator().manual_seed(99)
    logits = torch.randn(1, VOCAB, generator=g).expand(N, VOCAB).contiguous()
    params = SamplingParams(temperature=0.7, top_k=6)
    states = [SamplingState.create(params, [1], [], frozenset(), torch.device("cpu")) for _ in range(N)]
    torch.manual_seed(5)
    sampled = Sampler()(logits, states).sampled_token_ids
    target = torch.softmax(logits[0] / 0.7, dim=-1)
    target[target.argsort()[:2]] = 0.0  # top-k = 6 of 8
    target /= target.sum()
    draft = int(target.argmax())
    emitted = torch.tensor([[draft, t][num_accepted([t], [draft]) == 0] for t in sampled])
    assert chi_square(emitted, target) < CHI2_CRITICAL[VOCAB - 1]
    accepted = sum(num_accepted([t], [draft]) for t in sampled) / N
    assert accepted == pytest.approx(float(target[draft]), abs=0.01)


def test_num_accepted_counts_the_leading_matches():
    assert num_accepted([4, 5, 6], [4, 5]) == 2
    assert num_accepted([4, 9, 6], [4, 5]) == 1
    assert num_accepted([9], []) == 0
    assert num_accepted([3, 5], [4]) == 0


def test_a_row_after_drafts_samples_as_the_request_will_be():
    """`SamplingState.after`: penalties count the drafts, min_tokens has seen them, a seeded draw is the one of
    the position after them."""
    params = SamplingParams(seed=3, min_tokens=2, presence_penalty=1.0)
    state = SamplingState.create(params, [1, 2], [7], frozenset({2}), torch.device("cpu"))
    later = state.after([8])
    assert later.origin is state and list(later.output_token_ids) == [7, 8] and list(state.output_token_ids) == [7]
    assert state.suppresses_stops and not later.suppresses_stops
    caught_up = SamplingState.create(params, [1, 2], [7, 8], frozenset({2}), torch.device("cpu"))
    assert later.seeded_uniform() == caught_up.seeded_uniform() != state.seeded_uniform()
