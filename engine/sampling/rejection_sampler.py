"""Verifying draft tokens (speculative decoding): which of a request's drafts the target model accepts.

A request verifying drafts d1 .. dk has k + 1 rows of logits, row j at the position after d1 .. dj:

    rows      0      1      ...   k
    drafts    d1     d2     ...   -           row j is sampled as if d1 .. dj were accepted (`SamplingState.after`)
    sampled   x0     x1     ...   xk          with every processor, top-k/p, min-p and the row's own seeded draw
    output    d1 .. da, x(a)                  a = the first j where x(j) != d(j+1) (k when none)

For a draft that is a point mass (n-gram and suffix drafts carry no probabilities), comparing a sample of the
target with the draft is Leviathan et al.'s rejection sampling exactly: d is accepted with probability p(d), and
on a rejection x is distributed as p with d removed, normalized (max(p - q, 0) for q the point mass at d). Each
emitted token is therefore drawn from the very distribution, with the very uniform, that decoding without
speculation would have used at its position: greedy output is the same token for token, and so is a seeded
request's (given the same logits). `rejection_sample` is the general rule, for drafts with probabilities (a draft
model) and for tests.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def num_accepted(sampled: Sequence[int], draft_token_ids: Sequence[int]) -> int:
    """How many leading drafts equal the target's own samples at their positions (sampled[j] against
    draft_token_ids[j]: row j predicts the token after j drafts)."""
    accepted = 0
    for target, draft in zip(sampled, draft_token_ids):
        if target != draft:
            break
        accepted += 1
    return accepted


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: Sequence[int],
                     draft_probs: Optional[torch.Tensor] = None,
                     generator: Optional[torch.Generator] = None) -> list[int]:
    """Leviathan et al.'s speculative sampling for one request: the accepted drafts and one token more.

    target_probs: [k + 1, vocab], row j the target's distribution after j drafts; draft_probs: [k, vocab], the
    proposer's distribution each draft was drawn from, or None for drafts that are point masses. Draft j is
    accepted with probability min(1, p(d) / q(d)); at the first rejection the token is drawn from
    max(p - q, 0), normalized; when all are accepted a bonus token is drawn from the last row.
    """
    k = len(draft_token_ids)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{target_probs.shape[0]} rows of target probabilities for {k} drafts")
    out: list[int] = []
    for j, draft in enumerate(draft_token_ids):
        p = target_probs[j]  # [vocab]
        q = _point_mass(p, draft) if draft_probs is None else draft_probs[j]
        ratio = float(p[draft]) / float(q[draft]) if float(q[draft]) > 0 else 0.0
        if float(torch.rand((), generator=generator)) < min(1.0, ratio):
            out.append(draft)
            continue
        residual = (p - q).clamp_(min=0.0)
        if float(residual.sum()) <= 0:  # p == q: nothing is left to correct, any draw of p is right
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out


def _point_mass(p: torch.Tensor, token_id: int) -> torch.Tensor:
    q = torch.zeros_like(p)
    q[token_id] = 1.0
    return q
