"""Where an adapter's matrices of a mixture of experts' experts land: per sparse layer, every expert's gate, up
and down deltas, stacked over the experts.

Two forms of the same deltas are read. PEFT's `target_parameters` (transformers 5 holds a layer's experts stacked,
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]; PEFT's ParamWrapper adapts each
parameter as one module, the second wrapping the first, so the file names the module alone,
`mlp.experts.lora_A.weight` and `mlp.experts.base_layer.lora_A.weight`, never the parameter):

    lora_A [E * r, in]      expert e's A: rows [e r, (e + 1) r)               (reshape(E, r, in)[e])
    lora_B [out, r * E]     expert e's B: columns e, e + E, e + 2E, ...      (reshape(out, r, E)[:, :, e])
    delta_e = scale * B_e A_e   [out, in], the expert's own product's shape, however the family stores it

(peft/tuners/lora/layer.py, ParamWrapper.get_delta_weight). Where the family stores each expert transposed,
[E, in, out] (Llama 4's gate_up_proj [E, H, 2I]), PEFT takes the parameter's second axis as its output all the
same: its lora_A [E * r, out] and lora_B [in, r * E] give delta_e = B_e A_e [in, out], added to x @ W_e, so that
lora_B shrinks and lora_A expands; read so, B_e^T is the A and A_e^T the B of the product's delta. Which parameter
a pair adapts is told by its shapes (gate_up: H in, 2I out; down: I in, H out; never both, as I > 0); gate_up's B
is cut into its gate rows and its up rows, each reading the one A. And the per-expert modules (`mlp.experts.{e}.gate_proj|up_proj|down_proj`,
Mixtral's `block_sparse_moe.experts.{e}.w1|w3|w2`: what PEFT's `target_modules` adapted in older transformers'
per-expert linears, and what vLLM's loader reads): each expert's A [r, in] and B [out, r], stacked over the experts
(an expert left out is zeros, a smaller rank zero rows: zero deltas).

Either way an adapter's expert deltas are, per layer, `experts.gate_proj`, `experts.up_proj` (A [E, r, H], B
[E, I, r]) and `experts.down_proj` (A [E, r, I], B [E, H, r]), scale folded into B.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Optional

import torch

EXPERT_PROJECTIONS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
"""An adapter's expert deltas per layer (LoRAWeights' keys), each stacked over the experts."""

_EXPERTS = re.compile(
    r"(?:(?P<path>.*)\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.experts"
    r"(?P<wrapped>(?:\.base_layer)*)(?:\.(?P<expert>\d+)\.(?P<name>\w+))?"
)
"""A layer's experts (PEFT's ParamWrapper, nested wrappers' `base_layer`s included) or one expert's module."""

_STACKED_PARAMETERS = ("gate_up_proj", "down_proj")


class ExpertModule(NamedTuple):
    """An adapted module of a layer's experts: the stacked parameters' (expert None) or one expert's (`name`)."""

    path: str  # what stands before `layers.` (the language model's path)
    layer: int
    expert: Optional[int]
    name: Optional[str]


def expert_module(module: str) -> Optional[ExpertModule]:
    """`module` (its name in the base model) as a module of a layer's experts, or None."""
    match = _EXPERTS.fullmatch(module)
    if match is None:
        return None
    expert = match.group("expert")
    return ExpertModule(
        match.group("path") or "", int(match.group("layer")), None if expert is None else int(expert), match["name"]
    )


class UnservedExperts(ValueError):
    """Expert matrices the model does not take (peft_adapter turns it into a LoRAAdapterError)."""


Scale = Callable[[str, int], float]
"""PEFT's scale of a module (or parameter) by its full name and rank."""


