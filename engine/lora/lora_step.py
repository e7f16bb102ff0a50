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

With the native CPU kernels (the stack's `native`) every step instead reads each token's own slots only
(csrc/lora_delta.h: A rows grouped by slot, B on its diagonal blocks, up to each slot's rank), the same
code the fused decode step (engine/layers/fused_decode.py) runs inside its layers: at 8 adapters a fraction
of the slot range's products, measured in benchmarks/lora.py --micro.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from engine.lora.expert_deltas import ExpertDeltas
from engine.lora.lora_stack import LoRAKernels, LoRAStack


class LoRASegment(NamedTuple):
    """Tokens [start, start + length) of the step run with `slots` ((slot, scale) pairs; empty: the base)."""

    start: int
    length: int
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
        token_slots: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
        native_slots: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ):
        """`token_slots` (with the stack's Triton kernels): each token's slots [T, M] int32 (-1: none), their
        scales [T, M] float32 and the tokens grouped by slot [T] int32. `native_slots` (with the stack's native
        kernels): the first two of those on the CPU; `scales` is then unused."""
        self.stack = stack
        self.scales = scales
        self.lo, self.hi = lo, hi
        self.embeds = embeds
        self.token_slots = token_slots
        self.native_slots = native_slots
        # a mixture of experts' expert deltas (None: no adapter of the step adapts the experts; a decode graph's
        # step has none, lora_graph_inputs.py)
        self.experts: Optional[ExpertDeltas] = None
        self._mixing: dict[int, torch.Tensor] = {}  # parts -> M [T, S * parts * max_rank]
        # per projection: (first row, end row) of the slot range in the stack's row views, and its M
        self._ranges = (
            {}
            if native_slots is not None
            else {
                proj: (lo * rows, hi * rows, self.mixing(rows // stack.max_rank))
                for proj, rows in stack.rows_per_slot.items()
            }
        )

    @classmethod
    def build(cls, stack: LoRAStack, num_tokens: int, segments: Sequence[LoRASegment]) -> Optional["LoRAStep"]:
        """The step's deltas, or None when none of its tokens runs with an adapter."""
        used = [slot for segment in segments for slot, _ in segment.slots]
        if not used:
            return None
        step = cls._build(stack, num_tokens, segments)
        if stack.experts is not None:
            step.experts = ExpertDeltas.build(stack.experts, num_tokens, segments, stack.dtype, stack.device)
        return step

    @classmethod
    def _build(cls, stack: LoRAStack, num_tokens: int, segments: Sequence[LoRASegment]) -> "LoRAStep":
        used = [slot for segment in segments for slot, _ in segment.slots]
        if stack.native is not None:
            return cls._native(stack, num_tokens, segments)
        lo, hi = (0, stack.max_loras) if stack.packed else (min(used), max(used) + 1)
        scales = host_scales(segments, num_tokens, lo, hi)
        device = stack.device
        embeds = embedding_rows(stack, segments)
        token_slots = None
        if stack.kernels is not None:
            width = max(len(segment.slots) for segment in segments)
            slot_ids, slot_scales = host_token_slots(segments, num_tokens, width)
            slots_device = torch.from_numpy(slot_ids).to(device)
            token_slots = (
                slots_device,
                torch.from_numpy(slot_scales).to(device),
                stack.kernels.group_by_slot(slots_device),
            )
        scales_device = torch.from_numpy(scales).to(device=device, dtype=stack.dtype)
        return cls(stack, scales_device, lo, hi, embeds, token_slots)

    @classmethod
    def _native(cls, stack: LoRAStack, num_tokens: int, segments: Sequence[LoRASegment]) -> "LoRAStep":
        """The step for the native kernels: each token's slots and scales (no slot range, no mixing matrices)."""
        slot_ids, slot_scales = host_token_slots(segments, num_tokens, max(len(s.slots) for s in segments))
        native = (torch.from_numpy(slot_ids), torch.from_numpy(slot_scales))
        return cls(stack, native[1], 0, 0, embedding_rows(stack, segments), native_slots=native)

    @property
    def fusable(self) -> bool:
        """Whether the fused CPU decode step can add these deltas (csrc/decode_layer.cpp)."""
        return self.native_slots is not None

    def mixing(self, parts: int) -> torch.Tensor:
        """M for a projection of `parts` fused parts: each slot's scale over its parts * max_rank columns."""
        mixing = self._mixing.get(parts)
        if mixing is None:
            mixing = self._mixing[parts] = self.scales.repeat_interleave(parts * self.stack.max_rank, dim=1)
        return mixing

    def add(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, out] += the deltas of projection `proj` of `layer` for x [T, in], in place (nothing where the
        family adapts no such projection: a mixture of experts' MLPs)."""
        stack = self.stack
        if proj not in stack.shapes:
            return
        if stack.native is not None and self.native_slots is not None:
            slots, scales = self.native_slots
            widths = stack.shapes[proj][1]
            a, b = stack.a[layer][proj], stack.b[layer][proj]
            stack.native.lora_add_(x.contiguous(), out, a, b, slots, scales, stack.ranks, widths)
            return
        if stack.kernels is not None and self.token_slots is not None:
            self._add_segmented(stack.kernels, layer, proj, x, out)
            return
        first, end, mixing = self._ranges[proj]
        if stack.linear is not None:  # every slot, through the packed matrices
            shrunk = stack.linear(x, stack.a_packed[layer][proj], None)  # [T, max_loras * P]
            shrunk.mul_(mixing)
            out.add_(stack.linear(shrunk, stack.bt_packed[layer][proj], None))
            return
        shrunk = torch.mm(x, stack.a_rows[layer][proj][first:end].t())  # [T, S * P]
        shrunk.mul_(mixing)
        out.addmm_(shrunk, stack.b_rows[layer][proj][first:end])  # B rows [S * P, out]

    def _add_segmented(self, kernels: LoRAKernels, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """The Triton SGMV products: per part of the fused projection, each token's shrink over its own slots
        (the stack's rank block of that part, a strided view) and its expand into the part's output columns."""
        assert self.token_slots is not None
        slots, scales, order = self.token_slots
        stack, r = self.stack, self.stack.max_rank
        a, b = stack.a[layer][proj], stack.b[layer][proj]  # [L, parts * r, in], [L, parts * r, out]
        column = 0
        for part, width in enumerate(stack.shapes[proj][1]):
            shrunk = torch.empty(x.shape[0], slots.shape[1], r, dtype=torch.float32, device=x.device)  # [T, M, r]
            kernels.shrink(x, a[:, part * r : (part + 1) * r], slots, scales, shrunk, token_order=order)
            b_part = b[:, part * r : (part + 1) * r, column : column + width].transpose(1, 2)  # [L, width, r]
            kernels.expand(shrunk, b_part, slots, out, column, True, token_order=order)
            column += width

    def embed(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] with the rows of adapters that replace the embedding looked up in theirs."""
        for rows, matrix in self.embeds:
            hidden[rows] = F.embedding(input_ids[rows], matrix)
        return hidden


def embedding_rows(stack: LoRAStack, segments: Sequence[LoRASegment]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token rows, [vocab, hidden]) per adapter of the step that replaces the embedding (modules_to_save)."""
    rows: dict[int, list[int]] = {}
    for start, length, slots in segments:
        if replaces_embedding(stack, slots):
            rows.setdefault(slots[0][0], []).extend(range(start, start + length))
    return [
        (torch.tensor(indices, dtype=torch.int64, device=stack.device), matrix)
        for slot, indices in rows.items()
        if (matrix := stack.embed[slot]) is not None
    ]


def replaces_embedding(stack: LoRAStack, slots: tuple[tuple[int, float], ...]) -> bool:
    """Whether tokens run with `slots` look their embedding up in an adapter's (modules_to_save; alone only)."""
    return len(slots) == 1 and stack.embed[slots[0][0]] is not None


def host_scales(segments: Sequence[LoRASegment], num_tokens: int, lo: int, hi: int) -> np.ndarray:
    """[num_tokens, hi - lo] float32: each token's scale for each slot of [lo, hi) (0: not one of its slots)."""
    scales = np.zeros((num_tokens, hi - lo), dtype=np.float32)
    for start, length, slots in segments:
        for slot, scale in slots:
            scales[start : start + length, slot - lo] = scale
    return scales


def host_token_slots(segments: Sequence[LoRASegment], num_tokens: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The SGMV kernels' inputs: each token's slots [num_tokens, width] int32 (-1: none) and their scales."""
    slot_ids = np.full((num_tokens, width), -1, dtype=np.int32)
    slot_scales = np.zeros((num_tokens, width), dtype=np.float32)
    for start, length, pairs in segments:
        for m, (slot, scale) in enumerate(pairs):
            slot_ids[start : start + length, m] = slot
            slot_scales[start : start + length, m] = scale
    return slot_ids, slot_scales


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
