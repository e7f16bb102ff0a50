"""One step's adapters: which slots each token reads, with which scales, and the deltas they add.

The runner describes the step as segments of consecutive tokens that share a request's slots and scales
(`build`); every projection then adds its adapters' deltas to the base product in three operations,
whatever mix of base requests and adapters the step holds:

    slots in use: [lo, hi)              S = hi - lo,  P = parts * max_rank (lora_stack.py)
    t = x @ A[lo:hi]^T                  [T, S * P]    every used slot's shrink at once
    t *= M                              M[token, s * P + j] = the token's scale for slot lo + s (0: not its slot)
    out += t @ B[lo:hi]                 [T, out]      every slot's expand, summed

A token of the base model has zeros in M; a mix of adapters has several non-zero slots. The slots of a
step's adapters are kept low and together (LoRASlots), so [lo, hi) is one view of the stacked weights:
no weights are gathered or copied per step. Measured against per-adapter index_select/index_add segments
and per-token gathered bmm in benchmarks/lora.py.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from engine.lora.lora_stack import LoRAStack


class LoRASegment(NamedTuple):
    """Tokens [start, start + count) of the step run with `slots` ((slot, scale) pairs; empty: the base)."""

    start: int
    count: int
    slots: tuple[tuple[int, float], ...]


class LoRAStep:
    """The deltas of one step (built by `build`, read by the model's projections)."""

    def __init__(
        self,
        stack: LoRAStack,
        scales: torch.Tensor,  # [T, hi - lo]
        lo: int,
        hi: int,
        embeds: list[tuple[torch.Tensor, torch.Tensor]],  # (token rows, [vocab, hidden]) per replaced embedding
    ):
        self.stack = stack
        self.scales = scales
        self.lo, self.hi = lo, hi
        self.embeds = embeds
        self._mixing: dict[int, torch.Tensor] = {}  # parts -> M [T, S * parts * max_rank]

    @classmethod
    def build(cls, stack: LoRAStack, num_tokens: int, segments: Sequence[LoRASegment]) -> Optional["LoRAStep"]:
        """The step's deltas, or None when none of its tokens runs with an adapter."""
        used = [slot for segment in segments for slot, _ in segment.slots]
        if not used:
            return None
        lo, hi = min(used), max(used) + 1
        scales = np.zeros((num_tokens, hi - lo), dtype=np.float32)
        embed_rows: dict[int, list[int]] = {}
        for start, count, slots in segments:
            for slot, scale in slots:
                scales[start : start + count, slot - lo] = scale
            if len(slots) == 1 and stack.embed[slots[0][0]] is not None:
                embed_rows.setdefault(slots[0][0], []).extend(range(start, start + count))
        device = stack.device
        embeds = [
            (torch.tensor(rows, dtype=torch.int64, device=device), matrix)
            for slot, rows in embed_rows.items()
            if (matrix := stack.embed[slot]) is not None
        ]
        return cls(stack, torch.from_numpy(scales).to(device=device, dtype=stack.dtype), lo, hi, embeds)

    def mixing(self, parts: int) -> torch.Tensor:
        """M for a projection of `parts` fused parts: each slot's scale over its parts * max_rank columns."""
        mixing = self._mixing.get(parts)
        if mixing is None:
            mixing = self._mixing[parts] = self.scales.repeat_interleave(parts * self.stack.max_rank, dim=1)
        return mixing

    def add(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, out] += the deltas of projection `proj` of `layer` for x [T, in], in place."""
        stack = self.stack
        a = stack.a[layer][proj][self.lo : self.hi]  # [S, P, in]
        b = stack.b[layer][proj][self.lo : self.hi]  # [S, P, out]
        shrunk = torch.mm(x, a.reshape(-1, a.shape[-1]).t())  # [T, S * P]
        shrunk.mul_(self.mixing(stack.parts(proj)))
        out.addmm_(shrunk, b.reshape(-1, b.shape[-1]))

    def embed(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] with the rows of adapters that replace the embedding looked up in theirs."""
        for rows, matrix in self.embeds:
            hidden[rows] = F.embedding(input_ids[rows], matrix)
        return hidden


def lm_head_rows(
    stack: LoRAStack, row_slots: Sequence[tuple[tuple[int, float], ...]], device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For `compute_logits`: the rows (one per entry of `row_slots`, each a request's slots) whose adapter
    replaces the LM head, grouped by adapter, with its matrix."""
    rows: dict[int, list[int]] = {}
    for row, slots in enumerate(row_slots):
        if len(slots) == 1 and stack.lm_head[slots[0][0]] is not None:
            rows.setdefault(slots[0][0], []).append(row)
    return [
        (torch.tensor(indices, dtype=torch.int64, device=device), matrix)
        for slot, indices in rows.items()
        if (matrix := stack.lm_head[slot]) is not None
    ]