@dataclass(frozen=True)
class ExpertLayout:
    """A mixture of experts' shape, as its adapters are written against it (the whole model's)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int  # one expert's width
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the experts
    names: tuple[str, str, str]  # each expert's gate, up and down modules (Mixtral's w1, w3, w2)
    transposed: bool = False  # transformers stores each expert [in, out] (Llama 4)

    def collect(self) -> "ExpertPieces":
        return ExpertPieces(self)


@dataclass
class ExpertPieces:
    """An adapter's expert matrices as they are read, stacked over the experts at the end (`stacked`)."""

    layout: ExpertLayout
    # (layer, projection) -> per expert (A [r, in], B [out, r]) or None; or the stacked (A [E, r, in], B [E, out, r])
    per_expert: dict[tuple[int, str], list[Optional[tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=dict)
    stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def add(self, module: str, found: ExpertModule, a: torch.Tensor, b: torch.Tensor, scale: Scale) -> int:
        """Take one adapted module's A and B (not yet scaled); returns its rank (per expert)."""
        layout = self.layout
        if found.layer not in layout.sparse_layers:
            raise UnservedExperts(f"{module!r}: layer {found.layer} has no experts")
        if found.expert is None:
            return self._add_stacked(module, found.layer, a, b, scale)
        if found.expert >= layout.num_experts:
            raise UnservedExperts(f"{module!r}: the model has {layout.num_experts} experts")
        gate, up, down = layout.names
        projection = {gate: "experts.gate_proj", up: "experts.up_proj", down: "experts.down_proj"}.get(found.name or "")
        if projection is None:
            raise UnservedExperts(f"{module!r} is not an expert's {'/'.join(layout.names)}")
        inputs, outputs = self._widths(projection)
        if a.shape[1] != inputs or b.shape[0] != outputs:
            raise UnservedExperts(
                f"{module!r} is {b.shape[0]} x {a.shape[1]} (lora_B rows x lora_A columns); the model's is "
                f"{outputs} x {inputs}: an adapter of another model"
            )
        experts = self.per_expert.setdefault((found.layer, projection), [None] * layout.num_experts)
        if experts[found.expert] is not None or (found.layer, projection) in self.stacks:
            raise UnservedExperts(f"layer {found.layer}'s expert {found.expert} {projection} is adapted twice")
        rank = a.shape[0]
        experts[found.expert] = (a, b * scale(module, rank))
        return rank

    def _add_stacked(self, module: str, layer: int, a: torch.Tensor, b: torch.Tensor, scale: Scale) -> int:
        layout = self.layout
        experts, hidden, inter = layout.num_experts, layout.hidden_size, layout.intermediate_size
        shapes = {(hidden, 2 * inter): "gate_up_proj", (inter, hidden): "down_proj"}
        widths = (b.shape[0], a.shape[1]) if layout.transposed else (a.shape[1], b.shape[0])  # (in, out)
        parameter = shapes.get(widths)
        if parameter is None or a.shape[0] % experts:
            raise UnservedExperts(
                f"{module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} adapt neither the experts' "
                f"gate_up_proj ({experts} x {2 * inter} x {hidden}) nor their down_proj ({experts} x {hidden} x "
                f"{inter}): an adapter of another model"
            )
        rank = a.shape[0] // experts
        # the scale by the parameter's full name, as PEFT matches rank_pattern / alpha_pattern for it
        name = re.sub(r"(\.base_layer)+$", "", module) + "." + parameter
        peft_a = a.reshape(experts, rank, a.shape[1])  # [E, r, PEFT's in]
        peft_b = b.reshape(b.shape[0], rank, experts).permute(2, 0, 1)  # [E, PEFT's out, r]
        if layout.transposed:  # (see the module docstring)
            peft_a, peft_b = peft_b.transpose(1, 2), peft_a.transpose(1, 2)
        stacked_a, stacked_b = peft_a, peft_b * scale(name, rank)  # [E, r, in], [E, out, r]
        projections = (
            ("experts.gate_proj", "experts.up_proj") if parameter == "gate_up_proj" else ("experts.down_proj",)
        )
        parts = torch.split(stacked_b, inter, dim=1) if parameter == "gate_up_proj" else (stacked_b,)
        for projection, part in zip(projections, parts):
            if (layer, projection) in self.stacks or (layer, projection) in self.per_expert:
                raise UnservedExperts(f"layer {layer}'s experts' {projection} is adapted twice (by {module!r})")
            self.stacks[(layer, projection)] = (stacked_a.contiguous(), part.contiguous())
        return rank

    def _widths(self, projection: str) -> tuple[int, int]:
        hidden, inter = self.layout.hidden_size, self.layout.intermediate_size
        return (inter, hidden) if projection == "experts.down_proj" else (hidden, inter)

    def stacked(self) -> Iterator[tuple[int, str, torch.Tensor, torch.Tensor]]:
        """(layer, projection, A [E, r, in], B [E, out, r]) of every adapted layer's experts."""
        for (layer, projection), (a, b) in self.stacks.items():
            yield layer, projection, a, b
        for (layer, projection), experts in self.per_expert.items():
            rank = max(pair[0].shape[0] for pair in experts if pair is not None)
            inputs, outputs = self._widths(projection)
            a = torch.zeros(len(experts), rank, inputs)
            b = torch.zeros(len(experts), outputs, rank)
            for e, pair in enumerate(experts):
                if pair is not None:
                    a[e, : pair[0].shape[0]] = pair[0]
                    b[e, :, : pair[1].shape[1]] = pair[1]
            yield layer, projection, a, b
