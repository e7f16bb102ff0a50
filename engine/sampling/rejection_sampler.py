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


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al.'s speculative sampling, batched over requests that each verify k drafts.

    target_probs: [n, k + 1, vocab], row j the target's distribution after j drafts; draft_token_ids: [n, k];
    draft_probs: [n, k, vocab], the distribution each draft was drawn from, or None for drafts that are point
    masses. Draft j is accepted with probability min(1, p(d) / q(d)); at the first rejection the token is drawn
    from max(p - q, 0), normalized; when all are accepted a bonus token is drawn from the last row.

    Returns (tokens [n, k + 1], num_tokens [n]): request i's output is tokens[i, : num_tokens[i]], its accepted
    drafts and one token more (entries past it are unspecified).
    """
    n, k = draft_token_ids.shape
    if target_probs.shape[:2] != (n, k + 1):
        raise ValueError(f"target probabilities of shape {tuple(target_probs.shape)} for drafts {(n, k)}")
    drafts = draft_token_ids.long().unsqueeze(2)  # [n, k, 1]
    p = target_probs[:, :k]  # [n, k, vocab]
    q = torch.zeros_like(p).scatter_(2, drafts, 1.0) if draft_probs is None else draft_probs
    p_d, q_d = p.gather(2, drafts).squeeze(2), q.gather(2, drafts).squeeze(2)  # [n, k]
    u = torch.rand((n, k), generator=generator, dtype=p.dtype, device=p.device)
    accepted = u * q_d < p_d  # u < min(1, p/q), without dividing by a zero q
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [n], leading accepted drafts
    residual = (p - q).clamp_(min=0.0)  # [n, k, vocab]
    empty = residual.sum(dim=2, keepdim=True) <= 0  # p == q there: no correction needed, draw from p
    residual = torch.where(empty, p, residual)
    last = torch.cat([residual, target_probs[:, k:]], dim=1)  # [n, k + 1, vocab]: row k is the bonus row
    chosen = last[torch.arange(n, device=p.device), num_accepted]  # [n, vocab]
    extra = torch.multinomial(chosen, 1, generator=generator).squeeze(1)  # [n]
    tokens = torch.cat([draft_token_ids.long(), torch.zeros((n, 1), dtype=torch.long, device=p.device)], dim=1)
    tokens[torch.arange(n, device=p.device), num_accepted] = extra
    return tokens, num_accepted + 1
