"""A decode graph's LoRA inputs: the per-token tensors its captured deltas read, static and filled per step.

The adapters' weights stay in the stack's own buffers (a slot loading an adapter writes into them in place), so
a graph captured once serves every adapter loaded later. What changes per step is which tokens use which slots
with which scales: here, tensors of the bucket's rows that the graph's LoRAStep was captured over, refilled
before each replay. Rows of the base model and the padding rows past the step's requests get no slot (scale 0,
slot -1): their delta is zero. The slot range is every slot ([0, max_loras)): a range that moved would change
the captured views.

A step in which an adapter replaces the embedding (modules_to_save) runs eagerly: its rows are looked up by
index lists, whose lengths vary per step. (Its LM head is applied after the graph, with the logits.) So does a
step with an adapter of a mixture of experts' experts: their deltas follow the routing's rows per expert.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.lora.lora_stack import LoRAStack
from engine.lora.lora_step import LoRASegment, LoRAStep, host_scales, host_token_slots, replaces_embedding


class LoRAGraphInputs:
    """The static LoRA inputs of one decode graph of `rows` rows (and the LoRAStep captured over them)."""

    def __init__(self, stack: LoRAStack, rows: int):
        self.stack = stack
        self.rows = rows
        slots, device = stack.max_loras, stack.device
        token_slots = None
        if stack.kernels is not None:  # each token's slots, their scales, the tokens grouped by slot
            token_slots = (
                torch.full((rows, slots), -1, dtype=torch.int32, device=device),
                torch.zeros(rows, slots, dtype=torch.float32, device=device),
                torch.arange(rows, dtype=torch.int32, device=device),
            )
        scales = torch.zeros(rows, slots, dtype=stack.dtype, device=device)  # [rows, max_loras]
        self.step = LoRAStep(stack, scales, 0, slots, [], token_slots)

    @staticmethod
    def takes(stack: LoRAStack, segments: Sequence[LoRASegment]) -> bool:
        """Whether a step of `segments` can replay a graph (no adapter of it replaces the embedding or adapts a
        mixture of experts' experts: their deltas are added per expert's rows, whose counts vary per step)."""
        experts = stack.experts
        return not any(
            replaces_embedding(stack, segment.slots)
            or (experts is not None and any(experts.holds[slot] for slot, _ in segment.slots))
            for segment in segments
        )

    def fill(self, segments: Sequence[LoRASegment]) -> LoRAStep:
        """Write the step's slots and scales (its first rows; the rest padding) and return the captured step."""
        stack, step = self.stack, self.step
        scales = torch.from_numpy(host_scales(segments, self.rows, 0, stack.max_loras))
        step.scales.copy_(scales)
        for parts in {stack.parts(proj) for proj in stack.shapes}:  # each fused width's mixing matrix M
            step.mixing(parts).copy_(scales.repeat_interleave(parts * stack.max_rank, dim=1))
        if step.token_slots is not None:
            kernels = stack.kernels
            assert kernels is not None  # (token slots are made with the kernels only)
            slot_ids, slot_scales, order = step.token_slots
            ids, id_scales = host_token_slots(segments, self.rows, stack.max_loras)
            slot_ids.copy_(torch.from_numpy(ids))
            slot_scales.copy_(torch.from_numpy(id_scales))
            order.copy_(kernels.group_by_slot(slot_ids))
        return step
