"""A float64 mixture-of-experts reference, one token at a time, and random expert weights for the tests."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def random_experts(num_experts: int, hidden: int, intermediate: int, seed: int = 0):
    """(router [E, H], gate_up [E, 2I, H], down [E, H, I]) in float32, scaled so outputs stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(num_experts, hidden, generator=gen) * hidden**-0.5 * 2
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(num_experts, hidden, intermediate, generator=gen) * intermediate**-0.5
    return router, gate_up, down


def reference_moe(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_ids: Optional[torch.Tensor] = None,
    shared: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Each token through its top_k experts in float64 (`expert_ids` [T, k]: the experts to use, so a
    near-tie that float32 and float64 order differently does not count as an error)."""
    x64, router64 = x.double(), router.double()
    out = torch.zeros_like(x64)
    intermediate = down.shape[2]
    for t in range(x.shape[0]):
        probs = torch.softmax(router64 @ x64[t], dim=0)
        chosen = torch.topk(probs, top_k).indices if expert_ids is None else expert_ids[t]
        weights = probs[chosen]
        if renormalize:
            weights = weights / weights.sum()
        for e, w in zip(chosen.tolist(), weights):
            h = gate_up[e].double() @ x64[t]
            act = F.silu(h[:intermediate]) * h[intermediate:]
            out[t] += w * (down[e].double() @ act)
        if shared is not None:
            s_gate_up, s_down, s_gate = (m.double() for m in shared)
            h = s_gate_up @ x64[t]
            half = s_down.shape[1]
            out[t] += torch.sigmoid(s_gate @ x64[t])[0] * (s_down @ (F.silu(h[:half]) * h[half:]))
    return out
