"""One rank's part of an adapter under tensor and pipeline parallelism: cut as the base weights are cut.

Each rank reads the whole adapter (a few MiB beside gigabytes of base weights) and keeps its part, cut by the
same rules as the checkpoint's tensors (engine/models/tensor_parallel.py: shard_weights), so that every
rank's delta lines up with its slice of the base product:

    q|k|v, gate|up   column-parallel: A whole, B's output rows this rank's (its heads, its KV heads, its share
                     of the intermediate rows), part by part like the fused base weight
    o_proj, down     row-parallel: A's input columns this rank's, B whole; the rank's delta (x_r A_r^T) B^T is a
                     partial sum added before the layer's all-reduce, and sum_r x_r A_r^T = x A^T
    experts          each expert's gate|up and down as the stacked experts are cut (transformers' names: each
                     expert's gate rows and up rows of this rank in B, down's input columns of this rank in A)
    layers           a pipeline stage keeps its own layers, renumbered from 0 (the model's layer index)
    embed, lm_head   (modules_to_save) whole, on the first stage only (it embeds and samples)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.lora.expert_layout import EXPERT_PROJECTIONS
from engine.lora.peft_adapter import LoRAWeights
from engine.models.llama_arch import LlamaArch
from engine.models.tensor_parallel import shard_weights

_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", *EXPERT_PROJECTIONS[:2])
"""B's rows cut; o, down and the experts' down: A's columns."""


@dataclass(frozen=True, slots=True)
class AdapterShard:
    """Where a rank sits: the whole model's shape, its tensor-parallel group, its stage's layers (a LoRAStack's
    `AdapterCut`)."""

    whole: LlamaArch  # the unsharded model's shape (the cut's reference, as for the base weights)
    tp: ParallelGroup
    layers: range  # this stage's layers (all of them without pipeline parallelism)
    holds_vocab: bool  # the first stage: the embedding and the LM head
    expert_unit: int = 1  # what each rank's share of an expert's width holds whole, as the base experts were cut
    held_experts: Optional[range] = None  # expert parallelism: the routed experts this rank holds (whole)

    @property
    def num_layers(self) -> int:
        """The whole model's layers (what an adapter file names)."""
        return self.whole.num_layers

    @property
    def is_whole(self) -> bool:
        return not self.tp.is_parallel and len(self.layers) == self.whole.num_layers

    def cut(self, weights: LoRAWeights) -> LoRAWeights:
        """This rank's part of `weights` (the whole adapter, as read), layers renumbered from this stage's first."""
        if self.is_whole:
            return weights
        # Each kept module's cut matrix under its base weight's checkpoint name (that name picks the cut).
        kept = [(layer, proj) for layer, proj in weights.a if layer in self.layers]
        to_cut = [
            (
                _base_name(*module),
                _expert_rows(weights.b[module]) if module[1] in _COLUMN_PARALLEL else weights.a[module],
            )
            for module in kept
        ]
        # (by position: the experts' gate and up share their base weight's name)
        cut = dict(
            zip(
                kept,
                (
                    tensor
                    for _, tensor in shard_weights(
                        to_cut, self.whole, self.tp, expert_unit=self.expert_unit, held_experts=self.held_experts
                    )
                ),
                strict=True,
            )
        )
        part = LoRAWeights(weights.name, weights.path, weights.rank, content_hash=weights.content_hash)
        for layer, proj in kept:
            a, b = weights.a[(layer, proj)], weights.b[(layer, proj)]
            if proj in _COLUMN_PARALLEL:
                b = cut[(layer, proj)]  # [this rank's outputs, rank] ([E, this rank's outputs, rank])
                if proj in EXPERT_PROJECTIONS:  # (the gate half of the stacked cut: see _expert_rows)
                    b = b[:, : b.shape[1] // 2].contiguous()
            else:
                a = cut[(layer, proj)]  # [rank, this rank's inputs]
            if proj in EXPERT_PROJECTIONS and self.held_experts is not None:  # (whole experts: the other matrix too)
                held = slice(self.held_experts.start, self.held_experts.stop)
                a, b = (a[held], b) if proj in _COLUMN_PARALLEL else (a, b[held])
            local = (layer - self.layers.start, proj)
            part.a[local], part.b[local] = a, b
        if self.holds_vocab:
            part.embed, part.lm_head = weights.embed, weights.lm_head
        return part


def _base_name(layer: int, proj: str) -> str:
    """The checkpoint name of the base weight whose cut a module's matrix takes: the stacked experts' for the
    experts' gate and up (B [E, out, r]) and down (A [E, r, I])."""
    if proj in EXPERT_PROJECTIONS:
        return f"layers.{layer}.mlp.experts.{'down_proj' if proj == 'experts.down_proj' else 'gate_up_proj'}"
    return f"layers.{layer}.{_PARENT.get(proj, 'mlp')}.{proj}.weight"


def _expert_rows(b: torch.Tensor) -> torch.Tensor:
    """An expert gate's or up's B [E, I, r] as the stacked gate|up [E, 2I, r] whose cut gives its rows: the
    stacked cut takes this rank's rows of each half, so B given as both halves comes back as its own rows twice
    (the first kept). A dense projection's B as it is."""
    return torch.cat([b, b], dim=1) if b.dim() == 3 else b
