"""One step's expert deltas: the rows a mixture of experts routes to an expert each get their adapters' delta of
that expert's gate|up and down products.

The slots of the step's adapters that adapt the experts span [lo, hi); each token has a scale per slot (0: not
one of its slots, a base token's are all 0). For expert e's rows (the tokens routed to it, `tokens`):

    t    = rows @ A_e[lo:hi]^T                  [n, S * P]     (S = hi - lo slots, P = parts * max_rank)
    t   *= M[tokens]                            M[token, s * P + j] = the token's scale for slot lo + s
    out += t @ B_e[lo:hi]                       [n, out]       (B^T block-diagonal over gate and up)

A base token's row adds exact zeros, so base requests keep their bits beside adapters in the same batch.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from engine.lora.expert_stack import ExpertLoRAStack


class ExpertDeltas:
    """The expert deltas of one step (read by the MoE blocks through `at(layer)`)."""

    def __init__(self, stack: ExpertLoRAStack, scales: torch.Tensor, lo: int, hi: int):
        self.stack = stack
        self.scales = scales  # [T, hi - lo]
        self.lo, self.hi = lo, hi
        self._mixing: dict[int, torch.Tensor] = {}  # parts -> M [T, S * parts * max_rank]

    @classmethod
    def build(
        cls,
        stack: ExpertLoRAStack,
        num_tokens: int,
        segments: Sequence[tuple[int, int, tuple[tuple[int, float], ...]]],  # (start, length, (slot, scale)s)
        dtype: torch.dtype,
        device: torch.device,
    ) -> Optional["ExpertDeltas"]:
        """The step's expert deltas, or None when none of its adapters adapts the experts."""
        used = [slot for _, _, slots in segments for slot, _ in slots if stack.holds[slot]]
        if not used:
            return None
        lo, hi = min(used), max(used) + 1
        scales = np.zeros((num_tokens, hi - lo), dtype=np.float32)
        for start, length, slots in segments:
            for slot, scale in slots:
                if lo <= slot < hi:
                    scales[start : start + length, slot - lo] = scale
        return cls(stack, torch.from_numpy(scales).to(device=device, dtype=dtype), lo, hi)

    def mixing(self, parts: int) -> torch.Tensor:
        mixing = self._mixing.get(parts)
        if mixing is None:
            mixing = self._mixing[parts] = self.scales.repeat_interleave(parts * self.stack.max_rank, dim=1)
        return mixing

    def at(self, layer: int) -> "LayerExpertDeltas":
        return LayerExpertDeltas(self, layer)

    def add(
        self, layer: int, expert: int, proj: str, rows: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor
    ) -> None:
        """out [n, out] += the deltas of `expert`'s `proj` ("gate_up" or "down") for its rows [n, in], the rows of
        the step's tokens `tokens` [n], in place."""
        stack, lo, hi = self.stack, self.lo, self.hi
        a = stack.a[layer][proj][expert, lo:hi]  # [S, P, in]
        b = stack.b[layer][proj][expert, lo:hi]  # [S, P, out]
        shrunk = torch.mm(rows, a.reshape(-1, a.shape[-1]).t())  # [n, S * P]
        shrunk.mul_(self.mixing(stack.parts(proj)).index_select(0, tokens))
        out.addmm_(shrunk, b.reshape(-1, b.shape[-1]))


class LayerExpertDeltas(NamedTuple):
    """A step's expert deltas bound to one layer: what that layer's MoE block adds after each expert's products."""

    deltas: ExpertDeltas
    layer: int

    def add(self, expert: int, proj: str, rows: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor) -> None:
        self.deltas.add(self.layer, expert, proj, rows, tokens, out)
