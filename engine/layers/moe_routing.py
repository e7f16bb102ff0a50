"""Which experts each token goes to, and the token rows grouped by expert.

select_experts(router_logits [T, E], top_k, renormalize) -> Routing
    softmax over all E experts in float32, the top_k largest, divided by their sum when
    `renormalize` (Mixtral always; Qwen MoE when the config's `norm_topk_prob`): HF's routers.

select_top_logits(router_logits [T, E], top_k) -> Routing
    the top_k largest logits, then a softmax over those k only (GPT-OSS's and Granite MoE's routers).

select_top_sigmoid(router_logits [T, E], top_k) -> Routing
    the top_k largest logits, each through a sigmoid on its own (Llama 4's router: its weights scale the experts'
    inputs, SparseMoeBlock's `scores_on_input`).

sparse_mixer(router_logits [T, E], jitter_eps) -> Routing
    Phi-3.5-MoE's sparsemixer at inference: two experts, each weighted by a softmax over the logits near its own.

group_by_expert(routing) -> ExpertGroups
    the T * top_k (token, expert) pairs sorted by expert id (stable: tokens ascending within an
    expert), so each expert's rows are one contiguous segment:

        flat pair j = t * top_k + slot          expert_ids.view(-1)[j]
        order       = argsort(expert of each pair)        [T * top_k]
        token_index = order // top_k            the token of each sorted row
        experts, counts                         the experts with rows and their row counts, ascending:
                                                expert experts[i] has the i-th segment, counts[i] rows
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, top_k] float32 (or the model's dtype where the family rounds them to it)
    expert_ids: torch.Tensor  # [T, top_k] int64


class ExpertGroups(NamedTuple):
    token_index: torch.Tensor  # [T * top_k] int64: the token of each row, rows sorted by expert
    weights: torch.Tensor  # [T * top_k]: each row's routing weight
    experts: list[int]  # the experts with rows, ascending (on the host: which products to run)
    counts: list[int]  # their row counts

    def segments(self):
        """(expert, first row, row count) of every expert with rows, in expert order."""
        start = 0
        for expert, count in zip(self.experts, self.counts):
            yield expert, start, count
            start += count

    def held(self, first: int, count: int) -> "ExpertGroups":
        """The rows of experts [first, first + count) only (one run, the rows being sorted by expert), numbered
        from `first` (expert parallelism: a rank's own experts)."""
        kept = [(e, start, n) for e, start, n in self.segments() if first <= e < first + count]
        if not kept:
            return ExpertGroups(self.token_index[:0], self.weights[:0], [], [])
        lo, hi = kept[0][1], kept[-1][1] + kept[-1][2]
        return ExpertGroups(
            self.token_index[lo:hi], self.weights[lo:hi], [e - first for e, _, _ in kept], [n for _, _, n in kept]
        )


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """router_logits [T, E] -> the top_k experts of each token and their weights."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)  # [T, top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, expert_ids)


def select_top_logits(router_logits: torch.Tensor, top_k: int) -> Routing:
    """router_logits [T, E] -> the top_k experts of each token, weighted by a softmax over their k logits."""
    logits, expert_ids = torch.topk(router_logits, top_k, dim=-1)  # [T, top_k]
    return Routing(torch.softmax(logits.float(), dim=-1), expert_ids)


def select_top_sigmoid(router_logits: torch.Tensor, top_k: int) -> Routing:
    """router_logits [T, E] -> the top_k experts of each token, each weighted by the sigmoid of its logit, in the
    logits' dtype: transformers' Llama4Router (its sigmoid in float32, rounded back)."""
    logits, expert_ids = torch.topk(router_logits, top_k, dim=-1)  # [T, top_k]
    return Routing(torch.sigmoid(logits.float()).to(router_logits.dtype), expert_ids)


def group_by_expert(routing: Routing) -> ExpertGroups:
    top_k = routing.expert_ids.shape[1]
    sorted_ids, order = torch.sort(routing.expert_ids.reshape(-1), stable=True)  # [T * top_k]
    experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    return ExpertGroups(order // top_k, routing.weights.reshape(-1)[order], experts.tolist(), counts.tolist())


def sparse_mixer(router_logits: torch.Tensor, jitter_eps: float) -> Routing:
    """router_logits [T, E] -> two experts per token and their weights, in the logits' dtype, computed as
    transformers' modeling_phimoe.py `sparsemixer` computes them at inference (no sampling, no jitter):

        first   = argmax(scores)     weight: softmax over the scores within 2 * jitter_eps of its score, taken
                                     relative to max(|score|, its score), at `first`
        second  = argmax(scores without first)     weight: the same around its score, `first` left out

    Each weight is a softmax over the experts near the chosen one, not over the two chosen: with a small epsilon
    both weights are near 1. The operations are HF's own, in its order (ties broken alike: the lowest index)."""
    threshold = 2 * jitter_eps
    first_score, first = router_logits.max(dim=-1, keepdim=True)  # [T, 1]
    factor = router_logits.abs().clamp(min=first_score)
    gates = router_logits.masked_fill((first_score - router_logits) / factor > threshold, float("-inf"))
    first_weight = torch.softmax(gates, dim=-1).gather(dim=-1, index=first)
    rest = torch.scatter(router_logits, -1, first, float("-inf"))  # the first expert left out
    second_score, second = rest.max(dim=-1, keepdim=True)
    factor = router_logits.abs().clamp(min=second_score)  # (HF's: of all the scores, the first's included)
    gates = rest.masked_fill((second_score - router_logits) / factor > threshold, float("-inf"))
    second_weight = torch.softmax(gates, dim=-1).gather(dim=-1, index=second)
    return Routing(torch.cat([first_weight, second_weight], dim=-1), torch.cat([first, second], dim=-1))
