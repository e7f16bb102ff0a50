"""DeepSeek-V2/V3's routing: scores over every expert, the best groups of experts, the top-k within them.

    scores  = softmax(logits) ("softmax": V2) or sigmoid(logits) ("sigmoid": V3)      float32 [T, E]
    choice  = scores + e_score_correction_bias   (V3's "noaux_tc": the bias steers the choice, never the weights)
    groups  = the E experts as n_group runs of E / n_group; a group scores
                  its best choice                ("group_limited_greedy")
                  the sum of its two best        ("noaux_tc")
              the topk_group best groups stay, the others' experts are masked out (V2: to 0, V3: to -inf, as HF)
    experts = the top_k by choice ("greedy": over every expert, no groups)
    weights = the chosen experts' scores, divided by their sum (+ 1e-20) when renormalising, x routed_scaling_factor

HF transformers' DeepseekV2TopkRouter and DeepseekV3TopkRouter, in the same float32 operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.layers.moe_routing import Routing
from engine.layers.row_invariant import rowwise_sigmoid

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True, slots=True)
class GroupedTopK:
    """One layer's router settings; called on the router logits [T, E] (float32)."""

    top_k: int
    scoring: str  # SCORING_FUNCS
    method: str  # TOPK_METHODS
    num_groups: int
    topk_groups: int
    renormalize: bool
    scaling_factor: float
    correction_bias: Optional[torch.Tensor] = None  # [E] float32 (noaux_tc)

    def __post_init__(self):
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring!r} is not supported (supported: {', '.join(SCORING_FUNCS)})")
        if self.method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.method!r} is not supported (supported: {', '.join(TOPK_METHODS)})")
        if self.method != "greedy" and not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group {self.topk_groups} must be between 1 and n_group {self.num_groups}")

    def __call__(self, router_logits: torch.Tensor) -> Routing:
        logits = router_logits.float()
        scores = logits.softmax(dim=-1, dtype=torch.float32) if self.scoring == "softmax" else rowwise_sigmoid(logits)
        choice = scores if self.correction_bias is None else scores + self.correction_bias
        if self.method != "greedy":
            choice = self._in_best_groups(choice)
        expert_ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, top_k]
        weights = scores.gather(1, expert_ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(weights * self.scaling_factor, expert_ids)

    def _in_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with the experts outside each token's topk_group best groups masked out."""
        tokens, experts = choice.shape
        grouped = choice.view(tokens, self.num_groups, experts // self.num_groups)
        if self.method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        else:
            group_scores = grouped.max(dim=-1).values
        best = torch.topk(group_scores, k=self.topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand(tokens, self.num_groups, experts // self.num_groups).reshape(tokens, experts)
        return choice.masked_fill(~keep, float("-inf") if self.method == "noaux_tc" else 0.0)
