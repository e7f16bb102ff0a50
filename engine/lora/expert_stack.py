"""Every adapter slot's expert deltas: per sparse layer this rank holds, each expert's gate|up and down, stacked.

    a["gate_up"]  [E, max_loras, 2 * max_rank, H]     each expert's gate A, then its up A (one rank block each)
    b["gate_up"]  [E, max_loras, 2 * max_rank, 2 I]   their B^T (scale folded in), block-diagonal: gate's rows
                                                       into the gate columns, up's into the up columns
    a["down"]     [E, max_loras, max_rank, I]
    b["down"]     [E, max_loras, max_rank, H]

(I: this rank's share of an expert's width under tensor parallelism; the adapter is cut as it loads,
engine/lora_shard.py.) The layout of lora_stack.py's fused projections, one more axis in front: expert e's slots
[lo, hi) are one [(hi - lo) * parts * r, width] view, so a step's deltas for the rows routed to e are one shrink
and one expand over them (expert_deltas.py). An adapter that does not adapt the experts leaves its slot's zeros
and is marked so (`holds`): steps of such adapters alone add no expert deltas (and may replay decode graphs).
"""

from __future__ import annotations

import torch

from engine.lora.peft_adapter import LoRAWeights

_PARTS = {"gate_up": ("experts.gate_proj", "experts.up_proj"), "down": ("experts.down_proj",)}
_ALL_PARTS = frozenset(name for names in _PARTS.values() for name in names)


class ExpertLoRAStack:
    """The stacked expert deltas of every slot (see the module docstring)."""

    def __init__(
        self,
        layers: tuple[int, ...],  # this rank's sparse layers (the model's layer loop's indices)
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,  # this rank's share of one expert's width
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.max_rank = max_rank
        self.intermediate_size = intermediate_size
        self.widths = {"gate_up": (hidden_size, (intermediate_size,) * 2), "down": (intermediate_size, (hidden_size,))}
        self.a: dict[int, dict[str, torch.Tensor]] = {}
        self.b: dict[int, dict[str, torch.Tensor]] = {}
        for layer in layers:
            self.a[layer], self.b[layer] = {}, {}
            for proj, (width, outs) in self.widths.items():
                rows = len(outs) * max_rank
                shape = (num_experts, max_loras, rows)
                self.a[layer][proj] = torch.zeros(*shape, width, dtype=dtype, device=device)
                self.b[layer][proj] = torch.zeros(*shape, sum(outs), dtype=dtype, device=device)
        self.holds = [False] * max_loras  # whether each slot's adapter adapts the experts

    def parts(self, proj: str) -> int:
        return len(self.widths[proj][1])

    def load(self, slot: int, weights: LoRAWeights) -> None:
        """Copy an adapter's expert deltas (this rank's part, layers renumbered as the model's loop counts them)
        into `slot`; zeros where it adapts none."""
        if not self.holds[slot] and not any(proj in _ALL_PARTS for _, proj in weights.a):
            return  # (its zeros are in place: an attention adapter's load does not rewrite every expert's rows)
        r = self.max_rank
        held = False
        for layer in self.a:
            for proj, names in _PARTS.items():
                a_slot, b_slot = self.a[layer][proj][:, slot], self.b[layer][proj][:, slot]  # [E, P, in], [E, P, out]
                a_slot.zero_()
                b_slot.zero_()
                column = 0
                for part, (name, width) in enumerate(zip(names, self.widths[proj][1])):
                    lora_a, lora_b = (
                        weights.a.get((layer, name)),
                        weights.b.get((layer, name)),
                    )  # [E, r, in], [E, out, r]
                    if lora_a is not None and lora_b is not None:
                        if lora_a.shape[2] != a_slot.shape[2] or lora_b.shape[1] != width:
                            raise ValueError(
                                f"adapter {weights.name!r}: layer {layer}'s {name} is {lora_b.shape[1]} x "
                                f"{lora_a.shape[2]}, the model's is {width} x {a_slot.shape[2]}"
                            )
                        rank = lora_a.shape[1]
                        a_slot[:, part * r : part * r + rank].copy_(lora_a)
                        b_slot[:, part * r : part * r + rank, column : column + width].copy_(lora_b.transpose(1, 2))
                        held = True
                    column += width
        self.holds[slot] = held

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for stacks in (self.a, self.b) for d in stacks.values() for t in d.values()
        )
